"""Retained states moving device -> KV-RAM -> KV-disk and back, end to end.

A real tierstore process (real shared memory, real LMDB) under an in-process
EngineCore: on ignis-tiny (hybrid) with 2 retained device slots, and on a dense
model whose page pool is small enough that finished pages get reused. Every
output is checked against a cold run (reuse off): greedy tokens identical,
logprobs within 1e-5.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

import engine.tiers.link as link_module
from engine.config import EngineConfig
from engine.cache.reuse import ReuseCounters
from engine.core import EngineCore
from engine.facts import ReuseTier
from engine.model.loader import LoadedModel, load_model
from engine.outputs import RequestUpdate
from engine.prompt import render_chat
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from ignis.v1 import common_pb2, engine_pb2, tierstore_pb2
from services import RunningService, start_tierstore

P = 16
MiB = 1 << 20


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float | None]
    cached: int
    tier: str
    kind: str
    error: str | None


class Engine:
    """An EngineCore driven from the test thread."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, *, reuse: bool = True, tierstore: str = "",
                 kv_cache_bytes: int = 16 * MiB, interactive_ttl: float = 0.0, spill_ahead_pages: int = 0,
                 retained_device: int = 2) -> None:
        # interactive_ttl=0: these tests move state by recency; protection has tests of its own.
        # retained_device=0 on the dense model: its page chains alone (kept ends: test_dense_kept_ends.py).
        self.tokenizer = tokenizer
        self.core = EngineCore(loaded, tokenizer, EngineConfig(
            page_size=P, kv_cache_bytes=kv_cache_bytes, max_num_seqs=4, reuse_prompt=reuse,
            retained_device=retained_device,
            retained_interactive_ttl=interactive_ttl, tierstore_address=tierstore, tier_timeout=2.0,
            tier_retry_seconds=0.3, spill_ahead_pages=spill_ahead_pages))
        self.core.start()
        self.n = 0

    def request(self, topic: str, turns: int = 1) -> EngineRequest:
        """The first user turn about `topic`; with turns=2, a fixed reply and a second user turn follow."""
        chat = engine_pb2.ChatInput()
        chat.messages.add(role="user", content=f"Conversation about {topic}: " + f"tell me about {topic}. " * 6)
        if turns == 2:
            chat.messages.add(role="assistant", content=f"Here is what I know of {topic}.")
            chat.messages.add(role="user", content=f"And what else about {topic}?")
        self.n += 1
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)
        return EngineRequest(f"r{self.n}", render_chat(self.tokenizer, chat).token_ids, params)

    def run(self, topic: str, turns: int = 1) -> Result:
        req = self.request(topic, turns)
        done = threading.Event()
        updates: list[RequestUpdate] = []

        def sink(u: RequestUpdate) -> None:
            updates.append(u)
            if u.done:
                done.set()

        self.core.submit(req, sink)
        assert done.wait(60)
        last = updates[-1]
        deltas = [d for u in updates for d in u.deltas]
        usage = last.usage
        return Result([t for d in deltas for t in d.token_ids], [lp.logprob for d in deltas for lp in d.logprobs],
                      usage.cached_tokens if usage else 0, usage.reuse.tier.value if usage else "none",
                      usage.reuse.kind.value if usage else "none", last.error)

    def settle(self) -> None:
        """Wait until the copies the engine runs off the step are collected (counters are final)."""
        deadline = time.monotonic() + 30
        while self.core.residency.copying:
            assert time.monotonic() < deadline, "copies off the step never finished"
            time.sleep(0.01)

    def check(self) -> None:
        self.settle()
        self.core.check_integrity()
        assert self.core.stats().used_pages == 0

    def close(self) -> None:
        self.core.stop()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def oracle(model: tuple[LoadedModel, Tokenizer]):
    yield from cold_runs(model)


@pytest.fixture(scope="module")
def dense_model(dense_chat_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir)


@pytest.fixture(scope="module")
def dense_oracle(dense_model: tuple[LoadedModel, Tokenizer]):
    yield from cold_runs(dense_model)


def cold_runs(model: tuple[LoadedModel, Tokenizer]):
    cold = Engine(*model, reuse=False)
    memo: dict[str, Result] = {}

    def get(topic: str, turns: int = 1) -> Result:
        key = f"{topic}/{turns}"
        if key not in memo:
            memo[key] = cold.run(topic, turns)
        return memo[key]

    yield get
    cold.check()
    cold.close()


def tierstore(tmp_path: Path, arena: int, disk: int, port: int = 0) -> RunningService:
    args = ["--kv-host-pool-bytes", str(arena), "--kv-disk-path", str(tmp_path / "kv-disk"),
            "--kv-disk-bytes", str(disk)]
    return start_tierstore(tmp_path / "ts", args + (["--port", str(port)] if port else []))


LONG_LEASE_SECONDS = 600.0  # far past leases_settle's wait: a lease seen to go went back, it did not expire


@pytest.fixture
def long_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lease the engine takes (a Match's, an Acquire's) lasts LONG_LEASE_SECONDS, and a Match's lease
    may be copied under for half of that (however slow the machine): only a Release ends one in a test."""
    from engine.tiers.client import TierClient

    monkeypatch.setattr(link_module, "MATCH_LEASE_SECONDS", LONG_LEASE_SECONDS)
    monkeypatch.setattr(link_module, "LEASE_USE_SECONDS", LONG_LEASE_SECONDS / 2)
    acquire, acquire_stream = TierClient.acquire, TierClient.acquire_stream
    monkeypatch.setattr(TierClient, "acquire", lambda self, hash, lease_seconds=LONG_LEASE_SECONDS:
                        acquire(self, hash, lease_seconds))
    monkeypatch.setattr(TierClient, "acquire_stream", lambda self, hash, lease_seconds=LONG_LEASE_SECONDS:
                        acquire_stream(self, hash, lease_seconds))


@pytest.fixture
def match_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's client maps no published table, so every lookup asks Match and leases what it names
    (the paths these tests are about; the table's own: test_published_table.py)."""
    from engine.tiers.client import TierClient

    monkeypatch.setattr(TierClient, "_map_table", lambda self, reply: None)


def leases_settle(link, want: int) -> None:  # type: ignore[no-untyped-def]
    """Wait until the store holds `want` leases (Release runs in the background). Use with `long_leases`:
    with the engine's own lease times (a Match's lasts 3 s) a lease never released would expire within
    the wait and pass for one released."""
    assert link_module.MATCH_LEASE_SECONDS == LONG_LEASE_SECONDS, "leases_settle needs the long_leases fixture"
    deadline = time.monotonic() + 60
    while (stats := link.client.side_stats()) is None or stats.leases_active != want:
        assert time.monotonic() < deadline, f"the store holds {stats and stats.leases_active} leases, not {want}"
        time.sleep(0.01)


def same(got: Result, want: Result) -> None:
    assert got.error is None
    assert got.tokens == want.tokens
    assert max(abs((x or 0.0) - (y or 0.0)) for x, y in zip(got.logprobs, want.logprobs)) < 1e-5


TOPICS = ["tides", "glaciers", "volcanoes", "comets", "lichens"]


def serve_topics(engine: Engine, oracle) -> ReuseCounters:  # type: ignore[no-untyped-def]
    """One conversation per topic, each checked against a cold run; the reuse counters after."""
    for topic in TOPICS:
        same(engine.run(topic), oracle(topic))
    engine.settle()
    return engine.core.reuse.counters


def test_protected_states_keep_the_device_and_newcomers_go_straight_to_ram(tmp_path: Path, model, oracle) -> None:
    """Inside reuse.retained_interactive_ttl an interactive state someone claimed is protected: later
    interactive captures do not displace the first two conversations' states from the device (the one
    eviction order) but are written to KV-RAM from their own slot; every conversation still hits, the
    first one on the device."""
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address, interactive_ttl=300.0)
    try:
        for topic in TOPICS[:2]:  # each claimed once, so protected: they end up holding both slots
            same(engine.run(topic), oracle(topic))
            assert engine.run(topic).cached > 0  # from the device, or from ram and held on the device again
        before = engine.core.reuse.counters.evictions
        counters = serve_topics(engine, oracle)
        assert counters.evictions == before  # nothing left the device once both slots held claimed states
        # Each later conversation's two captures went below, and so did the reply ends of the first two
        # (their openers hold the slots).
        assert counters.protected_skips == counters.captures_below >= 2 * (len(TOPICS) - 2)
        assert engine.core.stats().retained_protected_skips == counters.protected_skips
        for topic in TOPICS[:2]:
            got = engine.run(topic)
            same(got, oracle(topic))
            assert (got.tier, got.cached) == ("device", len(engine.request(topic).prompt_ids))
        for topic in TOPICS[2:4]:
            got = engine.run(topic)
            same(got, oracle(topic))
            assert (got.tier, got.cached) == ("ram", len(engine.request(topic).prompt_ids))
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_without_a_ttl_newcomers_displace_the_least_recent_state(tmp_path: Path, model, oracle) -> None:
    """The same run with reuse.retained_interactive_ttl=0: nothing is protected, each capture
    displaces the least recently used state (spilled to RAM), and the newest stays on the device."""
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address, interactive_ttl=0.0)
    try:
        counters = serve_topics(engine, oracle)
        assert (counters.protected_skips, counters.captures_below) == (0, 0)
        assert counters.evictions == 2 * (len(TOPICS) - 1)
        got = engine.run(TOPICS[0])
        assert (got.tier, got.cached) == ("ram", len(engine.request(TOPICS[0]).prompt_ids))
        link = engine.core.tiers
        assert link is not None and (link.table_claims, link.match_leases_used) == (1, 0)  # no Match: the table
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_evicted_states_spill_to_ram_and_hit_from_ram(tmp_path: Path, model, oracle, long_leases,
                                                      match_only) -> None:
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS:  # 2 device slots: each conversation evicts the one before
            same(engine.run(topic), oracle(topic))
        link = engine.core.reuse.tiers  # type: ignore[attr-defined]
        assert link.spills >= 2 * (len(TOPICS) - 1)  # opener + end-of-reply checkpoint of each evicted one
        for topic in TOPICS[:3]:
            got = engine.run(topic)
            same(got, oracle(topic))
            assert got.tier == "ram" and got.cached == len(engine.request(topic).prompt_ids)
        # Each claim copied under its Match's lease (no Acquire), and every lease went back.
        assert link.match_leases_used == 3
        leases_settle(link, 0)
        assert engine.core.reuse.counters.reused_tokens[ReuseTier.RAM] > 0
        assert engine.core.stats().reused_tokens[ReuseTier.RAM] == engine.core.reuse.counters.reused_tokens[ReuseTier.RAM]
        floor = engine.core.reuse.lower.restore_floor  # type: ignore[attr-defined,union-attr]
        engine.core.reuse.lower.restore_floor = 10**6  # type: ignore[attr-defined,union-attr] # a restore never beats re-prefilling
        got = engine.run(TOPICS[3])  # in RAM, but below the floor: served cold
        same(got, oracle(TOPICS[3]))
        assert (got.tier, got.cached) == ("none", 0)
        engine.core.reuse.lower.restore_floor = floor  # type: ignore[attr-defined,union-attr]
        # A lookup whose restore never comes: its lease is held, then goes back at the next lookup.
        namespace, prompt = engine.core.namespace_hash(""), list(engine.request(TOPICS[1]).prompt_ids)
        assert link.find(namespace, engine_page_hashes(engine, TOPICS[1]), prompt) is not None
        leases_settle(link, 1)
        assert link.find(namespace, [], [7] * 5) is None
        leases_settle(link, 0)
        assert link.match_leases_used == 3
        engine.check()
    finally:
        engine.close()
        store.stop()


class _ShiftedTime:
    """The `time` module as engine/tiers/link.py reads it, its monotonic clock `shift` seconds ahead."""

    def __init__(self) -> None:
        self.shift = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.shift

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_a_match_lease_too_old_to_copy_under_goes_back_and_the_restore_acquires(
        tmp_path: Path, model, oracle, long_leases, match_only, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore copies under its lookup's lease only within LEASE_USE_SECONDS of the Match (the rest of the
    lease is for the copy itself): a restore that comes later lets that lease go and Acquires its own."""
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS:  # the first ones spill to RAM as later ones take the device slots
            same(engine.run(topic), oracle(topic))
        link = engine.core.tiers
        assert link is not None
        clock = _ShiftedTime()
        monkeypatch.setattr(link_module, "time", clock)
        find = link._find

        def find_then_wait(*args):  # type: ignore[no-untyped-def]
            hit = find(*args)
            clock.shift += link_module.LEASE_USE_SECONDS + 1.0  # the restore comes after the lease's use time
            return hit
        monkeypatch.setattr(link, "_find", find_then_wait)
        used = link.match_leases_used
        got = engine.run(TOPICS[0])
        same(got, oracle(TOPICS[0]))
        assert (got.tier, got.cached) == ("ram", len(engine.request(TOPICS[0]).prompt_ids))
        assert link.match_leases_used == used  # it Acquired instead
        leases_settle(link, 0)  # the Match's lease and the Acquire's both went back
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_a_lease_of_a_store_instance_no_longer_mapped_is_never_copied_under(
        tmp_path: Path, model, oracle, long_leases, match_only) -> None:
    """Between a lookup and its restore the store restarts, and the engine maps the new instance's arena (a
    spill on the copy worker reserved there meanwhile). The lookup's lease is the old instance's: its extent
    means nothing in the new arena (there the state lies elsewhere), so the restore Acquires it from the new
    instance and serves it, equal to cold, with nothing rejected."""
    from engine.facts import RequestClass
    from engine.kv.chain_hash import StateHash
    from tierstore.client import TierStoreClient

    stores = [tierstore(tmp_path, arena=16 * MiB, disk=0)]
    engine = Engine(*model, tierstore=stores[0].address)
    try:
        for topic in TOPICS:
            same(engine.run(topic), oracle(topic))
        link = engine.core.tiers
        assert link is not None
        namespace = engine.core.namespace_hash("")
        find = link._find
        offsets: list[int] = []

        def find_then_restart(*args):  # type: ignore[no-untyped-def]
            hit = find(*args)
            if hit is None or offsets:
                return hit
            with TierStoreClient(stores[0].address) as old:
                lease = old.acquire(hit.state_hash)
                meta, data = old.get(hit.state_hash)
                old.release(lease.lease_id)
            offsets.append(lease.extent.offset)
            stores[0].stop()
            stores[0] = tierstore(tmp_path, arena=64 * MiB, disk=0)  # same socket, a new instance
            with TierStoreClient(stores[0].address) as new:
                new.register(namespace, page_size=P, layout=link.codec.layout())
                pad = bytes(offsets[0] + len(data))  # where the old extent was, the new arena holds zeros
                new.store(b"p" * 16, pad, tierstore_pb2.StateMetadata(
                    namespace=namespace, tokens=P, kind=common_pb2.REUSE_KIND_PAGES,
                    request_class=common_pb2.REQUEST_CLASS_INTERACTIVE, checksum=xxhash.xxh3_128_digest(pad),
                    nbytes=len(pad)))
                offsets.append(new.store(hit.state_hash, data, meta).offset)
            deadline = time.monotonic() + 60
            while (spill := link.reserve(StateHash(b"s" * 16), namespace, 4096, RequestClass.INTERACTIVE)) is None:
                assert time.monotonic() < deadline, "the engine never reached the restarted store"
                time.sleep(0.05)  # past the client's retry back-off
            link.drop(spill.name)
            assert spill.instance == link.client.instance_id  # the new arena is the one mapped now
            return hit
        link._find = find_then_restart  # type: ignore[method-assign]
        rejected, used = link.rejected, link.match_leases_used
        got = engine.run(TOPICS[0])
        same(got, oracle(TOPICS[0]))
        assert offsets[0] != offsets[1]
        assert (got.tier, got.cached) == ("ram", len(engine.request(TOPICS[0]).prompt_ids))
        assert (link.rejected, link.match_leases_used) == (rejected, used)
        leases_settle(link, 0)
        engine.check()
    finally:
        engine.close()
        stores[0].stop()


def test_next_turn_hits_a_checkpoint_that_ends_mid_page_in_ram(tmp_path: Path, model, oracle) -> None:
    """Turn 2 extends turn 1's prompt; turn 1's opener checkpoint (mid-page) was spilled to RAM.

    Its name depends on where it ends, so the store returns it as an anchored candidate
    and the engine keeps it after checking the name against its own tokens.
    """
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS:
            same(engine.run(topic), oracle(topic))
        first_turn = len(engine.request(TOPICS[0]).prompt_ids)
        assert first_turn % P, "the test needs an opener that ends mid-page"
        got = engine.run(TOPICS[0], turns=2)
        same(got, oracle(TOPICS[0], turns=2))
        assert got.tier == "ram" and got.cached == first_turn
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_dense_pages_spill_when_the_pool_reuses_them_and_hit_from_ram(tmp_path: Path, dense_model,
                                                                             dense_oracle) -> None:
    """Attention-only: a finished conversation's pages leave the device when the allocator reuses them.

    They go to KV-RAM as one state whose every page hash is indexed; the next turn of that
    conversation (a longer prompt with the same head) restores a page-aligned prefix of it.
    """
    page_bytes = P * 4 * 2 * 2 * 16 * 4  # page x layers x (k, v) x kv heads x head dim x fp32
    store = tierstore(tmp_path, arena=4 * MiB, disk=0)
    engine = Engine(*dense_model, tierstore=store.address, kv_cache_bytes=16 * page_bytes, retained_device=0)
    try:
        assert engine.core.pages.num_pages == 16
        for topic in TOPICS:  # ~5 pages each: the later ones reuse the first ones' pages
            same(engine.run(topic), dense_oracle(topic))
        chains = engine.core.residency.chains
        assert chains.spills >= 1
        assert engine.core.pages.page_for(engine_page_hashes(engine, TOPICS[0])[0]) is None  # gone from the device
        n = len(engine.request(TOPICS[0], turns=2).prompt_ids)
        got = engine.run(TOPICS[0], turns=2)
        same(got, dense_oracle(TOPICS[0], turns=2))
        first_turn = len(engine.request(TOPICS[0]).prompt_ids)
        assert got.tier == "ram" and got.kind == "pages"
        assert (first_turn // P) * P <= got.cached < n and got.cached % P == 0  # a page-aligned prefix
        assert engine.core.reuse.counters.reused_tokens[ReuseTier.RAM] == got.cached
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_a_dense_chain_is_written_ahead_off_the_step_and_hits_from_ram(tmp_path: Path, dense_model,
                                                                       dense_oracle) -> None:
    """With the pool under pressure (here: any page in use) a finished chain is written to KV-RAM by
    the copy worker while the engine steps on: a request runs to its end while the write is held
    back, and the store has nothing yet. Once written, the allocator hands the chain's pages out
    without a copy on the step, and the next turn restores it from RAM, equal to cold."""
    page_bytes = P * 4 * 2 * 2 * 16 * 4
    store = tierstore(tmp_path, arena=4 * MiB, disk=0)
    engine = Engine(*dense_model, tierstore=store.address, kv_cache_bytes=16 * page_bytes, spill_ahead_pages=16,
                    retained_device=0)
    try:
        worker = engine.core.residency.worker
        same(engine.run(TOPICS[0]), dense_oracle(TOPICS[0]))
        worker.running.clear()  # the write ahead starts with the next step and cannot finish
        same(engine.run(TOPICS[1]), dense_oracle(TOPICS[1]))  # ran to its end beside the write
        assert worker.in_flight == 1 and engine.core.reuse.counters.spills_ahead == 0
        first_hashes = engine_page_hashes(engine, TOPICS[0])
        link = engine.core.tiers
        assert link is not None
        first = list(engine.request(TOPICS[0]).prompt_ids)
        assert link.find(engine.core.namespace_hash(""), first_hashes, first) is None  # not committed: nothing served
        worker.running.set()
        engine.settle()
        assert engine.core.reuse.counters.spills_ahead == 2  # both finished chains, one after the other
        assert link.find(engine.core.namespace_hash(""), first_hashes, first) is not None
        for topic in TOPICS[2:]:  # reuse the first chains' pages: written already, nothing to copy
            same(engine.run(topic), dense_oracle(topic))
        engine.settle()
        assert engine.core.reuse.counters.spills_on_step == 0 and engine.core.reuse.counters.spills_ahead >= 2
        assert engine.core.pages.page_for(first_hashes[0]) is None  # gone from the device
        got = engine.run(TOPICS[0], turns=2)
        same(got, dense_oracle(TOPICS[0], turns=2))
        assert got.tier == "ram" and got.kind == "pages" and got.cached >= len(first_hashes) // 2 * P
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_a_write_ahead_the_store_dies_under_loses_nothing_live(tmp_path: Path, dense_model, dense_oracle) -> None:
    """The tierstore is killed while a write ahead waits to run: the write fails, is counted, and
    the engine serves on with device-only reuse; every answer still equals cold."""
    page_bytes = P * 4 * 2 * 2 * 16 * 4
    store = tierstore(tmp_path, arena=4 * MiB, disk=0)
    engine = Engine(*dense_model, tierstore=store.address, kv_cache_bytes=16 * page_bytes, spill_ahead_pages=16,
                    retained_device=0)
    try:
        worker = engine.core.residency.worker
        same(engine.run(TOPICS[0]), dense_oracle(TOPICS[0]))
        worker.running.clear()
        same(engine.run(TOPICS[1]), dense_oracle(TOPICS[1]))  # the write of TOPICS[0]'s chain is queued
        store.process.send_signal(signal.SIGKILL)
        store.process.wait()
        failures = engine.core.tiers.spill_failures  # type: ignore[union-attr]
        worker.running.set()
        engine.settle()
        assert engine.core.reuse.counters.spills_ahead == 0
        assert engine.core.tiers.spill_failures > failures or not engine.core.tiers.client.up  # type: ignore[union-attr]
        for topic in TOPICS[2:]:
            same(engine.run(topic), dense_oracle(topic))
        got = engine.run(TOPICS[0])
        same(got, dense_oracle(TOPICS[0]))
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_retained_states_leaving_next_are_written_ahead_and_every_turn_matches_cold(
        tmp_path: Path, model, oracle) -> None:
    """Hybrid, 2 device slots: once they are full, the lowest-ranked state is written to KV-RAM off
    the step; evicting it then copies nothing. Every answer equals cold, the evicted conversations
    hit from RAM, and the written-ahead and on-the-step writes add up to what left the device."""
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    try:
        counters = serve_topics(engine, oracle)
        assert counters.spills_ahead >= 1
        assert counters.spills_ahead + counters.spills_on_step >= counters.evictions >= 2 * (len(TOPICS) - 1) - 1
        for topic in TOPICS[:3]:
            got = engine.run(topic)
            same(got, oracle(topic))
            assert got.tier in ("ram", "device") and got.cached == len(engine.request(topic).prompt_ids)
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_a_write_ahead_the_store_refuses_is_written_on_the_step_when_evicted(
        tmp_path: Path, model, oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another client's protected states of the same class fill KV-RAM when the first retained state is
    written ahead: the store refuses it, so it is not below. Once that room is free again, evicting the
    state writes it on the step, and its conversation's next turn is claimed from RAM, equal to cold."""
    from tierstore.client import TierStoreClient

    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    other = TierStoreClient(store.address)
    try:
        namespace, filler = b"o" * 16, b"f" * 16
        other.register(namespace, page_size=P, layout='{"another": "engine"}')
        stats = other.stats()
        data = bytes(stats.arena_bytes_total - stats.arena_bytes_used)  # every free byte of KV-RAM
        other.store(filler, data, tierstore_pb2.StateMetadata(
            namespace=namespace, tokens=P, kind=common_pb2.REUSE_KIND_CHECKPOINT,
            request_class=common_pb2.REQUEST_CLASS_INTERACTIVE, checksum=xxhash.xxh3_128_digest(data),
            nbytes=len(data)), protect_seconds=3600.0)
        link = engine.core.tiers
        assert link is not None
        write_state = link.write_state
        refused: list[str] = []

        def refused_once_then_room(*args, **kwargs):  # type: ignore[no-untyped-def]
            written = write_state(*args, **kwargs)
            if not written and not refused:
                refused.append(threading.current_thread().name)
                other.drop(filler)  # room again for every write after this one
            return written
        monkeypatch.setattr(link, "write_state", refused_once_then_room)
        same(engine.run(TOPICS[0]), oracle(TOPICS[0]))  # its opener and reply checkpoints take both device slots
        same(engine.run(TOPICS[1]), oracle(TOPICS[1]))  # whose captures evict them
        engine.settle()
        counters = engine.core.reuse.counters
        assert refused == ["ignis-copies"], "the first write was not a write ahead that the store refused"
        assert (counters.evictions, counters.spills_on_step, counters.spills_ahead) == (2, 1, 1), counters
        got = engine.run(TOPICS[0])
        same(got, oracle(TOPICS[0]))
        assert (got.tier, got.cached) == ("ram", len(engine.request(TOPICS[0]).prompt_ids))
        engine.check()
    finally:
        other.close()
        engine.close()
        store.stop()


def test_a_capture_straight_to_ram_is_claimed_only_once_written(tmp_path: Path, model, oracle) -> None:
    """A protected device state keeps its slot, so the next conversation's captures go straight to
    KV-RAM through the staging ring. Its retry, sent while the write is held back, waits for it (no
    torn read, no second prefill) and then claims it from RAM, equal to cold."""
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address, interactive_ttl=300.0, spill_ahead_pages=-1)
    try:
        for topic in TOPICS[:2]:  # the first two fill the device's two slots, each claimed (so protected)
            same(engine.run(topic), oracle(topic))
            assert engine.run(topic).cached > 0  # from the device, or from ram and held on the device again
        worker = engine.core.residency.worker
        engine.settle()
        worker.running.clear()
        same(engine.run(TOPICS[2]), oracle(TOPICS[2]))  # its captures are staged, their writes held back
        assert worker.in_flight >= 1
        result: list[Result] = []
        retry = threading.Thread(target=lambda: result.append(engine.run(TOPICS[2])))
        retry.start()
        retry.join(0.5)
        assert retry.is_alive() and engine.core.stats().inflight_holds >= 1  # held, not prefilled again
        worker.running.set()
        retry.join(60)
        same(result[0], oracle(TOPICS[2]))
        assert (result[0].tier, result[0].cached) == ("ram", len(engine.request(TOPICS[2]).prompt_ids))
        engine.check()
    finally:
        engine.close()
        store.stop()


def engine_page_hashes(engine: Engine, topic: str) -> list[bytes]:
    from engine.kv.chain_hash import page_hashes

    return page_hashes(engine.core.namespace_hash(""), engine.request(topic).prompt_ids, P)  # type: ignore[arg-type]


def test_small_arena_spills_on_to_disk_and_hits_from_disk(tmp_path: Path, model, oracle) -> None:
    store = tierstore(tmp_path, arena=1 * MiB, disk=64 * MiB)  # about two states fit in RAM
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS:
            same(engine.run(topic), oracle(topic))
        got = engine.run(TOPICS[0])  # spilled first: long pushed out of the arena onto disk
        same(got, oracle(TOPICS[0]))
        assert got.tier == "disk"
        assert engine.core.reuse.tiers.restores_streamed == 1  # type: ignore[attr-defined] # copied as it was read
        assert engine.core.reuse.counters.reused_tokens[ReuseTier.DISK] > 0
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_a_flipped_byte_on_disk_is_never_served_the_request_runs_cold(tmp_path: Path, model, oracle) -> None:
    from tierstore.client import TierStoreClient  # the test reads the store's counters; the engine never imports it

    store = tierstore(tmp_path, arena=1 * MiB, disk=64 * MiB)
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS:
            same(engine.run(topic), oracle(topic))
        # The store keeps copying RAM states ahead of need meanwhile: their temp files (*.tmp, *.copy.tmp)
        # come and go, and a blob may be removed between the listing and its read.
        blobs = sorted(p for p in (tmp_path / "kv-disk" / "blobs").iterdir() if not p.name.endswith(".tmp"))
        assert blobs, "nothing reached the disk tier"
        for blob in blobs:  # one byte in the middle of every state (its KV or recurrent section), in place
            try:
                with blob.open("r+b") as f:
                    middle = f.seek(0, 2) // 2
                    f.seek(middle)
                    byte = f.read(1)[0]
                    f.seek(middle)
                    f.write(bytes([byte ^ 0x40]))
            except FileNotFoundError:
                continue
        got = engine.run(TOPICS[0])  # its states are on disk only: every candidate fails its checksum
        same(got, oracle(TOPICS[0]))
        assert (got.tier, got.cached) == ("none", 0)
        with TierStoreClient(store.address) as client:
            assert client.stats().checksum_failures >= 1
        assert engine.core.reuse.tiers.restore_failures >= 1  # type: ignore[attr-defined]
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_state_forged_behind_the_stores_back_is_never_served(tmp_path: Path, model, oracle) -> None:
    """A local process with the store's access rewrites state two ways: zeroes the arena under
    the store (which keeps its metadata and checksums), and drops a state to put zeros with a
    valid checksum under its name. The store serves both as RAM hits; the engine's integrity
    tag, made with a key the store never sees, refuses them and the request runs cold."""
    import mmap
    import os

    import xxhash

    from engine.kv.chain_hash import state_name
    from ignis.v1 import common_pb2, tierstore_pb2
    from tierstore.client import TierStoreClient

    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS:  # the first ones spill to RAM as later ones take the device slots
            same(engine.run(topic), oracle(topic))
        namespace = engine.core.namespace_hash("")
        prompt = engine.request(TOPICS[1]).prompt_ids
        name = state_name(namespace, engine_page_hashes(engine, TOPICS[1]), prompt, len(prompt), P)
        link = engine.core.reuse.tiers  # type: ignore[attr-defined]
        with TierStoreClient(store.address) as attacker:  # registers as the engine does: nothing is replaced
            arena = attacker.register(namespace, page_size=P, layout=link.codec.layout())
            hits = attacker.match(namespace, [], tail_hash=name)
            assert hits and hits[0].tokens == len(prompt)  # the store holds TOPICS[1]'s opener checkpoint
            nbytes = hits[0].nbytes
            assert attacker.drop(name)
            zeros = bytes(nbytes)
            attacker.put(name, zeros, tierstore_pb2.StateMetadata(
                namespace=namespace, tokens=len(prompt), kind=common_pb2.REUSE_KIND_CHECKPOINT,
                request_class=common_pb2.REQUEST_CLASS_INTERACTIVE, checksum=xxhash.xxh3_128_digest(zeros),
                nbytes=nbytes))
            got = engine.run(TOPICS[1])
            same(got, oracle(TOPICS[1]))
            assert (got.tier, got.cached) == ("none", 0)
            fd = os.open(arena.arena_path, os.O_RDWR)  # now bypass the store entirely
            with mmap.mmap(fd, arena.arena_bytes) as raw:
                raw[:] = bytes(arena.arena_bytes)
            os.close(fd)
        got = engine.run(TOPICS[0])
        same(got, oracle(TOPICS[0]))
        assert (got.tier, got.cached) == ("none", 0)
        assert engine.core.reuse.tiers.rejected >= 2  # type: ignore[attr-defined]
        engine.check()
    finally:
        engine.close()
        store.stop()


@pytest.mark.parametrize("when", ["before the copy", "after the copy"])
def test_a_restore_checks_the_bytes_it_copied(tmp_path: Path, model, oracle, monkeypatch: pytest.MonkeyPatch,
                                              when: str) -> None:
    """A process racing the engine rewrites a state's arena bytes during its restore. Rewritten
    before the engine's copy (after any check of the arena itself could have passed), the copy
    fails the tag and the request runs cold; rewritten after it, the copy is the state the engine
    wrote and is served. The tag is checked on the engine's copies, not on the shared arena."""
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS:  # the first ones spill to RAM as later ones take the device slots
            same(engine.run(topic), oracle(topic))
        link = engine.core.reuse.tiers  # type: ignore[attr-defined]
        real = link_module.copy_and_check
        scribbled: list[int] = []

        def racing(pieces, source, mac, helpers, threads):  # type: ignore[no-untyped-def]
            def scribble() -> None:
                source.zero_()
                scribbled.append(source.numel())
            if when == "before the copy":
                scribble()
            real(pieces, source, mac, helpers, threads)
            if when == "after the copy":
                scribble()
        monkeypatch.setattr(link_module, "copy_and_check", racing)
        rejected = link.rejected
        got = engine.run(TOPICS[0])
        assert scribbled, "the request did not restore from KV-RAM"
        same(got, oracle(TOPICS[0]))
        if when == "before the copy":
            assert (got.tier, got.cached) == ("none", 0) and link.rejected == rejected + 1
        else:
            assert got.tier == "ram" and got.cached > 0 and link.rejected == rejected
        engine.check()
        assert link._helper_pool is not None, "the claim from KV-RAM copied on two threads"
    finally:
        engine.close()
        store.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("ignis-restore-copies")]  # ends with the engine


def test_full_tiers_stop_spills_and_every_request_still_succeeds(tmp_path: Path, model, oracle) -> None:
    from tierstore.client import TierStoreClient

    store = tierstore(tmp_path, arena=1 * MiB, disk=1 * MiB)  # room for about two states in all
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in [*TOPICS, *TOPICS, "auroras", "dunes"]:
            same(engine.run(topic), oracle(topic))
        with TierStoreClient(store.address) as client:
            stats = client.stats()
        assert stats.disk_bytes_used <= stats.disk_bytes_total == 1 * MiB
        assert stats.evictions >= 1  # the budget was hit: states were dropped, requests were not
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_tierstore_down_then_back(tmp_path: Path, model, oracle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ignis")
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    port = store.port
    engine = Engine(*model, tierstore=store.address)
    try:
        for topic in TOPICS[:3]:
            same(engine.run(topic), oracle(topic))
        store.process.send_signal(signal.SIGKILL)  # mid-service, no goodbye
        store.process.wait()
        for topic in [*TOPICS, TOPICS[0]]:  # spills and lookups fail; nothing else does
            same(engine.run(topic), oracle(topic))
        client = engine.core.reuse.tiers.client  # type: ignore[attr-defined]
        assert client.unavailable_events == 1 and client.errors >= 1
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1  # logged once, however many calls failed
        engine.check()

        store = tierstore(tmp_path, arena=16 * MiB, disk=0, port=port)  # a new instance on the same port
        threading.Event().wait(0.4)  # past the client's retry backoff
        for topic in ["auroras", "dunes", "mesas"]:  # auroras' states are evicted, spilled to the new store
            same(engine.run(topic), oracle(topic))
        got = engine.run("auroras")
        same(got, oracle("auroras"))
        assert got.tier == "ram"
        assert client.unavailable_events == 1
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_a_squatted_namespace_with_nothing_stored_is_taken_back(tmp_path: Path, model, oracle) -> None:
    """Another process registers the engine's namespace first with another layout. With nothing
    stored under it the engine's registration replaces the squatter's (tierstore/registry.py): the
    lower tiers are not switched off, states spill and hit from RAM as usual."""
    from tierstore.client import TierStoreClient  # the test plays another engine; the engine never imports it

    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    engine = Engine(*model, tierstore=store.address)
    try:
        with TierStoreClient(store.address) as other:
            other.register(engine.core.namespace_hash(""), page_size=P, layout='{"another": "layout"}')
        for topic in TOPICS:
            same(engine.run(topic), oracle(topic))
        assert engine.core.reuse.tiers.spills > 0  # type: ignore[attr-defined]
        got = engine.run(TOPICS[0])
        same(got, oracle(TOPICS[0]))
        assert got.tier == "ram"
        engine.check()
    finally:
        engine.close()
        store.stop()


def test_codec_round_trip_is_bit_exact(model: tuple[LoadedModel, Tokenizer]) -> None:
    """Pack a slot + pages + logits at an odd 4 KiB offset, unpack into another slot and other pages."""
    import torch

    from engine.tiers.codec import StateCodec

    engine = Engine(*model, reuse=True)
    try:
        cache = engine.core.cache
        codec = StateCodec(cache, model[0].config.vocab_size)
        gen = torch.Generator().manual_seed(0)
        for t in (cache.kv, cache.recurrent, cache.conv):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        tokens, src_pages, dst_pages = 3 * P + 5, [7, 2, 9, 4], [11, 12, 13, 14]
        logits = torch.randn(codec.vocab_size, generator=gen)
        arena = torch.zeros(3 * 4096 + codec.nbytes(tokens, True), dtype=torch.uint8)
        codec.pack(arena, 3 * 4096, tokens, 1, src_pages, logits)
        got = codec.unpack(arena, 3 * 4096, tokens, codec.nbytes(tokens, True), 3, dst_pages)
        assert got is not None and torch.equal(got, logits)
        assert torch.equal(cache.recurrent[3], cache.recurrent[1]) and torch.equal(cache.conv[3], cache.conv[1])
        assert torch.equal(cache.kv[dst_pages], cache.kv[src_pages])
        assert codec.unpack(arena, 3 * 4096, tokens, codec.nbytes(tokens, False), 3, dst_pages) is None
    finally:
        engine.close()


def test_a_streamed_restore_copies_what_has_landed_and_keeps_nothing_unverified() -> None:
    """Each copy runs once its bytes are in (before the rest is read); a stream that ends without
    `verified` (the store found the blob bad) makes the whole restore count for nothing."""
    from engine.tiers.link import _copy_as_landed
    from ignis.v1 import tierstore_pb2

    events: list[str] = []

    def steps() -> list:  # type: ignore[type-arg]
        def copy(name: str, out: object = None):  # type: ignore[no-untyped-def]
            return lambda: (events.append(name), out)[1]
        return [(10, copy("a")), (20, copy("b")), (30, copy("logits", "L"))]

    def landing(*ready: int, verified: bool = True):  # type: ignore[no-untyped-def]
        for i, n in enumerate(ready):
            events.append(f"landed {n}")
            yield tierstore_pb2.AcquireProgress(ready_bytes=n, verified=verified and i == len(ready) - 1)

    copied: list[int] = []
    assert _copy_as_landed(steps(), 0, landing(15, 30, 30), copied.append) == (True, "L")
    assert events == ["landed 15", "a", "landed 30", "b", "logits", "landed 30"]
    assert copied == [10, 30]  # once per round of copies, with the end of what they copied
    events.clear()
    assert _copy_as_landed(steps(), 0, landing(15, 30, verified=False)) == (False, None)
    assert events == ["landed 15", "a", "landed 30", "b", "logits"]
    events.clear()
    assert _copy_as_landed(steps(), 30, None) == (True, "L") and events == ["a", "b", "logits"]


@pytest.mark.parametrize("prefix", [False, True])
def test_a_tag_fed_copy_by_copy_is_the_tag_of_the_whole_copy(model: tuple[LoadedModel, Tokenizer],
                                                              dense_model: tuple[LoadedModel, Tokenizer],
                                                              prefix: bool) -> None:
    """A restore from disk hashes each copy as it is made (engine/tiers/unpacked_tag.py): fed step by
    step, over pages cut across steps and runs of consecutive pages, the digest is the one
    unpacked_tag gives in one go after all the copies, slot, conv, logits and the arena's other bytes
    included; a prefix of a dense state's pages too. And a copy changed before it is hashed changes it."""
    import torch

    from engine.tiers.codec import StateCodec
    from engine.tiers.integrity import TAG_BYTES, IntegrityKey
    from engine.tiers.checked_copy import copy_and_check
    from engine.tiers.link import _copy_as_landed
    from ignis.v1 import tierstore_pb2

    loaded, tokenizer = dense_model if prefix else model
    engine = Engine(loaded, tokenizer, reuse=True)
    try:
        cache = engine.core.cache
        codec = StateCodec(cache, loaded.config.vocab_size)
        assert cache.kv.shape[0] > 40
        gen = torch.Generator().manual_seed(1)
        for t in (cache.kv, cache.recurrent, cache.conv):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        tokens, src = 7 * P + 3, [9, 2, 3, 4, 12, 13, 1, 5]
        dst = [20, 21, 22, 30, 31, 32, 33, 40]  # runs that straddle the 3-page steps
        slot = None if prefix else 1
        nbytes = codec.nbytes(tokens, True)
        arena = torch.zeros(4096 + nbytes, dtype=torch.uint8)
        codec.pack(arena, 4096, tokens, slot, src, torch.randn(codec.vocab_size, generator=gen))
        arena[4096 + nbytes - 7:] = 0x5A  # bytes no copy takes: fed from the arena
        taken = dst[:5] if prefix else dst
        step_bytes = 3 * codec.page_bytes
        key, nonce = IntegrityKey(b"k" * 32), bytes(TAG_BYTES)  # one nonce, so that the digests compare

        def mac():  # type: ignore[no-untyped-def]
            return key.hasher(b"n" * 16, b"s" * 16, tokens, nbytes, nonce)

        def digest(stepwise: bool, meddle: bool = False) -> bytes:
            hasher = mac()
            feed = codec.unpacked_tag(hasher, arena, 4096, tokens, nbytes, slot, taken,
                                      step_bytes if stepwise else None)
            steps = codec.unpack_steps(arena, 4096, tokens, nbytes, slot, taken, step_bytes)
            if meddle:  # a page copy that is not what the blob holds, before its hash
                k = (slot is not None) * (bool(codec.recurrent_bytes) + bool(codec.conv_bytes))  # the first pages' step
                end, first = steps[k]
                steps[k] = (end, lambda: (first(), cache.kv[taken[0]].add_(1.0), None)[-1])
            fed: list[int] = []
            if stepwise:  # the store's messages as a read lands: ninths, then the whole, checked
                marks = range(nbytes // 9, nbytes, nbytes // 9)
                messages = [*(tierstore_pb2.AcquireProgress(ready_bytes=n) for n in marks),
                            tierstore_pb2.AcquireProgress(ready_bytes=nbytes, verified=True)]
                landed, logits = _copy_as_landed(steps, 0, iter(messages),
                                                 lambda end: (fed.append(end), feed.through(end))[-1])
            else:
                landed, logits = _copy_as_landed(steps, nbytes, None)
            assert landed and (logits is None) == prefix
            assert not stepwise or len(fed) >= 2  # the tag was fed in rounds, between the reads
            feed.finish(logits)
            return hasher.digest()

        whole = digest(stepwise=False)
        assert digest(stepwise=True) == whole
        helpers = ThreadPoolExecutor(1)
        for threads in (1, 2):  # a claim from KV-RAM: copied and checked segment by segment (checked_copy.py)
            checked = mac()
            cache.kv[taken].zero_()
            pieces, logits = codec.claim_pieces(tokens, nbytes, slot, taken)
            copy_and_check(pieces, arena[4096:4096 + nbytes], checked, helpers, threads)
            assert checked.digest() == whole and (logits is None) == prefix
            assert torch.equal(cache.kv[taken], cache.kv[src[:len(taken)]])  # the pages are the blob's
        helpers.shutdown()
        reference = mac()
        codec.unpacked_tag(reference, arena, 4096, tokens, nbytes, slot, taken).finish(
            codec.unpack(arena, 4096, tokens, nbytes, slot, taken))
        assert reference.digest() == whole
        assert digest(stepwise=True, meddle=True) != whole
    finally:
        engine.close()


def test_the_engine_maps_the_arena_at_start_before_any_request(tmp_path: Path, model) -> None:
    """The step thread registers and maps the arena first thing, so its pages are mapped in
    (common/prefault.py) before a first claim would copy through them."""
    store = tierstore(tmp_path, 8 * MiB, 32 * MiB)
    engine = Engine(*model, tierstore=store.address)
    try:
        link = engine.core.tiers
        assert link is not None
        deadline = time.monotonic() + 30
        while link.client.arena is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.client.arena is not None, "no request came, and the arena is still not mapped"
        assert link.client.wait_mapped(30)
    finally:
        engine.close()
        store.stop()


def test_a_failure_mapping_the_arena_at_start_leaves_the_engine_serving(tmp_path: Path, model, oracle,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up connect is a convenience: if it raises, the engine's loop still runs and serves (the arena
    is then mapped when a spill or a claim first needs it, by its own ensure)."""
    from engine.tiers.link import TierLink

    def broken(self: TierLink, namespace: bytes) -> bool:
        raise RuntimeError("a bug in connect")
    monkeypatch.setattr(TierLink, "connect", broken)
    store = tierstore(tmp_path, 8 * MiB, 32 * MiB)
    engine = Engine(*model, tierstore=store.address)
    try:
        same(engine.run("rivers"), oracle("rivers"))
        same(engine.run("lakes"), oracle("lakes"))
    finally:
        engine.close()
        store.stop()
