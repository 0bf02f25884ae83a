"""Scheduler decisions without a model: budgets, admission, preemption order."""

from __future__ import annotations

from engine.kv.chain_hash import StateHash
from engine.kv.page_pool import PagePool, SlotPool
from engine.facts import RequestClass
from engine.request import EngineRequest, EngineSequence
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler
from engine.scheduler import Scheduler, SchedulerLimits


class _NoText:
    """Stands in for the detokenizer, which the scheduler never touches."""


def make_seq(seq_id: int, n_prompt: int, cls: RequestClass = RequestClass.INTERACTIVE, arrival: float = 0.0) -> EngineSequence:
    request = EngineRequest(f"r{seq_id}", tuple(range(1, n_prompt + 1)), SamplingParams(max_tokens=100), cls,
                            arrival=arrival + seq_id)
    return EngineSequence(seq_id, request, 0, RequestSampler(request.params, request.prompt_ids), _NoText())  # type: ignore[arg-type]


def make_scheduler(pages: int, slots: int | None = None, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerLimits(page_size=4, max_num_seqs=max_seqs, step_token_budget=budget),
                     PagePool(pages), SlotPool(slots) if slots is not None else None)


def run_plan(s: Scheduler) -> list[tuple[int, int]]:
    plan = s.schedule()
    out = []
    for chunk in plan.chunks:
        chunk.seq.mark_computed(chunk.num_tokens)
        if chunk.seq.num_computed == len(chunk.seq.token_ids):
            chunk.seq.append_token(7)  # a sampled token
        out.append((chunk.seq.seq_id, chunk.num_tokens))
    return out


def test_admission_reserves_prompt_pages_and_chunks_by_budget() -> None:
    s = make_scheduler(pages=10, budget=6)
    a, b = make_seq(1, 10), make_seq(2, 3)
    s.add(a)
    s.add(b)
    # Shortest remaining prefill first; budget 6 is split 3 + 3.
    assert run_plan(s) == [(2, 3), (1, 3)]
    assert a.page_table == [0, 1, 2] and b.page_table == [3]
    # Next step: b decodes (1 token) first, a takes the remaining 5.
    assert run_plan(s) == [(2, 1), (1, 5)]
    assert run_plan(s) == [(2, 1), (1, 2)]
    s.check_integrity()


def test_decode_growth_preempts_lowest_ranked_latest_first() -> None:
    s = make_scheduler(pages=2, budget=64)
    a, b = make_seq(1, 4), make_seq(2, 4)
    s.add(a)
    s.add(b)
    assert run_plan(s) == [(1, 4), (2, 4)]  # each holds one full page, pool empty
    plan = s.schedule()  # a needs a second page: b (later arrival) is preempted
    assert [c.seq.seq_id for c in plan.chunks] == [1]
    assert plan.preempted == [b]
    assert b.num_computed == 0 and b.page_table == [] and s.waiting[RequestClass.INTERACTIVE][0] is b
    assert a.page_table == [0, 1]
    s.check_integrity()


def test_agent_preempted_before_interactive() -> None:
    s = make_scheduler(pages=2, budget=64)
    interactive, agent = make_seq(2, 4), make_seq(1, 4, RequestClass.AGENT)
    s.add(agent)
    s.add(interactive)
    run_plan(s)
    plan = s.schedule()
    assert plan.preempted == [agent]


def test_interactive_admission_preempts_agent_work() -> None:
    s = make_scheduler(pages=8, max_seqs=1)
    agent = make_seq(1, 4, RequestClass.AGENT)
    s.add(agent)
    run_plan(s)
    interactive = make_seq(2, 4)
    s.add(interactive)
    plan = s.schedule()
    assert plan.preempted == [agent]
    assert [c.seq for c in plan.chunks] == [interactive]


def test_no_state_slot_no_admission() -> None:
    s = make_scheduler(pages=8, slots=1)
    a, b = make_seq(1, 4), make_seq(2, 4)
    s.add(a)
    s.add(b)
    assert run_plan(s) == [(1, 4)]
    assert a.slot == 0 and b.slot is None and s.num_waiting == 1


def test_held_admission_waits_for_the_running_head_and_lets_others_pass() -> None:
    """b shares a's first 8 pages: it is held while a computes them, c (unrelated) is admitted
    at once; when a has published those pages, b claims them and prefills only its tail."""
    from engine.kv.chain_hash import page_hashes
    from engine.cache.page_reuse import PageReuse

    pool = PagePool(64)
    s = Scheduler(SchedulerLimits(page_size=4, max_num_seqs=8, step_token_budget=16), pool, None,
                  reuse=PageReuse(pool, 4))
    head = list(range(100, 132))  # 8 pages
    a, b, c = make_seq(1, 4), make_seq(2, 4), make_seq(3, 4)
    for seq, tokens in ((a, head + [1, 2]), (b, head + [3, 4, 5, 6, 7]), (c, list(range(200, 260)))):
        seq.token_ids = list(tokens)
        seq.num_prompt = len(tokens)
        namespace = StateHash(b"s" * 16)
        seq.name_pages(namespace, page_hashes(namespace, tokens, 4))
        s.add(seq)

    def step() -> list[tuple[int, int]]:
        plan = s.schedule()
        for chunk in plan.chunks:
            chunk.seq.mark_computed(chunk.num_tokens)
            s.reuse.after_compute(chunk.seq, None)
            if chunk.seq.num_computed == len(chunk.seq.token_ids):
                chunk.seq.append_token(7)
        return [(chunk.seq.seq_id, chunk.num_tokens) for chunk in plan.chunks]

    assert step() == [(1, 16)]  # a and c admitted, b held; shortest first leaves c no budget
    assert c in s.running and b not in s.running and s.reuse.counters.inflight_holds == 1
    assert step() == [(1, 16)]  # a reaches 32 tokens: its 8 head pages are published
    assert b not in s.running
    assert step() == [(1, 2), (2, 5), (3, 9)]  # b is admitted only now and prefills its tail
    assert b.num_cached == 32 and b.num_computed == b.num_prompt
    assert s.reuse.counters.inflight_holds == 1  # counted once per held sequence
    s.check_integrity()
