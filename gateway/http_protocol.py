"""uvicorn's h11 protocol with a header deadline, a bounded body drain and a connection limit.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but waits forever for the
headers of a request that has begun, and for a body the app answered without reading. This
subclass keeps one timer per connection, re-armed from the state h11 reports after each read:

- **headers** (`--header-timeout`): from the connection's start, or from the first byte of a
  later request on it, to the end of its headers. On expiry a client that sent part of a request
  gets a 408 (OpenAI body) and the connection is closed; one that sent nothing is just closed.
- **body drain** (`--body-timeout`): when the answer is complete but the client is still sending a
  body the app did not read (an early 401 or 413), the rest is read and dropped for this long so
  the client can finish and read the answer, then the connection is closed. (A body the app is
  reading has the app's own deadline: gateway/body_deadline.py.)
- **connections** (`--max-connections`): one over the limit is answered 503 and closed at once.

Each close is counted in `ConnectionFaults` (metrics, and one summary log line per interval).
"""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.config import GatewayConfig
from gateway.connection_faults import ConnectionFaults, Phase
from gateway.errors import OpenAIError, unavailable
from gateway.metrics import GatewayMetrics


def _raw_response(status: str, err: OpenAIError) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for moments h11 has no request to answer."""
    body = json.dumps(err.body()).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (err.headers or {}).items())
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """Set the class variables on a subclass (`protocol_class`); uvicorn makes one per connection."""

    limits: ClassVar[GatewayConfig]
    faults: ClassVar[ConnectionFaults]
    metrics: ClassVar[GatewayMetrics]
    header_timeout_answer: ClassVar[bytes]
    refused_answer: ClassVar[bytes]

    _timer: asyncio.TimerHandle | None = None
    _phase: Phase | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.metrics.connections_open.inc()
        if len(self.connections) > self.limits.max_connections:
            self.faults.refused()
            transport.write(self.refused_answer)
            transport.close()
            return
        self._arm("headers")  # the first request's headers are due from the start

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.metrics.connections_open.dec()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """The WebSocket protocol takes the connection over; this one's connection_lost never runs,
        so the socket's own lowers the open-connections gauge when it goes."""
        self._disarm()
        super().handle_websocket_upgrade(event)
        socket = self.transport.get_protocol()
        if socket is self:
            return
        lost = socket.connection_lost
        gauge = self.metrics.connections_open

        def connection_lost(exc: Exception | None) -> None:
            gauge.dec()
            lost(exc)

        socket.connection_lost = connection_lost  # type: ignore[method-assign]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _watch(self) -> None:
        """Keep the timer that fits what the client owes now, or none."""
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            pending, _ = self.conn.trailing_data
            if pending or self.cycle is None:
                self._arm("headers")  # a request has begun (or is the connection's first): headers due
            else:
                self._disarm()  # between requests: uvicorn's keep-alive timeout governs
        elif state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete:
            self._arm("body")  # answered already; the client still sends a body nobody reads
        else:
            self._disarm()  # the app has the request (and its body deadline), or the connection ends

    def _arm(self, phase: Phase) -> None:
        if self._phase == phase:
            return  # the deadline runs from when this phase began
        self._disarm()
        timeout = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
        self._phase = phase
        self._timer = self.loop.call_later(timeout, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._phase = None

    def _expired(self) -> None:
        phase = self._phase
        self._timer = None
        self._phase = None
        if phase is None or self.transport.is_closing():
            return
        self.faults.closed(phase)
        pending, _ = self.conn.trailing_data
        if phase == "headers" and pending:
            self.transport.write(self.header_timeout_answer)
        self.transport.close()


def protocol_class(limits: GatewayConfig, faults: ConnectionFaults, metrics: GatewayMetrics
                   ) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for these limits."""
    header_timeout = OpenAIError(408, f"the request headers did not arrive within {limits.header_timeout:g} s",
                                 code="request_timeout")
    refused = unavailable(f"the gateway is at its limit of {limits.max_connections} connections; retry later")
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "limits": limits, "faults": faults, "metrics": metrics,
        "header_timeout_answer": _raw_response("408 Request Timeout", header_timeout),
        "refused_answer": _raw_response("503 Service Unavailable", refused),
    })
