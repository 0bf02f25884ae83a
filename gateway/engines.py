"""The engines behind the gateway: one grpc.aio channel each, their health, their models.

A background loop probes every engine (gRPC health, then ListModels) every
`interval` seconds; a call that fails with UNAVAILABLE marks its engine down
at once. `candidates` orders the engines for one request: those serving the
model, by rendezvous hash (routing.py), healthy ones first; a down engine
stays in the list as a last resort because its state may be stale.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import OpenAIError, unavailable
from gateway.routing import rendezvous_order
from ignis.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("ignis.gateway")

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),  # echo with prompt logprobs of a long prompt
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    # Reconnect quickly after an engine restart (the default backoff grows to 2 minutes).
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(eq=False, slots=True)
class EngineClient:
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    models: dict[str, engine_pb2.ModelCard] = field(default_factory=dict)  # last ListModels answer
    models_known: bool = False


class EnginePool:
    def __init__(self, addresses: list[str], interval: float = 2.0, probe_timeout: float = 2.0) -> None:
        if not addresses:
            raise ValueError("at least one engine address is needed")
        self.interval = interval
        self.probe_timeout = probe_timeout
        self.engines: list[EngineClient] = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self.engines.append(EngineClient(address, channel, engine_pb2_grpc.EngineStub(channel),
                                             health_pb2_grpc.HealthStub(channel)))
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Probe once (without failing: engines may start after the gateway), then keep probing."""
        await self.probe_all()
        self._loop_task = asyncio.create_task(self._probe_loop(), name="engine-probes")

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await asyncio.gather(*(e.channel.close() for e in self.engines), return_exceptions=True)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.probe_all()

    async def probe_all(self) -> list[bool]:
        return list(await asyncio.gather(*(self.probe(e) for e in self.engines)))

    async def probe(self, engine: EngineClient) -> bool:
        """One health check (and a model list refresh); updates and returns `engine.healthy`."""
        try:
            reply = await engine.health.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            if ok:
                models = await engine.stub.ListModels(engine_pb2.ListModelsRequest(), timeout=self.probe_timeout)
                engine.models = {m.id: m for m in models.models}
                engine.models_known = True
            self._set_health(engine, ok, "" if ok else "not serving")
        except grpc.aio.AioRpcError as exc:
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

    def served_models(self) -> set[str]:
        return {m for e in self.engines for m in e.models}

    def candidates(self, model: str, key: bytes) -> list[EngineClient]:
        """Engines to try for `model`, best first; 404 when no engine is known to serve it."""
        serving = [e for e in self.engines if not e.models_known or model in e.models]
        if not serving:
            known = ", ".join(sorted(self.served_models())) or "none"
            raise OpenAIError(404, f"the model {model!r} does not exist; served models: {known}",
                              param="model", code="model_not_found")
        ordered = rendezvous_order(serving, [e.address for e in serving], key)
        return [e for e in ordered if e.healthy] + [e for e in ordered if not e.healthy]

    async def list_models(self) -> list[engine_pb2.ModelCard]:
        """Every model an engine answers for now (refreshing the pool's view); 503 when none answers."""
        results = await asyncio.gather(*(self.probe(e) for e in self.engines))
        if not any(results):
            raise unavailable("no engine is available")
        cards: dict[str, engine_pb2.ModelCard] = {}
        for engine in self.engines:
            if engine.healthy:
                for card in engine.models.values():
                    cards.setdefault(card.id, card)
        return list(cards.values())
