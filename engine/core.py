"""The engine core: owns the model, the cache and the scheduler, and runs steps on
a dedicated thread so the asyncio side (gRPC, health) stays responsive.

Requests come in through `submit` (any thread), updates go out through each
request's sink, called on the engine thread: the sink must only hand off
(e.g. loop.call_soon_threadsafe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from common.logs import log_event
from engine.cache.chain_hash import BlockHash, Namespace, model_fingerprint, page_hashes
from engine.cache.device_cache import CacheGeometry, DeviceCache, kv_bytes_per_page, state_bytes_per_slot
from engine.cache.page_pool import PagePool, SlotPool
from engine.cache.page_reuse import PageReuse
from engine.cache.retained import RetainedStateReuse
from engine.cache.reuse import NoReuse, PromptReuse
from engine.metrics import EngineMetrics, FinishedRequest, class_name
from engine.model.loader import LoadedModel
from engine.outputs import ChoiceDelta, EngineStats, RequestUpdate, TokenLogprob, Usage
from engine.request import EngineRequest, FinishReason, RequestClass, ReuseReport, Sequence, SeqStatus
from engine.runner import ChunkLogits, ModelRunner
from engine.sampling.sampler import RequestSampler, sample
from engine.scheduler import Scheduler, SchedulerLimits
from engine.text.detokenizer import TextStream
from engine.text.tokenizer import Tokenizer
from engine.tiers.client import TierClient
from engine.tiers.codec import StateCodec
from engine.tiers.link import TierLink
from engine.tracing import emit_request_spans

log = logging.getLogger("ignis.engine")
events = logging.getLogger("ignis.request")  # ignis.request.done, one JSON line per finished request

Sink = Callable[[RequestUpdate], None]


class QueueFull(Exception):
    """The engine's queue bound is reached: try again later (RESOURCE_EXHAUSTED)."""


class EngineStopped(Exception):
    """The engine is shutting down (UNAVAILABLE)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    page_size: int = 16
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    step_token_budget: int = 2048
    max_queue: int = 256
    max_model_len: int = 0  # 0: from the model config (and the cache's capacity)
    reuse_prompt: bool = True  # reuse.prompt
    retained_device: int = 8  # reuse.retained_device: retained-state slots reserved at load (hybrid models)
    retained_interactive_ttl: float = 300.0  # reuse.retained_interactive_ttl
    tierstore_address: str = ""  # tierstore.address; empty = device-only reuse
    tier_restore_floor: int = -1  # a lower-tier match must beat the device match by more tokens; -1: two pages
    tier_timeout: float = 2.0  # deadline of each tierstore call (seconds)
    tier_retry_seconds: float = 5.0  # after the store fails, device-only this long before trying again

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.kv_cache_bytes <= 0 or self.max_queue <= 0:
            raise ValueError(f"invalid engine config {self}")


@dataclass
class _Live:
    request: EngineRequest
    sink: Sink
    seqs: list[Sequence]
    finished: int = 0
    prompt_logprobs_sent: bool = False
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


class EngineCore:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.loaded = loaded
        self.tokenizer = tokenizer
        self.config = config
        model_cfg = loaded.config
        dtype = loaded.model.dtype
        page_bytes = kv_bytes_per_page(model_cfg, config.page_size, dtype)
        num_pages = max(1, config.kv_cache_bytes // page_bytes) if page_bytes else 1
        live_slots = config.max_num_seqs + 1 if model_cfg.is_hybrid else 0
        retained_slots = config.retained_device if model_cfg.is_hybrid and config.reuse_prompt else 0
        num_slots = live_slots + retained_slots
        self.cache = DeviceCache(model_cfg, CacheGeometry(config.page_size, num_pages, num_slots, dtype),
                                 loaded.model.device)
        self.pages = PagePool(num_pages)
        self.slots = SlotPool(live_slots) if model_cfg.is_hybrid else None
        self.reuse: PromptReuse
        if not config.reuse_prompt:
            self.reuse = NoReuse()
        elif model_cfg.is_hybrid:
            self.reuse = RetainedStateReuse(self.cache, self.pages, live_slots, retained_slots,
                                            config.retained_interactive_ttl, tiers=self._tier_link(),
                                            restore_floor=self._restore_floor())
        else:
            self.reuse = PageReuse(self.pages, config.page_size, tiers=self._tier_link(),
                                   restore_floor=self._restore_floor())
        self.scheduler = Scheduler(
            SchedulerLimits(config.page_size, config.max_num_seqs, config.step_token_budget),
            self.pages, self.slots, reuse=self.reuse,
        )
        self._fingerprint = model_fingerprint(model_cfg.fingerprint_fields(), loaded.weights_digest)
        self._seeds: dict[str, BlockHash] = {}
        self.runner = ModelRunner(loaded.model, self.cache)
        capacity = num_pages * config.page_size
        limit = config.max_model_len or model_cfg.max_position_embeddings
        self.max_model_len = min(limit, model_cfg.max_position_embeddings, capacity)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model_cfg.eos_token_ids)
        log.info(
            "cache: %d pages x %d tokens (%.1f MiB), %d state slots (%.1f MiB); max_model_len %d",
            num_pages, config.page_size, num_pages * page_bytes / 2**20, num_slots,
            num_slots * state_bytes_per_slot(model_cfg, dtype) / 2**20, self.max_model_len,
        )
        self._live: dict[str, _Live] = {}
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_seq = 0
        self.counters = {"finished": 0, "cancelled": 0, "preempted": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self.metrics = EngineMetrics(self.stats, lambda: getattr(self.reuse, "tiers", None))

    def _restore_floor(self) -> int:
        floor = self.config.tier_restore_floor
        return 2 * self.config.page_size if floor < 0 else floor

    def _tier_link(self) -> TierLink | None:
        """The tierstore below the device, if one is configured."""
        if not self.config.tierstore_address:
            return None
        codec = StateCodec(self.cache, self.loaded.config.vocab_size)
        client = TierClient(
            self.config.tierstore_address, model=self.loaded.config.model_type, page_size=self.config.page_size,
            layout=codec.layout(), kv_bytes_per_token=codec.kv_bytes_per_token,
            fixed_state_bytes=codec.fixed_state_bytes, timeout=self.config.tier_timeout,
            retry_seconds=self.config.tier_retry_seconds, pin=self.cache.kv.device.type == "cuda")
        log.info("retained states spill to the tierstore at %s (restore floor %d tokens)",
                 self.config.tierstore_address, self._restore_floor())
        return TierLink(client, codec)

    # --- public, any thread -------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ignis-engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        tiers = getattr(self.reuse, "tiers", None)
        if isinstance(tiers, TierLink) and (self._thread is None or not self._thread.is_alive()):
            tiers.client.close()

    def validate(self, request: EngineRequest) -> None:
        """Raise ValueError (a caller mistake) before anything is queued."""
        n = len(request.prompt_ids)
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in request.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but this model's context is {self.max_model_len} tokens"
            )
        if n + request.params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens and max_tokens is {request.params.max_tokens}, more than "
                f"this model's context of {self.max_model_len} tokens"
            )

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self.validate(request)
        with self._lock:
            if request.request_id in self._live or len(self._live) >= self.config.max_queue:
                if request.request_id in self._live:
                    raise ValueError(f"request id {request.request_id!r} is already in flight")
                raise QueueFull(f"the engine queue is full ({self.config.max_queue} requests)")
            self._live[request.request_id] = _Live(request, sink, [])
            self._inbox.append(("add", request))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def namespace_seed(self, cache_salt: str) -> BlockHash:
        seed = self._seeds.get(cache_salt)
        if seed is None:
            dtype = str(self.loaded.model.dtype).removeprefix("torch.")
            seed = Namespace(self._fingerprint, "", dtype, self.config.page_size, cache_salt).seed()
            if len(self._seeds) < 4096:  # salts are per tenant; bound the memo anyway
                self._seeds[cache_salt] = seed
        return seed

    def _page_use(self) -> tuple[int, int]:
        """(pages held by live sequences, pages held only for reuse). Read from another
        thread while the engine steps: a concurrent change makes us read again."""
        for _ in range(100):
            try:
                live = {p for seq in list(self.scheduler.running) for p in list(seq.page_table)}
                retained_only = self.reuse.held_pages() - live
                return len(live), len(retained_only) + self.pages.num_cached
            except RuntimeError:  # a dict changed size during iteration
                continue
        return self.pages.num_used, self.pages.num_cached

    def stats(self) -> EngineStats:
        running = list(self.scheduler.running)
        live_pages, cached_pages = self._page_use()
        retained_total, retained_used = self.reuse.retained_slots
        rc = self.reuse.counters
        return EngineStats(
            waiting_interactive=len(self.scheduler.waiting[RequestClass.INTERACTIVE]),
            waiting_agent=len(self.scheduler.waiting[RequestClass.AGENT]),
            running_interactive=sum(1 for s in running if s.request.request_class is RequestClass.INTERACTIVE),
            running_agent=sum(1 for s in running if s.request.request_class is RequestClass.AGENT),
            total_pages=self.pages.num_pages,
            used_pages=live_pages,
            cached_pages=cached_pages,
            page_size=self.config.page_size,
            total_slots=self.slots.num_slots if self.slots else 0,
            used_slots=self.slots.num_used if self.slots else 0,
            requests_finished=self.counters["finished"],
            requests_cancelled=self.counters["cancelled"],
            requests_preempted=self.counters["preempted"],
            prompt_tokens=self.counters["prompt_tokens"],
            generated_tokens=self.counters["generated_tokens"],
            retained_slots_total=retained_total,
            retained_slots_used=retained_used,
            retained_hits=rc.hits,
            retained_misses=rc.misses,
            reused_tokens_device=rc.reused_tokens["device"],
            reused_tokens_ram=rc.reused_tokens["ram"],
            reused_tokens_disk=rc.reused_tokens["disk"],
            prefix_reused_tokens=rc.prefix_reused_tokens,
            retained_slot_skips=rc.slot_skips,
            inflight_holds=rc.inflight_holds,
        )

    @property
    def num_live(self) -> int:
        return len(self._live)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # --- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # a bug: fail what is in flight, keep serving
                log.exception("engine step failed; failing in-flight requests")
                for rid in list(self._live):
                    self._fail(rid, "internal error in the engine step (see the engine log)")
        for rid in list(self._live):
            self._fail(rid, "the engine shut down")

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                assert isinstance(item, EngineRequest)
                self._add(item)
            elif kind == "abort":
                assert isinstance(item, str)
                self._cancel(item)

    def _new_seq(self, request: EngineRequest, choice: int, sampler: RequestSampler) -> Sequence:
        self._next_seq += 1
        stream = TextStream(self.tokenizer, request.params.stop, request.params.skip_special_tokens)
        return Sequence(self._next_seq, request, choice, sampler, stream)

    def _add(self, request: EngineRequest) -> None:
        live = self._live.get(request.request_id)
        if live is None:  # aborted before it reached the engine thread
            return
        base = RequestSampler(request.params, request.prompt_ids, self.loaded.model.device)
        first = self._new_seq(request, 0, base)
        first.unforked = [self._new_seq(request, i, base.fork(i)) for i in range(1, request.params.n)]
        if not isinstance(self.reuse, NoReuse):
            seed = self.namespace_seed(request.cache_salt)
            hashes = page_hashes(seed, request.prompt_ids, self.config.page_size)  # once per request
            for seq in (first, *first.unforked):
                seq.seed, seq.page_hashes = seed, list(hashes)
        live.seqs = [first, *first.unforked]
        self.counters["prompt_tokens"] += len(request.prompt_ids)
        self.scheduler.add(first)

    def _abort_all(self, request_id: str) -> _Live | None:
        """Stop every unfinished choice of a request and free what it holds."""
        live = self._live.pop(request_id, None)
        if live is not None:
            for seq in live.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    seq.finish(FinishReason.ABORT)
                    self.scheduler.remove(seq)
        return live

    def _cancel(self, request_id: str) -> None:
        live = self._abort_all(request_id)
        if live is not None:
            self.counters["cancelled"] += 1
            usage = self._usage(live)
            self._request_done(live, usage, FinishReason.ABORT.value)
            live.sink(RequestUpdate(request_id, usage=usage))

    def _fail(self, request_id: str, message: str) -> None:
        live = self._abort_all(request_id)
        if live is not None:
            self._request_done(live, self._usage(live), "error")
            live.sink(RequestUpdate(request_id, error=message))

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.counters["preempted"] += len(plan.preempted)
        if plan.empty:
            return
        results = self.runner.run(plan.chunks)
        to_sample: list[tuple[Sequence, torch.Tensor]] = []
        deltas: dict[str, list[ChoiceDelta]] = {}
        for res in results:
            seq = res.seq
            if res.prompt_logits is not None:
                self._collect_prompt_logprobs(res)
            if res.num_tokens:
                seq.mark_computed(res.num_tokens)
                self.reuse.after_compute(seq, res.next_token_logits)
            seq.pending_logits = None
            if res.next_token_logits is None:
                continue
            if seq.num_output == 0 and seq.request.params.max_tokens == 0:
                self._finish(seq, FinishReason.LENGTH, None, deltas, ())
                continue
            to_sample.append((seq, res.next_token_logits))
            for child in self._fork_children(seq):
                to_sample.append((child, res.next_token_logits))
        if to_sample:
            self._sample_and_append(to_sample, deltas)
        self._emit(deltas)

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        """Choices 1..n-1 copy the parent's state once its prompt is computed; the ones
        that do not fit now wait and prefill the prompt themselves."""
        children, parent.unforked = parent.unforked, []
        forked = []
        for child in children:
            full = parent.num_computed // self.config.page_size
            partial = parent.num_computed % self.config.page_size != 0
            slot = self.slots.allocate() if self.slots is not None else None
            new_page = self.pages.allocate(1) if partial else []
            if (self.slots is not None and slot is None) or new_page is None or \
                    len(self.scheduler.running) >= self.config.max_num_seqs:
                if slot is not None and self.slots is not None:
                    self.slots.release(slot)
                if new_page:
                    self.pages.release(new_page)
                self.scheduler.add(child)
                continue
            shared = parent.page_table[:full]
            self.pages.share(shared)
            child.page_table = shared + list(new_page)
            child.slot = slot
            self.runner.fork_state(parent, child, new_page[0] if new_page else None)
            child.num_computed = parent.num_computed
            child.num_cached, child.reuse, child.lineage = parent.num_cached, parent.reuse, parent.lineage
            child.status = SeqStatus.RUNNING
            self.scheduler.running.append(child)
            forked.append(child)
        return forked

    def _collect_prompt_logprobs(self, res: ChunkLogits) -> None:
        seq = res.seq
        live = self._live.get(seq.request.request_id)
        if live is None or seq.choice != 0 or res.prompt_logits is None:
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

    def _sample_and_append(self, items: list[tuple[Sequence, torch.Tensor]],
                           deltas: dict[str, list[ChoiceDelta]]) -> None:
        logits = torch.stack([row for _, row in items])  # [B, V]
        seqs = [seq for seq, _ in items]
        out = sample(logits, [s.sampler for s in seqs], self.eos_ids, [s.num_output for s in seqs])
        for i, seq in enumerate(seqs):
            token = out.token_ids[i]
            seq.append_token(token)
            self.counters["generated_tokens"] += 1
            lp: tuple[TokenLogprob, ...] = ()
            chosen = out.logprobs[i]
            if seq.request.params.logprobs and chosen is not None:
                lp = (TokenLogprob(token, chosen, tuple(out.top_logprobs[i])),)
            params = seq.request.params
            if token in self.eos_ids and not params.ignore_eos:
                self._finish(seq, FinishReason.STOP, None, deltas, (token,), lp)
                continue
            if token in params.stop_token_ids:
                self._finish(seq, FinishReason.STOP, token, deltas, (token,), lp)
                continue
            text, matched = seq.stream.push([token])
            if matched is not None:
                self._finish(seq, FinishReason.STOP, matched, deltas, (token,), lp, text)
                continue
            if seq.num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                self._finish(seq, FinishReason.LENGTH, None, deltas, (token,), lp, text)
                continue
            deltas.setdefault(seq.request.request_id, []).append(ChoiceDelta(seq.choice, (token,), text, lp))
        self.metrics.on_tokens(seqs)

    def _finish(self, seq: Sequence, reason: FinishReason, stop: str | int | None,
                deltas: dict[str, list[ChoiceDelta]], tokens: tuple[int, ...],
                lp: tuple[TokenLogprob, ...] = (), text: str = "") -> None:
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

    def _usage(self, live: _Live) -> Usage:
        first = min((s.first_token_time for s in live.seqs if s.first_token_time), default=None)
        ttft = (first - live.request.arrival) * 1000 if first else 0.0
        head = live.seqs[0] if live.seqs else None
        return Usage(
            prompt_tokens=len(live.request.prompt_ids),
            completion_tokens=sum(s.num_output for s in live.seqs),
            cached_tokens=head.num_cached if head else 0,
            time_to_first_token_ms=ttft,
            reuse=head.reuse if head else ReuseReport(),
        )

    def _emit(self, deltas: dict[str, list[ChoiceDelta]]) -> None:
        for rid, items in deltas.items():
            live = self._live.get(rid)
            if live is None:
                continue
            prompt_lp = None
            if live.request.echo and not live.prompt_logprobs_sent:
                live.prompt_logprobs_sent = True
                prompt_lp = tuple(live.prompt_logprobs) if live.prompt_logprobs else None
            done = all(s.status is SeqStatus.FINISHED for s in live.seqs)
            usage = None
            if done:
                self._live.pop(rid, None)
                self.counters["finished"] += 1
                usage = self._usage(live)
                reason = live.seqs[0].finish_reason if live.seqs else None
                self._request_done(live, usage, reason.value if reason else "stop")
            live.sink(RequestUpdate(rid, tuple(items), prompt_lp, usage))

    def _request_done(self, live: _Live, usage: Usage, finish_reason: str) -> None:
        """The request is over: its ignis.request.done line, metrics and trace spans (before its owner is told)."""
        emit_request_spans(live.request, live.seqs, finish_reason)
        done = FinishedRequest(
            request_id=live.request.request_id, request_class=class_name(live.request.request_class),
            prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens, tier=usage.reuse.tier,
            kind=usage.reuse.kind, ttft_ms=usage.time_to_first_token_ms, tokens_out=usage.completion_tokens,
            finish_reason=finish_reason, duration_ms=(time.monotonic() - live.request.arrival) * 1000)
        log_event(events, "ignis.request.done", **done.event_fields())
        self.metrics.on_done(done, (s.seq_id for s in live.seqs))
