"""The swarm benchmark's figures (bench/swarm_stats.py) on hand-made records with known answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.swarm_stats import per_turn, plot, ratios, summarize, table
from bench.workload import Kind, RequestRecord, WorkloadConfig, make_trace


def make_record(kind: Kind, turn: int, ttft: float, prompt: int, cached: int, agent: str = "agent-0",
                rnd: int = 0, server: str = "ignis") -> RequestRecord:
    return RequestRecord(server, agent, turn, rnd, kind, ttft, ttft + 1.0, prompt, cached, 4, 0.0)


def make_records(server: str = "ignis", scale: float = 1.0) -> list[RequestRecord]:
    return [make_record("first-turn", 0, 4.0 * scale, 1000, 0, "agent-0", server=server),
            make_record("first-turn", 0, 6.0 * scale, 1000, 992, "agent-1", server=server),
            make_record("later-turn", 1, 1.0 * scale, 1200, 1000, "agent-0", 1, server),
            make_record("later-turn", 1, 3.0 * scale, 1200, 1000, "agent-1", 1, server),
            make_record("subagent", 0, 2.0 * scale, 1010, 992, "burst-0/sub-0", 1, server)]


def test_summary_figures() -> None:
    s = summarize(make_records(), wall_s=30.0)
    assert s["requests"] == 5
    assert s["first_turn_ttft_p50_s"] == 5.0
    assert s["later_turn_ttft_p50_s"] == 2.0 and s["later_turn_ttft_p95_s"] == pytest.approx(2.9)
    assert s["burst_ttft_p50_s"] == 2.0
    assert s["prompt_tokens"] == 5410 and s["cached_tokens"] == 3984 and s["computed_tokens"] == 1426
    assert s["reuse_ratio"] == pytest.approx(1 - 1426 / 5410)
    assert s["requests_per_min"] == 10.0
    assert s["output_tokens"] == 20


def test_summary_without_bursts_has_none_for_them() -> None:
    s = summarize([r for r in make_records() if r.kind != "subagent"], wall_s=10.0)
    assert s["burst_ttft_p50_s"] is None


def test_ratios_and_table() -> None:
    ignis, peer = summarize(make_records(), 30.0), summarize(make_records("peer", 2.0), 60.0)
    r = ratios(ignis, peer)
    assert r["later_turn_ttft_p50_s"] == pytest.approx(0.5) and r["requests_per_min"] == pytest.approx(2.0)
    text = table({"ignis": ignis, "llama.cpp": peer}, "llama.cpp", None)
    assert "| later-turn TTFT p50 (s) | 2 | 4 | 0.5 (lower is better for ignis) |" in text
    alone = table({"ignis": ignis}, "llama.cpp", "not run: no compiler")
    assert "llama.cpp (did not run)" in alone and alone.endswith("**llama.cpp: not run: no compiler**")


def test_per_turn_and_plot(tmp_path: Path) -> None:
    records = make_records()
    assert per_turn(records, 2) == [5.0, 2.0]
    trace = make_trace(WorkloadConfig(agents=2, turns=2, head_tokens=32, burst_every=1, burst_size=1))
    path = tmp_path / "swarm.png"
    plot(path, "test", {"ignis": records, "peer": make_records("peer", 2.0)}, trace)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
