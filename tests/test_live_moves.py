"""Live sequences move down a tier and resume bit-exact (issue 15).

An EngineCore is stepped by hand against a real tierstore process. A sequence is
moved down at a chosen point (mid-decode, at a prefill chunk boundary, across a
stop string) and must then produce the same tokens and logprobs as the same
request run without interruption, sampler state and stop-string buffer included.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
import torch
import xxhash

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.facts import RequestClass, ReuseTier
from engine.model.loader import LoadedModel, load_model
from engine.outputs import RequestUpdate
from engine.request import EngineRequest, EngineSequence, MovedState, SeqStatus
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from ignis.v1 import common_pb2, tierstore_pb2
from services import RunningService, start_tierstore
from tierstore.client import TierStoreClient

P = 16
MiB = 1 << 20


@pytest.fixture(scope="module", params=["hybrid", "dense"])
def model(request: pytest.FixtureRequest, tiny_model_dir: Path, dense_chat_model_dir: Path
          ) -> tuple[str, LoadedModel, Tokenizer]:
    path = tiny_model_dir if request.param == "hybrid" else dense_chat_model_dir
    return request.param, load_model(path), Tokenizer.from_dir(path)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunningService]:
    service = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(32 * MiB), "--kv-disk-bytes", "0"])
    yield service
    service.stop()


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    text: str
    finish: str | None
    error: str | None


class Driver:
    """An EngineCore stepped on the test thread."""

    def __init__(self, model: tuple[str, LoadedModel, Tokenizer], tierstore: str = "", pages: int = 64,
                 **config: object) -> None:
        _, loaded, tokenizer = model
        # (a recurrent target's pages hold no bytes of its own: a drafter's layer may give them some)
        page_bytes = loaded.config.state_shape().kv_bytes_per_page(P, loaded.model.dtype) or 1 << 16
        # The moves are placed at steps and chunk boundaries: a step time target would cut the prompts
        # by this machine's speed (under load a chunk boundary moved), so the token budget alone.
        settings: dict[str, object] = {"max_num_seqs": 8, "spill_window_pages": 2, "step_time_target_ms": math.inf,
                                       **config}
        self.core = EngineCore(loaded, tokenizer, EngineConfig(
            page_size=P, kv_cache_bytes=pages * page_bytes, tierstore_address=tierstore, **settings))  # type: ignore[arg-type]
        self.updates: dict[str, list[RequestUpdate]] = {}
        self.poisoned: list[int] = []  # pages poisoned before each resume (move_at)

    def submit(self, request: EngineRequest) -> None:
        self.updates[request.request_id] = []
        self.core.submit(request, self.updates[request.request_id].append)
        self.core.drain_inbox()

    def done(self, rid: str) -> bool:
        return bool(self.updates[rid]) and self.updates[rid][-1].done

    def step_until(self, cond: Callable[[], bool], limit: int = 2000) -> None:
        for _ in range(limit):
            if cond():
                return
            self.core.drain_inbox()
            self.core.step()
        raise AssertionError("the condition never came")

    def running(self, rid: str) -> EngineSequence | None:
        found = [s for s in self.core.scheduler.running if s.request.request_id == rid]
        assert len(found) <= 1
        return found[0] if found else None

    def seq(self, rid: str) -> EngineSequence:
        seq = self.running(rid)
        assert seq is not None, f"{rid} is not running"
        return seq

    def running_and(self, rid: str, when: Callable[[EngineSequence], bool]) -> bool:
        seq = self.running(rid)
        return seq is not None and when(seq)

    def result(self, rid: str) -> Result:
        updates = self.updates[rid]
        deltas = [d for u in updates for d in u.deltas]
        return Result([t for d in deltas for t in d.token_ids],
                      [lp.logprob or 0.0 for d in deltas for lp in d.logprobs], "".join(d.text for d in deltas),
                      next((d.finish_reason.value for d in deltas if d.finish_reason), None), updates[-1].error)

    def run(self, request: EngineRequest) -> Result:
        self.submit(request)
        self.step_until(lambda: self.done(request.request_id))
        return self.result(request.request_id)

    def close(self) -> None:
        self.core.stop()


def make_prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def make_request(rid: str, prompt: tuple[int, ...], max_tokens: int = 24, seeded: bool = False,
                 cls: RequestClass = RequestClass.INTERACTIVE, **params: object) -> EngineRequest:
    sampling = SamplingParams(temperature=0.9 if seeded else 0.0, seed=11 if seeded else None,
                              max_tokens=max_tokens, ignore_eos=True, logprobs=True, **params)  # type: ignore[arg-type]
    return EngineRequest(rid, prompt, sampling, cls)


def same(got: Result, want: Result) -> None:
    assert got.error is None and want.error is None
    assert (got.tokens, got.text, got.finish) == (want.tokens, want.text, want.finish)
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= 1e-5


def stored_states(store: RunningService) -> int:
    stats = TierStoreClient(store.address, timeout=10).stats()
    return stats.states_ram + stats.states_disk


def poison_unowned_state(core: EngineCore, slot: int | None) -> int:
    """Fill every free page, every free slot and `slot` with finite garbage; the number of pages filled.
    Run just before a restore: whatever the resumed sequence then reads that its restore did not write
    (a page or slot it left, a partial page never copied back) changes its tokens."""
    pages = [p for p in range(core.pages.num_pages) if core.pages.is_free(p)]
    noise = torch.Generator().manual_seed(99)
    kv = core.cache.kv
    kv[pages] = (torch.randn(kv[pages].shape, generator=noise) * 8).to(kv.dtype)
    rows = core.cache.state_rows
    free_slots = list(core.slots._free) if core.slots is not None else []  # SlotPool's free list, read here only
    for s in free_slots + ([slot] if slot is not None else []):
        rows[s] = 0x3F  # 0x3F3F3F3F is 0.747 as float32: finite, and never the state
    return len(pages)


def move_at(driver: Driver, rid: str, when: Callable[[EngineSequence], bool]) -> None:
    """Step until `when(seq)`, then move the sequence down; it must stop running until it resumes.
    Its resume then starts on poisoned memory (poison_unowned_state): the tokens that follow match
    only if they are decoded from what the restore wrote."""
    driver.step_until(lambda: driver.running_and(rid, when))
    seq = driver.seq(rid)
    assert driver.core.scheduler.move_down(seq)
    assert seq.status is SeqStatus.MOVING
    scheduler = driver.core.scheduler
    resume = scheduler._resume
    poisoned: list[int] = []

    def resume_on_poison(resumed: EngineSequence, moved: MovedState) -> None:
        poisoned.append(poison_unowned_state(driver.core, resumed.slot))
        resume(resumed, moved)
    scheduler._resume = resume_on_poison  # type: ignore[method-assign]
    driver.poisoned = poisoned


@pytest.mark.parametrize("reuse", [False, True], ids=["cold", "claimed"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prompt_tokens", [19, 40, 100], ids=["one-window", "two-windows", "four-windows"])
def test_moved_mid_decode_resumes_bit_exact(model, store: RunningService, seeded: bool, reuse: bool,  # type: ignore[no-untyped-def]
                                            prompt_tokens: int) -> None:
    """With reuse on, the moved request starts from the first one's retained state (or pages). The
    move is written in windows of 2 pages: 25 computed tokens move in one, 46 in two, 106 in four (each
    with a partial last page)."""
    prompt = make_prompt(prompt_tokens, seed=1)
    driver = Driver(model, store.address, reuse_prompt=reuse)
    try:
        want = driver.run(make_request("alone", prompt, seeded=seeded))
        driver.submit(make_request("moved", prompt, seeded=seeded))
        move_at(driver, "moved", lambda s: s.num_output == 7)
        driver.step_until(lambda: driver.done("moved"))
        same(driver.result("moved"), want)
        assert len(driver.poisoned) == 1 and driver.poisoned[0] > 0  # it resumed on poisoned memory
        stats = driver.core.stats()
        assert stats.sequences_moved[ReuseTier.RAM] == 1 and stats.sequences_recomputed == 0
        driver.core.check_integrity()
        if not reuse:
            assert stored_states(store) == 0  # the live state is dropped once restored
    finally:
        driver.close()


def test_moved_at_a_prefill_chunk_boundary_resumes_bit_exact(model, store: RunningService) -> None:  # type: ignore[no-untyped-def]
    prompt = make_prompt(70, seed=2)
    driver = Driver(model, store.address, prefill_chunk_tokens=32, reuse_prompt=False)
    try:
        want = driver.run(make_request("alone", prompt, seeded=True, max_tokens=10))
        driver.submit(make_request("moved", prompt, seeded=True, max_tokens=10))
        move_at(driver, "moved", lambda s: s.num_computed == 32 and s.num_output == 0)
        driver.step_until(lambda: driver.done("moved"))
        same(driver.result("moved"), want)
        driver.core.check_integrity()
        assert stored_states(store) == 0
    finally:
        driver.close()


def test_moved_with_a_stop_string_half_matched_resumes_bit_exact(model, store: RunningService) -> None:  # type: ignore[no-untyped-def]
    """The text a possible stop string holds back travels with the sequence object: a stop
    string half matched when the sequence moves down still ends it, at the same token."""
    prompt = make_prompt(30, seed=3)
    driver = Driver(model, store.address, reuse_prompt=False)
    try:
        free = driver.run(make_request("free", prompt))
        pieces = [driver.core.tokenizer.decode([t]) for t in free.tokens]
        k = next(i for i in range(4, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip())
        stop = pieces[k] + pieces[k + 1][:1]  # starts in token k, completes in token k+1
        want = driver.run(make_request("alone", prompt, stop=(stop,)))
        assert want.finish == "stop"
        driver.submit(make_request("moved", prompt, stop=(stop,)))
        move_at(driver, "moved", lambda s: s.num_output == k + 1)  # token k's text is held back now
        driver.step_until(lambda: driver.done("moved"))
        same(driver.result("moved"), want)
        driver.core.check_integrity()
    finally:
        driver.close()


def test_interactive_request_moves_agents_down_and_nobody_is_recomputed(model, store: RunningService) -> None:  # type: ignore[no-untyped-def]
    prompts = [make_prompt(40, seed=10 + i) for i in range(3)]
    ask = make_prompt(40, seed=20)
    reference = Driver(model, pages=64)
    try:
        want_agents = [reference.run(make_request(f"a{i}", p, max_tokens=20)) for i, p in enumerate(prompts)]
        want_ask = reference.run(make_request("ask", ask, max_tokens=8))
    finally:
        reference.close()
    # 3 agents of 40 + 20 tokens need 4 pages each: 12 pages leave no room for the interactive one.
    driver = Driver(model, store.address, pages=12, reuse_prompt=False)
    try:
        for i, p in enumerate(prompts):
            driver.submit(make_request(f"a{i}", p, max_tokens=20, cls=RequestClass.AGENT))
        driver.step_until(lambda: all(driver.running_and(f"a{i}", lambda s: s.num_output >= 3) for i in range(3)))
        driver.submit(make_request("ask", ask, max_tokens=8))
        driver.step_until(lambda: driver.done("ask"))
        same(driver.result("ask"), want_ask)
        driver.step_until(lambda: all(driver.done(f"a{i}") for i in range(3)))
        for i in range(3):
            same(driver.result(f"a{i}"), want_agents[i])
        stats = driver.core.stats()
        assert stats.sequences_moved[ReuseTier.RAM] >= 1 and stats.sequences_recomputed == 0
        assert stats.requests_preempted == 0
        driver.core.check_integrity()
        assert stored_states(store) == 0
    finally:
        driver.close()


def test_a_cancelled_moved_sequence_leaves_nothing_in_any_tier(model, store: RunningService) -> None:  # type: ignore[no-untyped-def]
    """Cancelled while its state waits below (a blocker holds the only running place), and
    cancelled halfway through its move: either way no state and no reservation is left."""
    driver = Driver(model, store.address, reuse_prompt=False, max_num_seqs=1)
    try:
        driver.submit(make_request("gone", make_prompt(40, seed=4)))
        move_at(driver, "gone", lambda s: s.num_output == 2)
        driver.submit(make_request("blocker", make_prompt(50, seed=5), max_tokens=40))
        driver.step_until(lambda: driver.core.stats().moving == 0)  # committed below, waiting to resume
        assert driver.running("gone") is None and stored_states(store) == 1
        driver.core.abort("gone")
        driver.step_until(lambda: driver.done("gone"))
        assert stored_states(store) == 0
        move_at(driver, "blocker", lambda s: True)  # 4 pages at 2 a step
        driver.core.step()  # the first window is written
        assert TierStoreClient(store.address, timeout=10).stats().reservations_pending == 1
        driver.core.abort("blocker")
        driver.step_until(lambda: driver.done("blocker"))
        stats = TierStoreClient(store.address, timeout=10).stats()
        assert (stats.states_ram + stats.states_disk, stats.reservations_pending) == (0, 0)
        driver.core.check_integrity()
        assert driver.core.pages.num_free == driver.core.pages.num_pages
    finally:
        driver.close()


def test_a_committed_move_resumes_before_a_newcomer_of_its_class(model, store: RunningService) -> None:  # type: ignore[no-untyped-def]
    """A moved sequence keeps the rank it was admitted with: committed below, it goes back to the head
    of its class's queue, ahead of a request of its class that arrived after it and waits for the one
    running place."""
    prompt = make_prompt(19, seed=1)
    driver = Driver(model, store.address, reuse_prompt=False, max_num_seqs=1)
    try:
        want = driver.run(make_request("alone", prompt))
        driver.submit(make_request("moved", prompt))
        driver.step_until(lambda: driver.running_and("moved", lambda s: s.num_output == 3))
        driver.submit(make_request("newcomer", make_prompt(30, seed=8), max_tokens=4))
        move_at(driver, "moved", lambda s: s.num_computed == 21)  # 2 pages: written in one window
        driver.core.step()  # written, committed and queued again; then admission
        assert driver.running("moved") is not None and driver.running("newcomer") is None
        driver.step_until(lambda: driver.done("moved") and driver.done("newcomer"))
        same(driver.result("moved"), want)
        assert driver.result("newcomer").error is None
        driver.core.check_integrity()
    finally:
        driver.close()


def test_a_moved_state_keeps_its_room_in_ram_against_its_own_class(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A moved state belongs to a request in flight: its reservation is protected (LIVE_PROTECT_SECONDS).
    While it waits below, another client of its class fills KV-RAM (no disk to move anything to) with
    protected states of its own until the store refuses one: the moved state is not what makes room,
    and the sequence resumes from RAM, equal to a run never moved."""
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(8 * MiB), "--kv-disk-bytes", "0"])
    driver = Driver(model, store.address, reuse_prompt=False, max_num_seqs=1)
    other = TierStoreClient(store.address, timeout=10)
    try:
        prompt = make_prompt(40, seed=4)
        want = driver.run(make_request("alone", prompt))
        driver.submit(make_request("moved", prompt))
        move_at(driver, "moved", lambda s: s.num_output == 2)
        driver.submit(make_request("blocker", make_prompt(50, seed=5), max_tokens=40))
        driver.step_until(lambda: driver.core.stats().moving == 0)  # committed below; the blocker runs
        assert driver.running("moved") is None and driver.running("blocker") is not None
        assert stored_states(store) == 1
        namespace, size = b"o" * 16, 512 * 1024
        other.register(namespace, page_size=P, layout='{"another": "engine"}')
        with pytest.raises(grpc.RpcError) as refused:
            for i in range(4 * 8 * MiB // size):  # more than KV-RAM holds
                data = bytes([i % 251]) * size
                other.store(i.to_bytes(16, "little"), data, tierstore_pb2.StateMetadata(
                    namespace=namespace, tokens=P, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                    request_class=common_pb2.REQUEST_CLASS_INTERACTIVE, checksum=xxhash.xxh3_128_digest(data),
                    nbytes=size), protect_seconds=3600.0)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert other.stats().protected_refusals == 1
        driver.step_until(lambda: driver.done("moved") and driver.done("blocker"))
        same(driver.result("moved"), want)
        assert len(driver.poisoned) == 1  # it resumed (on poisoned memory), from what was restored
        stats = driver.core.stats()
        assert stats.sequences_moved[ReuseTier.RAM] == 1 and stats.sequences_recomputed == 0
        driver.core.check_integrity()
    finally:
        other.close()
        driver.close()
        store.stop()


def choice_tokens(driver: Driver, rid: str, choice: int) -> list[int]:
    return [t for u in driver.updates[rid] for d in u.deltas if d.choice == choice for t in d.token_ids]


def test_an_interactive_request_moves_every_agent_it_needs_at_once_when_they_share_pages(  # type: ignore[no-untyped-def]
        model, store: RunningService) -> None:
    """The two choices of an agent request (n=2) share their prompt's 4 pages. An interactive request
    fits only once both have moved: both start moving in the step it arrives. While one choice moves,
    its shared pages stay held by the other, so they are not room coming back (counted as such, the
    request would wait for pages that never come, and the choices would move one at a time)."""
    agent_prompt, ask = make_prompt(64, seed=30), make_prompt(90, seed=31)  # 4 pages; 6 pages
    reference = Driver(model, pages=64)
    try:
        want_agent = reference.run(make_request("agent", agent_prompt, max_tokens=12, n=2))
        want_ask = reference.run(make_request("ask", ask, max_tokens=4))
    finally:
        reference.close()
    driver = Driver(model, store.address, pages=10, reuse_prompt=False)
    try:
        pool = driver.core.pages
        assert pool.num_pages == 10
        driver.submit(make_request("agent", agent_prompt, max_tokens=12, cls=RequestClass.AGENT, n=2))

        def choices() -> list[EngineSequence]:
            return [s for s in driver.core.scheduler.running if s.request.request_id == "agent"]
        driver.step_until(lambda: len(choices()) == 2 and all(s.num_output == 2 for s in choices()))
        first, second = choices()
        shared = set(first.page_table) & set(second.page_table)
        assert len(shared) == 4 and all(pool.refcount(p) == 2 for p in shared)
        assert (pool.num_used, pool.num_free) == (6, 4)  # the ask's 6 pages fit once both choices have left
        driver.submit(make_request("ask", ask, max_tokens=4))
        driver.core.step()
        assert first.status is SeqStatus.MOVING and second.status is SeqStatus.MOVING
        driver.step_until(lambda: driver.done("ask") and driver.done("agent"))
        same(driver.result("ask"), want_ask)
        assert choice_tokens(driver, "agent", 0) == choice_tokens(reference, "agent", 0)
        assert choice_tokens(driver, "agent", 1) == choice_tokens(reference, "agent", 1)
        stats = driver.core.stats()
        assert stats.sequences_moved[ReuseTier.RAM] >= 2 and stats.sequences_recomputed == 0
        driver.core.check_integrity()
        assert pool.num_free == pool.num_pages
    finally:
        driver.close()


def test_tierstore_killed_during_a_move_falls_back_to_recompute(model, store: RunningService) -> None:  # type: ignore[no-untyped-def]
    prompt = make_prompt(60, seed=5)
    driver = Driver(model, store.address, reuse_prompt=False)
    try:
        want = driver.run(make_request("alone", prompt))
        driver.submit(make_request("moved", prompt))
        move_at(driver, "moved", lambda s: s.num_output == 4)  # 4 pages, 2 per step: the move takes two steps
        store.process.send_signal(signal.SIGKILL)
        store.process.wait()
        driver.step_until(lambda: driver.done("moved"))
        same(driver.result("moved"), want)
        stats = driver.core.stats()
        assert stats.sequences_recomputed == 1 and stats.sequences_moved[ReuseTier.RAM] == 0
        driver.core.check_integrity()
    finally:
        driver.close()


def test_without_a_tierstore_pressure_recomputes_and_counts_it(model) -> None:  # type: ignore[no-untyped-def]
    driver = Driver(model, reuse_prompt=False)
    try:
        driver.submit(make_request("r", make_prompt(30, seed=6)))
        driver.step_until(lambda: driver.running_and("r", lambda s: s.num_output == 2))
        assert not driver.core.scheduler.move_down(driver.seq("r"))  # no tier can take it
    finally:
        driver.close()
