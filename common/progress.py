"""A one-line progress bar on stderr for slow start-up work (loading weights, generating ignis-tiny).

Drawn only when stderr is a terminal (`make run`), so logs and tests stay clean;
IGNIS_PROGRESS=1 forces it on, IGNIS_PROGRESS=0 off. Redrawn at most 10 times a second.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import TextIO

_WIDTH = 30
_INTERVAL = 0.1


def progress_enabled(stream: TextIO | None = None) -> bool:
    forced = os.environ.get("IGNIS_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def _human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:.0f}"
    for suffix in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or suffix == "GiB":
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    def __init__(self, description: str, total: float, unit: str = "", stream: TextIO | None = None) -> None:
        self.description = description
        self.total = max(total, 0)
        self.unit = unit
        self.done = 0.0
        self.stream = stream or sys.stderr
        self.enabled = progress_enabled(self.stream)
        self.started = time.monotonic()
        self._drawn_at = 0.0

    def advance(self, amount: float = 1) -> None:
        self.done = min(self.done + amount, self.total) if self.total else self.done + amount
        now = time.monotonic()
        if self.enabled and now - self._drawn_at >= _INTERVAL:
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        self._drawn_at = now
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        count = f"{_human(self.done, self.unit)}/{_human(self.total, self.unit)}"
        if self.unit and self.unit != "B":
            count += f" {self.unit}"
        self.stream.write(f"\r{self.description} [{bar}] {frac:4.0%} {count} {now - self.started:.1f}s{end}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic(), end="\n")
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
