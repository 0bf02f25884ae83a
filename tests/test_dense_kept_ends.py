"""A dense model's kept prompt ends: an exact retry, a regenerate or an `n > 1` request whose prompt
equals a retained one computes nothing (issue 45).

An in-process EngineCore on a dense random checkpoint, its model wrapped to count forwards; every
output is checked against a cold engine (reuse off) on the same checkpoint: the same tokens, logprobs
within 1e-5, greedy and seeded. The claims are made from the device, from KV-RAM and from KV-disk
(a real tierstore process), and the Monitor's listing shows the kept end.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.eviction import EvictionOrder
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.facts import RequestClass
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.outputs import RequestUpdate
from engine.prompt import render_chat
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.state_listing import StateLister
from engine.text.tokenizer import Tokenizer
from ignis.v1 import common_pb2, engine_pb2
from services import RunningService, start_tierstore

P = 16
MiB = 1 << 20


@dataclass
class Result:
    choices: list[list[int]]  # tokens of each choice
    logprobs: list[list[float]]
    cached: int
    prompt_tokens: int
    tier: str
    kind: str
    forwards: int  # model calls the request caused


class CountingModel:
    """The engine's model, counting its calls (every forward, prefill or decode, goes through one)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class Engine:
    def __init__(self, model: tuple[LoadedModel, Tokenizer], *, reuse: bool = True, kept: int = 4,
                 tierstore: str = "", start: bool = True) -> None:
        loaded, self.tokenizer = model
        # restore floor 0: a claim from below that beats the device's pages by one token wins (these
        # tests claim from the tier they name; the floor has tests of its own).
        self.core = EngineCore(loaded, self.tokenizer, EngineConfig(
            page_size=P, kv_cache_bytes=4 * MiB, max_num_seqs=8, reuse_prompt=reuse, retained_device=kept,
            retained_interactive_ttl=0.0, tierstore_address=tierstore, tier_timeout=5.0, tier_restore_floor=0))
        self.model = CountingModel(self.core.runner.model)
        self.core.runner.model = self.model  # type: ignore[assignment]
        if start:
            self.core.start()
        self.ids = itertools.count(1)  # next() is atomic: requests from several threads get their own ids

    def prompt(self, topic: str) -> list[int]:
        chat = engine_pb2.ChatInput()
        chat.messages.add(role="user", content=f"About {topic}: " + f"say more about {topic}. " * 5)
        return list(render_chat(self.tokenizer, chat).token_ids)

    def request(self, topic: str, max_tokens: int = 5, n: int = 1, seed: int | None = None,
                cls: RequestClass = RequestClass.INTERACTIVE) -> EngineRequest:
        params = SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed, n=n, max_tokens=max_tokens,
                                ignore_eos=True, logprobs=True)
        return EngineRequest(f"r{next(self.ids)}", tuple(self.prompt(topic)), params, cls)

    def run(self, topic: str, max_tokens: int = 5, n: int = 1, seed: int | None = None,
            cls: RequestClass = RequestClass.INTERACTIVE) -> Result:
        before = self.model.calls
        updates = run_to_completion(self.core, self.request(topic, max_tokens, n, seed, cls), timeout=300)[0]
        return self.result(updates, n, self.model.calls - before)

    @staticmethod
    def result(updates: list[RequestUpdate], n: int = 1, forwards: int = 0) -> Result:
        assert updates[-1].error is None
        choices: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        for u in updates:
            for d in u.deltas:
                choices[d.choice] += d.token_ids
                logprobs[d.choice] += [lp.logprob or 0.0 for lp in d.logprobs]
        usage = updates[-1].usage
        assert usage is not None
        return Result(choices, logprobs, usage.cached_tokens, usage.prompt_tokens, usage.reuse.tier.value,
                      usage.reuse.kind.value, forwards)

    def settle(self) -> None:
        """Wait until the copies off the step are collected."""
        deadline = time.monotonic() + 30
        while self.core.residency.copying:
            assert time.monotonic() < deadline, "copies off the step never finished"
            time.sleep(0.01)

    def close(self) -> None:
        self.settle()
        self.core.stop()  # the step thread is gone: what is read next is not changing under it
        self.core.check_integrity()


def same(got: Result, want: Result) -> None:
    assert got.choices == want.choices
    for a, b in zip(got.logprobs, want.logprobs):
        assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) < 1e-5


@pytest.fixture(scope="module")
def dense(dense_chat_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir)


@pytest.fixture(scope="module")
def cold(dense: tuple[LoadedModel, Tokenizer]) -> Iterator[Engine]:
    engine = Engine(dense, reuse=False)
    yield engine
    engine.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def start_store(tmp_path: Path, arena: int = 64 * MiB, disk: int = 64 * MiB) -> RunningService:
    return start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(arena), "--kv-disk-path",
                                             str(tmp_path / "kv-disk"), "--kv-disk-bytes", str(disk)])


def test_an_exact_retry_computes_nothing_and_matches_cold(dense, cold: Engine, engines: list[Engine]) -> None:
    engine = Engine(dense)
    engines.append(engine)
    first = engine.run("tides")
    assert first.cached == 0
    same(first, cold.run("tides"))
    # Only its first token: sampled from the kept logits, with no forward at all.
    one = engine.run("tides", max_tokens=1)
    assert (one.cached, one.kind, one.tier, one.forwards) == (one.prompt_tokens, "pages", "device", 0)
    assert one.choices[0] == first.choices[0][:1]
    retry = engine.run("tides")
    assert (retry.cached, retry.kind) == (retry.prompt_tokens, "pages")
    assert retry.forwards == 4  # the four decodes after the first token, nothing for the prompt
    same(retry, first)
    # The page claim alone would stop one token short and compute the last page.
    assert retry.prompt_tokens % P != 0


def test_a_regenerate_with_a_seed_and_n4_compute_nothing_for_the_prompt(dense, cold: Engine,
                                                                         engines: list[Engine]) -> None:
    engine = Engine(dense)
    engines.append(engine)
    first = engine.run("glaciers", seed=11)
    same(first, cold.run("glaciers", seed=11))
    again = engine.run("glaciers", max_tokens=1, seed=11)
    assert (again.cached, again.forwards) == (again.prompt_tokens, 0)
    regenerate = engine.run("glaciers", seed=11)
    assert regenerate.cached == regenerate.prompt_tokens
    same(regenerate, first)
    four = engine.run("glaciers", n=4, seed=5, max_tokens=1)
    assert (four.cached, four.kind, four.forwards) == (four.prompt_tokens, "pages", 0)
    same(four, cold.run("glaciers", n=4, seed=5, max_tokens=1))
    four = engine.run("glaciers", n=4, seed=5)
    same(four, cold.run("glaciers", n=4, seed=5))
    greedy = engine.run("glaciers", n=4)
    assert greedy.cached == greedy.prompt_tokens
    same(greedy, cold.run("glaciers", n=4))


def test_a_burst_of_one_prompt_waits_for_its_end_instead_of_computing_it_again(dense, cold: Engine,
                                                                              engines: list[Engine]) -> None:
    """Four copies of one prompt sent together (all queued before the engine's first step): one computes
    it, the other three are held while it does, then claim its kept end."""
    engine = Engine(dense, start=False)
    engines.append(engine)
    requests = [engine.request("comets", max_tokens=2) for _ in range(4)]
    results = [Engine.result(u) for u in run_to_completion(engine.core, *requests, timeout=300, start=True)]
    assert engine.core.reuse.counters.inflight_holds == 3
    want = cold.run("comets", max_tokens=2)
    for r in results:
        same(r, want)
    assert sorted(r.cached for r in results) == [0] + [want.prompt_tokens] * 3


def test_kept_ends_are_bounded_ranked_and_listed(dense, engines: list[Engine]) -> None:
    engine = Engine(dense, kept=2)
    engines.append(engine)
    for topic in ("tides", "glaciers", "volcanoes"):
        engine.run(topic, max_tokens=2)
    views = [v for v in engine.core.residency.describe() if v.resident is not None]
    assert len(views) == 2  # reuse.retained_device of them: the oldest was evicted
    assert engine.core.residency.retained_slots == (2, 2)
    assert engine.core.reuse.counters.evictions == 1
    listing = StateLister("dense", EvictionOrder(0.0), None).listing(engine.core.request_snapshot().result(60), 0,
                                                                     100)
    rows = [r for r in listing.states if r.kind == common_pb2.REUSE_KIND_PAGES and r.HasField("rank")]
    assert sorted(r.tokens for r in rows) == sorted(len(engine.prompt(t)) for t in ("glaciers", "volcanoes"))
    # The evicted one still claims its pages on the device, one token short of its end.
    tides = engine.run("tides", max_tokens=1)
    assert tides.cached == (tides.prompt_tokens - 1) // P * P and tides.forwards == 1
    # Pages are a cache: a long request takes them back from the kept ends (live work first).
    engine.core.stop()  # reclaim is the step thread's to call: that thread is gone now
    assert engine.core.reuse.reclaim(engine.core.pages.num_pages)
    assert engine.core.residency.retained_slots == (2, 0)


@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("ask", ["retry", "regenerate", "n4"])
def test_a_kept_end_spills_with_its_logits_and_a_claim_from_below_computes_nothing(
        tmp_path: Path, dense, cold: Engine, engines: list[Engine], tier: str, ask: str) -> None:
    """A retry (greedy), a regenerate (seeded) or an n=4 request (seeded) of a prompt whose kept end left
    the device for KV-RAM or KV-disk: restored with its logits, nothing computed, equal to cold."""
    probe = Engine(dense, kept=1, start=False)  # only its codec is read
    nbytes = probe.core.residency.states.codec.nbytes(len(probe.prompt("tides")), True)  # type: ignore[union-attr]
    probe.core.stop()
    # RAM: room for every state. Disk: room for about two, so the first pushed out lands on disk.
    arena = 64 * MiB if tier == "ram" else -(-(2 * nbytes + nbytes // 2) // 4096) * 4096
    store = start_store(tmp_path, arena=arena)
    kwargs: dict[str, Any] = {"retry": {}, "regenerate": {"seed": 3}, "n4": {"n": 4, "seed": 3}}[ask]
    try:
        engine = Engine(dense, kept=1, tierstore=store.address)
        engines.append(engine)
        topics = ["tides", "glaciers", "volcanoes", "comets"] if tier == "disk" else ["tides", "glaciers"]
        for topic in topics:
            same(engine.run(topic), cold.run(topic))
            engine.settle()
        got = engine.run("tides", max_tokens=1, **kwargs)  # its end left the device for the tierstore
        assert (got.tier, got.kind, got.cached, got.forwards) == (tier, "pages", got.prompt_tokens, 0)
        same(got, cold.run("tides", max_tokens=1, **kwargs))
        again = engine.run("tides", **kwargs)  # held on the device again: claimed there
        assert (again.tier, again.cached) == ("device", again.prompt_tokens)
        same(again, cold.run("tides", **kwargs))
    finally:
        for engine in engines:
            engine.settle()
        store.stop()


def last_page_hash(engine: Engine, topic: str) -> bytes:
    """The name of the last full page of `topic`'s prompt: its page chain's name."""
    from engine.kv.chain_hash import page_hashes

    return page_hashes(engine.core.namespace_hash(""), engine.prompt(topic), P)[-1]


def test_a_kept_end_written_below_covers_its_page_chain(tmp_path: Path, dense, engines: list[Engine]) -> None:
    """Its pages are indexed in KV-RAM with it: the finished chain of the same pages is not written again."""
    store = start_store(tmp_path)
    try:
        engine = Engine(dense, kept=1, tierstore=store.address)
        engines.append(engine)
        chains = engine.core.residency.chains
        assert chains is not None

        engine.run("tides", max_tokens=1)  # one token, never computed: the chain is the prompt's full pages
        assert last_page_hash(engine, "tides") in {v.name for v in chains.views()}
        engine.run("glaciers", max_tokens=1)  # takes the one kept end's place: tides' is written below
        engine.settle()
        names = {v.name for v in chains.views()}
        assert last_page_hash(engine, "tides") not in names and last_page_hash(engine, "glaciers") in names
        assert chains.spills == 0  # it left the chains because the kept end covers it, not by a write of its own
        got = engine.run("tides", max_tokens=1)
        assert (got.tier, got.cached, got.forwards) == ("ram", got.prompt_tokens, 0)
    finally:
        for engine in engines:
            engine.settle()
        store.stop()


def test_a_kept_end_captured_straight_below_covers_its_page_chain(tmp_path: Path, dense,
                                                                   engines: list[Engine]) -> None:
    """An agent's prompt end may not displace an interactive one from the one device slot, so it is captured
    straight to KV-RAM: its chain is covered there too, not tracked to be written a second time."""
    store = start_store(tmp_path)
    try:
        engine = Engine(dense, kept=1, tierstore=store.address)
        engines.append(engine)
        chains = engine.core.residency.chains
        assert chains is not None
        engine.run("tides", max_tokens=1)  # the interactive end holds the slot
        engine.run("glaciers", max_tokens=1, cls=RequestClass.AGENT)
        engine.settle()
        glaciers = last_page_hash(engine, "glaciers")
        assert engine.core.reuse.counters.captures_below == 1
        assert glaciers not in {v.name for v in chains.views()} and chains.spills == 0
        got = engine.run("glaciers", max_tokens=1, cls=RequestClass.AGENT)
        assert (got.tier, got.cached, got.forwards) == ("ram", got.prompt_tokens, 0)
    finally:
        for engine in engines:
            engine.settle()
        store.stop()
