"""One request is one trace across gateway, engine and tierstore (OpenTelemetry over OTLP).

A real OTLP/gRPC receiver runs in the test on loopback; the three services run as
processes with OTEL_EXPORTER_OTLP_ENDPOINT pointed at it. The engine keeps one
retained device slot, so the first request's opener checkpoint is spilled to
KV-RAM and the same request again is restored from there: the second trace holds
the lookup and restore and their tierstore calls. The first is streamed (SSE), the
second is not. Services are stopped gracefully, which flushes their spans, before
anything is asserted.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from common.tracing import build_provider, setup_tracing
from services import RunningService, start_engine, start_gateway, start_tierstore

MODEL = "ignis-tiny"
SERVER = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SpanKind.SPAN_KIND_CLIENT
ENGINE_SPANS = {"engine.queue", "engine.reuse.lookup", "engine.prefill", "engine.decode"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: bytes
    span_id: bytes
    parent_id: bytes  # b"" for a root span
    name: str
    kind: int
    attributes: dict[str, Any]


def _values(attributes: Any) -> dict[str, Any]:
    def value(v: common_pb2.AnyValue) -> Any:
        which = v.WhichOneof("value")
        return getattr(v, which) if which else None
    return {a.key: value(a.value) for a in attributes}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            service = _values(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(service, s.trace_id, s.span_id, s.parent_span_id, s.name, s.kind,
                                          _values(s.attributes)) for s in scope_spans.spans]
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(0)


def _one(spans: list[ReceivedSpan], **match: Any) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one span with {match}, got {found}"
    return found[0]


def _check_request_trace(spans: list[ReceivedSpan], usage: Any, store: bool = True) -> dict[str, ReceivedSpan]:
    """The parenting of one request's trace; returns its engine spans by name. `store`: the request called
    the tierstore (a miss the published table answers does not)."""
    assert len({s.trace_id for s in spans}) == 1
    assert {s.service for s in spans} == {"ignis-gateway", "ignis-engine", *(["ignis-tierstore"] if store else [])}
    http = _one(spans, service="ignis-gateway", kind=SERVER)
    assert http.name == "POST /v1/chat/completions" and http.parent_id == b""
    call = _one(spans, service="ignis-gateway", kind=CLIENT)
    assert call.name == "ignis.v1.Engine/Generate" and call.parent_id == http.span_id
    generate = _one(spans, service="ignis-engine", kind=SERVER)
    assert generate.name == "ignis.v1.Engine/Generate" and generate.parent_id == call.span_id

    request_spans = {s.name: s for s in spans if s.service == "ignis-engine" and s.name.startswith("engine.")}
    assert len(request_spans) == len([s for s in spans if s.name.startswith("engine.")])  # one of each
    assert ENGINE_SPANS <= set(request_spans)
    for span in request_spans.values():
        assert span.parent_id == generate.span_id, span
        assert span.attributes["ignis.prompt_tokens"] == usage.prompt_tokens
        assert span.attributes["ignis.cached_tokens"] == usage.prompt_tokens_details.cached_tokens
        assert span.attributes["ignis.output_tokens"] == usage.completion_tokens
        assert span.attributes["ignis.request_class"] == "interactive"
    assert len({s.attributes["ignis.request_id"] for s in request_spans.values()}) == 1

    # Every tierstore call of the request: the tierstore's SERVER span under the engine's CLIENT span
    # of that call, which is a child of the request's Generate span (the engine thread ran it in its context).
    engine_clients = {s.span_id: s for s in spans if s.service == "ignis-engine" and s.kind == CLIENT}
    store_calls = [s for s in spans if s.service == "ignis-tierstore"]
    assert bool(store_calls) == store
    for served in store_calls:
        assert served.kind == SERVER
        caller = engine_clients[served.parent_id]
        assert caller.name == served.name and caller.parent_id == generate.span_id
    assert len(engine_clients) == len(store_calls)
    return request_spans


def test_one_request_is_one_trace_across_the_three_services(tmp_path: Path, tiny_model_dir: Path,
                                                             receiver: tuple[Receiver, int]) -> None:
    collector, port = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    # A prompt well past the restore floor (32 tokens): the engine asks the store on every lookup.
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me how retained state moves between tiers. " * 8}]
    services: list[RunningService] = []
    codes: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        @stack.callback
        def stop_all() -> None:  # gateway first: each flushes its spans as it stops
            for service in reversed(services):
                codes[service.name] = service.stop()

        store = start_tierstore(tmp_path / "tierstore", ["--kv-host-pool-bytes", "64MiB", "--kv-disk-bytes", "0"],
                                env=env)
        services.append(store)
        engine = start_engine(tmp_path / "engine", str(tiny_model_dir),
                              ["--served-model-name", MODEL, "--tierstore", store.address,
                               "--set", "reuse.retained_device=1", "--set", "reuse.retained_interactive_ttl=0"],
                              env=env)
        services.append(engine)
        gateway = start_gateway(tmp_path / "gateway", [engine.address], env=env)
        services.append(gateway)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused") as client:
            # Streamed (SSE): the engine call runs in the response's streaming task, still under the request's span.
            stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                    temperature=0, stream=True, stream_options={"include_usage": True})
            cold = [chunk for chunk in stream if chunk.usage is not None][-1]
            warm = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert codes == {"gateway": 0, "engine": 0, "tierstore": 0}, [s.log() for s in services]
    for service in services:  # a context detached in another task than it was attached in, a lost batch
        log = service.log()
        assert not any(m in log for m in ("Traceback", "Failed to detach context", "Failed to export")), log
    # The reply's checkpoint took the only device slot and pushed the opener's down to KV-RAM.
    assert warm.model_extra is not None and warm.model_extra["ignis"]["tier"] == "ram", warm.model_extra

    spans = collector.spans
    by_trace: dict[bytes, list[ReceivedSpan]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    http = [s for s in spans if s.service == "ignis-gateway" and s.kind == SERVER]
    assert {s.name for s in http} == {"POST /v1/chat/completions"}  # the readiness polls of /health are not traced
    requests = [by_trace[s.trace_id] for s in http]
    assert len(requests) == 2
    # The cold request's miss is answered by the store's published table: it calls no tierstore.
    first = _check_request_trace(next(t for t in requests if any(
        s.attributes.get("ignis.reuse.tier") == "none" for s in t)), cold.usage, store=False)
    second = _check_request_trace(next(t for t in requests if any(
        s.attributes.get("ignis.reuse.tier") == "ram" for s in t)), warm.usage)

    assert "engine.reuse.restore" not in first
    assert second["engine.reuse.restore"].attributes["ignis.reuse.kind"] == "checkpoint"
    names = {s.name for s in by_trace[second["engine.queue"].trace_id] if s.service == "ignis-tierstore"}
    # A claim from KV-RAM found in the store's published table: no Match and no Acquire on the request's
    # path; the use is reported to the store in a background Release that joins the request's trace.
    assert "ignis.v1.TierStore/Release" in names
    assert not names & {"ignis.v1.TierStore/Match", "ignis.v1.TierStore/Acquire"}

    # The spill (on the engine thread between steps, no request's) starts its own trace, still propagated.
    spill = [s for s in spans if s.service == "ignis-tierstore" and s.name == "ignis.v1.TierStore/Commit"]
    assert spill and all(s.trace_id not in {requests[0][0].trace_id, requests[1][0].trace_id} for s in spill)
    engine_clients = {s.span_id for s in spans if s.service == "ignis-engine" and s.kind == CLIENT}
    assert all(s.parent_id in engine_clients for s in spans if s.service == "ignis-tierstore")


def test_nothing_is_exported_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert build_provider("ignis-engine") is None
    assert setup_tracing("ignis-engine") is False
    assert not hasattr(trace.get_tracer_provider(), "shutdown")  # still the API's no-op provider


def test_service_name_comes_from_otel_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    provider = build_provider("ignis-engine")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "ignis-engine"
    provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "engine-eu-1")
    provider = build_provider("ignis-engine")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "engine-eu-1"
    provider.shutdown()
