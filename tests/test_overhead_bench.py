"""The engine-overhead benchmark (bench/overhead.py) at a tiny size: every part of a decode step is
timed, the parts add up to the step, and the table has a row per model and batch. No timings are
checked."""

from __future__ import annotations

import json
from pathlib import Path

from bench import overhead


def test_the_step_is_cut_into_parts_that_add_up(tmp_path: Path) -> None:
    assert overhead.main(["--hidden", "64", "--layers", "2", "--batches", "2,3", "--steps", "3",
                          "--out", str(tmp_path / "out"), "--models", str(tmp_path / "models")]) == 0
    res = json.loads((tmp_path / "out" / "overhead.json").read_text())["results"]
    assert [(r["kind"], r["batch"], r["traffic"]) for r in res] == [
        (kind, batch, traffic) for kind in ("dense", "hybrid") for batch in (2, 3) for traffic in ("steady", "churn")]
    for r in res:
        parts = r["ms_per_step"]
        assert set(parts) == set(overhead.PARTS) and parts["model forward"] > 0 and parts["sample"] > 0
        assert abs(sum(parts.values()) - r["total_ms_per_step"]) < 1e-6
        if r["traffic"] == "steady":  # the same sequences decoding: every measured step is the steady state
            assert r["steady_steps"] == r["steps"]
    text = (tmp_path / "out" / "overhead.md").read_text()
    assert "| " + " | ".join(overhead.HEADERS) + " |" in text
