"""The engine's spans of one request: queue wait, reuse lookup, restore, prefill, decode.

The model runs on its own thread in batched steps, so no span is held open
there. A sequence records when it reached each stage (`SeqTimes`, monotonic
clock) and, when the request ends, its spans are emitted at once with explicit
start and end times, as children of the context its gRPC handler captured (the
engine's SERVER span of Generate). Tierstore calls made while serving a request
run with that context attached, so their CLIENT spans join the same trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from engine.facts import ReuseTier
from engine.request import EngineRequest, EngineSequence, FinishReason

TRACER_NAME = "ignis.engine"


def capture_context() -> otel_context.Context | None:
    """The current context when it belongs to a recorded span (a traced RPC), else None (tracing off)."""
    if not trace.get_current_span().is_recording():
        return None
    return otel_context.get_current()


@contextlib.contextmanager
def in_request(request: EngineRequest) -> Iterator[None]:
    """Run the block in `request`'s trace context (on the engine thread), so outgoing calls join its trace."""
    if request.trace_context is None:
        yield
        return
    token = otel_context.attach(request.trace_context)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def admission_stage(seq: EngineSequence, stage: Literal["lookup", "claim"]) -> Iterator[None]:
    """Time one step of admitting `seq` (until its first admission) and run it in its request's trace."""
    start = time.monotonic()
    with in_request(seq.request):
        yield
    if seq.preemptions == 0:  # a preempted sequence keeps the times of its first admission
        setattr(seq.times, stage, (start, time.monotonic()))


def emit_request_spans(request: EngineRequest, seqs: Sequence[EngineSequence], finish_reason: FinishReason) -> None:
    """Emit the spans of a request that has ended (finished, cancelled or failed); cheap when untraced."""
    if request.trace_context is None or not seqs:
        return
    now = time.monotonic()
    offset = time.time_ns() - time.monotonic_ns()  # monotonic seconds -> epoch nanoseconds

    def ns(t: float) -> int:
        return round(t * 1e9) + offset

    head = seqs[0]
    t = head.times
    finished = max((s.times.finished or now for s in seqs), default=now)
    first_token = min((s.first_token_time for s in seqs if s.first_token_time is not None), default=None)
    attributes: dict[str, AttributeValue] = {
        "ignis.request_id": request.request_id,
        "ignis.request_class": request.request_class.name.lower(),
        "ignis.prompt_tokens": len(request.prompt_ids),
        "ignis.cached_tokens": head.num_cached,
        "ignis.reuse.tier": head.reuse.tier.value,
        "ignis.reuse.kind": head.reuse.kind.value,
        "ignis.output_tokens": sum(s.num_output for s in seqs),
        "ignis.finish_reason": finish_reason.value,
    }
    tracer = trace.get_tracer(TRACER_NAME)

    def emit(name: str, start: float, end: float, error: str = "", extra: dict[str, AttributeValue] | None = None
             ) -> None:
        span = tracer.start_span(name, context=request.trace_context, start_time=ns(start),
                                 attributes={**attributes, **(extra or {})})
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end(end_time=ns(max(start, end)))

    emit("engine.queue", request.arrival, t.admitted or finished)
    if t.admitted is None:
        return  # it ended while waiting
    if t.lookup is not None:
        emit("engine.reuse.lookup", *t.lookup)
    prefill_start = t.admitted
    if t.claim is not None:
        prefill_start = t.claim[1]
        if head.reuse.tier in (ReuseTier.RAM, ReuseTier.DISK):
            emit("engine.reuse.restore", *t.claim)
        elif head.reuse.tier is ReuseTier.NONE:  # only a lower-tier claim can fail to apply
            emit("engine.reuse.restore", *t.claim, error="the restore failed: the prompt was prefilled cold")
    emit("engine.prefill", prefill_start, first_token or finished,
         extra={"ignis.prefill_tokens": len(request.prompt_ids) - head.num_cached})
    if first_token is not None:
        emit("engine.decode", first_token, finished, extra={"ignis.preemptions": sum(s.preemptions for s in seqs)})
