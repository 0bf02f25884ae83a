"""The engines behind the gateway: one grpc.aio channel each, their health, their models, their load.

Health is watched two ways. Each engine has a gRPC health `Watch` stream open:
the engine says NOT_SERVING the moment it starts to shut down, and a dead
process or a lost connection ends the stream at once, so routing stops within
milliseconds, not at the next probe. A background loop also probes every engine
(gRPC health, then ListModels) every `interval` seconds: that finds an engine
that hangs with its connection open, and brings one back (as does its watch,
retried every `rewatch_delay` seconds). A call that fails with UNAVAILABLE
marks its engine down at once.

The engine set is the `--engine` addresses plus what the `--engine-dns` names
resolve to (gateway/discovery.py), looked up again every `dns_refresh` seconds.
An engine that leaves the set takes no new request; its channel closes once its
last call ends.

`candidates` orders the engines for one request: those serving the model,
healthy ones by the routing rule (gateway/routing.py, with each engine's
in-flight count here as the load), then the down ones as a last resort
(their state may be stale).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.bearer import read_secret, with_bearer
from gateway.config import DEFAULT_MAX_STREAM_BUFFER_BYTES, GatewayConfig
from gateway.discovery import Discovery, DnsName, Resolver, getaddrinfo_resolver
from gateway.errors import OpenAIError, unavailable
from gateway.routing import RouteKeys, RoutingRule, rendezvous_order
from gateway.session import EngineSession
from gateway.session_socket import on_this_host
from gateway.shutdown import Shutdown
from ignis.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("ignis.gateway")

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),  # echo with prompt logprobs of a long prompt
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    # Reconnect quickly after an engine restart (the default backoff grows to 2 minutes).
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
_SERVING = health_pb2.HealthCheckResponse.SERVING
# Probes in a row that time out before a serving engine leaves routing. One slow answer is load (a long
# prefill holds the engine's CPU), not an outage: taking the only engine out answered 503 to requests it
# would have served. An engine that refuses the connection or says NOT_SERVING leaves at once.
SLOW_PROBES_TO_MARK_DOWN = 3


@dataclass(eq=False, slots=True)
class EngineClient:
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    models: dict[str, engine_pb2.ModelCard] = field(default_factory=dict)  # last ListModels answer
    models_known: bool = False
    engine_id: str = ""  # names its response store (ListModels): stored ids resp_<engine_id>_... live there
    in_flight: int = 0  # this gateway's Generate calls on it now: the routing rule's load
    retired: bool = False  # left the engine set (DNS): no new call; the channel closes after the last one
    watch: asyncio.Task[None] | None = None
    slow_probes: int = 0  # probes in a row that timed out while it was serving
    # Its Generate calls, multiplexed on one stream (gateway/session.py); None: a Generate call each
    # (--upstream calls, or an engine that does not serve GenerateSession).
    session: EngineSession | None = None


class EnginePool:
    def __init__(self, addresses: list[str], interval: float = 2.0, probe_timeout: float = 2.0,
                 rule: RoutingRule | None = None, discovery: Discovery | None = None,
                 dns_refresh: float = 10.0, rewatch_delay: float = 0.5, sessions: bool = True,
                 session_sockets: bool = True, traced: bool = True, max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER_BYTES,
                 on_slow_reader: Callable[[], None] = lambda: None, secret: bytes | None = None,
                 shutdown: Shutdown | None = None) -> None:
        """`secret`: the engines' shared secret, sent on every call to an engine over TCP (not over unix:).
        `shutdown`: the server's stop, which ends the Generate calls still running when its grace is spent."""
        if not addresses and discovery is None:
            raise ValueError("at least one engine address or DNS name is needed")
        self.interval = interval
        self.probe_timeout = probe_timeout
        self.rule = rule or RoutingRule()
        self.discovery = discovery
        self.dns_refresh = dns_refresh
        self.rewatch_delay = rewatch_delay
        self.sessions = sessions
        self.session_sockets = session_sockets  # a session to an engine on this host uses its socket when it has one
        self.max_stream_buffer = max_stream_buffer  # bytes held for one call's slow reader (gateway/session.py)
        self.on_slow_reader = on_slow_reader  # a call ended for its slow reader (the fault summary counts it)
        self.traced = traced  # a CLIENT span per Generate call (off when no spans are exported)
        self.secret = secret
        self.shutdown = shutdown or Shutdown()
        self.static = list(dict.fromkeys(addresses))
        self.engines: list[EngineClient] = [self._client(a) for a in self.static]
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: set[asyncio.Task[None]] = set()
        self._started = False

    @classmethod
    def from_config(cls, config: GatewayConfig, resolver: Resolver = getaddrinfo_resolver,
                    on_slow_reader: Callable[[], None] = lambda: None, shutdown: Shutdown | None = None) -> EnginePool:
        discovery = Discovery([DnsName.parse(n) for n in config.engine_dns], resolver) if config.engine_dns else None
        secret = read_secret(config.engine_secret_file) if config.engine_secret_file else None
        return cls(config.engines, config.probe_interval, config.probe_timeout, config.routing_rule(), discovery,
                   config.dns_refresh, sessions=config.upstream != "calls",
                   session_sockets=config.upstream == "session", traced=config.tracing,
                   max_stream_buffer=config.max_stream_buffer_bytes, on_slow_reader=on_slow_reader, secret=secret,
                   shutdown=shutdown)

    def _client(self, address: str) -> EngineClient:
        channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        stub = engine_pb2_grpc.EngineStub(channel)
        if not address.startswith("unix:"):  # over TCP every call but health needs the secret (the socket: none)
            if self.secret is not None:
                stub = with_bearer(stub, self.secret)
            else:
                log.warning("engine %s is reached over TCP without --engine-secret-file: it refuses every call "
                            "but health checks (give its engine.secret_file, or use its unix: socket)", address)
        return EngineClient(address, channel, stub, health_pb2_grpc.HealthStub(channel),
                            session=EngineSession(stub, self.max_stream_buffer, self.on_slow_reader)
                            if self.sessions else None)

    @staticmethod
    def without_session(engine: EngineClient) -> None:
        """The engine does not serve GenerateSession (an older engine): a Generate call per request there."""
        if engine.session is not None:
            log.warning("engine %s does not serve GenerateSession: one Generate call per request", engine.address)
            engine.session = None

    async def start(self) -> None:
        """Resolve, probe once (without failing: engines may start after the gateway), then keep watching."""
        self._started = True
        if self.discovery is not None:
            await self.refresh()
        await self.probe_all()
        for engine in self.engines:
            self._start_watch(engine)
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="engine-probes"))
        if self.discovery is not None:
            self._tasks.append(asyncio.create_task(self._dns_loop(), name="engine-dns"))

    async def close(self) -> None:
        tasks = [*self._tasks, *(e.watch for e in self.engines if e.watch is not None), *self._closing]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(e.session.close() for e in self.engines if e.session is not None),
                             return_exceptions=True)
        await asyncio.gather(*(e.channel.close() for e in self.engines), return_exceptions=True)

    # ------------------------------------------------------------ the engine set

    async def refresh(self) -> None:
        """Look the DNS names up again: add the new addresses, retire the ones no longer there."""
        if self.discovery is None:
            return
        wanted = list(dict.fromkeys([*self.static, *await self.discovery.addresses()]))
        have = {e.address for e in self.engines}
        for engine in [e for e in self.engines if e.address not in wanted]:
            log.info("engine %s left the engine set", engine.address)
            self.engines.remove(engine)
            engine.retired = True
            if engine.watch is not None:
                engine.watch.cancel()
            if engine.in_flight == 0:
                self._close_later(engine)
        added = [self._client(a) for a in wanted if a not in have]
        self.engines.extend(added)
        for engine in added:
            log.info("engine %s joined the engine set", engine.address)
            if self._started:
                await self.probe(engine)
                self._start_watch(engine)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a resolver bug must not end discovery for good
                log.exception("engine DNS refresh failed")

    def _close_later(self, engine: EngineClient) -> None:
        task = asyncio.create_task(engine.channel.close(), name=f"close-{engine.address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # ------------------------------------------------------------ health

    def _start_watch(self, engine: EngineClient) -> None:
        if engine.watch is None and not engine.retired:
            engine.watch = asyncio.create_task(self._watch(engine), name=f"health-watch-{engine.address}")

    async def _watch(self, engine: EngineClient) -> None:
        """Follow the engine's health stream for as long as it is in the set; reopen it when it breaks."""
        while not engine.retired:
            try:
                async for reply in engine.health.Watch(health_pb2.HealthCheckRequest()):
                    if reply.status != _SERVING:
                        self._set_health(engine, False, "not serving")
                    elif not engine.healthy:
                        await self.probe(engine)  # the model list too, before it takes requests
                self._set_health(engine, False, "its health stream ended")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # no Watch there: the probe loop alone
                self._set_health(engine, False, f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(self.rewatch_delay)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.probe_all()

    async def probe_all(self) -> list[bool]:
        return list(await asyncio.gather(*(self.probe(e) for e in list(self.engines))))

    async def probe(self, engine: EngineClient) -> bool:
        """One health check (and a model list refresh); updates and returns `engine.healthy`."""
        try:
            reply = await engine.health.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout)
            ok = reply.status == _SERVING
            if ok:
                models = await engine.stub.ListModels(engine_pb2.ListModelsRequest(), timeout=self.probe_timeout)
                engine.models = {m.id: m for m in models.models}
                engine.models_known = True
                engine.engine_id = models.engine_id
                if engine.session is not None and self.session_sockets and on_this_host(engine.address):
                    engine.session.socket_path = models.session_socket
            engine.slow_probes = 0
            self._set_health(engine, ok, "" if ok else "not serving")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and engine.healthy:
                engine.slow_probes += 1
                if engine.slow_probes < SLOW_PROBES_TO_MARK_DOWN:
                    log.info("engine %s answered no probe within %.1f s (%d in a row): kept in routing",
                             engine.address, self.probe_timeout, engine.slow_probes)
                    return True
                reason = f"{engine.slow_probes} probes in a row timed out ({self.probe_timeout:.1f} s each)"
                self._set_health(engine, False, reason)
            else:
                self._set_health(engine, False, f"{exc.code().name}: {exc.details()}")
        return engine.healthy

    def mark_down(self, engine: EngineClient, reason: str) -> None:
        self._set_health(engine, False, reason)

    def _set_health(self, engine: EngineClient, ok: bool, reason: str) -> None:
        if ok != engine.healthy:
            if ok:
                log.info("engine %s is serving %s", engine.address, ", ".join(engine.models) or "no models")
            else:
                log.warning("engine %s is unavailable: %s", engine.address, reason)
        engine.healthy = ok

    # ------------------------------------------------------------ routing and load

    def served_models(self) -> set[str]:
        return {m for e in self.engines for m in e.models}

    def candidates(self, model: str, keys: RouteKeys) -> list[EngineClient]:
        """Engines to try for `model`, best first; 404 when no engine is known to serve it."""
        if not self.engines:
            raise unavailable("no engine is available (none is configured or discovered yet)")
        serving = [e for e in self.engines if not e.models_known or model in e.models]
        if not serving:
            known = ", ".join(sorted(self.served_models())) or "none"
            raise OpenAIError(404, f"the model {model!r} does not exist; served models: {known}",
                              param="model", code="model_not_found")
        healthy = [e for e in serving if e.healthy]
        down = [e for e in serving if not e.healthy]
        first = self.rule.order(healthy, [e.address for e in healthy], [e.in_flight for e in healthy], keys)
        return first + rendezvous_order(down, [e.address for e in down], keys.head)

    def by_engine_id(self, engine_id: str) -> EngineClient | None:
        """The engine whose response store is `engine_id` (a healthy one first: engines sharing a
        store folder report the same id)."""
        found = [e for e in self.engines if engine_id and e.engine_id == engine_id]
        return next((e for e in found if e.healthy), found[0] if found else None)

    def acquire(self, engine: EngineClient) -> None:
        engine.in_flight += 1

    def release(self, engine: EngineClient) -> None:
        engine.in_flight -= 1
        if engine.retired and engine.in_flight == 0:
            self._close_later(engine)

    async def list_models(self) -> list[engine_pb2.ModelCard]:
        """Every model an engine answers for now (refreshing the pool's view); 503 when none answers."""
        results = await self.probe_all()
        if not any(results):
            raise unavailable("no engine is available")
        cards: dict[str, engine_pb2.ModelCard] = {}
        for engine in self.engines:
            if engine.healthy:
                for card in engine.models.values():
                    cards.setdefault(card.id, card)
        return list(cards.values())
