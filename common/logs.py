"""Logging set-up shared by the three services (one place to change the format).

Events (`log_event`: ``ignis.request.done``, ``ignis.request.spilled``, ...) are
printed as one JSON object per line whatever the format, so that a log shipper
can parse them out of an otherwise readable log. Other lines follow
``IGNIS_LOG_FORMAT``: ``text`` (default, one readable line per record) or
``json`` (one JSON object per record, for a log pipeline that wants only JSON).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
_EVENT = "ignis_event"  # LogRecord attributes set by log_event (prefixed: no clash with logging's own)
_FIELDS = "ignis_fields"
_RESERVED = frozenset({"ts", "level", "logger", "event", "message"})


def log_event(logger: logging.Logger, name: str, level: int = logging.INFO, /, **fields: Any) -> None:
    """Log event `name` with `fields` (JSON-serialisable values): a JSON line through EventFormatter,
    ``name key=value ...`` as the record's message for any other handler (e.g. pytest's caplog)."""
    clash = _RESERVED.intersection(fields)
    if clash:
        raise ValueError(f"event fields may not be named {sorted(clash)}: the line uses them")
    if not logger.isEnabledFor(level):
        return
    text = " ".join([name, *(f"{k}={v}" for k, v in fields.items())])
    logger.log(level, "%s", text, extra={_EVENT: name, _FIELDS: fields})


def event_of(record: logging.LogRecord) -> tuple[str, dict[str, Any]] | None:
    """(name, fields) of a record made by log_event, else None."""
    name = getattr(record, _EVENT, None)
    return None if name is None else (name, getattr(record, _FIELDS, {}))


class EventFormatter(logging.Formatter):
    """Events as JSON always; other records as text, or as JSON with ``json_lines``."""

    def __init__(self, json_lines: bool = False) -> None:
        super().__init__(TEXT_FORMAT)
        self.json_lines = json_lines

    def format(self, record: logging.LogRecord) -> str:
        event = event_of(record)
        if event is None and not self.json_lines:
            return super().format(record)
        line: dict[str, Any] = {"ts": _iso_time(record.created), "level": record.levelname, "logger": record.name}
        if event is not None:
            line["event"] = event[0]
            line.update(event[1])
        else:
            line["message"] = record.getMessage()
            if record.exc_info:
                line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _iso_time(created: float) -> str:
    millis = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def configure_logging() -> None:
    """Level from IGNIS_LOG_LEVEL (default INFO), format from IGNIS_LOG_FORMAT (text|json)."""
    fmt = os.environ.get("IGNIS_LOG_FORMAT", "text").lower()
    if fmt not in FORMATS:
        raise SystemExit(f"IGNIS_LOG_FORMAT must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(EventFormatter(json_lines=fmt == "json"))
    logging.basicConfig(level=os.environ.get("IGNIS_LOG_LEVEL", "INFO"), handlers=[handler])
