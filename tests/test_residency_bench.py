"""The residency benchmark (bench/residency.py) at its smoke size: every section is there, each against
its baseline, the counters say what each mode did, and the two pressure modes' outputs match. No timings
are checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import residency


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    root = tmp_path_factory.mktemp("residency")
    threads = torch.get_num_threads()
    assert residency.main(["--smoke", "--out", str(root / "out"), "--models", str(root / "models")]) == 0
    assert torch.get_num_threads() == threads  # the smoke run's one thread is undone
    return json.loads((root / "out" / "residency.json").read_text()), (root / "out" / "residency.md").read_text()


def test_the_table_has_every_section(result: tuple[dict[str, Any], str]) -> None:
    _, text = result
    assert text.startswith("### Residency under pressure")
    for header in (residency.PRESSURE_HEADERS, residency.TAX_HEADERS, residency.SPILL_HEADERS,
                   residency.ROOM_HEADERS, residency.CROWD_HEADERS):
        assert "| " + " | ".join(header) + " |" in text
    assert "prefix at 32 + opener at 64" in text and residency.RING_NOTE in text


def test_pressure_moves_down_in_one_mode_and_recomputes_in_the_other(result: tuple[dict[str, Any], str]) -> None:
    res, text = result
    p = res["pressure"]
    assert p["identical"] == p["requests"] == 8 + 4  # every request, token for token
    assert "identical (12/12)" in text
    move, recompute = p["modes"]["move-down"], p["modes"]["recompute"]
    assert move["sequences_moved"] >= 1 and move["sequences_recomputed"] == 0 and move["recomputed_tokens"] == 0
    assert move["forward_tokens"] == move["ideal_tokens"]  # nothing computed twice
    assert recompute["sequences_moved"] == 0 and recompute["requests_preempted"] >= 1
    assert recompute["sequences_recomputed"] == recompute["requests_preempted"]
    # What the preempted sequences had computed is exactly what the forward passes did again.
    assert recompute["recomputed_tokens"] > 0
    assert recompute["forward_tokens"] - recompute["ideal_tokens"] == recompute["recomputed_tokens"]
    assert len(move["interactive_ttft_ms"]) == len(recompute["interactive_ttft_ms"]) == 4
    assert len(move["agents_done_s"]) == len(recompute["agents_done_s"]) == 8


def test_tax_spill_and_room(result: tuple[dict[str, Any], str]) -> None:
    res, _ = result
    sizes = res["tax"]["sizes"]
    assert [s["tokens"] for s in sizes] == [64, 128]
    assert all(len(s["on_ms"]) == len(s["ring_ms"]) == len(s["off_ms"]) == 2 for s in sizes)
    assert res["tax"]["skips"] == res["tax"]["ring_skips"] == 0
    assert res["tax"]["captured"] == res["tax"]["ring_captured"] == 2 * 2 * 2  # prefix + opener, 2 sizes x 2
    for mode, ahead in (("on the step", 0), ("written ahead", 1)):
        runs = res["spill"]["modes"][mode]["runs"]
        assert runs["no-spill"]["spills"] == []
        [spill] = runs["spill"]["spills"]
        assert int(spill["bytes"]) == res["spill"]["state_bytes"] and spill["kind"] == "pages"
        assert runs["spill"]["ahead"] == ahead  # where the one spill ran
        assert len(runs["spill"]["itl_ms"]) == len(runs["no-spill"]["itl_ms"]) == 4 * 39
    device, host = res["room"]["configs"]["device"], res["room"]["configs"]["host"]
    assert device["states"] == host["states"] == 8 and device["skips"] == host["skips"] == 0
    assert device["retained_pages"] == 8 * 64 // 16 and host["retained_pages"] == 0
    assert host["free_pages"] - device["free_pages"] == device["retained_pages"]
    assert (device["claim_tier"], host["claim_tier"]) == ("device", "host")


def test_same_class_pressure_finishes_with_moves_and_no_thrash(result: tuple[dict[str, Any], str]) -> None:
    """Issue 49's load (6 requests of 7 pages on 16, one class): every mode finishes, token for token."""
    res, text = result
    crowd = res["crowd"]
    assert crowd["pages_each"] == 7 and "identical (6/6)" in text
    for mode in crowd["modes"].values():
        assert mode["identical"] == crowd["requests"] == 6 and mode["tokens"] == 6 * 80 and mode["thrash"] == 0
    spare, move, recompute = (crowd["modes"][m] for m in ("room to spare", "move-down", "recompute"))
    assert spare["sequences_moved"] == move["sequences_recomputed"] == move["recomputed_tokens"] == 0
    assert 1 <= move["max_moves"] <= move["sequences_moved"] and move["max_moves"] <= crowd["pages_each"]
    assert recompute["sequences_moved"] == 0 and recompute["sequences_recomputed"] >= 1
