"""The Starlette app: routes, middleware (pure ASGI) and error handlers."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send

from gateway.auth import APIKeyMiddleware
from gateway.body_deadline import BodyDeadline
from gateway.config import GatewayConfig
from gateway.connection_faults import ConnectionFaults
from gateway.engines import EnginePool
from gateway.errors import UnexpectedErrors, handle_http_exception
from gateway.metrics import GatewayMetrics, MetricsMiddleware, RouteLabels
from gateway.origins import OriginsMiddleware
from gateway.routes.adapters import load_lora_adapter, unload_lora_adapter
from gateway.routes.chat import chat_completions
from gateway.routes.completions import completions
from gateway.routes.health import health
from gateway.routes.metrics import metrics
from gateway.routes.models import get_model, list_models
from gateway.routes.monitor import FAVICON, MONITOR_PATHS, favicon, ignis_state, ignis_state_stream, monitor_file
from gateway.routes.responses import delete_response, get_response, list_input_items, responses
from gateway.routes.responses_ws import responses_socket
from gateway.routes.tokenize import not_served, tokenize
from gateway.sse import SERVER_SEND
from gateway.state import GatewayState
from gateway.tracing import TracingMiddleware


class GatewayApp(Starlette):
    """Starlette, keeping the server's `send` in the scope: a stream's chunks after its first skip the
    middlewares' send wrappers (five coroutine calls a token; they only watch the head and first byte)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig) -> Starlette:
    gateway_metrics = GatewayMetrics()
    state = GatewayState(config, gateway_metrics, ConnectionFaults(gateway_metrics, config.fault_log_interval))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool = EnginePool.from_config(config, on_slow_reader=state.faults.slow_reader, shutdown=state.shutdown)
        state._pool = pool
        await pool.start()
        summaries = asyncio.create_task(state.faults.run(), name="connection-fault-summaries")
        try:
            yield
        finally:
            summaries.cancel()
            await asyncio.gather(summaries, return_exceptions=True)
            await pool.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_socket),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", not_served, methods=["POST"]),
        Route("/v1/embeddings", not_served, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/ignis/state", ignis_state, methods=["GET"]),
        Route("/v1/ignis/state/stream", ignis_state_stream, methods=["GET"]),
        *(Route(path, monitor_file, methods=["GET"]) for path in MONITOR_PATHS),
        Route(FAVICON, favicon, methods=["GET"]),
    ]
    # Outermost first: unexpected errors end as a 500 here, metrics see every answer (401s included),
    # then the origin check (CORS), the trace span, the key check, and the body deadline around the routes' reads.
    route_labels = RouteLabels(route.path for route in routes if isinstance(route, Route))
    middleware = [Middleware(UnexpectedErrors),
                  Middleware(MetricsMiddleware, metrics=state.metrics, routes=route_labels)]
    # Outside the key check: a browser's preflight carries no key. Always there: it checks the Origin of
    # every WebSocket handshake, and is CORS for HTTP only with --allowed-origins (gateway/origins.py).
    middleware.append(Middleware(OriginsMiddleware, allowed_origins=config.allowed_origins))
    if config.tracing:  # without an exporter the spans would go nowhere: skip their per-request cost
        middleware.append(Middleware(TracingMiddleware))
    if config.api_key is not None:
        # The Monitor's page carries no data: it asks for the key and sends it with /v1/ignis/state. Browsers
        # ask for /favicon.ico without one.
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key,
                                     public_paths=(*config.public_paths, *MONITOR_PATHS, FAVICON)))
    middleware.append(Middleware(BodyDeadline, timeout=config.body_timeout, faults=state.faults))
    app = GatewayApp(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={HTTPException: handle_http_exception})
    app.state.gateway = state
    return app
