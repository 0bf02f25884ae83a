"""bench/report.py: every result in the folder lands in REPORT.md, in reading order, none dropped."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import SECTIONS, write


def make_result(folder: Path, name: str, table: str | None, png: bool = False) -> None:
    machine = {"platform": "Linux-test", "torch": "2.13.0+cpu", "threads": 2, "cuda": None,
               "when": "2026-01-02 03:04:05"}
    (folder / f"{name}.json").write_text(json.dumps({"machine": machine, "rows": []}))
    if table is not None:
        (folder / f"{name}.md").write_text(table + "\n")
    if png:
        (folder / f"{name}.png").write_bytes(b"\x89PNG\r\n\x1a\n")


def test_report_gathers_known_and_unknown_results(tmp_path: Path) -> None:
    make_result(tmp_path, "swarm-dense", "| measure | ignis |\n|---|---|\n| reuse ratio | 0.9 |", png=True)
    make_result(tmp_path, "gateway", "| gw | 1 |")
    make_result(tmp_path, "new-suite", None)
    (tmp_path / "reuse.json").write_text("{not json")
    text = write(tmp_path).read_text()
    assert text.startswith("# ignis benchmark report")
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == [f"## {title}" for title, _, _ in SECTIONS] + ["## Other results"]
    assert sections[:5] == ["## Agent swarm: ignis vs llama.cpp's llama-server",
                            "## Per-token rates vs llama.cpp, and where ignis' step time goes", "## Reuse vs cold",
                            "## Throughput vs transformers", "## Residency under pressure"]
    assert "| reuse ratio | 0.9 |" in text and "![swarm-dense](swarm-dense.png)" in text
    assert "_run 2026-01-02 03:04:05, Linux-test, torch 2.13.0+cpu, 2 threads_" in text
    assert "`reuse`: no readable result (JSONDecodeError)" in text
    assert "(no `new-suite.md` table)" in text
    throughput = text.split("## Throughput vs transformers")[1].split("## ")[0]
    assert "_Not run yet._" in throughput
    assert "![gateway]" not in text
