"""Prometheus metrics of the gateway (``ignis_gateway_*``), on a registry of its own.

`MetricsMiddleware` (pure ASGI) counts every request by route and status and
times it to the last byte (for a stream, the end of the stream) and to the
first body byte (for a stream, about the engine's time to first token).
The route label is the template of the app's route the path matches
(`/v1/responses/{response_id}`), "other" for a path no route serves: its
values are bounded by the route table, whatever clients ask for.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.usage import Usage

OTHER_ROUTE = "other"  # the label of every path no route serves
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ignis_gateway_requests", "HTTP requests answered", ["route", "method", "status"],
                                registry=r)
        self.duration = Histogram("ignis_gateway_request_duration_seconds", "Time to the last byte of the answer",
                                  ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram("ignis_gateway_time_to_first_byte_seconds",
                                    "Time to the first body byte (streams: about the time to first token)",
                                    ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("ignis_gateway_requests_in_flight", "Requests being answered", ["route"], registry=r)
        self.tokens = Counter("ignis_gateway_tokens", "Tokens of finished requests", ["kind"], registry=r)
        self.slow_connections = Counter(
            "ignis_gateway_slow_connections_closed", "Connections closed because a request's headers or body "
            "did not arrive within --header-timeout / --body-timeout", ["phase"], registry=r)
        self.connections_refused = Counter(
            "ignis_gateway_connections_refused", "Connections refused and closed at once: at --max-connections "
            "(limit=total, answered 503) or over --max-connections-per-client (limit=per_client, answered 429)",
            ["limit"], registry=r)
        self.refused_at_total = self.connections_refused.labels("total")  # both listed at 0 from the start
        self.refused_per_client = self.connections_refused.labels("per_client")
        self.accept_failures = Counter(
            "ignis_gateway_accept_failures", "Connections the server could not accept for want of file descriptors",
            registry=r)
        self.connections_open = Gauge("ignis_gateway_connections_open",
                                      "HTTP connections open now (idle kept-alive ones included)", registry=r)
        for phase in ("headers", "body"):
            self.slow_connections.labels(phase)  # listed at 0 from the start
        self.engine_up = Gauge("ignis_gateway_engine_up", "1 when the engine answered its last probe", ["engine"],
                               registry=r)

        # Labelled children, looked up once: `labels()` costs ~3 us a call, several times a request.
        self._prompt, self._completion, self._cached = (self.tokens.labels(k) for k in ("prompt", "completion", "cached"))
        self._routes: dict[str, RouteMetrics] = {}
        self._answered: dict[tuple[str, str, str], Any] = {}

    def route(self, route: str) -> RouteMetrics:
        found = self._routes.get(route)
        if found is None:
            found = self._routes[route] = RouteMetrics(self.in_flight.labels(route), self.duration.labels(route),
                                                       self.first_byte.labels(route))
        return found

    def answered(self, route: str, method: str, status: int) -> None:
        key = (route, method, str(status))
        child = self._answered.get(key)
        if child is None:
            child = self._answered[key] = self.requests.labels(*key)
        child.inc()

    def observe_usage(self, usage: Usage) -> None:
        self._prompt.inc(usage.prompt_tokens)
        self._completion.inc(usage.completion_tokens)
        self._cached.inc(usage.cached_tokens)


class RouteLabels:
    """The route label of a request path: its route's template, parameters named without their convertor
    (`/v1/models/{model:path}` -> `/v1/models/{model}`), or "other"."""

    def __init__(self, templates: Iterable[str]) -> None:
        self._exact: set[str] = set()
        self._patterns: list[tuple[re.Pattern[str], str]] = []  # in the route table's order, as Starlette matches
        for template in dict.fromkeys(templates):  # a path served for several methods is one template
            if "{" not in template:
                self._exact.add(template)
            else:
                regex, _, _ = compile_path(template)
                self._patterns.append((regex, re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", template)))

    def label(self, path: str) -> str:
        if path in self._exact:  # the hot routes: one set lookup
            return path
        for regex, label in self._patterns:
            if regex.match(path):
                return label
        return OTHER_ROUTE


@dataclass(frozen=True, slots=True)
class RouteMetrics:
    in_flight: Any  # the labelled children of one route
    duration: Any
    first_byte: Any


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: RouteLabels) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.routes.label(scope["path"])
        m = self.metrics.route(route)
        start = time.perf_counter()
        status = 500  # if the app fails before answering, the server answers 500
        first_byte = False

        async def observed_send(message: Message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not first_byte and message.get("body"):
                first_byte = True
                m.first_byte.observe(time.perf_counter() - start)
            await send(message)

        m.in_flight.inc()
        try:
            await self.app(scope, receive, observed_send)
        finally:
            m.in_flight.dec()
            self.metrics.answered(route, scope["method"], status)
            m.duration.observe(time.perf_counter() - start)
