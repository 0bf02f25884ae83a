"""From a step's sampled tokens to what each request's owner is told.

The engine core runs the model and samples; this turns the result into
per-request updates: stop conditions (EOS, stop token ids, stop strings, length),
finishing a choice, usage when a request is over, prompt logprobs for echo, the
`ignis.request.done` event and the request's trace spans.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.logs import log_event
from engine.cache.reuse import PromptReuse
from engine.facts import ReuseReport
from engine.metrics import EngineMetrics, FinishedRequest
from engine.outputs import ChoiceDelta, RequestUpdate, TokenLogprob, Usage
from engine.request import EngineRequest, EngineSequence, FinishReason, SeqStatus
from engine.runner import ChunkLogits
from engine.sampling.sampler import SampleOutput
from engine.scheduler import Scheduler
from engine.speculative.speculator import drafted_counts
from engine.tracing import emit_request_spans

log = logging.getLogger("ignis.engine")
events = logging.getLogger("ignis.request")  # ignis.request.done, one JSON line per finished request

Sink = Callable[[RequestUpdate], None]
Deltas = dict[str, list[ChoiceDelta]]  # request id -> this step's deltas
RECENT_REQUESTS = 200  # finished requests the Monitor lists (a ring: the oldest leaves)


@dataclass
class LiveRequest:
    """A request between submit and its last update: its owner's sink and its choices."""

    request: EngineRequest
    sink: Sink
    seqs: list[EngineSequence]
    prompt_logprobs_sent: bool = False
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PlainDecode:
    """What the decode road needs to hand on a plain choice's token, looked up once when its request
    arrives. Plain: the only choice of its request, with no logprobs, stop strings, stop token ids,
    grammar or echo; so a token that does not end it (`ends`, `limit`) is appended, detokenized and
    sent with nothing else to check (OutputProcessor.decoded)."""

    request_id: str
    sink: Sink
    push: Callable[[int], str]  # the token's text: its stream's detokenizer (it holds nothing back)
    ends: frozenset[int]  # tokens that end it: EOS, unless ignore_eos
    limit: int  # its length when max_tokens or the model's context ends it


@dataclass(slots=True)
class RequestTotals:
    finished: int = 0
    cancelled: int = 0
    preempted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, reuse: PromptReuse, eos_ids: frozenset[int], max_model_len: int,
                 metrics: EngineMetrics, totals: RequestTotals) -> None:
        self.scheduler = scheduler
        self.reuse = reuse
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.totals = totals
        # The plain choices of the requests in flight (see add; engine thread only).
        self.plain: dict[EngineSequence, PlainDecode] = {}
        # (wall time it finished, its ignis.request.done fields); engine thread only, copied by the listing.
        self.recent: deque[tuple[float, FinishedRequest]] = deque(maxlen=RECENT_REQUESTS)

    def add(self, live: LiveRequest) -> None:
        """A request reached the engine thread: note whether its choice is plain (its PlainDecode)."""
        plain = self.plain_decode(live, live.seqs[0])
        if plain is not None:
            self.plain[live.seqs[0]] = plain

    def plain_decode(self, live: LiveRequest, seq: EngineSequence) -> PlainDecode | None:
        """`seq`'s PlainDecode, if its request makes it a plain choice."""
        request, params = live.request, live.request.params
        if params.n != 1 or params.logprobs or params.stop_token_ids or request.guided is not None \
                or request.echo or seq.stream.has_stops:
            return None
        ends = frozenset() if params.ignore_eos else self.eos_ids
        limit = params.length_limit(seq.num_prompt, self.max_model_len)
        return PlainDecode(request.request_id, live.sink, seq.stream.push_plain, ends, limit)

    # --- per step -------------------------------------------------------------------------
    def decoded(self, seqs: list[EngineSequence], out: SampleOutput, deltas: Deltas, failed: dict[str, str]) -> None:
        """append_sampled for a decode-only step, the steady state. A plain choice whose token does not end
        it is appended, detokenized and sent to its owner here, in one pass and without a delta to collect;
        any other choice, and one that ends, goes the general way into `deltas` (sent once the step's
        failures are known). A sequence whose handling raises is recorded in `failed`; the others go on."""
        general: list[int] = []
        plains = self.plain
        for i, (seq, token) in enumerate(zip(seqs, out.token_ids)):
            plain, ids = plains.get(seq), seq.token_ids
            if plain is None or token in plain.ends or len(ids) + 1 >= plain.limit:
                general.append(i)
                continue
            try:
                ids.append(token)
                seq.sampler.output_token_ids.append(token)  # RequestSampler.observe, for a choice without a grammar
                plain.sink(RequestUpdate(plain.request_id, (ChoiceDelta(0, (token,), plain.push(token)),)))
            except Exception:
                log.exception("handling the token of request %s failed", seq.request.request_id)
                failed.setdefault(seq.request.request_id, "internal error on this request (see the engine log)")
        self.totals.generated_tokens += len(seqs) - len(general)
        for i in general:
            seq = seqs[i]
            try:
                self._append(seq, out, i, deltas)
            except Exception:
                log.exception("handling the token of request %s failed", seq.request.request_id)
                failed.setdefault(seq.request.request_id, "internal error on this request (see the engine log)")
        self.metrics.on_tokens(seqs)

    def collect_prompt_logprobs(self, live: LiveRequest, res: ChunkLogits) -> None:
        """Echo with logprobs: the logprob of each prompt token, from the chunk's logits."""
        seq = res.seq
        if seq.choice != 0 or res.prompt_logits is None:
            return
        logprobs = torch.log_softmax(res.prompt_logits.float(), dim=-1)  # [n, V]
        start = seq.num_computed
        top_n = seq.request.params.top_logprobs
        if start == 0:
            live.prompt_logprobs = [TokenLogprob(seq.token_ids[0], None)]  # nothing predicts the first token
        for i in range(res.num_tokens):
            pos = start + i + 1  # logits at position p predict token p+1
            if pos >= seq.num_prompt:
                break
            token = seq.token_ids[pos]
            row = logprobs[i]
            top: tuple[tuple[int, float], ...] = ()
            if top_n:
                values, ids = torch.topk(row, top_n)
                top = tuple(zip(ids.tolist(), values.tolist()))
            live.prompt_logprobs.append(TokenLogprob(token, float(row[token]), top))

    def append_sampled(self, seqs: list[EngineSequence], out: SampleOutput, deltas: Deltas,
                       failed: dict[str, str]) -> None:
        """Append each sequence's sampled token and decide whether it ends the choice. A sequence
        whose handling raises is recorded in `failed` (request id -> why); the others go on."""
        for i, seq in enumerate(seqs):
            try:
                self._append(seq, out, i, deltas)
            except Exception:
                log.exception("handling the token of request %s failed", seq.request.request_id)
                failed.setdefault(seq.request.request_id, "internal error on this request (see the engine log)")
        self.metrics.on_tokens(seqs)

    def _append(self, seq: EngineSequence, out: SampleOutput, i: int, deltas: Deltas) -> None:
        token = out.token_ids[i]
        seq.append_token(token)
        self.totals.generated_tokens += 1
        params = seq.request.params
        lp: tuple[TokenLogprob, ...] = ()
        if params.logprobs:
            chosen = out.logprobs[i]
            if chosen is not None:
                lp = (TokenLogprob(token, chosen, tuple(out.top_logprobs[i])),)
        if token in self.eos_ids and not params.ignore_eos:
            self.finish(seq, FinishReason.STOP, None, deltas, (token,), lp)
        elif params.stop_token_ids and token in params.stop_token_ids:
            self.finish(seq, FinishReason.STOP, token, deltas, (token,), lp)
        elif seq.sampler.guide is not None and seq.sampler.guide.is_terminated:
            # A complete grammar took its stop token (EOS under ignore_eos): nothing may follow.
            self.finish(seq, FinishReason.STOP, token, deltas, (token,), lp)
        else:
            text, matched = seq.stream.push_token(token)
            length = len(seq.token_ids)
            if matched is not None:
                self.finish(seq, FinishReason.STOP, matched, deltas, (token,), lp, text)
            elif length >= params.length_limit(seq.num_prompt, self.max_model_len):
                self.finish(seq, FinishReason.LENGTH, None, deltas, (token,), lp, text)
            else:
                deltas.setdefault(seq.request.request_id, []).append(ChoiceDelta(seq.choice, (token,), text, lp))

    def finish(self, seq: EngineSequence, reason: FinishReason, stop: str | int | None, deltas: Deltas,
               tokens: tuple[int, ...], lp: tuple[TokenLogprob, ...] = (), text: str = "") -> None:
        if reason is not FinishReason.STOP or not isinstance(stop, str):
            text += seq.stream.finish()  # flush text held back for a possible stop string
        self.reuse.on_finish(seq)  # before its pages and slot are released
        seq.finish(reason, stop)
        self.scheduler.remove(seq)
        for child in seq.unforked:  # max_tokens=0: choices never forked
            child.finish(reason)
        deltas.setdefault(seq.request.request_id, []).append(
            ChoiceDelta(seq.choice, tokens, text, lp, reason, stop)
        )

    def emit(self, live_requests: dict[str, LiveRequest], deltas: Deltas) -> None:
        """Hand each request its deltas; a request whose choices all finished gets its usage and leaves."""
        for rid, items in deltas.items():
            live = live_requests.get(rid)
            if live is None:
                continue
            prompt_lp = None
            if live.request.echo and not live.prompt_logprobs_sent:
                live.prompt_logprobs_sent = True
                prompt_lp = tuple(live.prompt_logprobs) if live.prompt_logprobs else None
            usage = None
            if all(s.status is SeqStatus.FINISHED for s in live.seqs):
                live_requests.pop(rid, None)
                self.totals.finished += 1
                usage = self.usage(live)
                reason = live.seqs[0].finish_reason if live.seqs else None
                self.request_done(live, usage, reason or FinishReason.STOP)
            live.sink(RequestUpdate(rid, tuple(items), prompt_lp, usage))

    # --- per request ---------------------------------------------------------------------
    def usage(self, live: LiveRequest) -> Usage:
        first = min((s.first_token_time for s in live.seqs if s.first_token_time), default=None)
        ttft = (first - live.request.arrival) * 1000 if first else 0.0
        head = live.seqs[0] if live.seqs else None
        drafted = [drafted_counts(s) for s in live.seqs]
        media = live.request.media
        images = len(media.spans) if media is not None else 0
        return Usage(
            prompt_tokens=len(live.request.prompt_ids),
            completion_tokens=sum(s.num_output for s in live.seqs),
            cached_tokens=head.num_cached if head else 0,
            time_to_first_token_ms=ttft,
            reuse=head.reuse if head else ReuseReport(),
            draft_tokens=sum(d for d, _ in drafted),
            accepted_tokens=sum(a for _, a in drafted),
            images=images,
            images_reused=max(0, images - (head.images_encoded if head else 0)),
        )

    def request_done(self, live: LiveRequest, usage: Usage, finish_reason: FinishReason) -> None:
        """The request is over: its ignis.request.done line, metrics and trace spans (before its owner is told)."""
        for seq in live.seqs:
            self.plain.pop(seq, None)
        emit_request_spans(live.request, live.seqs, finish_reason)
        done = FinishedRequest(
            request_id=live.request.request_id, request_class=live.request.request_class,
            prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens, tier=usage.reuse.tier,
            kind=usage.reuse.kind, ttft_ms=usage.time_to_first_token_ms, tokens_out=usage.completion_tokens,
            finish_reason=finish_reason, duration_ms=(time.monotonic() - live.request.arrival) * 1000,
            moves=sum(seq.moves for seq in live.seqs),
            adapter="" if live.request.adapter is None else live.request.adapter.name,
            images=usage.images, images_reused=usage.images_reused)
        log_event(events, "ignis.request.done", **done.event_fields())
        self.recent.append((time.time(), done))
        self.metrics.on_done(done)
