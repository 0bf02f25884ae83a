"""Prometheus text on ``/metrics``: read from the store's Stats at scrape time (no second bookkeeping).

Gauges ``ignis_kv_ram_arena_bytes{kind="used|total"}``, ``ignis_kv_disk_bytes{kind="used|total"}``,
``ignis_kv_states{tier="ram|disk"}``, ``ignis_kv_leases_active``, ``ignis_kv_reservations_pending``;
counters ``ignis_kv_spills_total``, ``ignis_kv_restores_total``, ``ignis_kv_evictions_total``,
``ignis_kv_checksum_failures_total``, ``ignis_kv_protected_refusals_total``.
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
        yield GaugeMetricFamily("ignis_kv_leases_active", "Acquire leases held", value=s.leases_active)
        yield GaugeMetricFamily("ignis_kv_reservations_pending", "Reservations not yet committed",
                                value=s.reservations_pending)
        for name, doc, value in (
            ("ignis_kv_spills", "States moved from KV-RAM to KV-disk", s.spills),
            ("ignis_kv_restores", "States brought from KV-disk back to KV-RAM", s.restores),
            ("ignis_kv_evictions", "States dropped from their last tier to make room", s.evictions),
            ("ignis_kv_checksum_failures", "Blobs that failed their checksum (dropped, never served)",
             s.checksum_failures),
            ("ignis_kv_protected_refusals",
             "Reserves/Puts refused rather than drop a state they may not displace (protected, or of a higher class)",
             s.protected_refusals),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def store_registry(stats: Callable[[], StoreStats]) -> CollectorRegistry:
    """The tierstore's registry (serve it with common.metrics.serve_metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(stats))
    return registry
