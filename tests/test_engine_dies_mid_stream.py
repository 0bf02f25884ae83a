"""A stream cut because its engine died says so (issue 49, attack item 9): not "no engine is available:
the engine ended the session" (which read as if no engine had been found, beside a healthy second one)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx

from services import start_engine, start_gateway


def test_an_engine_killed_after_output_began_ends_the_stream_with_what_happened(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    engine = start_engine(tmp_path / "engine", str(tiny_model_dir), ["--served-model-name", "ignis-tiny"])
    gateway = start_gateway(tmp_path / "gateway", [engine.address])
    try:
        body = {"model": "ignis-tiny", "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{gateway.port}/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 1:
                    engine.process.send_signal(signal.SIGKILL)  # output has begun
        assert "choices" in events[0]
        error = events[-1]["error"]
        assert error["code"] == "engine_failed" and "failed after output began" in error["message"], error
        assert engine.address in error["message"] and "no engine is available" not in error["message"]
    finally:
        gateway.stop()
        engine.process.wait()
