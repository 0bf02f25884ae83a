"""Prometheus metrics of the gateway (``ignis_gateway_*``), on a registry of its own.

`MetricsMiddleware` (pure ASGI) counts every request by route and status and
times it to the last byte (for a stream, the end of the stream) and to the
first body byte (for a stream, about the engine's time to first token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.usage import Usage

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics"})
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
            "ignis_gateway_connections_refused", "Connections answered 503 and closed at --max-connections",
            registry=r)
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


@dataclass(frozen=True, slots=True)
class RouteMetrics:
    in_flight: Any  # the labelled children of one route
    duration: Any
    first_byte: Any


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
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
