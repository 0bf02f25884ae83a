"""Prometheus pieces the engine and the tierstore share: one labelled gauge, and the /metrics server."""

from __future__ import annotations

from collections.abc import Mapping
from http.server import HTTPServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily


def labelled_gauge(name: str, doc: str, label: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    """A gauge family with one sample per label value, e.g. kind="used"/"total"."""
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value_label, value in values.items():
        family.add_metric([value_label], value)
    return family


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> HTTPServer:
    """Starts ``/metrics`` for `registry` on a daemon thread; ``shutdown()`` the result to stop it."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
