"""The scale-out benchmark (bench/scale.py) at its smoke size, as `make bench` runs it (a subprocess):
every engine count and rule has its row, every request is finished by some engine, affinity keeps a
shared head on one engine while round-robin alternates, and killing an engine mid-round fails no request
before its first token. No timing or throughput is checked (those are the benchmark's figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from bench import scale
from common.launch import ROOT


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("scale")
    done = subprocess.run([sys.executable, "-m", "bench.scale", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return json.loads((out / "scale.json").read_text()), (out / "scale.md").read_text()


def rows(text: str, headers: list[str]) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    start = lines.index("| " + " | ".join(headers) + " |")
    table = []
    for line in lines[start + 1:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != len(headers) or cells == headers:
            break
        table.append(cells)
    return table


@pytest.mark.timeout(600)
def test_every_rule_has_its_row(result: tuple[dict[str, Any], str]) -> None:
    res, text = result
    assert text.startswith("### Scale-out: 2 engines behind one gateway") and "smoke" in text.splitlines()[0]
    table = rows(text, scale.HEADERS)
    assert [(r[0], r[1]) for r in table] == [("2", rule) for rule in scale.RULES]
    assert "2 engines, bounded / affinity: reuse ratio" in text
    requests = res["runs"][0]["summary"]["requests"]
    for run in res["runs"]:
        assert run["summary"]["requests"] == requests == len(run["repeats"][0]["records"])
        assert len(run["per_engine"]) == 2 and sum(run["per_engine"]) == requests  # every request, once
        assert 0 < run["summary"]["reuse_ratio"] < 1
    by_rule = {r["rule"]: r["per_engine"] for r in res["runs"]}
    assert sorted(by_rule["affinity"]) == [0, requests]  # one shared head: one engine
    assert abs(by_rule["round-robin"][0] - by_rule["round-robin"][1]) <= 1


@pytest.mark.timeout(600)
def test_a_killed_engine_fails_nothing_before_the_first_token(result: tuple[dict[str, Any], str]) -> None:
    res, text = result
    kill = res["kill"]
    assert kill["failed_before_first_token"] == 0, kill["errors"]
    assert kill["requests"] == res["runs"][0]["summary"]["requests"]
    assert kill["done"] + kill["failed_after_first_token"] == kill["requests"]
    assert kill["per_engine"][0] is None and kill["per_engine"][1] > 0  # the victim is gone, the other served
    assert kill["kill_to_out_of_routing_s"] is not None
    [row] = rows(text, scale.KILL_HEADERS)
    assert row[0] == "2" and row[1] == "bounded" and row[4] == "0" and row[-1].startswith("killed / ")
