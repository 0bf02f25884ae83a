"""common/logs.py: events are one JSON object per line; other records are text unless asked for JSON."""

from __future__ import annotations

import json
import logging
from typing import Callable

import pytest

from common.logs import EventFormatter, event_of, log_event


def make_record(caplog: pytest.LogCaptureFixture, emit: Callable[[logging.Logger], None]) -> logging.LogRecord:
    logger = logging.getLogger("ignis.test.logs")
    with caplog.at_level(logging.INFO, logger="ignis.test.logs"):
        emit(logger)
    assert len(caplog.records) == 1
    return caplog.records[0]


def test_an_event_is_one_json_line_with_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    record = make_record(caplog, lambda lg: log_event(lg, "ignis.request.done", request_id="r1", cached_tokens=48,
                                                      tier="device", ttft_ms=1.5))
    line = EventFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["event"] == "ignis.request.done" and parsed["logger"] == "ignis.test.logs"
    assert (parsed["request_id"], parsed["cached_tokens"], parsed["tier"], parsed["ttft_ms"]) == ("r1", 48, "device", 1.5)
    assert parsed["level"] == "INFO" and parsed["ts"].endswith("Z")
    assert record.getMessage() == "ignis.request.done request_id=r1 cached_tokens=48 tier=device ttft_ms=1.5"
    assert event_of(record) == ("ignis.request.done", {"request_id": "r1", "cached_tokens": 48, "tier": "device",
                                                       "ttft_ms": 1.5})


def test_other_records_are_text_by_default_and_json_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    record = make_record(caplog, lambda lg: lg.info("engine serving %s", "ignis-tiny"))
    assert event_of(record) is None
    text = EventFormatter().format(record)
    assert text.endswith("INFO ignis.test.logs: engine serving ignis-tiny")
    parsed = json.loads(EventFormatter(json_lines=True).format(record))
    assert parsed["message"] == "engine serving ignis-tiny" and "event" not in parsed


def test_event_fields_may_not_shadow_the_line_keys() -> None:
    with pytest.raises(ValueError, match="level"):
        log_event(logging.getLogger("ignis.test.logs"), "ignis.request.done", logging.WARNING, level="x")
