"""One verified chunk, from the target's logits to appended tokens, with the sequence's memory settled.

The forward ran the sequence's pending tokens and its draft (positions p .. p+pending+k-1, p its
computed tokens before the step). Which tokens stand is `verify_drafts`'; then:

- dense: the KV of every position written is right as far as the tokens that stand; the sequence's
  computed count moves past its pending tokens and the accepted drafts, and the pages past what its
  tokens need are freed (the drafted positions that did not stand are overwritten when reached again);
- hybrid: a Gated DeltaNet layer's state cannot be cut back to a position, so the state from before the
  step was copied to a spare slot (engine/scheduler.py `_verify_chunk`). Every draft standing, the new
  state is kept; otherwise the sequence goes back to the copy and, once every chunk of the step is
  settled, each linear-attention layer replays its recurrence over the tokens that stood from the
  inputs the forward kept (engine/model/batch.py KeptInputs): the state lands on the last token that
  stood without those tokens running through the model again (docs/architecture.md, "Hybrid rollback").

Tokens are appended one at a time through the output processor, so EOS, stop ids, stop strings and the
length limit end the choice at the token they name, as plain decoding does; while they are appended the
sequence's computed count and state agree (p + pending on a dense model, p on the spare slot of a
hybrid), so a capture at its finish (engine/cache/) keeps state that is what it says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.cache.reuse import PromptReuse
from engine.metrics import EngineMetrics
from engine.output_processor import Deltas, OutputProcessor
from engine.request import EngineSequence, SeqStatus
from engine.runner import ChunkLogits
from engine.sampling.sampler import SampleOutput
from engine.scheduler import Scheduler
from engine.speculative.speculator import Speculator
from engine.speculative.verify import verify_drafts

log = logging.getLogger("ignis.engine")


class VerifyStep:
    def __init__(self, speculator: Speculator, scheduler: Scheduler, reuse: PromptReuse, outputs: OutputProcessor,
                 metrics: EngineMetrics, eos_ids: frozenset[int]) -> None:
        self.speculator = speculator
        self.scheduler = scheduler
        self.reuse = reuse
        self.outputs = outputs
        self.metrics = metrics
        self.eos_ids = eos_ids
        # (sequence, the slot it went back to, the tokens that stood, the verify's kept inputs)
        self._replays: list[tuple[EngineSequence, int, int, dict[int, tuple[torch.Tensor, ...]]]] = []

    def settle(self, res: ChunkLogits, deltas: Deltas, failed: dict[str, str]) -> None:
        seq, draft = res.seq, res.draft
        rid = seq.request.request_id
        assert res.draft_logits is not None
        pending = res.num_tokens - len(draft)
        # A hybrid holds its state from before the step (as its computed count says) until the end.
        stepped = seq.swap_slot(res.spare_slot) if res.spare_slot is not None else None
        if res.spare_slot is None:
            seq.mark_computed(pending)
            self.reuse.after_decodes([seq])
        try:
            verified = verify_drafts(res.draft_logits, draft, seq.sampler, self.eos_ids, seq.num_output)
        except Exception:
            log.exception("verifying the draft of request %s failed", rid)
            failed.setdefault(rid, "sampling failed for this request (see the engine log)")
            verified = None
        if verified is not None:
            self.speculator.verified(seq, len(draft), verified.accepted)
            self.metrics.on_verified(self.speculator.method, len(draft), verified.accepted)
            self._append(seq, verified.tokens, deltas, failed)
        running = seq.status is SeqStatus.RUNNING and rid not in failed
        if stepped is not None:
            if running and verified is not None and verified.accepted == len(draft):
                copy = seq.swap_slot(stepped)  # every draft stood: the new state is the one to keep
                assert copy is not None
                self.scheduler.release_slot(copy)
                seq.mark_computed(pending + len(draft))
            else:  # back on the copy, the tokens that stood replayed on it; or gone with the sequence
                self.scheduler.release_slot(stepped)
                if running and verified is not None and res.kept_inputs is not None and seq.slot is not None:
                    self._replays.append((seq, seq.slot, pending + verified.accepted, res.kept_inputs))
        elif running and verified is not None:
            seq.mark_computed(verified.accepted)
            self.reuse.after_decodes([seq])
        if running:
            self.scheduler.trim_pages(seq)

    def forget(self) -> None:
        """A new step: rollbacks a failed step left unreplayed are not this step's."""
        self._replays.clear()

    def replay(self, replay_states: Callable[[list[tuple[int, int, dict[int, tuple[torch.Tensor, ...]]]]], None]
               ) -> None:
        """After the step's chunks are settled: the sequences that kept part of their draft take the state
        after the tokens that stood (`replay_states`: ModelRunner.replay_states), all in one replay."""
        replays, self._replays = self._replays, []
        live = [(seq, slot, tokens, kept) for seq, slot, tokens, kept in replays if seq.status is SeqStatus.RUNNING]
        if not live:
            return
        for seq, slot, _, _ in live:  # nothing between the settle and here moves a sequence's state
            if seq.slot != slot:
                raise RuntimeError(f"request {seq.request.request_id}'s state slot changed before its rollback "
                                   "(this is a bug)")
        replay_states([(slot, tokens, kept) for _, slot, tokens, kept in live])
        for seq, _, tokens, _ in live:
            seq.mark_computed(tokens)

    def _append(self, seq: EngineSequence, tokens: SampleOutput, deltas: Deltas, failed: dict[str, str]) -> None:
        """Each token that stands, in order, until one ends the choice."""
        for i, token in enumerate(tokens.token_ids):
            one = SampleOutput([token], [tokens.logprobs[i]], [tokens.top_logprobs[i]])
            self.outputs.append_sampled([seq], one, deltas, failed)
            if seq.status is not SeqStatus.RUNNING or seq.request.request_id in failed:
                return
