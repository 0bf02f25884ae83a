"""Drafting with the checkpoint's own multi-token-prediction layer (speculative.method=mtp).

The MTP layer at position j reads the embedding of token j+1 and the target's final (normed) hidden
state at j, runs one full-attention decoder layer with a KV cache of its own, and its (normed) output
gives the logits of token j+2 through the target's `lm_head` (engine/model/mtp.py). So:

- the **window**: every position the target computes is also run through the MTP layer once the
  token after it is known, writing the layer's K/V into the sequence's own pages (the device cache
  gives the MTP layer a cache layer of its own, `num_layers + i`, so a page holds the target's KV and
  the drafter's together). Whatever moves a page (retained states, the tiers, live moves, their
  integrity tags) moves the drafter's window with it, and a claimant drafts from its first token;
- **when**: right after the target's forward, the positions whose next token was already known
  (prompt chunks) are run, before the step's captures copy anything; after sampling, the positions
  whose next token was just sampled or verified (usually one: the one the step decoded), and from the
  last of them the first draft token;
- **drafting**: the layer run again on its own output, one position a round, k-1 rounds (the MTP
  output standing in for the target's hidden state, as vLLM and SGLang do), greedy (a point-mass
  draft, which the rejection rule of engine/speculative/verify.py expects). Those rounds write the
  layer's K/V past the sequence's tokens, in pages taken only if free and given back after; the next
  step's window run writes the real values over them.

Every running sequence's window is kept, drafting or not (a request with `speculative: false`, a
pause, penalties), so every state this engine captures carries it; a forward from which no draft is
made writes only the layer's K/V (no attention, MLP or head: what a sequence that does not draft
pays for its window). Not carried: the target's hidden
state at a state's last position (a claimant whose whole prompt was held with its logits samples its
first token without a forward, so it drafts from its second); the layer's K/V at a state's last
position is the one its writer computed from the token the writer had next. A sequence whose first
computed position is past 0 (it claimed a state) is counted (`ignis_spec_window_gaps_total`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv.device_cache import DeviceCache
from engine.model.batch import ForwardBatch, LogitsWanted, SequenceChunk
from engine.model.decoder import CausalLM, DecoderLayer
from engine.model.mtp import MtpPredictor
from engine.request import EngineSequence, SeqStatus, rope_shifts
from engine.speculative.speculator import SpecState


@dataclass(slots=True)
class ComputedRows:
    """A sequence's rows in the step's forward: positions start .. start+length-1 at rows offset .. ."""

    seq: EngineSequence
    offset: int
    start: int
    length: int
    windowed: int = 0  # positions from `start` whose window is written (after_forward's part)
    hidden: torch.Tensor | None = None  # its own hidden states (a state's, claimed whole), not the forward's


@dataclass(slots=True)
class _Run:
    """One sequence's part of an MTP forward: positions start .. start+len(tokens)-1, with the token after
    each position and the target's hidden state there (rows of `hidden`)."""

    seq: EngineSequence
    start: int
    tokens: list[int]
    rows: torch.Tensor  # [len(tokens), H]
    room: int  # tokens to draft from its last position (0: no draft, no logits)


class MtpDrafter:
    proposes_every_step = False  # its drafts cost a forward of its layer each (speculator.Drafter)

    def __init__(self, model: CausalLM, mtp: MtpPredictor, cache: DeviceCache,
                 draft_rooms: Callable[[list[EngineSequence]], list[int]], grow: Callable[[EngineSequence, int], bool],
                 trim: Callable[[EngineSequence], None], count_gaps: Callable[[int], None]) -> None:
        """`draft_rooms(seqs)`: how many tokens to draft for each next step (0: none); `grow(seq, tokens)`:
        pages for `tokens` positions if free; `trim(seq)`: back to the pages its tokens need;
        `count_gaps(n)`: n more sequences began from a state's window (the metric)."""
        if len(mtp.layers) != 1:
            raise ValueError(f"speculative.method=mtp runs one MTP layer; this checkpoint has {len(mtp.layers)} "
                             "(not built yet)")
        self.model = model
        self.mtp = mtp
        self.cache = cache
        self.draft_rooms = draft_rooms
        self.grow = grow
        self.trim = trim
        self.count_gaps = count_gaps
        self._rows: list[ComputedRows] = []
        self._hidden: torch.Tensor | None = None  # the step's forward's hidden states [T, H]

    # --- the Drafter protocol (engine/speculative/speculator.py) ---------------------------------
    def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
        """The draft made after the last step, if it was made for the sequence as it stands."""
        return list(state.draft[:k]) if state.draft_for == len(seq.token_ids) else []

    # --- the step's two calls --------------------------------------------------------------------
    def after_forward(self, rows: list[ComputedRows], hidden: torch.Tensor | None) -> None:
        """Right after the target's forward (`hidden`: its rows' final normed hidden states, `rows`: whose
        they are): the window for the positions whose next token is known."""
        self._rows = rows
        self._hidden = hidden
        runs = []
        gaps = 0
        for r in rows:
            state: SpecState | None = r.seq.speculation
            if state is None:
                state = r.seq.speculation = SpecState()
            if not state.windowed:
                state.windowed = True
                gaps += r.start > 0
            known = min(r.start + r.length, len(r.seq.token_ids) - 1) - r.start
            if known > 0:
                assert hidden is not None
                runs.append(self._run_of(r, hidden, 0, known, room=0))
                r.windowed = known
        if gaps:
            self.count_gaps(gaps)
        if runs:
            self._forward(runs)

    def last_hidden(self, seq: EngineSequence) -> torch.Tensor:
        """The target's hidden state at `seq`'s last position in the step's forward (kept with a captured
        state's logits, for the first draft of a claimant that computes nothing)."""
        r = next(r for r in self._rows if r.seq is seq)  # a prompt's last chunk: not every step
        assert self._hidden is not None
        return self._hidden[r.offset + r.length - 1]

    def claimed_whole(self, seq: EngineSequence, hidden: torch.Tensor) -> None:
        """`seq` claimed a state with its next-token row and computed nothing this step: its last position
        runs through the drafter from the hidden state the state kept, once its token is sampled."""
        state: SpecState | None = seq.speculation
        if state is None:
            state = seq.speculation = SpecState()
        state.windowed = True  # the window below is the state's, whole: no gap
        last = seq.num_computed - 1
        self._rows.append(ComputedRows(seq, 0, last, 1, hidden=hidden.to(self.model.dtype)[None]))

    def after_step(self) -> None:
        """After sampling: the window for the positions whose next token the step gave, then the drafts."""
        rows, self._rows = self._rows, []
        step_hidden, self._hidden = self._hidden, None
        runs: list[_Run] = []
        last: list[_Run] = []  # the runs that reach their sequence's last token: they may draft
        for r in rows:
            hidden = r.hidden if r.hidden is not None else step_hidden
            assert hidden is not None
            seq = r.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            end = min(r.start + r.length, len(seq.token_ids) - 1) - r.start
            if end <= r.windowed:
                continue
            run = self._run_of(r, hidden, r.windowed, end, room=0)
            runs.append(run)
            if end == len(seq.token_ids) - 1 - r.start:  # its last run position gives the first draft
                last.append(run)
        if not runs:
            return
        for run, room in zip(last, self.draft_rooms([run.seq for run in last])):
            run.room = room
        out, logits = self._forward(runs)
        drafting = [run for run in runs if run.room]
        if drafting:
            self._draft(drafting, out, logits)

    # --- internals -------------------------------------------------------------------------------
    def _run_of(self, r: ComputedRows, hidden: torch.Tensor, begin: int, end: int, room: int) -> _Run:
        start = r.start + begin
        tokens = r.seq.token_ids[start + 1:r.start + end + 1]
        media = r.seq.request.media
        if media is not None and start < r.seq.num_prompt:
            # An image's key ids are no tokens: the drafter embeds the image token there. Its positions in the
            # prompt are the 1-D ones, near enough for a draft (the target verifies every draft).
            tokens = media.model_ids(tokens)
        return _Run(r.seq, start, list(tokens), hidden[r.offset + begin:r.offset + end], room)

    def _forward(self, runs: list[_Run]) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward over the runs; (normed output, logits) of the last position of each run that
        drafts, in order."""
        model, mtp = self.model, self.mtp
        page_size, device = self.cache.page_size, model.device
        if all(len(run.tokens) == 1 and run.start > 0 for run in runs):
            # One position each (the steady state): the decode road's batch, its attention kernel; only the
            # drafting rows go on to the head.
            batch = ForwardBatch.for_decodes([run.tokens[0] for run in runs], [run.start for run in runs],
                                             [run.seq.page_table for run in runs], [None] * len(runs),
                                             page_size, device, rope_shifts([run.seq for run in runs]))
            drafting = [i for i, run in enumerate(runs) if run.room]
            rows = batch.logits_rows if len(drafting) == len(runs) else \
                torch.tensor(drafting, dtype=torch.long, device=device)
        else:
            batch = ForwardBatch.build([SequenceChunk(run.tokens, run.start, run.seq.page_table, None,
                                                      LogitsWanted.LAST if run.room else LogitsWanted.NONE,
                                                      shift=run.seq.rope_shift if run.start >= run.seq.num_prompt
                                                      else 0)
                                        for run in runs], page_size, device)
            rows = batch.logits_rows
        hidden = runs[0].rows if len(runs) == 1 else torch.cat([run.rows for run in runs])
        with torch.inference_mode():
            x = mtp.fuse(model.model.embed_tokens(batch.input_ids), hidden)
            assert model.rotary is not None
            cos_sin = model.rotary.cos_sin(batch.positions, x.dtype)
            if not any(run.room for run in runs):  # the window only: its K/V, not the layer's output
                layer = mtp.layers[0]
                assert isinstance(layer, DecoderLayer)
                layer.write_kv(x, batch, self.cache, model.rotary, cos_sin)
                empty = x[:0]
                return empty, empty.float()
            x = mtp.layers[0](x, batch, self.cache, model.rotary, cos_sin)
            out = mtp.norm(x[rows])
            return out, model.lm_head(out).float()

    def _draft(self, drafting: list[_Run], out: torch.Tensor, logits: torch.Tensor) -> None:
        """From each run's first draft token (its row of `logits`), the rest: the layer on its own output,
        one position a round, as far as each one's room and free pages allow."""
        seqs = [run.seq for run in drafting]
        rooms = [run.room for run in drafting]
        drafts = [[int(t)] for t in logits.argmax(dim=-1).tolist()]
        grown: set[int] = set()
        live = list(range(len(seqs)))
        h = out
        for i in range(1, max(rooms)):
            keep = []
            for j, at in enumerate(live):
                seq = seqs[at]
                position = len(seq.token_ids) - 2 + i  # this round's position: its token is draft i
                if rooms[at] > i and self.grow(seq, position + 1):
                    grown.add(at)
                    keep.append((j, at))
            if not keep:
                break
            runs = [_Run(seqs[at], len(seqs[at].token_ids) - 2 + i, [drafts[at][-1]], h[j:j + 1], rooms[at])
                    for j, at in keep]
            h, logits = self._forward(runs)
            for (_, at), token in zip(keep, logits.argmax(dim=-1).tolist()):
                drafts[at].append(int(token))
            live = [at for _, at in keep]
        for at in grown:
            self.trim(seqs[at])
        for seq, draft in zip(seqs, drafts):
            state: SpecState = seq.speculation
            state.draft, state.draft_for = tuple(draft), len(seq.token_ids)
