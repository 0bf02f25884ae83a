"""The engine's counters and gauges in one record (`EngineStats`): /metrics, GetStats and the Monitor.

Read from other threads while the step thread runs (a scrape does not wait for a
step), so every collection is copied before it is walked.
"""

from __future__ import annotations

from engine.facts import RequestClass
from engine.output_processor import RequestTotals
from engine.outputs import EngineStats
from engine.residency.counters import ReuseCounters
from engine.residency.layer import Residency
from engine.scheduler import Scheduler


def _page_use(scheduler: Scheduler, residency: Residency) -> tuple[int, int]:
    """(pages held by live sequences, pages held only for reuse). A concurrent change
    while the engine steps makes it read again."""
    pages = scheduler.pages
    for _ in range(100):
        try:
            live = {p for seq in list(scheduler.running) for p in list(seq.page_table)}
            retained_only = residency.held_pages() - live
            return len(live), len(retained_only) + pages.num_cached
        except RuntimeError:  # a dict changed size during iteration
            continue
    return pages.num_used, pages.num_cached


def gather_stats(scheduler: Scheduler, residency: Residency, rc: ReuseCounters, t: RequestTotals) -> EngineStats:
    running = list(scheduler.running)
    live_pages, cached_pages = _page_use(scheduler, residency)
    retained_total, retained_used = residency.retained_slots
    host_total, host_used = residency.host_slots
    moves, slots, pacing = residency.moves.counters, scheduler.slots, scheduler.pacing
    return EngineStats(
        waiting_interactive=len(scheduler.waiting[RequestClass.INTERACTIVE]),
        waiting_agent=len(scheduler.waiting[RequestClass.AGENT]),
        running_interactive=sum(1 for s in running if s.request.request_class is RequestClass.INTERACTIVE),
        running_agent=sum(1 for s in running if s.request.request_class is RequestClass.AGENT),
        total_pages=scheduler.pages.num_pages,
        used_pages=live_pages,
        cached_pages=cached_pages,
        page_size=scheduler.limits.page_size,
        total_slots=slots.num_slots if slots else 0,
        used_slots=slots.num_used if slots else 0,
        requests_finished=t.finished,
        requests_cancelled=t.cancelled,
        requests_preempted=t.preempted,
        prompt_tokens=t.prompt_tokens,
        generated_tokens=t.generated_tokens,
        retained_slots_total=retained_total,
        retained_slots_used=retained_used,
        retained_host_slots_total=host_total,
        retained_host_slots_used=host_used,
        retained_hits=rc.hits,
        retained_misses=rc.misses,
        reused_tokens=dict(rc.reused_tokens),
        prefix_reused_tokens=rc.prefix_reused_tokens,
        retained_slot_skips=rc.slot_skips,
        retained_protected_skips=rc.protected_skips,
        retained_staging_skips=rc.staging_skips,
        spills_ahead=rc.spills_ahead,
        spills_on_step=rc.spills_on_step,
        copy_waits=residency.copy_waits,
        retained_promotions=rc.promotions,
        inflight_holds=rc.inflight_holds,
        sequences_moved=dict(moves.moved),
        sequences_recomputed=t.preempted + moves.restore_failures,
        moving=len(residency.moves.moving),
        sequence_thrash=moves.thrash,
        prefill_allowance_tokens=pacing.allowance if pacing else scheduler.limits.step_token_budget,
        step_time_target_seconds=(pacing.target_s or 0.0) if pacing else 0.0,
        paced_steps=pacing.bounded_steps if pacing else 0,
    )
