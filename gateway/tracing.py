"""OpenTelemetry: one server span per HTTP request, its context carried to the engine in gRPC metadata.

Export is on only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; otherwise the
OpenTelemetry API's no-op tracer costs next to nothing.
"""

from __future__ import annotations

import os

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRACER_NAME = "ignis.gateway"


def setup_tracing(service_name: str = "ignis-gateway") -> bool:
    """Install an OTLP-exporting tracer provider when the endpoint is configured; True if it did."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (W3C traceparent), for the engine's server span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


class TracingMiddleware:
    """Pure ASGI: a SERVER span around each HTTP request, continuing an incoming traceparent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.tracer = trace.get_tracer(TRACER_NAME)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
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
