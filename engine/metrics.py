"""Prometheus metrics of the engine, on a registry of its own (served on ``--metrics-port``).

Two sources, one bookkeeping each:
- totals and gauges (reuse hits and reused tokens, tokens, queues, page pool, slots,
  the tierstore link) are read from the engine's own counters at scrape time
  (`EngineCollector`, through `EngineCore.stats`), never counted twice;
- latencies are observed on the engine thread as they happen (`EngineMetrics`):
  time to first token and inter-token latency as tokens are sampled, and per
  finished request its duration, finish reason and cached tokens.

Every name is listed in docs/metrics.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import is_
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import labelled_gauge
from engine.outputs import EngineStats
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.request import EngineSequence, FinishReason
from engine.tiers.link import TierLink

if TYPE_CHECKING:
    from engine.vision.encoder import EncoderCounts

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request: the fields of the ``ignis.request.done`` event."""

    request_id: str
    request_class: RequestClass
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose state was reused (== the reused token count)
    tier: ReuseTier
    kind: ReuseKind
    ttft_ms: float  # 0 when no token was produced
    tokens_out: int  # generated tokens, all choices
    finish_reason: FinishReason  # the first choice's (ERROR: the request failed)
    duration_ms: float  # arrival to the last update
    moves: int = 0  # times its sequences were moved down a tier to make room and resumed, all choices
    adapter: str = ""  # the LoRA adapter it ran with (its name); "": the base model
    images: int = 0  # images in its prompt
    images_reused: int = 0  # of those, the ones the vision tower did not run for

    def event_fields(self) -> dict[str, Any]:
        fields = {"request_id": self.request_id, "class": self.request_class.label, "prompt_tokens": self.prompt_tokens,
                  "cached_tokens": self.cached_tokens, "tier": self.tier.value, "kind": self.kind.value,
                  "ttft_ms": round(self.ttft_ms, 3), "tokens_out": self.tokens_out,
                  "finish_reason": self.finish_reason.value, "duration_ms": round(self.duration_ms, 3),
                  "moves": self.moves}
        if self.adapter:
            fields["adapter"] = self.adapter
        if self.images:
            fields["images"] = self.images
            fields["images_reused"] = self.images_reused
        return fields


@dataclass(slots=True, eq=False)  # compared and hashed by identity: a sequence points to its last one
class _Round:
    """The sequences of a sampling round, when they got their tokens, and how many of each class. Its time
    moves on only while the same sequences take a token each round (EngineMetrics.on_tokens)."""

    seqs: Sequence[EngineSequence]
    time: float
    classes: list[tuple[RequestClass, int]]


class EngineMetrics:
    """The engine's registry: observed latencies plus an `EngineCollector` over its counters."""

    def __init__(self, stats: Callable[[], EngineStats], tiers: Callable[[], TierLink | None],
                 encoder: EncoderCounts | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        ttft = Histogram("ignis_time_to_first_token_seconds", "Arrival at the engine to the first generated token",
                         ["class"], buckets=_TTFT_BUCKETS, registry=r)
        itl = Histogram("ignis_inter_token_latency_seconds", "Time between two tokens of one choice",
                        ["class"], buckets=_ITL_BUCKETS, registry=r)
        duration = Histogram("ignis_request_duration_seconds", "Arrival at the engine to the request's end",
                             ["class"], buckets=_DURATION_BUCKETS, registry=r)
        self._requests = Counter("ignis_requests", "Finished requests (abort: cancelled; error: failed)",
                                 ["class", "finish_reason"], registry=r)
        self._cached = Counter("ignis_cached_tokens", "Prompt tokens of finished requests served from reused state",
                               registry=r)
        # Label children bound once: the per-token path is a dict lookup and an observe.
        self._ttft = {c: ttft.labels(c.label) for c in RequestClass}
        self._itl = {c: itl.labels(c.label) for c in RequestClass}
        self._duration = {c: duration.labels(c.label) for c in RequestClass}
        self._drafted = Counter("ignis_spec_draft_tokens", "Drafted tokens verified (speculative decoding)",
                                ["method"], registry=r)
        self._accepted = Counter("ignis_spec_accepted_tokens", "Drafted tokens the target kept", ["method"],
                                 registry=r)
        self._accept_length = Histogram("ignis_spec_acceptance_length", "Tokens one verify step yields (the "
                                        "drafts kept, plus the target's own)", ["method"],
                                        buckets=tuple(range(1, 17)), registry=r)
        self._spec: dict[str, tuple[Any, Any, Any]] = {}  # the three above's children, by method
        self._window_gaps = Counter("ignis_spec_window_gaps", "Sequences whose MTP drafter window lacked a position "
                                    "its state did not carry (the drafter catches up from the first it computes)",
                                    registry=r)
        r.register(EngineCollector(stats, tiers, encoder))
        self._round: _Round | None = None  # engine thread only
        self._finished: dict[tuple[RequestClass, FinishReason], Any] = {}  # ignis_requests children by (class, reason)

    def on_verified(self, method: str, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens kept `accepted` of them (engine thread)."""
        children = self._spec.get(method)
        if children is None:  # bound once per method: a verify is a dict lookup, not three label lookups
            children = self._spec[method] = (self._drafted.labels(method), self._accepted.labels(method),
                                             self._accept_length.labels(method))
        children[0].inc(drafted)
        children[1].inc(accepted)
        children[2].observe(accepted + 1)

    def on_window_gaps(self, count: int) -> None:
        """`count` more sequences started drafting with a gap in their MTP window (engine thread)."""
        self._window_gaps.inc(count)

    def on_tokens(self, seqs: Sequence[EngineSequence]) -> None:
        """After a sampling round (engine thread): each sequence got one token just now."""
        now = time.monotonic()
        last = self._round
        if last is not None and (seqs is last.seqs or (len(seqs) == len(last.seqs) and all(map(is_, seqs, last.seqs)))):
            # The last round's sequences again (a decode step's steady state): each one's previous token is
            # that round's, so they share its gap, once per class, and the round moves on with them.
            for cls, times in last.classes:
                observe_times(self._itl[cls], now - last.time, times)
            last.time = now
            return
        # Each sequence points to the round of its previous token (whose time is that token's: a round
        # moves on only with all of its sequences), so the sequences of one earlier round share one gap:
        # observed once, counted n. One pass, one write a sequence.
        here = _Round(seqs, now, [])
        gaps: dict[tuple[RequestClass, _Round | None], int] = {}
        firsts: list[EngineSequence] = []
        for seq in seqs:
            before = seq.token_round
            key = (seq.request.request_class, before)
            gaps[key] = gaps.get(key, 0) + 1
            if before is None:
                firsts.append(seq)
            seq.token_round = here
        classes: dict[RequestClass, int] = {}
        for (cls, before), times in gaps.items():
            classes[cls] = classes.get(cls, 0) + times
            if before is not None:
                observe_times(self._itl[cls], now - before.time, times)
        for seq in firsts:  # their first tokens: the request's first is its time to first token
            if seq.choice == 0 and seq.first_token_time is not None:
                self._ttft[seq.request.request_class].observe(seq.first_token_time - seq.request.arrival)
        here.classes = list(classes.items())
        self._round = here  # callers never change seqs after

    def on_done(self, done: FinishedRequest) -> None:
        """Once per request, when it is over (engine thread)."""
        key = (done.request_class, done.finish_reason)
        finished = self._finished.get(key)
        if finished is None:  # a label child bound once: labels() takes a lock and builds a tuple each call
            finished = self._finished[key] = self._requests.labels(done.request_class.label, done.finish_reason.value)
        finished.inc()
        self._cached.inc(done.cached_tokens)
        self._duration[done.request_class].observe(done.duration_ms / 1000)


def observe_times(histogram: Any, amount: float, times: int) -> None:
    """`times` observations of `amount` at the cost of one: prometheus_client's own `observe`, with a count
    (it has none; its sum and bucket counters are the child's `_sum` and `_buckets`, checked in
    tests/test_engine_metrics.py against `times` calls of `observe`)."""
    if times == 1:
        histogram.observe(amount)
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(amount * times)
    for i, bound in enumerate(histogram._upper_bounds):
        if amount <= bound:
            histogram._buckets[i].inc(times)
            break


class EngineCollector(Collector):
    """Gauges and totals read from EngineStats and the tier link at scrape time (HTTP thread)."""

    def __init__(self, stats: Callable[[], EngineStats], tiers: Callable[[], TierLink | None],
                 encoder: EncoderCounts | None = None) -> None:
        self._stats = stats
        self._tiers = tiers
        self._encoder = encoder  # the vision tower's counts (a model that takes images)

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, doc, value in (
            ("ignis_retained_state_hits", "Admissions that started from reused state (any tier)", s.retained_hits),
            ("ignis_retained_state_misses", "Admissions that found no reusable state", s.retained_misses),
            ("ignis_prefix_reused_tokens", "Reused tokens that came from a retained prefix", s.prefix_reused_tokens),
            ("ignis_retained_slot_skips", "Captures skipped for want of a free retained-state slot",
             s.retained_slot_skips),
            ("ignis_retained_protected_skips", "Captures skipped because the state they would displace is protected",
             s.retained_protected_skips),
            ("ignis_retained_staging_skips", "Host captures skipped because both staging buffers were busy",
             s.retained_staging_skips),
            ("ignis_tier_spills_ahead", "States written to KV-RAM off the step, before the device gave them up",
             s.spills_ahead),
            ("ignis_tier_spills_on_step", "States written to KV-RAM on the step, as the device gave them up",
             s.spills_on_step),
            ("ignis_retained_promotions", "Host retained states moved up to a free device slot when claimed",
             s.retained_promotions),
            ("ignis_copy_waits", "Steps that waited for a copy off the step to finish before reusing its memory",
             s.copy_waits),
            ("ignis_reuse_inflight_holds", "Admissions held while a running request computed the state they reuse",
             s.inflight_holds),
            ("ignis_prompt_tokens", "Prompt tokens of admitted requests", s.prompt_tokens),
            ("ignis_generated_tokens", "Tokens generated (all choices)", s.generated_tokens),
            ("ignis_preemptions", "Sequences preempted to make room (recomputed later)", s.requests_preempted),
            ("ignis_sequences_recomputed", "Live sequences that lost their state (no tier could hold it) and "
             "prefilled it again", s.sequences_recomputed),
            ("ignis_sequence_thrash", "Live sequences moved down again with no token computed since they "
             "resumed (each one is a scheduling bug)", s.sequence_thrash),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        moved = CounterMetricFamily("ignis_sequences_moved", "Live sequences moved down a tier to make room, "
                                    "resumed from there", labels=["to"])
        for tier, count in s.sequences_moved.items():
            moved.add_metric([tier.value], count)
        yield moved
        yield GaugeMetricFamily("ignis_sequences_moving", "Live sequences being moved down a tier now", value=s.moving)
        yield GaugeMetricFamily("ignis_prefill_allowance_tokens", "Prompt tokens the next step may run "
                                "(engine.step_time_target_ms paces them)", value=s.prefill_allowance_tokens)
        yield GaugeMetricFamily("ignis_step_time_target_seconds", "The step time the prefill allowance aims at "
                                "now (0: off, or nothing measured yet)", value=s.step_time_target_seconds)
        yield CounterMetricFamily("ignis_paced_steps", "Steps whose prompt tokens the step time target cut",
                                  value=s.paced_steps)
        reused = CounterMetricFamily("ignis_retained_reused_tokens", "Prompt tokens whose state was reused, by tier",
                                     labels=["tier"])
        for tier, tokens in s.reused_tokens.items():
            reused.add_metric([tier.value], tokens)
        yield reused
        for name, doc, interactive, agent in (
            ("ignis_requests_waiting", "Sequences waiting for admission", s.waiting_interactive, s.waiting_agent),
            ("ignis_requests_running", "Sequences admitted and computing", s.running_interactive, s.running_agent),
        ):
            yield labelled_gauge(name, doc, "class", {"interactive": interactive, "agent": agent})
        yield labelled_gauge("ignis_kv_pages", "Device KV page pool: total, used by live sequences, "
                             "held only for reuse (cached)", "kind",
                             {"total": s.total_pages, "used": s.used_pages, "cached": s.cached_pages})
        yield GaugeMetricFamily("ignis_kv_page_size_tokens", "Tokens per KV page", value=s.page_size)
        for name, doc, total, used in (
            ("ignis_state_slots", "Recurrent-state slots of live sequences (hybrid models)", s.total_slots,
             s.used_slots),
            ("ignis_retained_slots", "Retained-state slots reserved at load (reuse.retained_device)",
             s.retained_slots_total, s.retained_slots_used),
            ("ignis_retained_host_slots", "Retained-state slots in the host block (reuse.retained_host)",
             s.retained_host_slots_total, s.retained_host_slots_used),
        ):
            yield labelled_gauge(name, doc, "kind", {"total": total, "used": used})
        encoder = self._encoder
        if encoder is not None:
            yield CounterMetricFamily("ignis_encoder_cache_hits", "Images whose vision tower output came from the "
                                      "encoder cache", value=encoder.hits)
            yield CounterMetricFamily("ignis_encoder_cache_misses", "Images the vision tower ran for",
                                      value=encoder.misses)
        link = self._tiers()
        if link is not None:
            yield from _tier_metrics(link)


def _tier_metrics(link: TierLink) -> Iterator[Metric]:
    """The engine's side of the tierstore (only when one is configured)."""
    yield GaugeMetricFamily("ignis_tierstore_up", "1 when the engine's last call reached the tierstore, "
                            "0 from a failure until a call succeeds again", value=int(link.client.up))
    yield GaugeMetricFamily("ignis_tierstore_usable", "1 when the lower tiers can take and serve state now: the "
                            "store answers, the namespace is registered (not refused) and its arena is mapped whole",
                            value=int(link.client.usable))
    for name, doc, value in (
        ("ignis_tier_spills", "States the engine wrote to KV-RAM as they left the device", link.spills),
        ("ignis_tier_spill_failures", "Spills that failed (no room, store down): the state was lost",
         link.spill_failures),
        ("ignis_tier_restores", "States restored from KV-RAM or KV-disk into the device", link.restores),
        ("ignis_tier_restore_failures", "Restores that failed (gone, corrupt, store down): served cold",
         link.restore_failures),
        ("ignis_tier_restores_rejected", "Restores refused because the bytes or metadata are not what this engine "
         "wrote (its integrity tag did not verify): served cold", link.rejected),
        ("ignis_tier_table_claims", "Restores from KV-RAM found in the tierstore's published table: no Match, "
         "no lease", link.table_claims),
        ("ignis_tier_table_races", "Such restores whose state left KV-RAM during the copy (its table slot "
         "changed): served cold, never the bytes copied", link.table_races),
        ("ignis_tierstore_outages", "Times the tierstore went from usable to unavailable",
         link.client.unavailable_events),
        ("ignis_tierstore_errors", "Tierstore calls answered with nothing (down, slow, refused)",
         link.client.errors),
    ):
        yield CounterMetricFamily(name, doc, value=value)
