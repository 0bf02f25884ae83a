"""Engine choice (gateway/routing.py), health, failover and DNS discovery (gateway/engines.py,
gateway/discovery.py, gateway/upstream.py).

The rules are pure functions, checked directly (hypothesis for the load bound). The pool is checked
against real ignis-tiny engine processes on loopback: in process, where a test must see which engine a
call went to and hold calls open, and through a real gateway process where a client would notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import signal
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.__main__ import parse_args
from gateway.config import GatewayConfig
from gateway.discovery import Discovery, DnsName, getaddrinfo_resolver
from gateway.engines import EngineClient, EnginePool
from gateway.routing import (RouteKeys, RoutingRule, bounded_order, chat_head, conversation_head,
                             rendezvous_order, route_key, route_keys)
from gateway.upstream import CallSpec, generate
from ignis.v1 import engine_pb2
from services import RunningService, start_engine, start_gateway

NODES = [f"10.0.0.{i}:50051" for i in range(5)]
MODEL = "ignis-tiny"
HEAD = "You are one subagent of a swarm. Use the tools."


def owner(nodes: list[str], key: bytes) -> str:
    return rendezvous_order(nodes, nodes, key)[0]


def chat(*messages: tuple[str, str], tools: str = "") -> engine_pb2.ChatInput:
    return engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                                tools_json=tools)


# ------------------------------------------------------------------ the rules, pure


def test_order_is_a_permutation_and_deterministic() -> None:
    key = route_key("m", "", "head")
    order = rendezvous_order(NODES, NODES, key)
    assert sorted(order) == sorted(NODES)
    assert rendezvous_order(list(reversed(NODES)), list(reversed(NODES)), key) == order  # input order is irrelevant


def test_keys_spread_and_removing_a_node_moves_only_its_keys() -> None:
    keys = [route_key("m", "", f"system prompt {i}") for i in range(400)]
    before = {k: owner(NODES, k) for k in keys}
    assert all(sum(1 for o in before.values() if o == n) > 40 for n in NODES)  # roughly even
    gone = NODES[2]
    after = {k: owner([n for n in NODES if n != gone], k) for k in keys}
    for k in keys:
        if before[k] != gone:
            assert after[k] == before[k]
        else:
            assert after[k] == rendezvous_order(NODES, NODES, k)[1]  # the runner-up takes over


def test_the_head_is_the_system_prompt_and_tools() -> None:
    a = chat(("system", "You are a subagent."), ("user", "task one"), tools='[{"t": 1}]')
    b = chat(("system", "You are a subagent."), ("user", "task two"), ("assistant", "x"), ("user", "y"),
             tools='[{"t": 1}]')
    assert chat_head(a) == chat_head(b)
    assert chat_head(a) != chat_head(chat(("system", "You are a subagent."), ("user", "task one")))  # no tools
    assert chat_head(a) != chat_head(chat(("system", "Another."), ("user", "task one"), tools='[{"t": 1}]'))
    # No system prompt: the first message is what every later turn shares.
    assert chat_head(chat(("user", "hi"))) == chat_head(chat(("user", "hi"), ("assistant", "yo"), ("user", "more")))
    assert route_key("m", "salt-a", "h") != route_key("m", "salt-b", "h") != route_key("n", "salt-b", "h")


def request_of(c: engine_pb2.ChatInput, salt: str = "") -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="r", model="m", chat=c, cache_salt=salt)


def default_keys(c: engine_pb2.ChatInput, salt: str = "") -> RouteKeys:
    """What a route computes for a chat without prompt_cache_key, refined as upstream does."""
    return route_keys(request_of(c, salt), route_key("m", salt, chat_head(c)))


def test_a_conversation_keeps_its_key_and_subagents_get_their_own() -> None:
    turn1 = chat(("system", HEAD), ("user", "task one"))
    turn3 = chat(("system", HEAD), ("user", "task one"), ("assistant", "a"), ("user", "tool result"),
                 ("assistant", "b"), ("user", "more"))
    other = chat(("system", HEAD), ("user", "task two"))
    k1, k3, k_other = default_keys(turn1), default_keys(turn3), default_keys(other)
    assert k1 == k3  # every turn of one conversation: one head key, one conversation key
    assert k1.head == k_other.head and k1.conversation != k_other.conversation  # one head, two conversations
    assert default_keys(turn1, "tenant").conversation != k1.conversation  # the salt is in both keys
    assert conversation_head(chat(("user", "hi"))) == conversation_head(chat(("user", "hi"), ("assistant", "x")))
    # prompt_cache_key (any key the route did not derive from the head) is kept as the client gave it.
    given_key = route_key("m", "", "client key")
    assert route_keys(request_of(turn1), given_key) == RouteKeys(given_key, given_key)
    text = engine_pb2.GenerateRequest(request_id="r", model="m", text="a raw prompt")
    assert route_keys(text, given_key) == RouteKeys(given_key, given_key)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.floats(1.0, 4.0), st.integers(0, 2**32))
def test_bounded_order_prefers_affinity_under_the_capacity(loads: list[int], bound: float, seed: int) -> None:
    names = [f"e{i}" for i in range(len(loads))]
    load = dict(zip(names, loads))
    affinity = rendezvous_order(names, names, seed.to_bytes(8, "little"))
    order = bounded_order(affinity, [load[n] for n in affinity], bound)
    assert sorted(order) == sorted(names)
    capacity = math.ceil(bound * (sum(loads) + 1) / len(loads))
    under = [n for n in affinity if load[n] < capacity]
    assert under, "the least loaded engine is always under the capacity"
    assert order[:len(under)] == under and order[0] == under[0]  # the best-ranked engine that has room


@given(st.integers(1, 6), st.integers(1, 200), st.floats(1.0, 3.0))
def test_placing_requests_one_by_one_never_passes_the_bound(engines: int, requests: int, bound: float) -> None:
    """Every request on one key (a swarm's shared head): the affinity engine fills up to the bound,
    then the rest spread; no engine ever holds more than ceil(bound * mean)."""
    names = [f"e{i}" for i in range(engines)]
    affinity = rendezvous_order(names, names, b"one shared head")
    loads = dict.fromkeys(names, 0)
    for placed in range(requests):
        target = bounded_order(affinity, [loads[n] for n in affinity], bound)[0]
        loads[target] += 1
        assert loads[target] <= math.ceil(bound * (placed + 1) / engines)
    if bound == 1.0:
        assert max(loads.values()) - min(loads.values()) <= 1


@given(st.permutations(NODES), st.binary(min_size=1, max_size=16), st.binary(min_size=1, max_size=16))
def test_gateways_agree_whatever_order_they_list_the_engines_in(nodes: list[str], head: bytes, conv: bytes) -> None:
    """Two gateways with the same engines (listed or resolved in any order) and no load of their own
    choose the same order: no shared state is needed."""
    keys = RouteKeys(head, conv)
    for rule in ("affinity", "bounded"):
        mine = RoutingRule(rule).order(NODES, NODES, [0] * len(NODES), keys)
        theirs = RoutingRule(rule).order(nodes, nodes, [0] * len(nodes), keys)
        assert mine == theirs


def test_the_three_rules() -> None:
    loads = [0] * len(NODES)
    keys = RouteKeys(route_key("m", "", "head"), route_key("m", "", "head + task"))
    assert RoutingRule("affinity").order(NODES, NODES, loads, keys) == rendezvous_order(NODES, NODES, keys.head)
    bounded = RoutingRule("bounded", 1.25)
    assert bounded.order(NODES, NODES, loads, keys) == rendezvous_order(NODES, NODES, keys.conversation)
    # The conversation's engine is full: the next one in the same order, for every gateway alike.
    first, second = rendezvous_order(NODES, NODES, keys.conversation)[:2]
    busy = [9 if n == first else 0 for n in NODES]
    assert bounded.order(NODES, NODES, busy, keys)[0] == second
    assert RoutingRule("bounded", 10.0).order(NODES, NODES, busy, keys)[0] == first  # a loose bound keeps it
    rr = RoutingRule("round-robin")
    firsts = [rr.order(NODES, NODES, loads, keys)[0] for _ in range(2 * len(NODES))]
    assert firsts == NODES + NODES
    with pytest.raises(ValueError, match="routing must be one of"):
        RoutingRule("random")
    with pytest.raises(ValueError, match="load bound must be >= 1.0"):
        RoutingRule("bounded", 0.9)


def test_flags(capsys: pytest.CaptureFixture[str]) -> None:
    _, config = parse_args(["--engine-dns", "ignis-engine.ns.svc:50051", "--dns-refresh", "5",
                            "--routing", "affinity", "--load-bound", "1.5"])
    assert (config.engines, config.engine_dns, config.dns_refresh) == ([], ["ignis-engine.ns.svc:50051"], 5.0)
    assert config.routing_rule() == RoutingRule("affinity", 1.5)
    _, default = parse_args(["--engine", "127.0.0.1:1"])
    assert (default.routing, default.load_bound, default.engine_dns) == ("bounded", 1.25, [])
    for argv, message in ((["--engine", "h:1", "--routing", "random"], "invalid choice"),
                          (["--engine", "h:1", "--load-bound", "0.5"], "load bound must be >= 1.0"),
                          (["--engine-dns", "no-port"], "is not NAME:PORT"),
                          (["--engine-dns", "h:1", "--dns-refresh", "0"], "dns_refresh must be > 0"),
                          ([], "--engine-dns NAME:PORT")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert DnsName.parse("[fd00::1]:50051") == DnsName("fd00::1", 50051)


def test_getaddrinfo_resolves_localhost() -> None:
    """The default resolver, for real: localhost is 127.0.0.1 (and ::1 where the host has IPv6)."""
    found = getaddrinfo_resolver("localhost", 50051)
    assert "127.0.0.1:50051" in found and len(found) == len(set(found))
    assert set(found) <= {"127.0.0.1:50051", "[::1]:50051"}
    with pytest.raises(OSError):
        getaddrinfo_resolver("no-such-host.invalid", 1)


# ------------------------------------------------------------------ against real engines

ENGINE_ARGS = ["--served-model-name", MODEL, "--max-queue", "64", "--set", "reuse.retained_interactive_ttl=0"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningService]]:
    started: list[RunningService] = []
    try:
        for i in range(2):
            workdir = tmp_path_factory.mktemp(f"engine{i}")
            tcp = ["--port", "0", "--secret-file", str(workdir / "engine.secret")] if i == 0 else []  # for DNS
            started.append(start_engine(workdir, str(tiny_model_dir), [*ENGINE_ARGS, *tcp]))
        yield started
    finally:
        for e in started:
            e.stop()


def swarm_request(task: str, max_tokens: int = 4, head: str = HEAD) -> engine_pb2.GenerateRequest:
    c = chat(("system", head), ("user", task))
    return engine_pb2.GenerateRequest(request_id=uuid.uuid4().hex, model=MODEL, chat=c,
                                      sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


def head_key(request: engine_pb2.GenerateRequest) -> bytes:
    return route_key(request.model, request.cache_salt, chat_head(request.chat))


async def until(predicate: object, timeout: float = 30.0) -> None:
    """Poll `predicate()` (no sleeping for readiness); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def pool_of(addresses: list[str], **kwargs: object) -> AsyncIterator[EnginePool]:
    pool = EnginePool(addresses, **kwargs)  # type: ignore[arg-type]
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def open_calls(pool: EnginePool, count: int, max_tokens: int = 4096
                     ) -> list[tuple[AsyncIterator[engine_pb2.GenerateResponse], EngineClient]]:
    """`count` swarm calls (one head, a task each), each held open after its first message."""
    held: list[tuple[AsyncIterator[engine_pb2.GenerateResponse], EngineClient]] = []
    spec = CallSpec("messages", "max_tokens")
    for i in range(count):
        request = swarm_request(f"task {i}", max_tokens)
        stream = generate(pool, request, head_key(request), spec)
        await anext(stream)
        busy = [e for e in pool.engines if e.in_flight > len([h for _, h in held if h is e])]
        assert len(busy) == 1
        held.append((stream, busy[0]))
    return held


def test_bounded_spreads_a_swarm_that_affinity_keeps_on_one_engine(engines: list[RunningService]) -> None:
    async def main() -> None:
        addresses = [e.address for e in engines]
        for rule, spread in ((RoutingRule("affinity"), False), (RoutingRule("bounded", 1.0), True)):
            async with pool_of(addresses, rule=rule) as pool:
                held = await open_calls(pool, 6)
                loads = sorted(e.in_flight for e in pool.engines)
                if spread:
                    assert loads == [3, 3]  # bound 1.0: as even as it gets
                else:
                    assert loads == [0, 6]  # one head, one engine
                for stream, _ in held:
                    await stream.aclose()  # type: ignore[attr-defined]
                await until(lambda: all(e.in_flight == 0 for e in pool.engines))

    asyncio.run(main())


def head_on(pool: EnginePool, address: str) -> str:
    """A system prompt whose engine, by affinity, is the one at `address`."""
    return next(h for h in (f"{HEAD} {i}" for i in itertools.count())
                if pool.candidates(MODEL, route_keys(r := swarm_request("x", head=h), head_key(r)))[0].address
                == address)


def test_a_full_engine_is_passed_over(tiny_model_dir: Path, engines: list[RunningService], tmp_path: Path) -> None:
    """An engine at --max-queue answers RESOURCE_EXHAUSTED before any output: the call goes to the next
    engine instead of failing (and the full one stays up)."""
    small = start_engine(tmp_path / "small", str(tiny_model_dir), [*ENGINE_ARGS, "--max-queue", "1"])

    async def main() -> None:
        async with pool_of([small.address, engines[0].address], rule=RoutingRule("affinity")) as pool:
            head = head_on(pool, small.address)
            spec = CallSpec("messages", "max_tokens")
            first = swarm_request("hog", 4096, head)
            hog = generate(pool, first, head_key(first), spec)
            await anext(hog)
            assert [e.in_flight for e in pool.engines] == [1, 0]
            second = swarm_request("second", 2, head)
            served = [m async for m in generate(pool, second, head_key(second), spec)]
            assert served and served[-1].HasField("usage")
            assert all(e.healthy for e in pool.engines)
            await hog.aclose()  # type: ignore[attr-defined]

    try:
        asyncio.run(main())
    finally:
        small.stop()


def test_a_killed_engine_is_dropped_at_once_and_comes_back(tiny_model_dir: Path, engines: list[RunningService],
                                                           tmp_path: Path) -> None:
    """The health watch, not the probe loop (an hour apart here), takes a killed engine out of routing,
    and brings it back once it serves again on its address."""
    victim = start_engine(tmp_path / "victim", str(tiny_model_dir), ENGINE_ARGS)

    async def main() -> RunningService:
        async with pool_of([victim.address, engines[0].address], interval=3600.0,
                           rule=RoutingRule("affinity")) as pool:
            gone = next(e for e in pool.engines if e.address == victim.address)
            assert gone.healthy and gone.session is not None
            first_socket = gone.session.socket_path
            assert first_socket, "an engine on this host names its session socket"
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            await until(lambda: not gone.healthy)
            # Routing now starts on the live engine, whatever the key's affinity.
            spec = CallSpec("messages", "max_tokens")
            for i in range(4):
                request = swarm_request(f"after {i}", 2)
                assert pool.candidates(MODEL, route_keys(request, head_key(request)))[0] is not gone
                assert [m async for m in generate(pool, request, head_key(request), spec)][-1].HasField("usage")
            back = await asyncio.to_thread(start_engine, tmp_path / "victim", str(tiny_model_dir),
                                           ENGINE_ARGS)  # the same workdir: the same socket address
            await until(lambda: gone.healthy, timeout=60)
            # Back, it names a new session socket (the old one died with it), and calls go there.
            request = swarm_request("on the socket again", 2, head_on(pool, victim.address))
            assert [m async for m in generate(pool, request, head_key(request), spec)][-1].HasField("usage")
            assert gone.session is not None and gone.session.transport == "socket"
            assert gone.session.socket_path not in ("", first_socket) and Path(gone.session.socket_path).exists()
            return back

    back = asyncio.run(main())
    back.stop()


def test_a_draining_engine_leaves_routing_while_it_finishes(tiny_model_dir: Path, engines: list[RunningService],
                                                             tmp_path: Path) -> None:
    """SIGTERM: the engine says NOT_SERVING and drains. Its health watch takes it out of routing while the
    process still runs (the probe loop is an hour apart), and its running call goes on. The drain may take
    5 minutes (--grace), not the default 10 s: a loaded machine took a minute for 512 tokens."""
    victim = start_engine(tmp_path / "draining", str(tiny_model_dir), [*ENGINE_ARGS, "--grace", "300"])

    async def main() -> None:
        async with pool_of([victim.address, engines[0].address], interval=3600.0,
                           rule=RoutingRule("affinity")) as pool:
            draining = next(e for e in pool.engines if e.address == victim.address)
            spec = CallSpec("messages", "max_tokens")
            request = swarm_request("a long one", 256, head_on(pool, victim.address))  # longer than the watch takes
            request.sampling.ignore_eos = True
            call = generate(pool, request, head_key(request), spec)
            await anext(call)
            assert draining.in_flight == 1
            victim.process.send_signal(signal.SIGTERM)
            await until(lambda: not draining.healthy, timeout=120)
            assert victim.process.poll() is None  # still draining: it was NOT_SERVING, not gone
            rest = [m async for m in call]  # the running call finishes
            assert rest and rest[-1].HasField("usage") and rest[-1].usage.completion_tokens == 256

    try:
        asyncio.run(main())
        assert victim.process.wait(300) == 0
    finally:
        victim.stop()


def test_dns_discovery_adds_and_retires_engines(engines: list[RunningService]) -> None:
    """A resolver of the test's own (a real function, answering with the real engines' addresses, as a
    headless Service would) is looked up again on refresh: engines join, leave, and a failed lookup
    changes nothing."""
    answer: list[str] = [engines[0].address]
    failing = False

    def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("ignis-engine.test", 50051)
        if failing:
            raise OSError("temporary failure in name resolution")
        return list(answer)

    async def main() -> None:
        nonlocal failing
        discovery = Discovery([DnsName("ignis-engine.test", 50051)], resolver)
        async with pool_of([], discovery=discovery, dns_refresh=3600.0) as pool:
            assert [(e.address, e.healthy) for e in pool.engines] == [(engines[0].address, True)]
            answer.append(engines[1].address)
            await pool.refresh()
            assert [(e.address, e.healthy) for e in pool.engines] == [(e.address, True) for e in engines]
            first = pool.engines[0]
            failing = True
            await pool.refresh()
            assert len(pool.engines) == 2  # a failed lookup keeps the last answer
            failing = False
            answer.remove(engines[0].address)
            await pool.refresh()
            assert [e.address for e in pool.engines] == [engines[1].address] and first.retired
            request = swarm_request("after the move", 2)
            spec = CallSpec("messages", "max_tokens")
            assert [m async for m in generate(pool, request, head_key(request), spec)][-1].HasField("usage")

    asyncio.run(main())


def test_gateway_with_engine_dns_and_a_dead_engine(engines: list[RunningService], tmp_path: Path) -> None:
    """A gateway process finding its engine through `localhost` (getaddrinfo for real; an IPv6 ::1
    answer has no engine and is marked down), next to an --engine nobody listens on: requests are
    served, never sent to the dead ones, and /health lists them all."""
    with socket_closed_port() as dead_port:
        gw = start_gateway(tmp_path, [f"127.0.0.1:{dead_port}"],
                           ["--engine-dns", f"localhost:{engines[0].port}", "--dns-refresh", "1",
                            "--engine-secret-file", str(engines[0].log_path.parent / "engine.secret")])
    try:
        with openai.OpenAI(base_url=f"http://{gw.address}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            for i in range(4):
                reply = c.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                                  messages=[{"role": "system", "content": HEAD},
                                                            {"role": "user", "content": f"task {i}"}])
                assert reply.usage is not None and reply.usage.completion_tokens >= 1
        health = httpx.get(f"http://{gw.address}/health", timeout=10).json()
        by_address = {e["address"]: e["healthy"] for e in health["engines"]}
        assert by_address[f"127.0.0.1:{engines[0].port}"] is True
        assert by_address[f"127.0.0.1:{dead_port}"] is False
        assert all(healthy is False for a, healthy in by_address.items() if a.startswith("[::1]"))
    finally:
        assert gw.stop() == 0, gw.log()
        assert "Traceback" not in gw.log(), gw.log()


@contextlib.contextmanager
def socket_closed_port() -> Iterator[int]:
    """A loopback port that was free a moment ago (nothing listens on it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    yield port


def test_config_needs_an_engine_or_a_name() -> None:
    with pytest.raises(ValueError, match="--engine-dns"):
        GatewayConfig(engines=[])
    assert GatewayConfig(engines=[], engine_dns=["svc:1"]).engine_dns == ["svc:1"]
