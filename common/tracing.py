"""OpenTelemetry for the three services: one set-up, and trace context carried in gRPC metadata.

Export is on only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or its traces-only
variant) is set: then spans go over OTLP/gRPC through a batch processor. Otherwise
the API's no-op tracer stays in place and nothing leaves the process.

The gRPC helpers are small on purpose: a ``grpc.aio`` server interceptor that
continues the caller's W3C context in a SERVER span per RPC, and a sync
unary-unary client interceptor that wraps each call in a CLIENT span whose
context goes out in the metadata (``traceparent``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

TRACER_NAME = "ignis.grpc"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# Polled, not requested: traced only inside a caller's trace, never as new root traces every probe.
QUIET_METHODS: tuple[str, ...] = ("/grpc.health.", "/grpc.reflection.")
# Status codes that are the server's fault (OpenTelemetry's gRPC conventions); a client sees any non-OK as an error.
_SERVER_ERRORS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                            grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


# --- set-up -------------------------------------------------------------------------------
def build_provider(service_name: str) -> TracerProvider | None:
    """An OTLP-exporting provider when an endpoint is configured, else None. `OTEL_SERVICE_NAME` wins."""
    if not any(os.environ.get(var) for var in _ENDPOINT_VARS):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint, delays: OTEL_* variables
    return provider


_exporting = False  # setup_tracing installed an exporting provider in this process


def setup_tracing(service_name: str) -> bool:
    """Install the exporting provider for this process; True if tracing is on."""
    global _exporting
    provider = build_provider(service_name)
    if provider is None:
        return False
    trace.set_tracer_provider(provider)
    _exporting = True
    return True


def exporting() -> bool:
    """Whether this process exports spans (setup_tracing found an endpoint): a hot path that makes its
    own spans skips them, and the context it would carry, when nobody reads them."""
    return _exporting


def shutdown_tracing() -> None:
    """Export what is still queued and stop the exporter (graceful shutdown); no-op when tracing is off."""
    shutdown = getattr(trace.get_tracer_provider(), "shutdown", None)
    if shutdown is not None:
        shutdown()


def run_traced(service_name: str, serve: Callable[[bool], Coroutine[Any, Any, int]]) -> int:
    """`asyncio.run(serve(tracing_on))` with tracing set up first and flushed after, whatever happens."""
    tracing = setup_tracing(service_name)
    try:
        return asyncio.run(serve(tracing))
    finally:
        shutdown_tracing()  # export the spans still queued


# --- spans and metadata ----------------------------------------------------------------------
def grpc_metadata(ctx: otel_context.Context | None = None) -> tuple[tuple[str, str], ...]:
    """The trace context (`ctx`, or the current one) as gRPC metadata (W3C traceparent/tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple(carrier.items())


def _rpc_attributes(method: str) -> tuple[str, dict[str, Any]]:
    """("pkg.Service/Method", rpc.* attributes) for a full method name "/pkg.Service/Method"."""
    name = method.lstrip("/")
    service, _, rpc = name.partition("/")
    return name, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}


def client_span(method: str, peer: str = "") -> Span:
    """A started (not current) CLIENT span for one call of `method`, a child of the current context."""
    name, attributes = _rpc_attributes(method)
    if peer:
        attributes["server.address"] = peer
    return trace.get_tracer(TRACER_NAME).start_span(name, kind=SpanKind.CLIENT, attributes=attributes)


def set_rpc_status(span: Span, code: grpc.StatusCode | None, server: bool = False) -> None:
    code = code or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK and (not server or code in _SERVER_ERRORS):
        span.set_status(Status(StatusCode.ERROR, code.name))


# --- client (sync channels) -----------------------------------------------------------------
class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class ClientTracingInterceptor(grpc.UnaryUnaryClientInterceptor):
    """A CLIENT span around each unary call, its context injected into the call's metadata.

    Use with ``grpc.intercept_channel``. Without a current span the call starts its own trace.
    """

    def __init__(self, peer: str = "") -> None:
        self.peer = peer

    def intercept_unary_unary(self, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                              client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        d = client_call_details
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        span = client_span(method, self.peer)
        metadata = (*(d.metadata or ()), *grpc_metadata(trace.set_span_in_context(span)))
        code: grpc.StatusCode | None = grpc.StatusCode.UNKNOWN
        try:
            outcome = continuation(_CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready,
                                                d.compression), request)
            code = outcome.code()  # the call has ended: a blocking call's outcome (or its error)
            return outcome
        finally:
            set_rpc_status(span, code)
            span.end()


# --- server (grpc.aio) ----------------------------------------------------------------------
@contextlib.contextmanager
def _server_span(method: str, parent: otel_context.Context, context: grpc.aio.ServicerContext) -> Iterator[Span]:
    name, attributes = _rpc_attributes(method)
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes,
                                      record_exception=False, set_status_on_exception=False) as span:
        try:
            yield span
        except grpc.aio.AbortError:  # context.abort: the status the handler chose
            set_rpc_status(span, context.code(), server=True)
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, then re-raised unchanged
            span.record_exception(exc)
            set_rpc_status(span, grpc.StatusCode.UNKNOWN, server=True)
            raise
        except BaseException:  # cancelled: the caller went away or passed its deadline
            set_rpc_status(span, grpc.StatusCode.CANCELLED, server=True)
            raise
        set_rpc_status(span, context.code(), server=True)


@contextlib.contextmanager
def server_call_span(method: str, carried: Mapping[str, str]) -> Iterator[Span]:
    """A current SERVER span for one call that is not its own RPC (a call on a session stream, a Match on
    the tierstore's socket), continuing the trace `carried` names (W3C traceparent/tracestate); the
    caller sets its status (`set_rpc_status(..., server=True)`). Without an exporter: the invalid span,
    current for nothing, and the carried context is not even read (nobody reads the spans)."""
    if not _exporting:
        yield trace.INVALID_SPAN
        return
    name, attributes = _rpc_attributes(method)
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(name, context=propagate.extract(dict(carried)), kind=SpanKind.SERVER,
                                      attributes=attributes,
                                      record_exception=False, set_status_on_exception=False) as span:
        yield span


def _traced_unary(behavior: Callable[..., Awaitable[Any]], method: str, parent: otel_context.Context
                  ) -> Callable[..., Awaitable[Any]]:
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with _server_span(method, parent, context):
            return await behavior(request, context)
    return traced


def _traced_stream(behavior: Callable[..., AsyncIterator[Any]], method: str, parent: otel_context.Context
                   ) -> Callable[..., AsyncIterator[Any]]:
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # The server iterates a handler's generator in the RPC's own task, so the span stays current
        # across the yields (the handler may capture it) and is detached in the context it was attached in.
        with _server_span(method, parent, context):
            async for message in behavior(request, context):
                yield message
    return traced


_HANDLER_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class ServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per RPC, named by the method, continuing the W3C context from the metadata.

    Methods starting with a `quiet` prefix are traced only when the caller sent a context.
    """

    def __init__(self, quiet: Iterable[str] = QUIET_METHODS) -> None:
        self.quiet = tuple(quiet)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        metadata = handler_call_details.invocation_metadata or ()
        parent = propagate.extract({key: value for key, value in metadata if isinstance(value, str)})
        if method.startswith(self.quiet) and not trace.get_current_span(parent).get_span_context().is_valid:
            return handler
        attr, factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, attr)
        if inspect.isasyncgenfunction(behavior):
            wrapped: Callable[..., Any] = _traced_stream(behavior, method, parent)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = _traced_unary(behavior, method, parent)
        else:  # a synchronous handler (not used by ignis): left as it is
            return handler
        return factory(wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
