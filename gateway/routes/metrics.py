"""GET /metrics: the gateway's Prometheus metrics, in the format the scraper asks for.

As the engine's and the tierstore's /metrics (prometheus_client's own server): OpenMetrics for an
``Accept: application/openmetrics-text`` (what Prometheus asks first), the Prometheus text otherwise.
"""

from __future__ import annotations

from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response

from gateway.state import state_of


async def metrics(request: Request) -> Response:
    state = state_of(request)
    for engine in state.pool.engines:  # the probe loop's view, as of the last probe
        state.metrics.engine_up.labels(engine.address).set(1 if engine.healthy else 0)
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(state.metrics.registry), headers={"Content-Type": content_type})
