"""Prometheus text on ``/metrics``: read from the store's Stats at scrape time (no second bookkeeping).

Gauges ``ignis_kv_ram_arena_bytes{kind="used|total"}``, ``ignis_kv_disk_bytes{kind="used|total"}``,
``ignis_kv_states{tier="ram|disk"}``, ``ignis_kv_leases_active``, ``ignis_kv_reservations_pending``;
counters ``ignis_kv_spills_total``, ``ignis_kv_restores_total``, ``ignis_kv_evictions_total``,
``ignis_kv_checksum_failures_total``, ``ignis_kv_protected_refusals_total``,
``ignis_kv_copies_ahead_total`` (RAM states given their disk copy ahead of need).

Faults: gauges ``ignis_kv_tier_usable{tier="ram|disk"}`` (0 while the arena cannot be
recreated, or the disk fails); counters ``ignis_kv_disk_errors_total``,
``ignis_kv_blobs_missing_total``, ``ignis_kv_arena_recreations_total``,
``ignis_kv_ram_states_lost_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import labelled_gauge
from tierstore.store import StoreStats


class StoreCollector(Collector):
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, doc, used, total in (
            ("ignis_kv_ram_arena_bytes", "KV-RAM arena bytes (stored, reserved or pinned; and size)",
             s.arena_bytes_used, s.arena_bytes_total),
            ("ignis_kv_disk_bytes", "KV-disk bytes (used; and the kv_disk.bytes budget)",
             s.disk_bytes_used, s.disk_bytes_total),
        ):
            yield labelled_gauge(name, doc, "kind", {"used": used, "total": total})
        yield labelled_gauge("ignis_kv_states", "Stored states by tier (ram: in the arena)", "tier",
                             {"ram": s.states_ram, "disk": s.states_disk})
        yield labelled_gauge("ignis_kv_tier_usable", "1 while the tier serves; 0 while the arena cannot be recreated "
                             "or the disk fails (read-only, full, I/O errors)", "tier",
                             {"ram": int(s.arena_usable), "disk": int(s.disk_usable)})
        yield GaugeMetricFamily("ignis_kv_leases_active", "Acquire leases held", value=s.leases_active)
        yield GaugeMetricFamily("ignis_kv_reservations_pending", "Reservations not yet committed",
                                value=s.reservations_pending)
        for name, doc, value in (
            ("ignis_kv_spills", "States moved from KV-RAM to KV-disk", s.spills),
            ("ignis_kv_restores", "States brought from KV-disk back to KV-RAM", s.restores),
            ("ignis_kv_copies_ahead", "KV-RAM states given their KV-disk copy ahead of need (kv_disk.copy_ahead)",
             s.copies_ahead),
            ("ignis_kv_evictions", "States dropped from their last tier to make room", s.evictions),
            ("ignis_kv_checksum_failures", "Blobs that failed their checksum (dropped, never served)",
             s.checksum_failures),
            ("ignis_kv_protected_refusals",
             "Reserves/Puts refused rather than drop a state they may not displace (protected, or of a higher class)",
             s.protected_refusals),
            ("ignis_kv_disk_errors", "Disk operations that failed (filesystem or index errors)", s.disk_errors),
            ("ignis_kv_blobs_missing", "Blobs found deleted behind the store's back (their records removed)",
             s.blobs_missing),
            ("ignis_kv_arena_recreations", "Times the arena file was found truncated, deleted or replaced, and "
             "recreated under a new instance id", s.arena_recreations),
            ("ignis_kv_ram_states_lost", "States lost with a recreated arena (they were in RAM only)",
             s.ram_states_lost),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def store_registry(stats: Callable[[], StoreStats]) -> CollectorRegistry:
    """The tierstore's registry (serve it with common.metrics.serve_metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(stats))
    return registry
