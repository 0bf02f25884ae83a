"""GET /metrics: the gateway's Prometheus text."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from gateway.state import state_of


async def metrics(request: Request) -> Response:
    state = state_of(request)
    for engine in state.pool.engines:  # the probe loop's view, as of the last probe
        state.metrics.engine_up.labels(engine.address).set(1 if engine.healthy else 0)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
