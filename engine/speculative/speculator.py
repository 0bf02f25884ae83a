"""Per sequence: whether to draft this step, what, and whether drafting has been paying.

A sequence is drafted for once it has its first token (the prompt's forward gave it), when its
request allows it (`ignis.speculative`, on by default) and its sampling reads nothing of the tokens
before each position but their count: requests with penalties or a grammar are decoded one token a
step (their processing would have to be redone token by token inside a verify; not built).

Drafting does not always pay: a verify forward of k+1 tokens costs more than a decode of one, a
draft that is rejected at once buys nothing, and at a larger batch a step with any verify in it
leaves the steady decode path for every sequence. Two checks:
- per sequence: the drafts its verifies keep, a moving average (weight RECENT_WEIGHT, the first verify
  sets it); once at least two verifies have been seen and it is under KEPT_TO_DRAFT, the sequence
  stops drafting for a pause that doubles each time (4, 8 ... 64 steps); after a pause one verify
  probes, and a miss pauses it again; a kept draft resets the doubling. At acceptance near zero a
  sequence so spends almost every step as a plain decode, while at a middling one (a draft token
  wrong 40% of the time: 1.3 kept a verify) a run of misses does not pause it (two misses in a row
  did, 16% of the time);
- per step: what steps give is measured (`StepCosts`, by the number of sequences: the seconds of a
  step without drafts, the tokens a second of a step with them, kept drafts counted). When steps
  with drafts yield fewer tokens a second than plain steps, no sequence drafts for a pause that
  doubles the same way, then one step probes with every sequence that would draft. Before both
  are measured at a batch size, steps draft, but once a step with drafts is measured and none
  without, the next step is plain: in a batch each sequence's probes fall on steps of their own,
  so a step without any verify may not come for many steps. A step with drafts yields 1 to k+1 tokens a sequence,
  by the verify's luck, so its rate is averaged over more steps (DRAFTING_WEIGHT) than a plain
  step's seconds, which barely vary: averaged as those, two unlucky verifies in a row paused a
  sequence whose drafting paid 1.5x.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.request import EngineSequence
from engine.speculative.ngram import TokenHistory

VERIFIES_BEFORE_PAUSE = 2  # a sequence's verifies seen before its kept drafts may pause it
KEPT_TO_DRAFT = 0.3  # drafts kept a verify (moving average) under which a sequence pauses
RECENT_WEIGHT = 0.25  # of a verify's kept drafts in a sequence's moving average
FIRST_PAUSE = 4  # steps
LONGEST_PAUSE = 64  # steps
PLAIN_WEIGHT = 0.5  # of the newest plain step's seconds in their moving average
DRAFTING_WEIGHT = 0.25  # of the newest drafting step's tokens a second in theirs


def _moving(average: float | None, value: float, weight: float) -> float:
    return value if average is None else average + weight * (value - average)


@dataclass(slots=True)
class StepCosts:
    """What steps give, measured, by the number of sequences in them (moving averages): the seconds of
    a step without drafts, and the tokens a second of a step with drafts (its sequences' tokens plus
    the drafts its verifies kept). Steps that run prompt tokens are not counted."""

    plain: dict[int, float] = field(default_factory=dict)
    drafting: dict[int, float] = field(default_factory=dict)

    def observe(self, sequences: int, drafting: int, tokens: int, seconds: float) -> None:
        if drafting == 0:
            self.plain[sequences] = _moving(self.plain.get(sequences), seconds, PLAIN_WEIGHT)
        elif seconds > 0:
            self.drafting[sequences] = _moving(self.drafting.get(sequences), tokens / seconds, DRAFTING_WEIGHT)

    def plain_unmeasured(self, sequences: int) -> bool:
        """Steps with drafts are measured at this many sequences, and none without."""
        return sequences in self.drafting and sequences not in self.plain

    def drafting_pays(self, sequences: int) -> bool | None:
        """Whether steps with drafts yield more tokens a second than plain steps of as many sequences;
        None until both are measured."""
        plain, rate = self.plain.get(sequences), self.drafting.get(sequences)
        return None if plain is None or rate is None or plain <= 0 else rate >= sequences / plain


@dataclass(slots=True)
class SpecState:
    """One sequence's drafting: its token history (the drafter's window) and its record."""

    history: TokenHistory = field(default_factory=TokenHistory)
    draft_tokens: int = 0  # drafted and verified, this sequence's whole life
    accepted_tokens: int = 0
    recent_kept: float | None = None  # drafts kept a verify, a moving average (None: no verify yet)
    seen: int = 0  # verifies since the last pause
    pauses: int = 0  # pauses in a row (each doubles the next)
    paused_for: int = 0  # steps left without drafting
    draft: tuple[int, ...] = ()  # a draft made after a step (MTP), for the sequence at `draft_for` tokens
    draft_for: int = -1
    windowed: bool = False  # MTP: this sequence has run positions of its own through the drafter


class Drafter(Protocol):
    def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
        """Up to `k` tokens likely to follow `seq`'s tokens ([]: none worth verifying)."""
        ...


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens (engine/speculative/ngram.py)."""

    def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
        state.history.sync(seq.token_ids)
        return state.history.propose(k)


@dataclass(slots=True)
class SpecTotals:
    """The engine's totals (its metrics read them), by method."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifies: int = 0


METHODS = ("none", "ngram", "mtp")


class Speculator:
    def __init__(self, method: str, num_tokens: int, max_model_len: int, batch_limit: int = 0,
                 measured_pause: bool = True) -> None:
        """`batch_limit`: no drafting in a step with more sequences running (0: no limit);
        `measured_pause`: pause drafting where steps with drafts measure fewer tokens a second."""
        if method not in METHODS:
            raise ValueError(f"speculative.method={method!r}: use one of {', '.join(METHODS)}")
        self.method = method
        self.batch_limit = batch_limit
        self.running = 0  # sequences running in the step being planned (the scheduler says)
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.drafter: Drafter = NgramDrafter()
        self.totals = SpecTotals()
        self.costs = StepCosts()
        self.measured_pause = measured_pause
        self.kept_this_step = 0  # drafts the step's verifies kept (its tokens past one a sequence)
        self.paused_steps = 0  # steps left in which no sequence drafts (drafting did not pay)
        self.pauses = 0  # such pauses in a row (each doubles the next)

    def begin_step(self, running: int) -> bool:
        """A step of `running` sequences is being planned: whether any of them may draft."""
        self.running = running
        self.kept_this_step = 0
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        if self.measured_pause and self.costs.plain_unmeasured(running):
            return False  # a plain step to compare the drafting ones with (at a batch, probes rarely leave one)
        return not self.batch_too_large

    def observe_step(self, drafting: int, seconds: float) -> None:
        """A step without prompt tokens took `seconds`; `drafting` of its sequences verified drafts.
        A step with drafts that yields fewer tokens a second than plain steps pauses drafting for
        every sequence (4, 8 .. 64 steps; the step after a pause probes)."""
        if not self.running:
            return
        self.costs.observe(self.running, drafting, self.running + self.kept_this_step, seconds)
        pays = self.costs.drafting_pays(self.running) if drafting and self.measured_pause else None
        if pays is False:
            self.paused_steps = min(FIRST_PAUSE * 2 ** self.pauses, LONGEST_PAUSE)
            self.pauses += 1
        elif pays:
            self.pauses = 0

    @property
    def on(self) -> bool:
        return self.method != "none"

    @property
    def batch_too_large(self) -> bool:
        """More sequences running than drafting pays for (speculative.disable_batch_size)."""
        return 0 < self.batch_limit < self.running

    def use(self, drafter: Drafter) -> None:
        """The drafter of a method that needs the model (mtp: engine/speculative/mtp_drafter.py)."""
        self.drafter = drafter

    def next_draft_room(self, seq: EngineSequence) -> int:
        """How many tokens `seq` drafts next step if a draft is there (0: it will not draft); for a
        drafter that drafts after a step for the next one (MTP)."""
        room = seq.request.params.length_limit(seq.num_prompt, self.max_model_len) - len(seq.token_ids) - 1
        if room <= 0 or seq.num_output == 0 or not _draftable(seq) or self.batch_too_large or self.paused_steps > 0:
            return 0
        state: SpecState | None = seq.speculation
        if state is None:
            state = seq.speculation = SpecState()
        return 0 if state.paused_for > 0 else min(self.num_tokens, room)

    def draft(self, seq: EngineSequence) -> tuple[int, ...]:
        """Tokens to verify after `seq`'s pending ones this step; () when it does not draft this step. A
        verify appends one token more than the draft kept, so the draft leaves room for it under the
        sequence's length limit (max_tokens, the context)."""
        room = seq.request.params.length_limit(seq.num_prompt, self.max_model_len) - len(seq.token_ids) - 1
        if room <= 0 or seq.num_output == 0 or not _draftable(seq):
            return ()
        state: SpecState | None = seq.speculation
        if state is None:
            state = seq.speculation = SpecState()
        if state.paused_for > 0:
            state.paused_for -= 1
            return ()
        return tuple(self.drafter.propose(seq, state, min(self.num_tokens, room)))

    def verified(self, seq: EngineSequence, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens kept `accepted` of them."""
        totals = self.totals
        totals.verifies += 1
        totals.draft_tokens += drafted
        totals.accepted_tokens += accepted
        state: SpecState = seq.speculation
        state.draft_tokens += drafted
        state.accepted_tokens += accepted
        self.kept_this_step += accepted
        state.recent_kept = _moving(state.recent_kept, accepted, RECENT_WEIGHT)
        state.seen += 1
        if accepted:
            state.pauses = 0
        probe_missed = state.pauses > 0 and not accepted  # after a pause, one probe that misses is enough
        if probe_missed or (state.seen >= VERIFIES_BEFORE_PAUSE and state.recent_kept < KEPT_TO_DRAFT):
            state.paused_for = min(FIRST_PAUSE * 2 ** state.pauses, LONGEST_PAUSE)
            state.pauses += 1
            state.seen = 0


def _draftable(seq: EngineSequence) -> bool:
    sampler = seq.sampler
    return seq.request.speculative and sampler.guide is None and not sampler.penalised


def drafted_counts(seq: EngineSequence) -> tuple[int, int]:
    """(drafted, accepted) tokens of a sequence so far."""
    state: SpecState | None = seq.speculation
    return (state.draft_tokens, state.accepted_tokens) if state is not None else (0, 0)
