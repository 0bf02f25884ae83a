"""The Monitor's view of one engine (the ListState RPC): the pool, the retained states one row
each, the tiers below and the recent requests.

Two halves, so that listing never holds the step up for more than a copy of the index:

- `take_snapshot` runs on the engine thread, between two steps (the core's inbox hands it
  over): it copies the stats, one `StateView` per retained state, the namespaces in use and
  the ring of recent requests. No sorting, no RPC, no protobuf.
- `StateLister.listing` runs on a servicer worker thread: it ranks each tier by the one
  eviction order (common/eviction.py), asks the tierstore for its summary and its states
  (on a channel of its own), cuts the page and builds the reply.

Rows come in one list: the device's states in eviction order, then the host's, then
KV-RAM's and KV-disk's (the tierstore's order). A page token is an offset into that
live list: a state that moves between two calls may be skipped or shown twice.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from common.eviction import EvictionOrder
from engine.residency.layer import Residency
from engine.residency.retained_state import StateView
from engine.facts import ReuseTier
from engine.kv.page_pool import PagePool
from engine.metrics import FinishedRequest
from engine.outputs import EngineStats
from engine.proto_convert import request_class_pb, reuse_kind_pb, reuse_tier_pb
from engine.tiers.link import TierLink
from ignis.v1 import engine_pb2, tierstore_pb2

DEFAULT_PAGE_ROWS = 100
MAX_PAGE_ROWS = 1000  # rows of one page: a reply stays a few hundred KiB
NAME_BYTES = 8  # a row's name: the first 8 bytes of its chain hash, in hex
RATE_WINDOW_SECONDS = 10.0  # tokens per second over the calls of the last 10 s
_MAX_TOKEN_DIGITS = 10


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """A copy of what the Monitor shows, taken on the engine thread."""

    taken_at: float  # monotonic (the clock of the states' times)
    wall: float  # Unix seconds
    stats: EngineStats
    states: tuple[StateView, ...]
    namespaces: tuple[bytes, ...]  # h0 of every namespace the engine has served (for the tierstore's rows)
    recent: tuple[tuple[float, FinishedRequest], ...]  # (finished at, Unix seconds; its fields), oldest first
    registered_pages: int
    copy_ms: float  # what taking it cost the engine thread


def take_snapshot(stats: EngineStats, residency: Residency, pages: PagePool, namespaces: Iterable[bytes],
                  recent: Iterable[tuple[float, FinishedRequest]], started: float) -> EngineSnapshot:
    """Engine thread: copies only. `started`: perf_counter() when the copy began (stats included)."""
    states, names, ring = tuple(residency.describe()), tuple(namespaces), tuple(recent)
    return EngineSnapshot(time.monotonic(), time.time(), stats, states, names, ring, pages.num_registered,
                          (time.perf_counter() - started) * 1000)


def parse_page(page_size: int, page_token: str) -> tuple[int, int]:
    """(offset, rows) of a ListState request; ValueError names what is wrong with the token."""
    rows = min(page_size or DEFAULT_PAGE_ROWS, MAX_PAGE_ROWS)
    if not page_token:
        return 0, rows
    if len(page_token) > _MAX_TOKEN_DIGITS or not page_token.isascii() or not page_token.isdigit():
        raise ValueError(f"page_token {page_token[:32]!r} is not one this engine gave: pass the "
                         "next_page_token of an earlier reply, or none for the first page")
    return int(page_token), rows


class Throughput:
    """Prefill and decode tokens per second from the counters seen by the last calls."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self._samples: deque[tuple[float, int, int]] = deque()
        self._lock = threading.Lock()  # listings run on worker threads

    def rates(self, now: float, prefilled: int, generated: int) -> tuple[float, float]:
        with self._lock:
            self._samples.append((now, prefilled, generated))
            # Keep the newest sample at or before the window's start, so the rate spans the window.
            while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
                self._samples.popleft()
            t0, p0, g0 = self._samples[0]
        dt = now - t0
        if dt <= 0:
            return 0.0, 0.0
        return max(prefilled - p0, 0) / dt, max(generated - g0, 0) / dt


class StateLister:
    def __init__(self, model: str, order: EvictionOrder, tiers: TierLink | None) -> None:
        self.model = model
        self.order = order
        self.tiers = tiers
        self.throughput = Throughput()

    def listing(self, snap: EngineSnapshot, offset: int, rows: int) -> engine_pb2.ListStateResponse:
        """The reply for one page (a worker thread: the ranking and the tierstore calls happen here)."""
        s = snap.stats
        prefilled = s.prompt_tokens - sum(s.reused_tokens.values())
        prefill_rate, decode_rate = self.throughput.rates(snap.taken_at, prefilled, s.generated_tokens)
        own = self._engine_rows(snap)
        page = own[offset:offset + rows]
        total = len(own)
        summary = engine_pb2.TierSummary(configured=self.tiers is not None)
        if self.tiers is not None:
            link = self.tiers
            summary.engine_spills, summary.engine_spill_failures = link.spills, link.spill_failures
            summary.engine_restores, summary.engine_restore_failures = link.restores, link.restore_failures
            summary.engine_restores_rejected = link.rejected
            store = link.client.side_stats()
            if store is not None:
                summary.reachable = True
                summary.store.CopyFrom(_store_view(store))
            if snap.namespaces and store is not None:
                want = rows - len(page)
                lower = link.client.side_list(snap.namespaces, max(offset - len(own), 0), max(want, 1))
                if lower is not None:
                    total += lower.total
                    if want > 0:
                        page += [_stored_row(r) for r in lower.states[:want]]
        end = offset + len(page)
        return engine_pb2.ListStateResponse(
            stats=stats_message(s), prefill_tokens_per_second=prefill_rate, decode_tokens_per_second=decode_rate,
            states=page, states_total=total, next_page_token=str(end) if end < total and page else "",
            tiers=summary, recent=[_recent_row(at, r) for at, r in snap.recent], taken_at=snap.wall,
            registered_pages=snap.registered_pages, model=self.model, snapshot_ms=snap.copy_ms)

    def _engine_rows(self, snap: EngineSnapshot) -> list[engine_pb2.RetainedStateRow]:
        now = snap.taken_at
        out: list[engine_pb2.RetainedStateRow] = []
        for tier in (ReuseTier.DEVICE, ReuseTier.HOST):
            here = [v for v in snap.states if v.tier is tier]
            # What the order ranks: ready retained states (one still being copied cannot leave yet).
            ranked = sorted((v for v in here if v.resident is not None and v.ready),
                            key=lambda v: self.order.rank(v.resident, now))  # type: ignore[arg-type]
            for rank, v in enumerate(ranked):
                assert v.resident is not None
                out.append(_row(v, now, rank=rank, protected=self.order.is_protected(v.resident, now),
                                idle=now - v.resident.last_used))
            for v in here:  # unranked: still being copied, or page chains (they leave with their pages)
                if v.resident is None or not v.ready:
                    out.append(_row(v, now, idle=now - v.resident.last_used if v.resident else 0.0))
        return out


def _row(v: StateView, now: float, rank: int | None = None, protected: bool = False, idle: float = 0.0
         ) -> engine_pb2.RetainedStateRow:
    row = engine_pb2.RetainedStateRow(
        name=v.name[:NAME_BYTES].hex(), kind=reuse_kind_pb(v.kind), tier=reuse_tier_pb(v.tier),
        request_class=request_class_pb(v.request_class), tokens=v.tokens, bytes=v.nbytes,
        age_seconds=max(now - v.created, 0.0) if v.created is not None else 0.0, idle_seconds=max(idle, 0.0),
        hits=v.hits, protected=protected, pages=v.pages, ready=v.ready)
    if rank is not None:
        row.rank = rank
    return row


def _stored_row(r: tierstore_pb2.StoredStateRow) -> engine_pb2.RetainedStateRow:
    return engine_pb2.RetainedStateRow(
        name=r.hash[:NAME_BYTES].hex(), kind=r.kind, tier=r.tier, request_class=r.request_class, tokens=r.tokens,
        bytes=r.nbytes, age_seconds=r.age_seconds, idle_seconds=r.idle_seconds, hits=r.hits, protected=r.protected,
        rank=r.rank, ready=True)


def _store_view(s: tierstore_pb2.StatsResponse) -> engine_pb2.TierStoreStatsView:
    return engine_pb2.TierStoreStatsView(
        ram_bytes_used=s.arena_bytes_used, ram_bytes_total=s.arena_bytes_total, disk_bytes_used=s.disk_bytes_used,
        disk_bytes_total=s.disk_bytes_total, states_ram=s.states_ram, states_disk=s.states_disk, spills=s.spills,
        restores=s.restores, evictions=s.evictions, checksum_failures=s.checksum_failures,
        disk_usable=s.disk_usable, arena_usable=s.arena_usable)


def redacted_id(request_id: str) -> str:
    """A request id as the Monitor shows it: its kind and its last 4 characters. A stored response's
    full id is all a client needs to read or delete it (`resp_...` in the unsalted scope), and the
    listing is served to every client of the gateway; the id stays whole in the engine's log."""
    kind, sep, _ = request_id.partition("_") if "_" in request_id else request_id.partition("-")
    head = kind + sep if sep and len(kind) <= 12 else ""
    return f"{head}…{request_id[-4:]}" if len(request_id) > len(head) + 4 else head + "…"


def _recent_row(finished_at: float, r: FinishedRequest) -> engine_pb2.RecentRequest:
    return engine_pb2.RecentRequest(
        request_id=redacted_id(r.request_id), request_class=request_class_pb(r.request_class),
        prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens, tier=reuse_tier_pb(r.tier),
        kind=reuse_kind_pb(r.kind), ttft_ms=r.ttft_ms, completion_tokens=r.tokens_out,
        finish_reason=r.finish_reason.value, finished_at=finished_at)


def stats_message(s: EngineStats) -> engine_pb2.GetStatsResponse:
    """GetStats' reply (also the `stats` of a listing)."""
    return engine_pb2.GetStatsResponse(
        waiting=engine_pb2.ClassCounts(interactive=s.waiting_interactive, agent=s.waiting_agent),
        running=engine_pb2.ClassCounts(interactive=s.running_interactive, agent=s.running_agent),
        page_pool=engine_pb2.PagePoolStats(total_pages=s.total_pages, used_pages=s.used_pages,
                                           cached_pages=s.cached_pages, page_size=s.page_size),
        state_slots=engine_pb2.SlotStats(total=s.total_slots, used=s.used_slots),
        retained_device_slots=engine_pb2.SlotStats(total=s.retained_slots_total, used=s.retained_slots_used),
        retained_host_slots=engine_pb2.SlotStats(total=s.retained_host_slots_total, used=s.retained_host_slots_used),
        counters=engine_pb2.EngineCounters(
            requests_finished=s.requests_finished, requests_cancelled=s.requests_cancelled,
            requests_preempted=s.requests_preempted, prompt_tokens=s.prompt_tokens,
            generated_tokens=s.generated_tokens, retained_state_hits=s.retained_hits,
            retained_state_misses=s.retained_misses, reused_tokens=sum(s.reused_tokens.values()),
            retained_slot_skips=s.retained_slot_skips, inflight_holds=s.inflight_holds,
        ),
    )
