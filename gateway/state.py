"""What the app holds for its lifetime (no per-request or per-conversation state)."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from gateway.config import GatewayConfig
from gateway.connection_faults import ConnectionFaults
from gateway.engines import EnginePool
from gateway.media import MediaPolicy
from gateway.metrics import GatewayMetrics
from gateway.shutdown import Shutdown


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    faults: ConnectionFaults  # shared with the HTTP protocol (gateway/http_protocol.py)
    shutdown: Shutdown = field(default_factory=Shutdown)  # the server's stop (gateway/__main__.py starts it)
    _pool: EnginePool | None = None  # made in the lifespan: grpc.aio channels bind to the running loop
    media: MediaPolicy = field(init=False)  # the config's media flags, its folder resolved once

    def __post_init__(self) -> None:
        self.media = self.config.media_policy()

    @property
    def pool(self) -> EnginePool:
        if self._pool is None:
            raise RuntimeError("the engine pool is not started (the app ran without its lifespan); this is a bug")
        return self._pool


def state_of(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state
