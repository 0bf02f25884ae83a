"""Turns a step plan into one forward pass: builds the batch, runs the model,
returns the logits each sequence asked for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kv.device_cache import DeviceCache
from engine.lora.sites import LoraSites
from engine.model.batch import ChunkMedia, ForwardBatch, KeptInputs, LogitsWanted, SequenceChunk
from engine.model.kept_decodes import KeptDecodes
from engine.model.decoder import CausalLM, DecoderLayer
from engine.request import EngineSequence, rope_shifts
from engine.scheduler import ScheduledChunk
from engine.speculative.mtp_drafter import ComputedRows

if TYPE_CHECKING:  # engine.vision imports the image processor, which a text-only engine never loads
    from engine.vision.encoder import ImageEncoder
    from engine.vision.preprocess import PreparedImage


@dataclass(slots=True)  # not frozen: made per sequence every step, and a frozen init costs 4x
class ChunkLogits:
    seq: EngineSequence
    num_tokens: int
    next_token_logits: torch.Tensor | None  # [V] when the chunk completes the pending tokens
    prompt_logits: torch.Tensor | None  # [n, V] for echo with logprobs: logits at each chunk position
    draft: tuple[int, ...] = ()  # the drafted tokens this chunk verified (engine/speculative/)
    draft_logits: torch.Tensor | None = None  # [len(draft) + 1, V]: at the last pending token and each draft
    spare_slot: int | None = None  # a hybrid's state from before the step (ScheduledChunk.spare_slot)
    drafter_hidden: torch.Tensor | None = None  # [H]: claimed with the logits, the MTP drafter's hidden state
    # A hybrid's verify: each linear-attention layer's inputs of the chunk's rows (KeptInputs), for a rollback
    kept_inputs: dict[int, tuple[torch.Tensor, ...]] | None = None


@dataclass(slots=True)
class StepLogits:
    """What a step's forward pass gives: the leading decodes past their first token as one block of logits
    (the decode road's, also in a step with prefills), and each other chunk's logits."""

    decodes: list[EngineSequence]
    decode_logits: torch.Tensor | None  # [D, V]: row i is decodes[i]'s next-token logits
    chunks: list[ChunkLogits]


class ModelRunner:
    def __init__(self, model: CausalLM, cache: DeviceCache) -> None:
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.kept = KeptDecodes(cache.page_size, model.device)  # the steady state's batch, from step to step
        # With an MTP drafter: every row's hidden state in the last forward, and where each sequence's rows are.
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.rows: list[ComputedRows] = []
        self.lora: LoraSites | None = None  # the adapters' slots in the linears (lora.enabled)
        self.encoder: ImageEncoder | None = None  # the vision tower and its cache (a checkpoint with one)

    def _forward(self, batch: ForwardBatch, row_slots: Callable[[], list[int]]) -> torch.Tensor:
        """The model's forward pass; with LoRA sites, each row runs with its sequence's adapter
        (`row_slots`: the rows' slots, -1 for the base model, asked only where adapters are served)."""
        lora = self.lora
        if lora is None:
            return self.model(batch, self.cache, self.keep_hidden)
        lora.begin(row_slots(), self.model.device)
        try:
            return self.model(batch, self.cache, self.keep_hidden)
        finally:
            lora.end()

    def run(self, chunks: Sequence[ScheduledChunk]) -> StepLogits:
        self.kept.forget()  # a step off the decode road: the next decode batch is built from the sequences
        self.rows, self.hidden = [], None
        # A sequence that claimed a state together with its next-token logits computes nothing.
        ready = [self._claimed(c.seq) for c in chunks if c.num_tokens == 0]
        chunks = [c for c in chunks if c.num_tokens > 0]
        if not chunks:
            return StepLogits([], None, ready)
        # The plan lists decodes first: those past their first token (each one token, completing what is
        # pending) have the first logits rows, one each, and go on as one block (the decode road's).
        lead = 0
        for item in chunks:
            seq = item.seq
            if not (item.num_tokens == 1 and seq.num_computed + 1 == len(seq.token_ids) and seq.num_computed > 0
                    and len(seq.token_ids) > seq.num_prompt):
                break
            lead += 1
        decodes = [item.seq for item in chunks[:lead]]
        specs = [self._spec(item) for item in chunks[lead:]]
        if lead and specs and not any(len(s.token_ids) == 1 and s.start > 0 for s in specs):
            # The decodes as the decode road lists them, the rest as chunks (ForwardBatch.mixed).
            batch = ForwardBatch.mixed([s.token_ids[-1] for s in decodes], [s.num_computed for s in decodes],
                                       [s.page_table for s in decodes], [s.slot for s in decodes], specs,
                                       self.page_size, self.model.device, rope_shifts(decodes))
        else:
            batch = ForwardBatch.build([*map(self._spec, chunks[:lead]), *specs], self.page_size, self.model.device)
        rolling = {item.seq.slot for item in chunks[lead:] if item.spare_slot is not None and item.seq.slot is not None}
        if rolling:  # a hybrid's verify: keep its recurrent inputs for a partial acceptance's replay
            batch = dataclasses.replace(batch, kept_inputs=KeptInputs(rolling))
        logits = self._forward(batch, lambda: self._chunk_slots(chunks, batch))  # [R, V]
        if self.keep_hidden:
            self.hidden = self.model.hidden
            self.rows = [ComputedRows(item.seq, view.offset, view.start, view.length)
                         for item, view in zip(chunks, batch.seqs)]
        step = StepLogits(decodes, logits[:lead] if lead else None, ready)
        out = step.chunks
        if batch.decodes_only:  # one logits row per sequence, in order
            out.extend(ChunkLogits(item.seq, item.num_tokens, row, None)
                       for item, row in zip(chunks[lead:], logits[lead:].unbind(0)))
            return step
        row = lead
        for item, spec, count in zip(chunks[lead:], specs, batch.logits_counts[lead:]):
            rows = logits[row : row + count]
            row += count
            if item.draft:
                kept = batch.kept_inputs.by_slot.get(spec.state_slot) \
                    if batch.kept_inputs is not None and spec.state_slot is not None else None
                out.append(ChunkLogits(item.seq, item.num_tokens, None, None, item.draft, rows, item.spare_slot,
                                       kept_inputs=kept))
                continue
            completes = item.seq.num_computed + item.num_tokens == len(item.seq.token_ids)
            out.append(
                ChunkLogits(
                    seq=item.seq,
                    num_tokens=item.num_tokens,
                    next_token_logits=rows[-1] if completes and count else None,
                    prompt_logits=rows if spec.logits is LogitsWanted.ALL else None,
                )
            )
        return step

    @staticmethod
    def _chunk_slots(chunks: Sequence[ScheduledChunk], batch: ForwardBatch) -> list[int]:
        """Each row's adapter slot: its sequence's (the batch's views are the chunks', in order)."""
        slots = [-1] * batch.input_ids.shape[0]
        for item, view in zip(chunks, batch.seqs):
            slots[view.offset:view.offset + view.length] = [item.seq.request.adapter_slot] * view.length
        return slots

    def _claimed(self, seq: EngineSequence) -> ChunkLogits:
        """A sequence that claimed a state with its next-token row: the logits, and past them the MTP
        drafter's hidden state where the engine keeps one (engine/builder.py next_row_size)."""
        row, vocab = seq.pending_logits, self.model.config.vocab_size
        if row is not None and row.shape[-1] > vocab:
            return ChunkLogits(seq, 0, row[:vocab], None, drafter_hidden=row[vocab:])
        return ChunkLogits(seq, 0, row, None)

    def _spec(self, item: ScheduledChunk) -> SequenceChunk:
        """A scheduled chunk as the forward batch takes it."""
        seq, n = item.seq, item.num_tokens
        if item.draft:  # the pending tokens, then the draft; logits at the last pending one and each draft
            ids = [*seq.token_ids[seq.num_computed:], *item.draft]
            return SequenceChunk(ids, seq.num_computed, seq.page_table, seq.slot, LogitsWanted.TAIL,
                                 len(item.draft) + 1, seq.rope_shift, self._media(seq, len(ids)))
        completes = seq.num_computed + n == len(seq.token_ids)
        wants_prompt = seq.request.echo and seq.request.params.logprobs and seq.num_computed < seq.num_prompt
        return SequenceChunk(
            token_ids=seq.token_ids[seq.num_computed : seq.num_computed + n],
            start=seq.num_computed,
            page_table=seq.page_table,
            state_slot=seq.slot,
            logits=LogitsWanted.ALL if wants_prompt else (LogitsWanted.LAST if completes else LogitsWanted.NONE),
            shift=seq.rope_shift,
            media=self._media(seq, n),
        )

    def _media(self, seq: EngineSequence, n: int) -> ChunkMedia | None:
        """Positions and image embeddings of a chunk of `n` tokens from `seq.num_computed` that reaches
        into a prompt with images (past the prompt, its shift is all it needs)."""
        media = seq.request.media
        if media is None or seq.num_computed >= seq.num_prompt:
            return None
        encoder = self.encoder
        if encoder is None:
            raise RuntimeError("a prompt with images on an engine without a vision tower (this is a bug)")
        held = seq.image_embeds  # an image its chunks cut is encoded (or taken from the cache) once

        def encode(image: PreparedImage) -> torch.Tensor:
            key = bytes(image.digest)
            out = held.get(key)
            if out is None:
                out, ran = encoder.embeddings(image, seq.namespace)
                held[key] = out
                seq.images_encoded += ran
            return out

        start = seq.num_computed
        chunk = media.chunk(start, start + n, encode)
        if start + n >= seq.num_prompt:
            held.clear()  # its prompt is computed: the rows are in its state now
        return chunk

    def run_decodes(self, seqs: list[EngineSequence], steady: bool = False) -> torch.Tensor:
        """The decode road: each sequence decodes its one pending token and wants its next-token logits.
        Returns logits [B, V], row i sequence i's, from a batch built without a chunk per sequence.
        `steady`: the scheduler planned the same list of sequences as the last step, each one token on,
        so the batch kept from that step moves on (KeptDecodes.advance) instead of being built again."""
        kept = self.kept
        if steady and kept.holds(seqs):
            batch = kept.advance([s.token_ids[-1] for s in seqs], lambda i: seqs[i].page_table)
        else:
            batch = kept.build(seqs, [s.token_ids[-1] for s in seqs], [s.num_computed for s in seqs],
                               [s.page_table for s in seqs], [s.slot for s in seqs], rope_shifts(seqs))
        logits = self._forward(batch, lambda: [seq.request.adapter_slot for seq in seqs])
        if self.keep_hidden:
            self.hidden = self.model.hidden
            self.rows = [ComputedRows(seq, i, seq.num_computed, 1) for i, seq in enumerate(seqs)]
        return logits

    def replay_states(self, replays: Sequence[tuple[int, int, dict[int, tuple[torch.Tensor, ...]]]]) -> None:
        """Each (slot, tokens, kept inputs): the first `tokens` of a verify's kept inputs run through every
        linear-attention layer's recurrence from the state in `slot` (its state before the verify), which
        ends where the verify's forward was after them: a partial acceptance's rollback."""
        for layer in self.model.model.layers:
            if isinstance(layer, DecoderLayer) and layer.is_linear:
                index = layer.linear_attn.layer
                layer.linear_attn.replay([(slot, tuple(t[:tokens] for t in kept[index]))
                                          for slot, tokens, kept in replays], self.cache)

    def fork_state(self, parent: EngineSequence, child: EngineSequence, new_last_page: int | None) -> None:
        """Give `child` a copy of the parent's state: shared full pages are already in its
        table; the partially filled last page (if any) and the recurrent slot are copied."""
        if new_last_page is not None:
            self.cache.copy_page(parent.page_table[-1], new_last_page)
        if parent.slot is not None and child.slot is not None:
            self.cache.copy_slot(parent.slot, child.slot)
