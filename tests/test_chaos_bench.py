"""The chaos benchmark (bench/chaos.py) at its smoke size, as `make bench` runs it (a subprocess): every
fault has its row, the table has its columns, and no completed answer differs from its reference.
Correctness only: no timing, RSS or failure count is checked (those are the benchmark's targets, shown
in its table). About a minute on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import chaos
from common.launch import ROOT


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("chaos")
    done = subprocess.run([sys.executable, "-m", "bench.chaos", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return json.loads((out / "chaos.json").read_text()), (out / "chaos.md").read_text()


def table_rows(text: str) -> list[list[str]]:
    """The cells of the fault table (the first Markdown table of the page), header first."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = "| " + " | ".join(chaos.HEADERS) + " |"
    start = lines.index(header)
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[start:]]
    return rows[:1 + len(chaos.ROWS)]


@pytest.mark.timeout(1800)  # the fixture's run: ~1 min quiet, >9 min seen at load 9
def test_every_fault_has_a_row_with_every_column(result: tuple[dict[str, Any], str]) -> None:
    res, text = result
    assert text.startswith("### Chaos: faults under load, smoke")
    rows = table_rows(text)
    assert rows[0] == chaos.HEADERS
    assert [r[0] for r in rows[1:]] == [label for _, label in chaos.ROWS]
    assert all(len(r) == len(chaos.HEADERS) for r in rows)
    assert [r["key"] for r in res["rows"]] == [key for key, _ in chaos.ROWS]
    assert "engine RSS, MiB" in text and res["rss_mib"][0][0] == "start"
    for r in res["rows"]:
        if r["skipped"]:  # the read-only disk needs mount privileges
            assert r["key"] == "read-only-disk" and r["tried"] == 0
        else:
            assert r["episodes"] == 1 and r["tried"] > 0, r
    assert res["distinct_references"] > 1  # a wrong state would show as another answer


@pytest.mark.timeout(1800)  # the fixture's run: ~1 min quiet, >9 min seen at load 9
def test_no_answer_is_wrong(result: tuple[dict[str, Any], str]) -> None:
    res, text = result
    wrong = chaos.HEADERS.index("wrong")
    for row, cells in zip(res["rows"], table_rows(text)[1:]):
        assert row["wrong"] == 0, row["samples"]
        assert cells[wrong] == ("-" if row["skipped"] else "0"), cells
    aborts = next(r for r in res["rows"] if r["key"] == "aborts")
    assert aborts["aborted"] > 0  # the aborts window did cut streams
