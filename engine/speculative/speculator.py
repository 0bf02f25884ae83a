"""Per sequence: whether to draft this step, what, and whether drafting has been paying.

A sequence is drafted for once it has its first token (the prompt's forward gave it), when its
request allows it (`ignis.speculative`, on by default) and its sampling reads nothing of the tokens
before each position but their count: requests with penalties or a grammar are decoded one token a
step (their processing would have to be redone token by token inside a verify; not built).

Drafting does not always pay: a verify forward of k+1 tokens costs more than a decode of one, a
draft that is rejected at once buys nothing, and at a larger batch each drafted row costs about what
a sequence's own decode does. So each step the drafts are cut to the lengths that make the step's
tokens a second largest, none at all included, by the step costs this engine measured and each
sequence's acceptance (engine/speculative/draft_sizing.py). Before drafts are weighed at a batch size
a plain step of that size is measured (and again now and then: it is what the rest is weighed
against); before any step with drafts is, a drafted row is taken to cost a tenth of it. A draft cut to nothing from a drafter that proposes every step (prompt lookup) is
kept as a shadow and judged against the tokens plain decoding gives instead: the sequence's acceptance
is measured for nothing. With MTP, whose drafts cost a forward each, a sequence whose drafts are cut
to nothing probes instead: once it has gone `probe_after`
steps without a verify (4, doubling after each probe to 64; a verify that is not a probe resets it)
with the first token of its draft, twice as many after a probe kept whole (to k), one again after a
miss: a sequence whose text turns copyable (a file echoed back) drafts again, its acceptance rising
with each probe, while one whose drafts never stand probes one token at ever longer intervals, and
one whose drafts stand but cost more than they give probes rarely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.request import EngineSequence
from engine.speculative.draft_sizing import (ENGINE_DECAY, FIRST_GUESS, KEPT_DECAY, PRIOR, Acceptance, StepTimes,
                                             draft_lengths)
from engine.speculative.ngram import TokenHistory

FIRST_PROBE = 4  # steps without a verify after which a sequence whose drafts are cut probes with one
LONGEST_PROBE = 64  # steps


@dataclass(slots=True)
class SpecState:
    """One sequence's drafting: its token history (the drafter's window) and its record."""

    history: TokenHistory = field(default_factory=TokenHistory)
    draft_tokens: int = 0  # drafted and verified, this sequence's whole life
    accepted_tokens: int = 0
    kept: Acceptance = field(default_factory=Acceptance)  # its drafts kept over judged, recent ones most
    verified_at: int | None = None  # the step of its last verify (or of its first draft, before one)
    probe_after: int = FIRST_PROBE  # steps without a verify after which a cut draft probes
    probing: bool = False  # its draft this step is a probe
    probe_tokens: int = 1  # of its draft the next probe verifies
    shadow: tuple[int, ...] = ()  # a draft cut to nothing, judged against the tokens decoded instead
    shadow_at: int = 0  # its first token's position
    draft: tuple[int, ...] = ()  # a draft made after a step (MTP), for the sequence at `draft_for` tokens
    draft_for: int = -1
    windowed: bool = False  # MTP: this sequence has run positions of its own through the drafter


class Drafter(Protocol):
    # Its proposals cost next to nothing and are asked every step (prompt lookup): a draft cut to nothing is
    # judged against the tokens plain decoding gives instead, so it needs no probes (MTP's drafts cost a
    # forward of its layer each, and are made only as long as the next step verifies).
    proposes_every_step: bool

    def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
        """Up to `k` tokens likely to follow `seq`'s tokens ([]: none worth verifying)."""
        ...


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens (engine/speculative/ngram.py)."""

    proposes_every_step = True

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
                 measured: bool = True) -> None:
        """`batch_limit`: no drafting in a step with more sequences running (0: no limit); `measured`:
        drafts cut to what pays by measured step costs (else every draft is verified whole)."""
        if method not in METHODS:
            raise ValueError(f"speculative.method={method!r}: use one of {', '.join(METHODS)}")
        self.method = method
        self.batch_limit = batch_limit
        self.running = 0  # sequences running in the step being planned (the scheduler says)
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.drafter: Drafter = NgramDrafter()
        self.totals = SpecTotals()
        self.times = StepTimes()
        self.acceptance = Acceptance()  # the engine's, over every sequence's verifies
        self.measured = measured

    def begin_step(self, running: int) -> bool:
        """A step of `running` sequences is being planned: whether any of them may draft."""
        self.running = running
        self.times.tick()
        if self.batch_too_large:
            return False
        # Drafts are weighed against a plain step of as many sequences: one is measured first.
        return not self.measured or self.times.plain_seconds(running) is not None

    def observe_step(self, drafted: int, seconds: float) -> None:
        """A step without prompt tokens took `seconds`, verifying `drafted` draft tokens in all."""
        if self.running:
            self.times.observe(self.running, drafted, seconds)

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

    def _room(self, seq: EngineSequence) -> int:
        """Tokens `seq` may draft: a verify appends one token more than the draft kept, so the draft leaves
        room for it under the sequence's length limit (max_tokens, the context); 0 where it may not."""
        room = seq.request.params.length_limit(seq.num_prompt, self.max_model_len) - len(seq.token_ids) - 1
        if room <= 0 or seq.num_output == 0 or not _draftable(seq):
            return 0
        if seq.speculation is None:
            seq.speculation = SpecState()
        return min(self.num_tokens, room)

    def next_draft_rooms(self, seqs: list[EngineSequence]) -> list[int]:
        """How many tokens each of `seqs` drafts for the next step (0: none), for a drafter that drafts
        after a step for the next one (MTP): what the next step would verify of full drafts."""
        if self.batch_too_large:
            return [0] * len(seqs)
        return self._lengths(seqs, [self._room(seq) for seq in seqs])

    def draft(self, seq: EngineSequence) -> tuple[int, ...]:
        """The drafter's tokens to follow `seq`'s pending ones (() for none); `size` cuts them."""
        room = self._room(seq)
        if not room:
            return ()
        state: SpecState = seq.speculation
        if state.shadow:
            self._judge_shadow(seq, state)
        return tuple(self.drafter.propose(seq, state, room))

    def size(self, drafts: dict[EngineSequence, tuple[int, ...]]) -> dict[EngineSequence, tuple[int, ...]]:
        """The step's drafts as verified: each cut to the length that pays (draft_sizing); those cut to
        nothing are left out (and, from a drafter that proposes every step, kept as shadows to judge)."""
        seqs = list(drafts)
        lengths = self._lengths(seqs, [len(draft) for draft in drafts.values()])
        if self.drafter.proposes_every_step:
            for seq, n in zip(seqs, lengths):
                state: SpecState = seq.speculation
                if not n and not state.shadow:
                    state.shadow, state.shadow_at = drafts[seq], len(seq.token_ids)
        return {seq: drafts[seq][:n] for seq, n in zip(seqs, lengths) if n}

    def _judge_shadow(self, seq: EngineSequence, state: SpecState) -> None:
        """A shadow draft against the tokens decoded since: its acceptance counted as a verify's would be
        (a greedy verify keeps a draft while it equals the target's token; a sampled one keeps it with
        the probability plain sampling draws it), once its first wrong token or all of it is decoded."""
        shadow, at, tokens = state.shadow, state.shadow_at, seq.token_ids
        decoded = min(len(tokens) - at, len(shadow))
        for i in range(decoded):
            if tokens[at + i] != shadow[i]:
                decoded = i
                break
        else:
            if decoded < len(shadow):
                return  # right so far: judged when more is decoded
        state.kept.verified(len(shadow), decoded, KEPT_DECAY)
        self.acceptance.verified(len(shadow), decoded, ENGINE_DECAY)
        state.shadow = ()

    def _lengths(self, seqs: list[EngineSequence], offered: list[int]) -> list[int]:
        """Of `offered` draft tokens each, how many each sequence verifies in the step."""
        if not self.measured:
            return offered
        plain = self.times.plain_seconds(self.running)
        if plain is None:
            return [0] * len(offered)  # a plain step is to be measured first
        curve = self.times.extra_curve(self.running)
        engine = self.acceptance.rate(FIRST_GUESS, 1.0)
        offers = [(seq.speculation.kept.rate(engine, PRIOR) if n else 0.0, n) for seq, n in zip(seqs, offered)]
        lengths = draft_lengths(self.running, offers, plain, curve)
        step = self.times.step
        for i, seq in enumerate(seqs):
            if offered[i] and not self.drafter.proposes_every_step:  # (those are judged as shadows)
                state: SpecState = seq.speculation
                if state.verified_at is None:
                    state.verified_at = step  # its first probe 4 steps on: the engine's acceptance says enough now
                state.probing = not lengths[i] and step - state.verified_at >= state.probe_after
                if state.probing:  # its acceptance would otherwise never be measured again
                    lengths[i] = min(offered[i], state.probe_tokens)
        return lengths

    def verified(self, seq: EngineSequence, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens kept `accepted` of them."""
        totals = self.totals
        totals.verifies += 1
        totals.draft_tokens += drafted
        totals.accepted_tokens += accepted
        state: SpecState = seq.speculation
        state.draft_tokens += drafted
        state.accepted_tokens += accepted
        state.kept.verified(drafted, accepted, KEPT_DECAY)
        self.acceptance.verified(drafted, accepted, ENGINE_DECAY)
        state.verified_at = self.times.step
        if state.probing:
            state.probe_after = min(2 * state.probe_after, LONGEST_PROBE)
            state.probe_tokens = min(2 * drafted, self.num_tokens) if accepted == drafted else 1
        else:
            state.probe_after, state.probe_tokens = FIRST_PROBE, 1
        state.probing = False


def _draftable(seq: EngineSequence) -> bool:
    sampler = seq.sampler
    return seq.request.speculative and sampler.guide is None and not sampler.penalised


def drafted_counts(seq: EngineSequence) -> tuple[int, int]:
    """(drafted, accepted) tokens of a sequence so far."""
    state: SpecState | None = seq.speculation
    return (state.draft_tokens, state.accepted_tokens) if state is not None else (0, 0)
