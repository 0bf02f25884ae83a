"""Prometheus text on ``/metrics``: read from the store's Stats at scrape time (no second bookkeeping).

Gauges ``ignis_kv_ram_arena_bytes{kind="used|total"}``, ``ignis_kv_disk_bytes{kind="used|total"}``,
``ignis_kv_states{tier="ram|disk"}``, ``ignis_kv_leases_active``, ``ignis_kv_reservations_pending``;
counters ``ignis_kv_spills_total``, ``ignis_kv_restores_total``, ``ignis_kv_evictions_total``,
``ignis_kv_checksum_failures_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from http.server import HTTPServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
            g = GaugeMetricFamily(name, doc, labels=["kind"])
            g.add_metric(["used"], used)
            g.add_metric(["total"], total)
            yield g
        states = GaugeMetricFamily("ignis_kv_states", "Stored states by tier (ram: in the arena)", labels=["tier"])
        states.add_metric(["ram"], s.states_ram)
        states.add_metric(["disk"], s.states_disk)
        yield states
        yield GaugeMetricFamily("ignis_kv_leases_active", "Acquire leases held", value=s.leases_active)
        yield GaugeMetricFamily("ignis_kv_reservations_pending", "Reservations not yet committed",
                                value=s.reservations_pending)
        for name, doc, value in (
            ("ignis_kv_spills", "States moved from KV-RAM to KV-disk", s.spills),
            ("ignis_kv_restores", "States brought from KV-disk back to KV-RAM", s.restores),
            ("ignis_kv_evictions", "States dropped from their last tier to make room", s.evictions),
            ("ignis_kv_checksum_failures", "Blobs that failed their checksum (dropped, never served)",
             s.checksum_failures),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def serve_metrics(host: str, port: int, stats: Callable[[], StoreStats]) -> HTTPServer:
    """Starts ``/metrics`` on a daemon thread; ``shutdown()`` the result to stop it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(stats))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
