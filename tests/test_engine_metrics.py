"""The engine's /metrics and its JSON event log, scraped from a real engine process.

Requests go over gRPC; the scrape is parsed with prometheus_client's own parser,
and the engine's log file is read back for the ``ignis.request.*`` JSON lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.launch import free_port
from ignis.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services import RunningService, start_engine, start_tierstore

MODEL = "ignis-tiny"
MiB = 1 << 20
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Done:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def scrape(port: int) -> Samples:
    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert reply.status_code == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def events(service: RunningService, name: str) -> list[dict[str, Any]]:
    """The service's JSON log lines for event `name`."""
    lines = [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == name]


def generate(stub: engine_pb2_grpc.EngineStub, request_id: str, topic: str,
             request_class: int = common_pb2.REQUEST_CLASS_INTERACTIVE) -> Done:
    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(
        role="user", content=f"Conversation about {topic}: " + f"tell me about {topic}. " * 6)])
    request = engine_pb2.GenerateRequest(
        request_id=request_id, model=MODEL, chat=chat, request_class=request_class,  # type: ignore[arg-type]
        sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    usage = [msg.usage for msg in stub.Generate(request, timeout=120) if msg.HasField("usage")]
    assert len(usage) == 1
    return Done(usage[0].prompt_tokens, usage[0].completion_tokens, usage[0].cached_tokens)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    port = free_port()
    service = start_engine(tmp_path_factory.mktemp("engine"), str(tiny_model_dir),
                           ["--served-model-name", MODEL, "--metrics-port", str(port)])
    service.extra["metrics"] = port
    yield service
    assert service.stop() == 0, service.log()


def test_metrics_and_done_events_after_a_miss_a_device_hit_and_an_agent_request(engine: RunningService) -> None:
    port = engine.extra["metrics"]
    rest = scrape(port)
    for cls in ("interactive", "agent"):
        assert value(rest, "ignis_time_to_first_token_seconds_count", **{"class": cls}) == 0
    assert value(rest, "ignis_retained_state_hits_total") == 0
    total_pages = value(rest, "ignis_kv_pages", kind="total")
    assert total_pages > 0 and value(rest, "ignis_kv_pages", kind="used") == 0

    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        first = generate(stub, "m-1", "tides")
        retry = generate(stub, "m-2", "tides")  # the same prompt: the opener checkpoint on the device
        agent = generate(stub, "m-3", "glaciers", common_pb2.REQUEST_CLASS_AGENT)
    assert first.cached_tokens == 0 and agent.cached_tokens == 0
    assert retry.cached_tokens == retry.prompt_tokens > 0

    m = scrape(port)
    assert value(m, "ignis_retained_state_hits_total") == 1
    assert value(m, "ignis_retained_state_misses_total") == 2
    assert value(m, "ignis_retained_reused_tokens_total", tier="device") == retry.cached_tokens
    assert value(m, "ignis_retained_reused_tokens_total", tier="ram") == 0
    assert value(m, "ignis_retained_reused_tokens_total", tier="disk") == 0
    assert value(m, "ignis_prefix_reused_tokens_total") == 0  # no system block: nothing published as a prefix
    assert value(m, "ignis_retained_slot_skips_total") == 0
    assert value(m, "ignis_reuse_inflight_holds_total") == 0  # one request at a time: nothing to hold
    assert value(m, "ignis_cached_tokens_total") == retry.cached_tokens
    assert value(m, "ignis_prompt_tokens_total") == first.prompt_tokens + retry.prompt_tokens + agent.prompt_tokens
    assert value(m, "ignis_generated_tokens_total") == 12

    interactive, agent_cls = {"class": "interactive"}, {"class": "agent"}
    assert value(m, "ignis_time_to_first_token_seconds_count", **interactive) == 2
    assert value(m, "ignis_time_to_first_token_seconds_count", **agent_cls) == 1
    assert value(m, "ignis_inter_token_latency_seconds_count", **interactive) == 2 * (4 - 1)
    assert value(m, "ignis_inter_token_latency_seconds_count", **agent_cls) == 4 - 1
    assert value(m, "ignis_request_duration_seconds_count", **interactive) == 2
    assert value(m, "ignis_requests_total", finish_reason="length", **interactive) == 2
    assert value(m, "ignis_requests_total", finish_reason="length", **agent_cls) == 1

    for cls in ("interactive", "agent"):
        assert value(m, "ignis_requests_waiting", **{"class": cls}) == 0
        assert value(m, "ignis_requests_running", **{"class": cls}) == 0
    used, cached = value(m, "ignis_kv_pages", kind="used"), value(m, "ignis_kv_pages", kind="cached")
    assert value(m, "ignis_kv_pages", kind="total") == total_pages
    assert used == 0 and 0 < cached <= total_pages  # the retained checkpoints hold pages
    assert value(m, "ignis_state_slots", kind="used") == 0
    assert 2 <= value(m, "ignis_retained_slots", kind="used") <= value(m, "ignis_retained_slots", kind="total")
    assert ("ignis_tierstore_up", frozenset()) not in m  # no tierstore configured

    done = {line["request_id"]: line for line in events(engine, "ignis.request.done")}
    assert len(events(engine, "ignis.request.done")) == len(done) == 3  # one line per request
    for rid, usage, tier, kind, cls in (("m-1", first, "none", "none", "interactive"),
                                        ("m-2", retry, "device", "checkpoint", "interactive"),
                                        ("m-3", agent, "none", "none", "agent")):
        line = done[rid]
        assert (line["class"], line["tier"], line["kind"], line["finish_reason"]) == (cls, tier, kind, "length")
        assert (line["prompt_tokens"], line["cached_tokens"], line["tokens_out"]) == \
               (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        assert line["level"] == "INFO" and line["logger"] == "ignis.request"
        assert 0 < line["ttft_ms"] <= line["duration_ms"]
    plain = [line for line in engine.log().splitlines() if "engine serving" in line]
    assert plain and not plain[0].startswith("{")  # other lines stay readable text


def test_restore_from_ram_counts_under_tier_ram_and_logs_spills_and_the_restore(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(16 * MiB),
                                              "--kv-disk-path", str(tmp_path / "kv-disk"), "--kv-disk-bytes", "0"])
    port = free_port()
    engine = start_engine(tmp_path / "engine", str(tiny_model_dir), [
        "--served-model-name", MODEL, "--metrics-port", str(port), "--tierstore", store.address,
        "--set", "reuse.retained_device=2", "--kv-cache-bytes", str(16 * MiB),
            "--set", "reuse.retained_interactive_ttl=0"])  # nothing protected: each capture evicts by recency
    try:
        topics = ["tides", "glaciers", "volcanoes", "comets", "lichens"]
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for i, topic in enumerate(topics):  # 2 device slots: each conversation evicts the one before
                generate(stub, f"t-{i}", topic)
            again = generate(stub, "t-again", topics[0])
        assert again.cached_tokens == again.prompt_tokens

        m = scrape(port)
        assert value(m, "ignis_retained_reused_tokens_total", tier="ram") == again.cached_tokens
        assert value(m, "ignis_retained_reused_tokens_total", tier="device") == 0
        assert value(m, "ignis_retained_state_hits_total") == 1
        assert value(m, "ignis_tier_restores_total") == 1
        assert value(m, "ignis_tier_restore_failures_total") == 0
        assert value(m, "ignis_tier_spill_failures_total") == 0
        spills = value(m, "ignis_tier_spills_total")
        assert spills >= 2 * (len(topics) - 1)  # opener + end-of-reply checkpoint of each evicted conversation
        assert value(m, "ignis_tierstore_up") == 1

        spilled = events(engine, "ignis.request.spilled")
        assert len(spilled) == spills
        assert all(len(e["hash"]) == 32 and e["tier"] == "ram" and e["kind"] == "checkpoint" and e["bytes"] > 0
                   for e in spilled)
        restored = events(engine, "ignis.request.restored")
        assert len(restored) == 1
        assert restored[0]["tier"] == "ram" and restored[0]["tokens"] == again.cached_tokens
        assert restored[0]["hash"] in {e["hash"] for e in spilled}
        done = [e for e in events(engine, "ignis.request.done") if e["request_id"] == "t-again"]
        assert len(done) == 1 and (done[0]["tier"], done[0]["cached_tokens"]) == ("ram", again.cached_tokens)
        assert not events(engine, "ignis.request.evicted")  # every eviction found room below
    finally:
        assert engine.stop() == 0, engine.log()
        store.stop()


@pytest.mark.parametrize("amount", [0.0, 0.004, 0.0123, 0.5, 7.0, 1e6])
@pytest.mark.parametrize("times", [1, 2, 64])
def test_observe_times_is_that_many_observes(amount: float, times: int) -> None:
    """engine.metrics.observe_times writes prometheus_client's own counters: if a release renames them,
    this fails (the sum may differ in its last bits: n additions against one product)."""
    from prometheus_client import CollectorRegistry, Histogram

    from engine.metrics import observe_times

    registry = CollectorRegistry()
    one = Histogram("one", "observed one by one", registry=registry)
    many = Histogram("many", "observed at once", registry=registry)
    for _ in range(times):
        one.observe(amount)
    observe_times(many, amount, times)
    by_metric: dict[str, dict[Any, float]] = {"one": {}, "many": {}}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                by_metric[family.name][(s.name[len(family.name):], tuple(sorted(s.labels.items())))] = s.value
    assert len(by_metric["one"]) > 3
    assert by_metric["one"].keys() == by_metric["many"].keys()
    for key, value in by_metric["one"].items():
        assert by_metric["many"][key] == pytest.approx(value, rel=1e-12), key


@dataclass
class _Req:
    request_class: Any
    arrival: float


@dataclass(eq=False)
class _Seq:
    """What EngineMetrics.on_tokens reads of a sequence."""

    request: _Req
    choice: int = 0
    first_token_time: float | None = None
    token_round: Any = None


def test_rounds_of_the_same_sequences_observe_each_tokens_own_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of the same sequences share one gap without a write per sequence; when the batch changes
    (a sequence leaves, joins, or sits a round out) each one's gap is still the time since its own last
    token: the same histogram as observing every sequence's every gap one by one."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    import engine.metrics
    from engine.facts import RequestClass
    from engine.metrics import _ITL_BUCKETS, EngineMetrics

    clock = [100.0]
    monkeypatch.setattr(engine.metrics.time, "monotonic", lambda: clock[0])
    metrics = EngineMetrics(lambda: None, lambda: None)  # type: ignore[arg-type,return-value]
    reference = Histogram("itl", "each gap observed alone", ["class"], buckets=_ITL_BUCKETS,
                          registry=CollectorRegistry())
    rng = random.Random(5)
    pool = [_Seq(_Req(rng.choice(list(RequestClass)), 0.0)) for _ in range(8)]
    last_token: dict[int, float] = {}
    batch = pool[:4]
    for round_ in range(60):
        if round_ % 7 == 3:  # the batch changes: one leaves for a while, one (new or back) joins
            batch = [s for s in batch if s is not rng.choice(batch)] + [rng.choice(pool)]
            batch = list(dict.fromkeys(batch))
        clock[0] += rng.choice([0.001, 0.003, 0.02, 0.07])
        metrics.on_tokens(batch)  # type: ignore[arg-type]
        for seq in batch:
            if id(seq) in last_token:
                reference.labels(seq.request.request_class.name.lower()).observe(clock[0] - last_token[id(seq)])
            last_token[id(seq)] = clock[0]

    def counts(child: Any) -> tuple[float, list[float]]:  # the counters observe_times writes (checked above)
        return child._sum.get(), [bucket.get() for bucket in child._buckets]

    assert sum(sum(counts(reference.labels(c.name.lower()))[1]) for c in RequestClass) > 100
    for cls in RequestClass:
        got_sum, got_buckets = counts(metrics._itl[cls])
        want_sum, want_buckets = counts(reference.labels(cls.name.lower()))
        assert got_buckets == want_buckets and got_sum == pytest.approx(want_sum, rel=1e-9), cls
