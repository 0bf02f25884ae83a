"""The steady state (engine/steady_decodes.py): while the running list stays the same list of
sequences, the scheduler plans from the last plan and the runner moves its kept batch on. Each is
checked against the general way on the same work: the same plans (page tables and preemptions too),
the same tokens, and the model's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core import EngineCore
from engine.kv.page_pool import PagePool
from engine.model.loader import LoadedModel, load_model
from engine.offline import greedy_generate
from engine.request import EngineSequence
from engine.scheduler import Scheduler, SchedulerLimits
from engine.steady_decodes import SteadyDecodes
from engine.text.tokenizer import Tokenizer
from tests.test_engine_core import Collector, make_core, make_prompt, make_request
from tests.test_scheduler import make_seq

Tiny = tuple[LoadedModel, Tokenizer]
Plan = tuple[tuple[tuple[int, int, tuple[int, ...]], ...], tuple[int, ...], bool]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tiny:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def _general_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SteadyDecodes, "holds", lambda self, running: False)


def _scheduled(pages: int) -> tuple[list[Plan], int]:
    """Plans of a scripted run: sequences of several lengths arrive over time, decode until their own
    length, leave; `pages` small enough and the last ones are preempted. (plans, steady plans)."""
    s = Scheduler(SchedulerLimits(page_size=4, max_num_seqs=6, step_token_budget=64), PagePool(pages), None)
    arrivals = {0: [(1, 5, 30), (2, 9, 22), (3, 3, 40)], 12: [(4, 6, 18)], 30: [(5, 2, 25), (6, 7, 12)]}
    ends: dict[int, int] = {}
    plans: list[Plan] = []
    steady = 0
    for step in range(90):
        for seq_id, prompt, out in arrivals.get(step, []):
            seq = make_seq(seq_id, prompt)
            ends[seq_id] = prompt + out
            s.add(seq)
        plan = s.schedule()
        steady += plan.steady
        plans.append((tuple((c.seq.seq_id, c.num_tokens, tuple(c.seq.page_table)) for c in plan.chunks),
                      tuple(seq.seq_id for seq in plan.preempted), plan.decodes_only))
        done: list[EngineSequence] = []
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.mark_computed(chunk.num_tokens)
            if seq.num_computed == len(seq.token_ids):
                seq.append_token(7)
                if len(seq.token_ids) >= ends[seq.seq_id]:
                    done.append(seq)
        for seq in done:
            s.remove(seq)
        s.check_integrity()
    assert not s.running and not s.num_waiting
    return plans, steady


@pytest.mark.parametrize("pages", [64, 14])
def test_steady_plans_are_the_general_ones(pages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same plans step for step, with the steady state and without: sequences entering new pages,
    arriving, leaving, and (14 pages) preempted when one cannot have its next page."""
    steady_plans, steady = _scheduled(pages)
    _general_only(monkeypatch)
    general_plans, none = _scheduled(pages)
    assert steady_plans == general_plans
    assert none == 0 and steady > 20
    if pages == 14:
        assert any(preempted for _, preempted, _ in general_plans)


def _generate(core: EngineCore, work: dict[int, list[tuple[str, tuple[int, ...], int]]]) -> Collector:
    """Requests arriving at the steps given, stepped by hand until all are done; after each steady step
    the kept batch is checked against the sequences it decoded."""
    out = Collector()
    out.expected = sum(len(v) for v in work.values())
    step = 0
    checked = [0]
    while step <= max(work) or core.scheduler.has_work():
        for rid, prompt, max_tokens in work.get(step, []):
            core.submit(make_request(rid, prompt, max_tokens), out.sink)
        core.drain_inbox()
        core.step()
        kept = core.runner.kept
        seqs = kept.owner
        running = {id(s) for s in core.scheduler.running}
        if isinstance(seqs, list) and kept.holds(seqs) and all(id(s) in running for s in seqs):
            kept.check([s.num_computed - 1 for s in seqs], [s.page_table for s in seqs], [s.slot for s in seqs])
            checked[0] += 1
        step += 1
    assert checked[0] > 20
    return out


@pytest.mark.parametrize("pages", [64, 9])
def test_the_engine_gives_the_same_tokens_with_and_without_the_steady_state(
        tiny: Tiny, pages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy requests of several lengths, arriving while others decode: the model's greedy tokens with
    the steady state, as without it; with 9 pages some are preempted (and recomputed) mid-decode."""
    prompts = [make_prompt(6 + 9 * i, seed=40 + i) for i in range(5)]
    work = {0: [("a", prompts[0], 40), ("b", prompts[1], 25)], 5: [("c", prompts[2], 30)],
            21: [("d", prompts[3], 12), ("e", prompts[4], 35)]}

    def tokens(core: EngineCore) -> dict[str, list[int]]:
        out = _generate(core, work)
        core.check_integrity()
        assert core.stats().used_pages == 0
        return {rid: out.tokens(rid) for rid in "abcde"}

    steady_core = make_core(tiny, pages=pages)
    with_steady = tokens(steady_core)
    _general_only(monkeypatch)
    general_core = make_core(tiny, pages=pages)
    assert tokens(general_core) == with_steady
    for rid, prompt, max_tokens in (item for items in work.values() for item in items):
        assert with_steady[rid] == greedy_generate(tiny[0], list(prompt), max_tokens).token_ids, rid
    # Batches built from the sequences: each change of the batch, not each step.
    assert steady_core.runner.kept.builds < general_core.runner.kept.builds / 3
    if pages == 9:
        assert steady_core.totals.preempted > 0
