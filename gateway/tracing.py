"""OpenTelemetry at the gateway: a SERVER span per HTTP request.

Set-up (export only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set) is
`common.tracing.setup_tracing`; the engine call under this span is a CLIENT span
whose context goes to the engine in the gRPC metadata (`gateway.upstream`).
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRACER_NAME = "ignis.gateway"
QUIET_PATHS = ("/health", "/metrics")  # probes and scrapes: a new trace every few seconds would bury the requests


class TracingMiddleware:
    """Pure ASGI: a SERVER span around each HTTP request, continuing an incoming traceparent."""

    def __init__(self, app: ASGIApp, quiet_paths: tuple[str, ...] = QUIET_PATHS) -> None:
        self.app = app
        self.tracer = trace.get_tracer(TRACER_NAME)
        self.quiet_paths = quiet_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.quiet_paths:
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        name = f"{scope['method']} {scope['path']}"
        with self.tracer.start_as_current_span(name, context=propagate.extract(carrier), kind=SpanKind.SERVER,
                                               attributes={"http.method": scope["method"],
                                                           "http.target": scope["path"]}) as span:
            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, traced_send)
