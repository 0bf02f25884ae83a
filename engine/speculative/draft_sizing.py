"""How many of its drafted tokens each sequence verifies in a step: the most tokens a second, as measured.

A verify of d drafts runs d more rows through the model. At batch 1 a row costs little beside the
step's fixed cost (the weights are read once whatever the rows), so every draft likely to stand is
worth its row; at batch 8 on a CPU the linears are compute bound and a drafted row costs about what a
sequence's own decode does (2.7 ms a row on a 2-core Zen 4, dense h1024/16: a plain step of 8 rows
39 ms, a verify of 40 rows 125 ms), so only drafts that stand nearly always pay. Which regime a step is
in is the engine's to measure on its own machine and load, not a constant:

- the step's cost: a step of B sequences with n drafted rows takes plain(B) + extra(n) seconds.
  `StepTimes` keeps moving averages of steps' seconds by B and n (a plain step n = 0); extra is read
  from steps of B, or else of the nearest batch size measured (a drafted row costs about the same),
  linearly between the measured n (and 0 at 0), past the largest in proportion to it. Interference
  on a shared machine only adds time, so a figure is the least of its 8 latest measurements (figures
  measured at different times are compared: a mean would weigh a plain step taken in a slow minute
  against drafting steps taken in a quiet one). The plain figure is
  what the rest is weighed against: it is measured again after 4, 8, 16 then every 32 steps, and at
  once when a step with drafts measured faster than it (a slow first step sets it too high). A
  drafting figure measured c times is set aside once not measured again for 4, 8 .. `STALE_STEPS`
  steps as c grows (dropped past that), so costs follow growing contexts and a choice made on one
  figure (a first call's) is tried again, less often the more it was measured; with no drafting
  figure in use a drafted row is taken to cost a tenth of a plain step (`PRIOR_ROW_COST`);
- what a draft gives: draft token j of a sequence stands only if tokens 1..j all do, so with a
  per-token acceptance a it yields a^j tokens in expectation. The acceptance is the sequence's
  (`Acceptance`: drafts kept over drafts judged, a kept draft a hit and the first rejected one a
  miss, the drafts after it unjudged; a moving count), leaning on the engine's over all sequences
  until the sequence has its own verifies;
- the choice: every sequence's draft tokens in decreasing order of a^j; the step verifies the prefix
  that makes (B + its expected tokens) / (plain(B) + extra(n)) largest, the empty one (a plain step)
  included. SmartSpec (Liu et al., 2024, "Optimizing Speculative Decoding for Serving Large Language
  Models Using Goodput") chooses draft lengths by the same goodput; vLLM's `disable_by_batch_size`
  and a fixed k are the constants it replaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

STALE_STEPS = 256  # steps after which a drafting step's figure not measured again is dropped (at the most)
PRIOR_ROW_COST = 0.1  # of a plain step, a drafted row's seconds while none is measured (a 2-core CPU: 0.09
# at batch 1, 0.07-0.11 at 8 with the verify's own overhead; a GPU's rows cost less, and are then measured)
PLAIN_FRESH = 32  # steps after which a plain step's figure is measured again (the baseline of the rest)
FIRST_REFRESH = 4  # ... its second measurement after this many steps, its third after twice as many ..
RECENT = 8  # a figure is the least of this many latest measurements: interference only adds time
KEPT_DECAY = 0.75  # a sequence's hits and misses, discounted each verify: its recent drafts count most
ENGINE_DECAY = 0.95  # the engine's, over every verify
PRIOR = 1.0  # verifies' worth of the engine's acceptance in a sequence's estimate
FIRST_GUESS = 0.5  # the engine's acceptance before any verify


@dataclass(slots=True)
class _Figure:
    recent: list[float]  # the latest measurements' seconds, oldest first
    step: int  # the step it was last measured on
    count: int = 1  # measurements

    @property
    def seconds(self) -> float:
        return min(self.recent)


def _settle(figure: _Figure | None, seconds: float, step: int) -> _Figure:
    if figure is None:
        return _Figure([seconds], step)
    return _Figure([*figure.recent[1 - RECENT:], seconds], step, figure.count + 1)


@dataclass(slots=True)
class StepTimes:
    """Measured seconds of steps without prompt tokens, by sequences and then drafted rows (0: plain)."""

    figures: dict[int, dict[int, _Figure]] = field(default_factory=dict)
    step: int = 0

    def tick(self) -> None:
        """A step is being planned: figures age."""
        self.step += 1

    def observe(self, sequences: int, drafted: int, seconds: float) -> None:
        by_rows = self.figures.setdefault(sequences, {})
        by_rows[drafted] = _settle(by_rows.get(drafted), seconds, self.step)

    def plain_seconds(self, sequences: int) -> float | None:
        """A plain step's seconds at this many sequences; None when it is to be measured (again): never
        measured, not lately (after 4, 8 .. 32 steps: a first figure may be a slow start's), or over a
        step with drafts (then it is the wrong one, unless it was measured on the last step: then the
        figures under it are dropped)."""
        by_rows = self.figures.get(sequences)
        plain = by_rows.get(0) if by_rows else None
        if plain is None or self.step - plain.step > min(PLAIN_FRESH, FIRST_REFRESH << (plain.count - 1)):
            return None
        under = [rows for rows, f in by_rows.items() if rows and f.seconds < plain.seconds]  # type: ignore[union-attr]
        if under and self.step - plain.step > 1:
            return None
        for rows in under:  # measured again just now and still over them: they are the wrong ones
            del by_rows[rows]  # type: ignore[union-attr]
        return plain.seconds

    def extra_curve(self, sequences: int) -> list[tuple[int, float]]:
        """(drafted rows, seconds beyond a plain step), by rows, from steps of this many sequences, or else
        of the nearest number measured with and without drafts (a drafted row costs about the same); with
        none, PRIOR_ROW_COST a row. A figure measured c times is set aside once not measured again for 4,
        8 .. 256 steps as c grows (and dropped past 256): one measurement may be a first call's (a tiny
        model's first verify took 6 plain steps); set aside, drafts of that size are weighed by the prior
        again and, where worth it, measured again, the figure's count going on."""
        for batch in sorted(self.figures, key=lambda b: (abs(b - sequences), b)):
            by_rows = self.figures[batch]
            for rows in [r for r, f in by_rows.items() if r and self.step - f.step > STALE_STEPS]:
                del by_rows[rows]
            plain = by_rows.get(0)
            resting = [(rows, f) for rows, f in by_rows.items()
                       if rows and self.step - f.step <= min(STALE_STEPS, FIRST_REFRESH << (f.count - 1))]
            if plain is not None and resting:
                return sorted((rows, f.seconds - plain.seconds) for rows, f in resting)
        plain_now = self.plain_seconds(sequences)
        return [] if plain_now is None else [(1, PRIOR_ROW_COST * plain_now)]


def extra_seconds(curve: Sequence[tuple[int, float]], rows: int) -> float:
    """Seconds beyond a plain step for `rows` drafted rows: linear between the measured figures (and 0 at
    0 rows), past the largest in proportion to it."""
    below_rows, below = 0, 0.0
    for at, seconds in curve:
        if rows <= at:
            return below + (seconds - below) * (rows - below_rows) / (at - below_rows)
        below_rows, below = at, seconds
    return below * rows / below_rows


def _extras(curve: Sequence[tuple[int, float]], count: int) -> list[float]:
    """extra_seconds(curve, n) for n = 1 .. count, in one walk of the curve (a step of 64 sequences weighs
    up to 256 draft tokens: a search of the curve for each was a millisecond of Python a step)."""
    out: list[float] = []
    below_rows, below, at = 0, 0.0, 0
    for rows in range(1, count + 1):
        while at < len(curve) and curve[at][0] < rows:
            below_rows, below = curve[at]
            at += 1
        if at < len(curve):
            upper_rows, upper = curve[at]
            out.append(below + (upper - below) * (rows - below_rows) / (upper_rows - below_rows))
        else:
            out.append(below * rows / below_rows)
    return out


@dataclass(slots=True)
class Acceptance:
    """Drafts kept over drafts judged, as moving counts: a kept draft is a hit, the first rejected one a
    miss (the drafts after it are not judged)."""

    hits: float = 0.0
    judged: float = 0.0

    def verified(self, drafted: int, accepted: int, decay: float) -> None:
        self.hits = decay * self.hits + accepted
        self.judged = decay * self.judged + accepted + (accepted < drafted)

    def rate(self, prior: float, weight: float) -> float:
        """Per-token acceptance, with `weight` judged drafts' worth of `prior`."""
        return (self.hits + weight * prior) / (self.judged + weight)


def draft_lengths(sequences: int, offers: Sequence[tuple[float, int]], plain: float,
                  curve: Sequence[tuple[int, float]]) -> list[int]:
    """How many of its drafted tokens each offer verifies in a step of `sequences` sequences: offers are
    (per-token acceptance, tokens drafted) of the sequences with a draft; `plain`: a plain step's
    seconds; `curve`: extra seconds by drafted rows (StepTimes.extra_curve, not empty)."""
    values = sorted(((acceptance ** j, i) for i, (acceptance, drafted) in enumerate(offers)
                     for j in range(1, drafted + 1)), reverse=True)
    best_rate, best, tokens = sequences / plain, 0, float(sequences)
    for n, ((value, _), extra) in enumerate(zip(values, _extras(curve, len(values))), 1):
        tokens += value
        rate = tokens / (plain + max(0.0, extra))
        if rate > best_rate:
            best_rate, best = rate, n
    lengths = [0] * len(offers)
    for _, i in values[:best]:  # a sequence's values fall with j: the prefix takes each one's first drafts
        lengths[i] += 1
    return lengths
