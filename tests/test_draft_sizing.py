"""Draft sizing (engine/speculative/draft_sizing.py): how many drafted tokens each sequence verifies.

The choice is checked against a brute-force search over every way of cutting the drafts, on costs and
acceptances hypothesis draws; then on the two regimes measured on a 2-core CPU (batch 1, where a drafted
row is cheap beside the step; batch 8, where it costs about a sequence's own decode)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from engine.speculative.draft_sizing import (STALE_STEPS, Acceptance, StepTimes, _extras, draft_lengths,
                                             extra_seconds)


def rate(sequences: int, offers: list[tuple[float, int]], lengths: list[int], plain: float,
         curve: list[tuple[int, float]]) -> float:
    """Expected tokens a second of a step verifying `lengths` drafted tokens of each offer."""
    tokens = sequences + sum(sum(a ** j for j in range(1, n + 1)) for (a, _), n in zip(offers, lengths))
    return tokens / (plain + max(0.0, extra_seconds(curve, sum(lengths))))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 4)), min_size=1, max_size=4),
       st.floats(0.005, 0.1), st.lists(st.tuples(st.integers(1, 16), st.floats(-0.01, 0.2)), min_size=1, max_size=3))
def test_the_choice_is_the_best_of_every_way_to_cut_the_drafts(sequences: int, offers: list[tuple[float, int]],
                                                               plain: float, points: list[tuple[int, float]]) -> None:
    curve = sorted(dict(points).items())
    got = draft_lengths(sequences, offers, plain, curve)
    assert all(0 <= n <= drafted for n, (_, drafted) in zip(got, offers))
    best = max(rate(sequences, offers, list(cut), plain, curve)
               for cut in itertools.product(*(range(drafted + 1) for _, drafted in offers)))
    assert rate(sequences, offers, got, plain, curve) == pytest.approx(best, rel=1e-9)


def test_batch_1_verifies_every_draft_likely_to_stand() -> None:
    """Batch 1 (a 30 ms step, 4 drafted rows 11 ms more): at a per-token acceptance of 0.7 all four drafts;
    at 0.6 three (the fourth stands with 0.13, under what its row costs at the rate the three give); at
    0.05 none."""
    curve = [(4, 0.011)]
    assert draft_lengths(1, [(0.7, 4)], 0.030, curve) == [4]
    assert draft_lengths(1, [(0.6, 4)], 0.030, curve) == [3]
    assert draft_lengths(1, [(0.05, 4)], 0.030, curve) == [0]


def test_batch_8_verifies_only_drafts_that_nearly_always_stand() -> None:
    """Batch 8 (a 39 ms step, 32 drafted rows 86 ms more): drafts that always stand are verified whole; at
    0.85 the first two of each (the third stands with 0.61, under what its row costs at the 251 tokens a
    second the two give); at 0.4 none, and a sequence with a good draft beside seven with bad ones
    verifies its own alone."""
    curve = [(32, 0.086)]
    assert draft_lengths(8, [(1.0, 4)] * 8, 0.039, curve) == [4] * 8
    assert draft_lengths(8, [(0.85, 4)] * 8, 0.039, curve) == [2] * 8
    assert draft_lengths(8, [(0.4, 4)] * 8, 0.039, curve) == [0] * 8
    assert draft_lengths(8, [(0.98, 4)] + [(0.2, 4)] * 7, 0.039, curve) == [4] + [0] * 7


def test_extra_seconds_between_and_past_the_measured_rows() -> None:
    curve = [(4, 0.01), (8, 0.03)]
    assert extra_seconds(curve, 2) == pytest.approx(0.005)  # from 0 at 0 rows
    assert extra_seconds(curve, 6) == pytest.approx(0.02)
    assert extra_seconds(curve, 16) == pytest.approx(0.06)  # past the largest: in proportion to it
    for points in ([(4, 0.01), (8, 0.03)], [(1, 0.002)], [(2, 0.01), (3, 0.005), (9, 0.04)]):
        assert _extras(points, 20) == pytest.approx([extra_seconds(points, n) for n in range(1, 21)])


def test_step_times_by_batch_size_and_drafted_rows() -> None:
    """A figure is the least of its 8 latest measurements; the extra seconds of drafted rows come from steps
    of the batch size, or else of the nearest one measured with and without drafts."""
    times = StepTimes()
    times.tick()
    assert times.plain_seconds(8) is None and times.extra_curve(8) == []
    times.observe(8, 4, 0.06)  # no plain step of 8 yet: nothing to take it from
    assert times.extra_curve(8) == []
    times.observe(8, 0, 0.05)
    times.observe(8, 0, 0.045)
    times.observe(8, 0, 0.085)  # a slow step: the figure is the least
    assert times.plain_seconds(8) == pytest.approx(0.045)
    for _ in range(7):
        times.observe(8, 0, 0.055)  # the 0.045 is the 9th latest now
    assert times.plain_seconds(8) == pytest.approx(0.055)
    assert times.extra_curve(8) == [(4, pytest.approx(0.005))]
    assert times.extra_curve(1) == [(4, pytest.approx(0.005))]  # batch 1: from batch 8's
    times.observe(2, 0, 0.03)
    times.observe(2, 8, 0.05)
    assert times.extra_curve(1) == [(8, pytest.approx(0.02))]  # the nearest
    assert times.plain_seconds(1) is None


def test_the_plain_figure_is_measured_again_and_stale_drafting_figures_dropped() -> None:
    """The plain figure is measured again after 4, 8, 16, then every 32 steps, and when a step with drafts
    measured faster than it; a drafting figure measured c times is set aside when not measured again for
    4, 8 .. STALE_STEPS steps, and with none in use a drafted row is taken to cost a tenth of a plain
    step."""
    times = StepTimes()
    due = []
    for step in range(1, 150):
        times.tick()
        if times.plain_seconds(1) is None:
            due.append(step)
            times.observe(1, 0, 0.03)
    assert due == [1, 6, 15, 32, 65, 98, 131]
    times.observe(1, 4, 0.02)  # a step with drafts under the plain figure: the plain one is measured again
    times.tick()
    times.tick()
    assert times.plain_seconds(1) is None
    times.observe(1, 0, 0.03)  # measured just now and still over it: the drafting figure goes
    times.tick()
    assert times.plain_seconds(1) == pytest.approx(0.03)
    assert times.extra_curve(1) == [(1, pytest.approx(0.003))]  # none measured: a row a tenth of a plain step
    times.observe(1, 4, 0.06)  # measured once: set aside when not measured again within 4 steps
    for _ in range(4):
        times.tick()
    assert times.extra_curve(1) == [(4, pytest.approx(0.03))]
    times.tick()
    assert times.extra_curve(1) == [(1, pytest.approx(0.003))]
    times.observe(1, 4, 0.04)  # measured again: its count goes on (set aside after 8 steps now)
    for _ in range(8):
        times.tick()
    assert times.extra_curve(1) == [(4, pytest.approx(0.01))]
    times.tick()
    assert times.extra_curve(1) == [(1, pytest.approx(0.003))]
    for _ in range(7):  # measured 9 times: in use while not older than STALE_STEPS
        times.observe(1, 4, 0.04)
    for _ in range(STALE_STEPS):
        times.tick()
    times.observe(1, 0, 0.03)
    assert times.extra_curve(1) == [(4, pytest.approx(0.01))]
    times.tick()
    assert times.extra_curve(1) == [(1, pytest.approx(0.003))]


def test_acceptance_counts_kept_drafts_over_those_judged() -> None:
    """A kept draft is a hit, the first rejected one a miss, those after it unjudged; the prior weighs as
    one judged draft."""
    kept = Acceptance()
    assert kept.rate(0.5, 1.0) == 0.5
    kept.verified(4, 2, 1.0)  # two kept, the third rejected, the fourth unjudged
    assert kept.rate(0.5, 0.0) == pytest.approx(2 / 3)
    kept.verified(4, 4, 1.0)
    assert kept.rate(0.5, 0.0) == pytest.approx(6 / 7)
    kept.verified(4, 0, 0.5)  # the older verifies count half
    assert (kept.hits, kept.judged) == (3.0, 4.5)
    assert kept.rate(0.0, 1.0) == pytest.approx(3 / 5.5)
