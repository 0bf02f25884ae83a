"""The engine core: runs steps on a dedicated thread so the asyncio side (gRPC,
health) stays responsive.

Requests come in through `submit` (any thread), updates go out through each
request's sink, called on the engine thread: the sink must only hand off
(e.g. loop.call_soon_threadsafe). Who owns what: the scheduler owns live
sequences' memory (pages, slots, running, forks), the reuse strategy owns
retained state, the output processor turns sampled tokens into updates; the
builder wired them together.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
import xxhash

from engine.builder import build_parts, build_vision
from engine.config import EngineConfig
from engine.engine_stats import gather_stats
from engine.inbox import AbortRequest, AddRequest, ChangeAdapters, Inbox, TakeSnapshot
from engine.kv.chain_hash import MEDIA_KEY_BASE, StateHash, Namespace, model_fingerprint, page_hashes
from engine.kv.device_cache import namespace_dtype
from engine.lora.adapter import LoraAdapter
from engine.lora.registry import AdapterRegistry, ServedAdapter
from engine.lora.sites import LoraSites
from engine.metrics import EngineMetrics
from engine.model.loader import LoadedModel
from engine.output_processor import Deltas, LiveRequest, OutputProcessor, RequestTotals, Sink
from engine.outputs import EngineStats, RequestUpdate
from engine.request import EngineRequest, EngineSequence, FinishReason, SeqStatus, context_length_message
from engine.runner import ChunkLogits, ModelRunner
from engine.sampling.defaults import SamplingDefaults
from engine.sampling.sampler import RequestSampler
from engine.scheduler import Scheduler, SchedulerLimits, StepPlan
from engine.speculative.mtp_drafter import MtpDrafter
from engine.speculative.speculator import Speculator
from engine.verify_step import VerifyStep
from engine.state_listing import EngineSnapshot, take_snapshot
from engine.step_pacing import StepPacing
from engine.step_sampling import StepSampling
from engine.text.detokenizer import TextStream
from engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.vision.media import VisionInput

log = logging.getLogger("ignis.engine")

_MAX_NAMESPACES = 4096  # memoised cache_salt namespaces (keyed by the salt's digest: bounded in bytes too)


class QueueFull(Exception):
    """The engine's queue bound is reached: try again later (RESOURCE_EXHAUSTED)."""


class EngineStopped(Exception):
    """The engine is shutting down (UNAVAILABLE)."""


class EngineCore:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.loaded = loaded
        self.tokenizer = tokenizer
        self.config = config
        parts = build_parts(loaded, config)
        self.cache, self.pages, self.slots, self.reuse = parts.cache, parts.pages, parts.slots, parts.reuse
        self.residency = parts.residency  # every move of state: copies off the step, tiers, live moves
        self.tiers = self.residency.tiers
        self.max_model_len = parts.max_model_len
        self.runner = ModelRunner(loaded.model, self.cache)
        vision = build_vision(loaded, config)
        self.vision: VisionInput | None = None  # None: the model takes no images
        if vision is not None:
            # images past the context are refused before their pixels are made
            self.vision = dataclasses.replace(vision[0], max_image_tokens=self.max_model_len)
            self.runner.encoder = vision[1]
        self.adapters: AdapterRegistry | None = None  # LoRA adapters (lora.enabled): their slots in every linear
        if config.lora_enabled:
            sites = LoraSites.install(loaded.model, config.lora_max_adapters, config.lora_max_rank, config.lora_dtype)
            self.adapters = AdapterRegistry(sites)
            self.runner.lora = sites
        self.sampling_defaults = SamplingDefaults.from_checkpoint(loaded.path)  # generation_config.json
        self.moves = self.residency.moves
        self.pacing = StepPacing(config.step_time_target_ms, config.prefill_chunk_tokens)
        batch_limit = config.speculative_disable_batch_size
        if batch_limit < 0:  # auto: measured (docs/architecture.md "Speculative decoding")
            batch_limit = 1 if loaded.config.state_shape().has_recurrent_state else 0
        self.speculator = Speculator(config.speculative_method, config.speculative_num_tokens, self.max_model_len,
                                     batch_limit, measured=config.speculative_measured)
        self.scheduler = Scheduler(
            SchedulerLimits(config.page_size, config.max_num_seqs, config.prefill_chunk_tokens),
            self.pages, self.slots, reuse=self.reuse, fork_copy=self.runner.fork_state,
            residency=self.residency, pacing=self.pacing, speculator=self.speculator,
        )
        self._fingerprint = model_fingerprint(loaded.config.fingerprint_fields(), loaded.weights_digest)
        self._namespaces: dict[bytes, StateHash] = {}
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(loaded.config.eos_token_ids)
        self.totals = RequestTotals()
        self.metrics = EngineMetrics(self.stats, lambda: self.tiers,
                                     self.runner.encoder.counts if self.runner.encoder is not None else None)
        self.outputs = OutputProcessor(self.scheduler, self.reuse, self.eos_ids, self.max_model_len,
                                       self.metrics, self.totals)
        self._live: dict[str, LiveRequest] = {}
        self._inbox = Inbox()
        self._wake = self._inbox.wake
        self.residency.notify_copies(self._wake.set)  # a copy off the step is through: collect it, even when idle
        self._lock = threading.Lock()
        self._listeners: tuple[Callable[[], None], ...] = ()  # told after each round of updates (step thread)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_seq = 0
        self.sampling = StepSampling(self.eos_ids, self.outputs.append_sampled)
        self.drafter = self._mtp_drafter() if config.speculative_method == "mtp" else None
        self.verify = VerifyStep(self.speculator, self.scheduler, self.reuse, self.outputs, self.metrics, self.eos_ids)

    def _mtp_drafter(self) -> MtpDrafter:
        mtp = self.loaded.mtp
        if mtp is None:
            raise ValueError(f"speculative.method=mtp needs a checkpoint with an MTP layer (mtp.*): "
                             f"{self.loaded.path.name} has none (use ngram)")
        drafter = MtpDrafter(self.loaded.model, mtp, self.cache, self.speculator.next_draft_rooms,
                             self.scheduler.grow_for_draft, self.scheduler.trim_pages, self.metrics.on_window_gaps)
        self.speculator.use(drafter)
        self.runner.keep_hidden = True
        return drafter

    # --- public, any thread -------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ignis-engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.residency.close()

    def validate(self, request: EngineRequest) -> None:
        """Raise ValueError (a caller mistake) before anything is queued."""
        n = len(request.prompt_ids)
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in request.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None and request.media is not None and bad >= MEDIA_KEY_BASE:  # its images' key ids
            bad = next((t for t in request.media.model_ids(request.prompt_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        wanted = request.params.max_tokens or 0  # none: the rest of the context, whatever it is
        if n >= self.max_model_len or n + wanted > self.max_model_len:
            raise ValueError(context_length_message(self.max_model_len, n, wanted))
        request.params.check_vocabulary(vocab)

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        """Validate (ValueError) and queue a request (QueueFull, EngineStopped)."""
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self.validate(request)
        with self._lock:
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            if len(self._live) >= self.config.max_queue:
                raise QueueFull(f"the engine queue is full ({self.config.max_queue} requests)")
            self._live[request.request_id] = LiveRequest(request, sink, [])
            self._inbox.put(AddRequest(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))

    def add_update_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` on the step thread after each round of updates it hands to sinks (a step's,
        or the cancels and failures between steps), so that a sink may queue quietly and its owner
        wake once a round (engine/session.py) instead of once an update. Any thread."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove_update_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners = tuple(fn for fn in self._listeners if fn != listener)  # a bound method: equal, not the same

    def _updates_sent(self) -> None:
        for listener in self._listeners:  # a tuple replaced whole: read without the lock
            listener()

    def namespace_hash(self, cache_salt: str, adapter: bytes = b"") -> StateHash:
        """h0 of the request's chain: the model's namespace, salted by the tenant's cache_salt, and the
        LoRA adapter's digest when it runs with one."""
        key = xxhash.xxh3_128_digest(adapter + cache_salt.encode("utf-8", "surrogatepass"))
        found = self._namespaces.get(key)
        if found is None:
            dtype = namespace_dtype(self.cache.kv.dtype, self.loaded.model.dtype)
            drafter = f"mtp{len(self.drafter.mtp.layers)}" if self.drafter is not None else ""
            found = Namespace(self._fingerprint, dtype, self.config.page_size, cache_salt, drafter, adapter).digest()
            if len(self._namespaces) < _MAX_NAMESPACES:
                self._namespaces[key] = found
        return found

    def change_adapters(self, change: Callable[[AdapterRegistry], ServedAdapter]) -> Future[ServedAdapter]:
        """Run a load or an unload on the step thread, between steps (any thread); ValueError when this
        engine serves no adapters."""
        registry = self.adapters
        if registry is None:
            raise ValueError("this engine serves no LoRA adapters: start it with --lora or lora.enabled=true")
        future: Future[ServedAdapter] = Future()
        if self._thread is None or not self._thread.is_alive():  # a synchronous driver
            future.set_result(change(registry))
            return future
        self._inbox.put(ChangeAdapters(lambda: change(registry), future))
        return future

    def load_adapter(self, name: str, adapter: LoraAdapter) -> Future[ServedAdapter]:
        """Serve `adapter` (read by engine/lora/adapter.py off this thread) as model `name`."""
        if not name:
            raise ValueError("an adapter needs a name")
        return self.change_adapters(lambda registry: registry.add(name, adapter, self._slot_in_use))

    def unload_adapter(self, name: str) -> Future[ServedAdapter]:
        return self.change_adapters(lambda registry: registry.remove(name))

    def _slot_in_use(self, slot: int) -> bool:
        """Whether a live request (queued or running) was admitted with the adapter in `slot` (step thread)."""
        with self._lock:
            return any(live.request.adapter_slot == slot for live in self._live.values())

    def stats(self) -> EngineStats:
        return gather_stats(self.scheduler, self.residency, self.reuse.counters, self.totals)

    def request_snapshot(self) -> Future[EngineSnapshot]:
        """A copy of the stats and the retained-state index for the Monitor (any thread): taken by the
        step thread between two steps, so it never holds a step up for more than the copy."""
        future: Future[EngineSnapshot] = Future()
        if self._thread is None or not self._thread.is_alive():  # a synchronous driver, or stopped
            future.set_result(self.snapshot())
            return future
        self._inbox.put(TakeSnapshot(future))
        return future

    def snapshot(self) -> EngineSnapshot:
        """The copy itself (the thread that steps)."""
        started = time.perf_counter()
        return take_snapshot(self.stats(), self.residency, self.pages, list(self._namespaces.values()),
                             list(self.outputs.recent), started)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # --- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.tiers is not None:  # the first claim's copy then reads pages already mapped in
            try:
                self.tiers.connect(self.namespace_hash(""))
            except Exception:  # a bug: a spill's or a claim's own ensure maps it later; the loop must run
                log.exception("mapping the tierstore's arena at start failed")
        while not self._stopping:
            self.drain_inbox()
            if not self.scheduler.has_work():
                self._updates_sent()  # what the inbox ended (cancels) is on its way before the wait
                if self.residency.copying:
                    self.residency.poll()  # frees what finished copies held; makes their states claimable
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # a bug: fail what is in flight, keep serving
                log.exception("engine step failed; failing in-flight requests")
                for rid in list(self._live):
                    self._fail(rid, "internal error in the engine step (see the engine log)")
            self._updates_sent()
        for rid in list(self._live):
            self._fail(rid, "the engine shut down")
        self._updates_sent()

    def drain_inbox(self) -> None:
        """Take in what submit and abort queued (the step thread does it; synchronous drivers call it before step())."""
        while (message := self._inbox.take()) is not None:
            if isinstance(message, AddRequest):
                self._add(message.request)
            elif isinstance(message, AbortRequest):
                self._cancel(message.request_id)
            elif isinstance(message, ChangeAdapters):
                try:
                    message.future.set_result(message.change())
                except Exception as exc:  # a name taken or unknown, no slot free: the caller's answer
                    message.future.set_exception(exc)
            elif message.future.set_running_or_notify_cancel():  # TakeSnapshot; False: the caller gave up
                try:
                    message.future.set_result(self.snapshot())
                except Exception as exc:  # a bug: the listing fails, the engine goes on
                    log.exception("taking the Monitor's snapshot failed")
                    message.future.set_exception(exc)

    def _new_seq(self, request: EngineRequest, choice: int, sampler: RequestSampler) -> EngineSequence:
        self._next_seq += 1
        stream = TextStream(self.tokenizer, request.params.stop, request.params.skip_special_tokens)
        return EngineSequence(self._next_seq, request, choice, sampler, stream)

    def _add(self, request: EngineRequest) -> None:
        live = self._live.get(request.request_id)
        if live is None:  # aborted before it reached the engine thread
            return
        adapter = request.adapter
        if adapter is not None and (self.adapters is None or not self.adapters.current(adapter)):
            self._fail(request.request_id, f"the adapter {adapter.name!r} was unloaded before the request started")
            return
        guide = request.guided.new_guide() if request.guided is not None else None
        prompt = request.prompt_ids if request.media is None else request.media.model_ids(request.prompt_ids)
        base = RequestSampler(request.params, prompt, self.loaded.model.device, guide=guide)
        first = self._new_seq(request, 0, base)
        first.hold_forks([self._new_seq(request, i, base.fork(i)) for i in range(1, request.params.n)])
        # The namespace names state below the device too (a live sequence moved down); page
        # hashes only serve reuse.
        namespace = self.namespace_hash(request.cache_salt, b"" if adapter is None else adapter.digest)
        reuses = request.lookup and self.config.reuse_prompt
        hashes = page_hashes(namespace, request.prompt_ids, self.config.page_size) if reuses else []
        for seq in (first, *first.unforked):
            seq.name_pages(namespace, list(hashes))
        live.seqs = [first, *first.unforked]
        self.outputs.add(live)
        self.totals.prompt_tokens += len(request.prompt_ids)
        self.scheduler.add(first)

    def _abort_all(self, request_id: str) -> LiveRequest | None:
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
            self.totals.cancelled += 1
            usage = self.outputs.usage(live)
            self.outputs.request_done(live, usage, FinishReason.ABORT)
            live.sink(RequestUpdate(request_id, usage=usage))

    def _fail(self, request_id: str, message: str) -> None:
        live = self._abort_all(request_id)
        if live is not None:
            self.outputs.request_done(live, self.outputs.usage(live), FinishReason.ERROR)
            live.sink(RequestUpdate(request_id, error=message))

    def step(self) -> None:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.totals.preempted += len(plan.preempted)
        if plan.empty:
            return
        if plan.decodes_only:
            seqs = plan.decode_seqs
            self._decoded(seqs, self.runner.run_decodes(seqs, plan.steady))
        else:
            self._run_chunks(plan)
        if self.speculator.on and not plan.prefill_tokens:  # what drafting costs (engine/speculative/)
            drafted = 0 if plan.decodes_only else sum(len(chunk.draft) for chunk in plan.chunks)
            self.speculator.observe_step(drafted, time.perf_counter() - started)
        if plan.prefill_tokens:
            if self.loaded.model.device.type == "cuda":  # a chunk that samples nothing left its work queued
                torch.cuda.synchronize(self.loaded.model.device)
            self.pacing.observe(time.perf_counter() - started, plan.paced)

    def _run_chunks(self, plan: StepPlan) -> None:
        self.verify.forget()
        for chunk in plan.chunks:
            if chunk.spare_slot is not None and chunk.seq.slot is not None:  # a drafting hybrid's rollback copy
                self.cache.copy_slot(chunk.seq.slot, chunk.spare_slot)
        step = self.runner.run(plan.chunks)
        if self.drafter is not None:
            self.drafter.after_forward(self.runner.rows, self.runner.hidden)
        to_sample: list[tuple[EngineSequence, torch.Tensor]] = []
        deltas: Deltas = {}
        failed: dict[str, str] = {}
        if step.decode_logits is not None:  # the decodes beside the prefills take the decode road
            self._decode_road(step.decodes, step.decode_logits, deltas, failed)
        for res in step.chunks:
            seq = res.seq
            if res.draft:
                self.verify.settle(res, deltas, failed)
                continue
            if res.prompt_logits is not None:
                live = self._live.get(seq.request.request_id)
                if live is not None:
                    self.outputs.collect_prompt_logprobs(live, res)
            if res.num_tokens:
                seq.mark_computed(res.num_tokens)
                self.reuse.after_compute(seq, self._next_row(res))
            elif seq.num_cached == seq.num_prompt:  # claimed whole: a state from below is held here again
                self.reuse.after_compute(seq, self._next_row(res))
            seq.take_pending_logits()
            if self.drafter is not None and res.drafter_hidden is not None and res.next_token_logits is not None:
                self.drafter.claimed_whole(seq, res.drafter_hidden)
            if res.next_token_logits is None:
                continue
            if seq.num_output == 0 and seq.request.params.max_tokens == 0:
                self.outputs.finish(seq, FinishReason.LENGTH, None, deltas, ())
                continue
            to_sample.append((seq, res.next_token_logits))
            for child in self.scheduler.fork_children(seq):
                to_sample.append((child, res.next_token_logits))
        self.verify.replay(self.runner.replay_states)  # hybrids that kept part of a draft: their state rolled back
        if to_sample:
            self.sampling.sample([seq for seq, _ in to_sample], torch.stack([row for _, row in to_sample]), deltas, failed)
        self._finish_step(deltas, failed)

    def _next_row(self, res: ChunkLogits) -> torch.Tensor | None:
        """What a state keeps for its next token: the logits, and with an MTP drafter its hidden state too."""
        logits = res.next_token_logits
        if self.drafter is None or logits is None:
            return logits
        hidden = res.drafter_hidden if res.num_tokens == 0 else self.drafter.last_hidden(res.seq)
        assert hidden is not None
        return torch.cat([logits, hidden.float()])

    def _decoded(self, seqs: list[EngineSequence], logits: torch.Tensor) -> None:
        """After a decode-only step: each sequence computed its one pending token; sample them all."""
        deltas: Deltas = {}
        failed: dict[str, str] = {}
        if self.drafter is not None:
            self.drafter.after_forward(self.runner.rows, self.runner.hidden)
        self._decode_road(seqs, logits, deltas, failed)
        self._finish_step(deltas, failed)

    def _decode_road(self, seqs: list[EngineSequence], logits: torch.Tensor, deltas: Deltas,
                     failed: dict[str, str]) -> None:
        """Sequences past their first token that each computed their one pending token (logits [B, V], row i
        seqs[i]'s): sampled in one call, a plain choice's token handed on at once (OutputProcessor.decoded)."""
        for seq in seqs:
            seq.num_computed += 1  # mark_computed(1), whose check the plan already made (one pending each)
        # No logits: each is past its prompt's last token, where the only capture that keeps logits is made.
        self.reuse.after_decodes(seqs)
        self.sampling.sample(seqs, logits, deltas, failed, self.outputs.decoded)

    def _finish_step(self, deltas: Deltas, failed: dict[str, str]) -> None:
        for rid, message in failed.items():
            deltas.pop(rid, None)
            self._fail(rid, message)
        self.outputs.emit(self._live, deltas)
        if self.drafter is not None:  # the tokens are out: then the window and the next step's drafts
            self.drafter.after_step()
