"""The long-prefill benchmark (bench/long_prefill.py) at a small size, as `make bench` runs it (a
subprocess): both variants have their row, every probe of the alone phase and of the beside phase
finished with its 4 tokens, and the long prompts produced their token. No time is checked (those are
the benchmark's figures)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.long_prefill import HEADERS
from common.launch import ROOT


@pytest.mark.timeout(600)
def test_both_variants_measure_probes_alone_and_beside_a_long_prompt(tmp_path_factory: pytest.TempPathFactory
                                                                     ) -> None:
    out = tmp_path_factory.mktemp("long-prefill")
    done = subprocess.run([sys.executable, "-m", "bench.long_prefill", "--long-tokens", "6000", "--probes", "3",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    payload = json.loads((out / "long-prefill.json").read_text())
    variants = {v["name"]: v for v in payload["variants"]}
    assert set(variants) == {"shipped", "token budget only"}
    assert variants["token budget only"]["flags"] == "--set engine.step_time_target_ms=off"
    for variant in variants.values():
        assert len(variant["probes_alone"]) == 3
        assert all(p["tokens"] == 4 and 0 < p["ttft"] <= p["total"] for p in variant["probes_alone"])
        assert all(p["tokens"] == 4 for p in variant["probes_beside"])  # each wholly beside the long prompt
        assert variant["long_alone_s"] > 0 and variant["long_beside_s"] > 0
    table = (out / "long-prefill.md").read_text()
    assert "| " + " | ".join(HEADERS) + " |" in table
    assert "| shipped |" in table and "| token budget only |" in table
