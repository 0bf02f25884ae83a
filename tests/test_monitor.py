"""The Monitor's data path (issue 21): the engine's ListState RPC (paged, bounded, bad tokens are
INVALID_ARGUMENT) and the gateway's /v1/ignis/state JSON behind --api-key, on a real stack:
a tierstore, an engine on the hybrid ignis-tiny with two retained device slots (so a third
conversation spills to KV-RAM), and a gateway."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from common.launch import free_port
from engine.state_listing import MAX_PAGE_ROWS, Throughput, parse_page
from ignis.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services import RunningService, start_engine, start_gateway, start_tierstore

MiB = 1 << 20
KEY = "monitor-key"
LONG_SYSTEM = "You are a careful assistant. Answer briefly, name your sources, and say when you are unsure."


@dataclass
class Stack:
    store: RunningService
    engine: RunningService
    gateway: RunningService

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def state(self, **params: str) -> httpx.Response:
        return httpx.get(f"{self.url}/v1/ignis/state", params=params, headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30)


def start_stack(workdir: Path, retained_device: int = 2, model: str = "ignis-tiny",
                more_engines: tuple[str, ...] = ()) -> Stack:
    """Tiny budgets: `retained_device` slots on the device, nothing protected (TTL 0), 16 MiB of KV-RAM.
    `more_engines`: further addresses behind the gateway (e.g. one where nothing listens)."""
    store = start_tierstore(workdir / "ts", ["--kv-host-pool-bytes", str(16 * MiB), "--kv-disk-bytes", "0"])
    engine = gateway = None
    try:
        engine = start_engine(workdir / "engine", model, [
            "--served-model-name", "ignis-tiny", "--tierstore", store.address,
            "--set", f"reuse.retained_device={retained_device}", "--set", "reuse.retained_interactive_ttl=0"])
        gateway = start_gateway(workdir / "gw", [engine.address, *more_engines], ["--api-key", KEY])
    except Exception:
        for service in (engine, store):
            if service is not None:
                service.stop()
        raise
    return Stack(store, engine, gateway)


def stop_stack(stack: Stack) -> None:
    for service in (stack.gateway, stack.engine, stack.store):
        service.stop()


def cached_tokens(reply: openai.types.chat.ChatCompletion) -> int:
    """The completion's usage.prompt_tokens_details.cached_tokens."""
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def chat(stack: Stack, topic: str, system: str = "") -> openai.types.chat.ChatCompletion:
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"Tell me about {topic}."})
    with stack.client() as client:
        return client.chat.completions.create(model="ignis-tiny", messages=messages, max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("monitor"))
    try:
        chat(s, "tides")
        assert cached_tokens(chat(s, "tides")) > 0  # the exact retry: its prompt checkpoint
        for topic in ("glaciers", "volcanoes"):  # two slots: the tides states move down to KV-RAM
            chat(s, topic)
        settle(s)
        yield s
    finally:
        stop_stack(s)


def settle(stack: Stack, quiet: float = 1.0, timeout: float = 60.0) -> None:
    """Poll until the listing has not changed for `quiet` seconds: with every slot taken, the engine
    writes its next victim to KV-RAM ahead of need off the step, even when idle (a state then shows
    on the device and in ram), and these tests compare listings taken one after another."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        rows = [(r.name, r.tier) for r in list_state(stack).states]
        if rows != last:
            last, since = rows, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
    raise TimeoutError("the retained states kept changing")


def list_state(stack: Stack, page_size: int = 0, page_token: str = "") -> engine_pb2.ListStateResponse:
    with grpc.insecure_channel(stack.engine.address) as channel:
        return engine_pb2_grpc.EngineStub(channel).ListState(
            engine_pb2.ListStateRequest(page_size=page_size, page_token=page_token), timeout=30)


# ------------------------------------------------------------------ the engine RPC

def test_list_state_shows_device_and_ram_states_each_tier_in_eviction_order(stack: Stack) -> None:
    reply = list_state(stack)
    rows = list(reply.states)
    assert reply.states_total == len(rows) and not reply.next_page_token
    tiers = [r.tier for r in rows]
    device = [r for r in rows if r.tier == common_pb2.REUSE_TIER_DEVICE]
    ram = [r for r in rows if r.tier == common_pb2.REUSE_TIER_RAM]
    assert len(device) == 2 and len(ram) >= 2  # two slots; the tides (and glaciers) states spilled
    assert tiers == sorted(tiers, key=[common_pb2.REUSE_TIER_DEVICE, common_pb2.REUSE_TIER_RAM].index)
    for group in (device, ram):
        assert [r.rank for r in group] == list(range(len(group))) and all(r.HasField("rank") for r in group)
    # The engine runs with TTL 0 (nothing protected); the store with the default 300 s, which protects
    # each state restored from it (a hit) and none that nobody claimed.
    assert not any(r.protected for r in device) and all(r.protected == (r.hits > 0) for r in ram)
    # Least recently used leaves first: the device rank follows the last use.
    assert device[0].idle_seconds >= device[1].idle_seconds
    assert all(r.kind == common_pb2.REUSE_KIND_CHECKPOINT and r.tokens > 0 and r.bytes > 0 for r in rows)
    assert all(len(r.name) == 16 and int(r.name, 16) >= 0 for r in rows)
    for group in (device, ram):  # a state written ahead to KV-RAM is on the device and in ram at once
        assert len({r.name for r in group}) == len(group)
    assert {r.name for r in ram} - {r.name for r in device}  # the tides states left the device
    assert all(r.pages > 0 for r in device) and all(r.pages == 0 for r in ram)


def test_list_state_reports_pool_tiers_and_recent_requests(stack: Stack) -> None:
    reply = list_state(stack)
    pool = reply.stats.page_pool
    assert pool.total_pages > 0 and pool.cached_pages > 0  # the two device states hold pages
    assert reply.stats.retained_device_slots.total == 2 and reply.stats.retained_device_slots.used == 2
    assert reply.model == "ignis-tiny" and reply.taken_at > 0
    t = reply.tiers
    assert t.configured and t.reachable and t.engine_spills >= 2
    assert t.store.ram_bytes_total == 16 * MiB and 0 < t.store.ram_bytes_used <= t.store.ram_bytes_total
    assert t.store.states_ram >= 2 and t.store.checksum_failures == 0
    recent = list(reply.recent)
    assert len(recent) == 4 and [r.finish_reason for r in recent] == ["length"] * 4
    assert recent[0].cached_tokens == 0 and recent[1].cached_tokens > 0  # cold, then the exact retry
    assert recent[1].tier == common_pb2.REUSE_TIER_DEVICE and recent[1].kind == common_pb2.REUSE_KIND_CHECKPOINT
    assert all(r.ttft_ms > 0 and r.prompt_tokens > 0 for r in recent)
    assert [r.finished_at for r in recent] == sorted(r.finished_at for r in recent)


def test_list_state_pages_through_every_row(stack: Stack) -> None:
    whole = list_state(stack)
    names, token, pages = [], "", 0
    while True:
        page = list_state(stack, page_size=1, page_token=token)
        assert len(page.states) == 1 and page.states_total == whole.states_total
        names.append(page.states[0].name)
        pages += 1
        token = page.next_page_token
        if not token:
            break
        assert token == str(pages)
    assert pages == whole.states_total and names == [r.name for r in whole.states]
    past = list_state(stack, page_size=10, page_token="999")  # past the end: an empty last page
    assert list(past.states) == [] and not past.next_page_token


@pytest.mark.parametrize("token", ["abc", "-1", "1.5", "9" * 11, "\uff11", " 1"])
def test_a_page_token_the_engine_never_gave_is_invalid_argument(stack: Stack, token: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list_state(stack, page_token=token)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token" in (info.value.details() or "")
    assert list_state(stack).states_total > 0  # and it keeps serving


def test_page_size_defaults_and_bound() -> None:
    assert parse_page(0, "") == (0, 100)
    assert parse_page(5000, "") == (0, MAX_PAGE_ROWS)
    assert parse_page(7, "42") == (42, 7)
    with pytest.raises(ValueError, match="page_token"):
        parse_page(1, "x")


def test_throughput_is_the_rate_over_the_window() -> None:
    meter = Throughput(window=10.0)
    assert meter.rates(100.0, 0, 0) == (0.0, 0.0)
    assert meter.rates(102.0, 200, 20) == (100.0, 10.0)
    for t in range(103, 120):
        meter.rates(float(t), 200 + 50 * (t - 102), 20)
    prefill, decode = meter.rates(120.0, 200 + 50 * 18, 20)
    assert prefill == pytest.approx(50.0) and decode == 0.0  # the old burst has left the window


# ------------------------------------------------------------------ the gateway JSON

def test_state_json_needs_the_key_and_the_page_does_not(stack: Stack) -> None:
    got = httpx.get(f"{stack.url}/v1/ignis/state", timeout=30)
    assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key"
    for path, kind in (("/monitor", "text/html"), ("/monitor/monitor.js", "text/javascript"),
                       ("/monitor/monitor.css", "text/css")):
        page = httpx.get(stack.url + path, timeout=30)
        assert page.status_code == 200 and page.headers["content-type"].startswith(kind)
    assert "/v1/ignis/state" in httpx.get(f"{stack.url}/monitor/monitor.js", timeout=30).text


def test_state_json_has_one_section_per_engine(stack: Stack) -> None:
    body = stack.state().json()
    assert body["object"] == "ignis.state" and len(body["engines"]) == 1
    e = body["engines"][0]
    assert e["address"] == stack.engine.address and e["healthy"] and "error" not in e
    assert 0 < e["snapshot_ms"] < 10_000 and e["taken_at"] <= body["time"]
    pool = e["pool"]
    assert pool["used"] + pool["cached"] + pool["free"] == pool["total"]
    assert e["slots"]["retained_device"] == {"total": 2, "used": 2}
    assert set(e["sequences"]) == {"running", "waiting"} and set(e["throughput"]) == {
        "prefill_tokens_per_second", "decode_tokens_per_second"}
    states = e["states"]
    assert len(states) == e["states_total"] and e["next_page_token"] is None
    assert {s["tier"] for s in states} == {"device", "ram"}
    assert {s["kind"] for s in states} == {"checkpoint"} and {s["class"] for s in states} == {"interactive"}
    assert [s["rank"] for s in states if s["tier"] == "device"] == [0, 1]
    assert e["tiers"]["ram"]["bytes_total"] == 16 * MiB and e["tiers"]["disk"]["bytes_total"] == 0
    assert e["tiers"]["store"]["checksum_failures"] == 0
    retry = e["recent"][1]
    assert (retry["tier"], retry["kind"]) == ("device", "checkpoint") and retry["cached_tokens"] > 0
    assert e["counters"]["reused_tokens"] >= retry["cached_tokens"]


def test_state_json_pages_one_engine(stack: Stack) -> None:
    first = stack.state(limit="1").json()["engines"][0]
    assert len(first["states"]) == 1 and first["next_page_token"] == "1"
    second = stack.state(limit="1", engine=stack.engine.address, page_token="1").json()["engines"][0]
    assert len(second["states"]) == 1 and second["states"][0]["name"] != first["states"][0]["name"]


@pytest.mark.parametrize("params, param", [
    ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"), ({"limit": "ten"}, "limit"),
    ({"page_token": "1"}, "page_token"), ({"engine": "127.0.0.1:1"}, "engine"),
])
def test_bad_state_queries_are_400s(stack: Stack, params: dict[str, str], param: str) -> None:
    got = stack.state(**params)
    assert got.status_code == 400 and got.json()["error"]["param"] == param


def test_a_bad_page_token_is_a_400_and_the_gateway_keeps_serving(stack: Stack) -> None:
    got = stack.state(engine=stack.engine.address, page_token="nope")
    assert got.status_code == 400 and got.json()["error"]["param"] == "page_token"
    assert "page_token" in got.json()["error"]["message"]
    assert stack.state().status_code == 200


def test_the_state_stream_sends_one_state_per_interval(stack: Stack) -> None:
    url = f"{stack.url}/v1/ignis/state/stream"
    assert httpx.get(url, timeout=30).status_code == 401
    events: list[dict[str, Any]] = []
    with httpx.stream("GET", url, params={"interval": "0.25", "limit": "2"}, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 3:
                    break
    times = [e["time"] for e in events]
    assert times == sorted(times) and len(set(times)) == 3
    for event in events:
        (section,) = event["engines"]
        assert section["address"] == stack.engine.address and len(section["states"]) == 2
    assert stack.state().status_code == 200  # and the gateway goes on


@pytest.mark.parametrize("params, param", [
    ({"interval": "0"}, "interval"), ({"interval": "61"}, "interval"), ({"interval": "nan"}, "interval"),
    ({"interval": "soon"}, "interval"), ({"limit": "0"}, "limit"), ({"page_token": "1"}, "page_token"),
])
def test_bad_stream_queries_are_400s(stack: Stack, params: dict[str, str], param: str) -> None:
    got = httpx.get(f"{stack.url}/v1/ignis/state/stream", params=params, timeout=30,
                    headers={"Authorization": f"Bearer {KEY}"})
    assert got.status_code == 400 and got.json()["error"]["param"] == param


def test_a_claim_counts_as_a_hit(stack: Stack) -> None:
    """Runs last: it adds a request. The exact retry of the newest conversation claims its device checkpoint."""
    before = {r.name: r.hits for r in list_state(stack).states if r.tier == common_pb2.REUSE_TIER_DEVICE}
    again = cached_tokens(chat(stack, "volcanoes"))
    assert again > 0
    after = list_state(stack)
    hits = {r.name: r.hits for r in after.states if r.tier == common_pb2.REUSE_TIER_DEVICE}
    assert sum(hits.values()) == sum(before.values()) + 1
    assert after.recent[-1].cached_tokens == again


def test_tierstore_lists_only_the_namespaces_named(stack: Stack) -> None:
    from ignis.v1 import tierstore_pb2, tierstore_pb2_grpc

    with grpc.insecure_channel(stack.store.address) as channel:
        store = tierstore_pb2_grpc.TierStoreStub(channel)
        assert store.ListStates(tierstore_pb2.ListStatesRequest(), timeout=10).total == 0  # none named: none
        other = store.ListStates(tierstore_pb2.ListStatesRequest(namespaces=[b"\x00" * 16]), timeout=10)
        assert other.total == 0 and list(other.states) == []
        with pytest.raises(grpc.RpcError) as info:
            store.ListStates(tierstore_pb2.ListStatesRequest(namespaces=[b"short"]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------ an attention-only model, two engines

def test_a_dense_model_lists_page_chains_and_a_dead_engine_has_its_own_section(
        tmp_path: Path, dense_chat_model_dir: Path) -> None:
    """Dense pages are listed one row per finished chain (never per page), not ranked by the order, after
    the kept prompt end (ranked like any retained state); a second engine that does not answer is a
    section with an error, the first one still shows."""
    dead = f"127.0.0.1:{free_port()}"
    stack = start_stack(tmp_path, model=str(dense_chat_model_dir), more_engines=(dead,))
    try:
        chat(stack, "tides", system=LONG_SYSTEM)
        body = stack.state().json()
        assert [e["address"] for e in body["engines"]] == [stack.engine.address, dead]
        live, gone = body["engines"]
        assert "error" in gone and "UNAVAILABLE" in gone["error"] and not gone["healthy"]
        rows = live["states"]
        assert len(rows) == 2 and live["states_total"] == 2
        end, chain = rows
        assert (end["kind"], end["tier"], end["rank"]) == ("pages", "device", 0)
        assert end["tokens"] == live["recent"][0]["prompt_tokens"]  # the prompt's end, kept with its logits
        assert live["slots"]["retained_device"]["used"] == 1  # one of reuse.retained_device
        assert (chain["kind"], chain["tier"], chain["rank"]) == ("pages", "device", None)
        assert chain["pages"] == chain["tokens"] // live["pool"]["page_size"] >= 2
        assert live["pool"]["registered"] >= chain["pages"]
        assert live["recent"][0]["prompt_tokens"] > chain["tokens"]
    finally:
        stop_stack(stack)


def test_host_states_are_listed_in_their_own_eviction_order(tiny_model_dir: Path) -> None:
    """In process: an engine whose retained states live in host slots (reuse.retained_host); the
    snapshot is handed over by the running step thread, through the core's inbox."""
    from common.eviction import EvictionOrder
    from engine.model.loader import load_model
    from engine.state_listing import StateLister
    from engine.text.tokenizer import Tokenizer
    from test_reuse import Harness, conversation

    loaded, tokenizer = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=0, retained_host=4, retained_interactive_ttl=0.0)
    try:
        for topic in ("tides", "glaciers"):
            warm.run(warm.request(conversation(f"Tell me about {topic}.")))
        assert warm.core._thread is not None and warm.core._thread.is_alive()
        snap = warm.core.request_snapshot().result(timeout=60)
        assert snap.copy_ms > 0 and len(snap.recent) == 2
        reply = StateLister("ignis-tiny", EvictionOrder(0.0), None).listing(snap, 0, 100)
        rows = list(reply.states)
        assert rows and {r.tier for r in rows} == {common_pb2.REUSE_TIER_HOST}
        ready = [r for r in rows if r.ready]
        assert [r.rank for r in ready] == list(range(len(ready)))  # ranked first, least recently used first
        assert [r.idle_seconds for r in ready] == sorted((r.idle_seconds for r in ready), reverse=True)
        assert not any(r.HasField("rank") for r in rows if not r.ready)  # being copied: it cannot leave yet
        codec = warm.core.residency.states.codec  # type: ignore[union-attr]
        assert all(r.bytes in (codec.nbytes(r.tokens, False), codec.nbytes(r.tokens, True)) for r in rows)
        # A host state holds no device page, except its full pages while its staged copy still reads them.
        assert all(r.pages == 0 for r in rows if r.ready)
        assert reply.stats.retained_host_slots.used == len(rows) and not reply.tiers.configured
    finally:
        warm.close()


def test_the_listing_never_hands_out_a_stored_response_s_id(stack: Stack) -> None:
    """Issue 49, attack item 3: `recent[].request_id` carried the full `resp_...` id, all an anonymous
    client needed to read or delete another's stored response. It shows the kind and 4 characters."""
    with stack.client() as client:
        response = client.responses.create(model="ignis-tiny", input="Remember the tides.", max_output_tokens=2)
    assert response.id.startswith("resp_") and client_can_read(stack, response.id)
    body = stack.state().text
    assert response.id not in body and response.id[5:] not in body
    shown = [r.request_id for r in list_state(stack).recent]
    assert f"resp_…{response.id[-4:]}" in shown and all(len(r) <= 16 for r in shown)


def client_can_read(stack: Stack, response_id: str) -> bool:
    with stack.client() as client:
        return client.responses.retrieve(response_id).id == response_id
