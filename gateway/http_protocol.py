"""uvicorn's HTTP/1.1 protocols with a header deadline, a bounded body drain and a connection limit.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but waits forever for the
headers of a request that has begun, and for a body the app answered without reading. These
subclasses keep one timer per connection, re-armed from the request's state after each read
(h11's state machine, or httptools' parser callbacks; `--http` picks the parser: httptools, in C,
by default, h11 in pure Python as before):

- **headers** (`--header-timeout`): from the connection's start, or from the first byte of a
  later request on it, to the end of its headers. On expiry a client that sent part of a request
  gets a 408 (OpenAI body) and the connection is closed; one that sent nothing is just closed.
- **body drain** (`--body-timeout`): when the answer is complete but the client is still sending a
  body the app did not read (an early 401 or 413), the rest is read and dropped for this long so
  the client can finish and read the answer, then the connection is closed. (A body the app is
  reading has the app's own deadline: gateway/body_deadline.py.)
- **connections** (`--max-connections`): one over the limit is answered 503 and closed at once;
  one that takes its client address over `--max-connections-per-client` is answered 429 and closed
  at once (gateway/client_connections.py), so one peer cannot lock the others out.
- **head size**: a request line and headers over 16 KiB are a 400 and the connection is closed
  (h11's own bound; llhttp has none, so the httptools protocol counts the bytes read after the
  one the head began in).

A connection upgraded to a WebSocket leaves all of these for good: its liveness is the WebSocket's
ping/pong (gateway/__main__.py), and an idle socket or a long prefill is not a slow client.

Each close is counted in `ConnectionFaults` (metrics, and one summary log line per interval).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.client_connections import ClientConnections
from gateway.config import GatewayConfig
from gateway.connection_faults import ConnectionFaults, Phase
from gateway.errors import OpenAIError, unavailable
from gateway.head_coalescing import HeadCoalescingTransport
from gateway.metrics import GatewayMetrics


def _raw_response(status: str, err: OpenAIError) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for moments h11 has no request to answer."""
    body = json.dumps(err.body()).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (err.headers or {}).items())
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


class _Guard(asyncio.Protocol):
    """The deadlines and the connection limit, whatever parses the HTTP; mixed in before uvicorn's protocol.

    Set the class variables on a subclass (`protocol_class`); uvicorn makes one per connection. A parser's
    subclass says what the client owes now (`_owed`) and whether it has sent part of a request.
    """

    limits: ClassVar[GatewayConfig]
    faults: ClassVar[ConnectionFaults]
    metrics: ClassVar[GatewayMetrics]
    clients: ClassVar[ClientConnections]  # shared by the server's connections
    header_timeout_answer: ClassVar[bytes]
    refused_answer: ClassVar[bytes]
    client_refused_answer: ClassVar[bytes]

    _timer: asyncio.TimerHandle | None = None
    _client: str | None = None  # the peer address this connection is counted under (until given back)
    _phase: Phase | None = None
    # Set once the WebSocket protocol owns the connection: its liveness is ping/pong from then on
    # (uvicorn's ws_ping_interval/ws_ping_timeout), never these deadlines.
    _upgraded = False

    # uvicorn's protocols have these (set in their __init__ / connection_made)
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    connections: set[Any]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # The head of each answer leaves with the start of its body (gateway/head_coalescing.py).
        super().connection_made(HeadCoalescingTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]
        self.metrics.connections_open.inc()
        if len(self.connections) > self.limits.max_connections:
            self.faults.refused()
            transport.write(self.refused_answer)
            transport.close()
            return
        if self.clients.limit:
            peer = transport.get_extra_info("peername")
            address = peer[0] if isinstance(peer, tuple) else None  # (host, port[, flow, scope]); None off TCP
            if address is not None:
                if not self.clients.take(address):
                    self.faults.refused_client(address)
                    transport.write(self.client_refused_answer)
                    transport.close()
                    return
                self._client = address
        self._arm("headers")  # the first request's headers are due from the start

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._give_back()
        self.metrics.connections_open.dec()
        super().connection_lost(exc)

    def _give_back(self) -> None:
        """The connection's room in its client's share, once (the HTTP or the WebSocket protocol loses it)."""
        if self._client is not None:
            address, self._client = self._client, None
            self.clients.give_back(address)

    def handle_websocket_upgrade(self, *event: Any) -> None:
        """The WebSocket protocol takes the connection over; this one's connection_lost never runs,
        so the socket's own lowers the open-connections gauge and gives its client's room back when it goes."""
        self._upgraded = True  # before the disarm: the read that carried the handshake ends in _watch()
        self._disarm()
        super().handle_websocket_upgrade(*event)  # type: ignore[misc]
        socket = self.transport.get_protocol()
        if socket is self:
            return
        lost = socket.connection_lost
        gauge = self.metrics.connections_open
        give_back = self._give_back

        def connection_lost(exc: Exception | None) -> None:
            gauge.dec()
            give_back()
            lost(exc)

        socket.connection_lost = connection_lost  # type: ignore[method-assign]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._watch()

    def _owed(self) -> Phase | None:
        """What the client owes now: a request's headers, a body nobody reads, or nothing."""
        raise NotImplementedError

    def _partial_request(self) -> bool:
        """Whether the client has sent part of a request whose headers have not all arrived."""
        raise NotImplementedError

    def _watch(self) -> None:
        """Keep the timer that fits what the client owes now, or none."""
        if self._upgraded or self.transport.is_closing():
            self._disarm()
            return
        phase = self._owed()
        if phase is None:
            self._disarm()
        else:
            self._arm(phase)

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
        if phase == "headers" and self._partial_request():
            self.transport.write(self.header_timeout_answer)
        self.transport.close()


class GuardedH11Protocol(_Guard, H11Protocol):
    """h11 (pure Python): the state of the request comes from h11's state machine after each read."""

    def _owed(self) -> Phase | None:
        state = self.conn.their_state
        if state is h11.IDLE:
            pending, _ = self.conn.trailing_data
            if pending or self.cycle is None:
                return "headers"  # a request has begun (or is the connection's first): headers due
            return None  # between requests: uvicorn's keep-alive timeout governs
        if state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete:
            return "body"  # answered already; the client still sends a body nobody reads
        return None  # the app has the request (and its body deadline), or the connection ends

    def _partial_request(self) -> bool:
        return bool(self.conn.trailing_data[0])


class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
    """httptools (llhttp, in C): the state of the request comes from the parser's callbacks."""

    _receiving = False  # a request's first byte was parsed and its end not yet
    _headers_done = False
    _head_bytes = 0  # bytes read while this request's head is incomplete
    _begun = False  # a request began in the read being parsed

    def on_message_begin(self) -> None:
        self._receiving, self._headers_done, self._head_bytes, self._begun = True, False, 0, True
        super().on_message_begin()

    def data_received(self, data: bytes) -> None:
        self._begun = False
        super().data_received(data)
        if self._receiving and not self._headers_done and not self.transport.is_closing():
            # llhttp bounds no header: a head longer than h11's bound is malformed here too (400, closed).
            # The read a head began in is not counted (it may hold a pipelined request before it): the
            # bound is 16 KiB past that read.
            self._head_bytes += 0 if self._begun else len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.faults.malformed()
                self.send_400_response(f"Invalid HTTP request received: a head over {MAX_HEAD_BYTES} bytes.")

    def on_headers_complete(self) -> None:
        self._headers_done = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._receiving = False
        super().on_message_complete()

    def _owed(self) -> Phase | None:
        if not self._receiving:
            # the connection's first request is due; between requests uvicorn's keep-alive timeout governs
            return "headers" if self.cycle is None else None
        if not self._headers_done:
            return "headers"
        if self.cycle is not None and self.cycle.response_complete:
            # answered already; the client still sends a body nobody reads. This deadline, not the
            # keep-alive one that uvicorn arms once the answer is out, decides when to close.
            self._unset_keepalive_if_required()
            return "body"
        return None

    def _partial_request(self) -> bool:
        return self._receiving and not self._headers_done


MAX_HEAD_BYTES = 16 * 1024  # a request line and headers, at most: h11's bound (uvicorn's default for h11)
HTTP_PARSERS = ("httptools", "h11")  # --http; the first is the default


def protocol_class(limits: GatewayConfig, faults: ConnectionFaults, metrics: GatewayMetrics,
                   parser: str = HTTP_PARSERS[0]) -> type[_Guard]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for these limits and that parser."""
    header_timeout = OpenAIError(408, f"the request headers did not arrive within {limits.header_timeout:g} s",
                                 code="request_timeout")
    refused = unavailable(f"the gateway is at its limit of {limits.max_connections} connections; retry later")
    per_client = limits.client_connection_limit
    client_refused = OpenAIError(
        429, f"this client address holds {per_client} connections, the gateway's limit per client: close one "
             "or reuse it (keep-alive), then retry", code="rate_limit_exceeded", headers={"Retry-After": "1"})
    base: type[_Guard] = {"httptools": GuardedHttpToolsProtocol, "h11": GuardedH11Protocol}[parser]
    return type(base.__name__, (base,), {
        "limits": limits, "faults": faults, "metrics": metrics, "clients": ClientConnections(per_client),
        "header_timeout_answer": _raw_response("408 Request Timeout", header_timeout),
        "refused_answer": _raw_response("503 Service Unavailable", refused),
        "client_refused_answer": _raw_response("429 Too Many Requests", client_refused),
    })
