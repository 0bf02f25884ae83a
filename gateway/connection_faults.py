"""Connections the gateway closed, refused or could not take, tallied and logged as one line per interval.

A flood of slow or broken clients is one condition, not thousands of events: each is counted
(also in the gateway's metrics) and `run` logs one summary line for each interval in which
anything was counted, e.g. ``in the last 10 s: closed 1734 slow connections (1730 sending
headers, 4 sending a body), refused 20 at the connection limit``. What is folded in:

- slow connections closed at --header-timeout / --body-timeout (gateway/http_protocol.py,
  gateway/body_deadline.py);
- connections refused at --max-connections, and those over --max-connections-per-client (with the
  addresses refused most);
- malformed HTTP requests, which uvicorn answers 400, and Upgrade requests, which it serves as
  plain HTTP; it would log a warning (or two) for each (`UvicornWarnings`, a logging filter);
- failed accepts for want of file descriptors, which asyncio would log with a traceback up to
  `backlog` times per attempt (`accept_failures`, a loop exception handler).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Literal

from gateway.metrics import GatewayMetrics

log = logging.getLogger("ignis.gateway")

Phase = Literal["headers", "body"]
SUMMARY_INTERVAL = 10.0  # seconds
_ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message (selector_events.py)
# uvicorn's per-request warnings (protocols/http/h11_impl.py): a request it could not parse, and one
# asking to upgrade (to WebSocket or anything else), which it serves as plain HTTP.
_MALFORMED = "Invalid HTTP request received."
_UPGRADE = "Unsupported upgrade request."
_NO_WEBSOCKETS = "No supported WebSocket library detected."


class ConnectionFaults:
    def __init__(self, metrics: GatewayMetrics, interval: float = SUMMARY_INTERVAL) -> None:
        self.metrics = metrics
        self.interval = interval
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._closed: dict[Phase, int] = {"headers": 0, "body": 0}
        self._refused = 0
        # By address, for the summary's top three; no more entries than refusals in one interval.
        self._refused_clients: Counter[str] = Counter()
        self._malformed = 0
        self._upgrades = 0
        self._accept_failures = 0
        self._slow_readers = 0
        self._since = now

    def closed(self, phase: Phase) -> None:
        """A connection closed because its request's headers or body did not arrive in time."""
        self._closed[phase] += 1
        self.metrics.slow_connections.labels(phase).inc()

    def refused(self) -> None:
        """A connection answered 503 and closed at once: the gateway holds --max-connections already."""
        self._refused += 1
        self.metrics.refused_at_total.inc()

    def refused_client(self, address: str) -> None:
        """A connection answered 429 and closed at once: its client address holds --max-connections-per-client."""
        self._refused_clients[address] += 1
        self.metrics.refused_per_client.inc()

    def malformed(self) -> None:
        """A request uvicorn could not parse and answered 400."""
        self._malformed += 1

    def upgrade_ignored(self) -> None:
        """A request asking to switch protocols, served as plain HTTP."""
        self._upgrades += 1

    def accept_failed(self) -> None:
        """An accept() that failed with EMFILE/ENFILE/ENOBUFS/ENOMEM (asyncio retries a second later)."""
        self._accept_failures += 1
        self.metrics.accept_failures.inc()

    def slow_reader(self) -> None:
        """A stream ended because its client read too slowly (over --max-stream-buffer behind)."""
        self._slow_readers += 1

    def summary(self) -> str | None:
        """What was counted since the last summary, as one line (None when nothing was); starts a new tally."""
        now = time.monotonic()
        parts = []
        slow = sum(self._closed.values())
        if slow:
            parts.append(f"closed {slow} slow connection{'' if slow == 1 else 's'} "
                         f"({self._closed['headers']} sending headers, {self._closed['body']} sending a body)")
        if self._refused:
            parts.append(f"refused {self._refused} at the connection limit (--max-connections)")
        if self._refused_clients:
            top = ", ".join(f"{n} from {address}" for address, n in self._refused_clients.most_common(3))
            more = len(self._refused_clients) - 3
            parts.append(f"refused {self._refused_clients.total()} over the per-client limit "
                         f"(--max-connections-per-client), {top}{f' and {more} more addresses' if more > 0 else ''}")
        if self._malformed:
            parts.append(f"answered {self._malformed} malformed HTTP request{'' if self._malformed == 1 else 's'} "
                         "with 400")
        if self._upgrades:
            parts.append(f"served {self._upgrades} Upgrade request{'' if self._upgrades == 1 else 's'} as plain HTTP")
        if self._accept_failures:
            parts.append(f"failed {self._accept_failures} accepts for want of file descriptors")
        if self._slow_readers:
            parts.append(f"ended {self._slow_readers} stream{'' if self._slow_readers == 1 else 's'} whose client "
                         "read too slowly (--max-stream-buffer), their requests stopped")
        line = f"in the last {round(now - self._since)} s: " + ", ".join(parts) if parts else None
        self._reset(now)
        return line

    def flush(self) -> None:
        line = self.summary()
        if line is not None:
            log.warning("%s", line)

    async def run(self) -> None:
        """Log a summary every interval, until cancelled (then once more)."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                self.flush()
        finally:
            self.flush()

    def accept_failures(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """A loop exception handler: counts failed accepts, hands everything else to the default."""
        if context.get("message") == _ACCEPT_FAILED:
            self.accept_failed()
        else:
            loop.default_exception_handler(context)


class UvicornWarnings(logging.Filter):
    """On uvicorn's error logger: its per-request warnings (invalid request, unsupported upgrade) become counts."""

    def __init__(self, faults: ConnectionFaults) -> None:
        super().__init__()
        self.faults = faults

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message == _MALFORMED:
            self.faults.malformed()
            return False
        if message == _UPGRADE:
            self.faults.upgrade_ignored()
            return False
        return not message.startswith(_NO_WEBSOCKETS)  # the second line of the same warning
