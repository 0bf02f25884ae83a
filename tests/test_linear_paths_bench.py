"""The linear-paths benchmark (bench/linear_paths.py) at a tiny size: the report names every path that
runs here and every row count, and says why any other path did not run; a path whose output is wrong
fails the run before any timing. No time is checked (those are the benchmark's figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import linear_paths
from kernels.cpu import linear_rows

TINY = ["--hidden", "128", "--layers", "2", "--rows", "1,8,9", "--repeats", "1"]


def _expected_paths() -> tuple[list[str], list[str]]:
    """The paths that run on this machine (every dtype asked for), and those that cannot."""
    paths, skipped = linear_paths.make_paths(["fp32", "bf16"], linear_rows.load(), linear_rows.LIBRARY)
    return [p.name for p in paths], list(skipped)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_the_report_names_every_path_and_row_count(tmp_path: Path, kind: str) -> None:
    assert linear_paths.main([*TINY, "--kind", kind, "--dtypes", "fp32,bf16", "--out", str(tmp_path)]) == 0
    name = f"linear-paths-{kind}-h128-l2-fp32-bf16"
    text = (tmp_path / f"{name}.md").read_text()
    ran, skipped = _expected_paths()
    header = text.split("\n| rows | ", 1)[1].split("\n", 1)[0]
    assert header.split(" | ")[:len(ran)] == ran
    assert all(f"{p}: " in text for p in skipped)  # each path not run, with its reason
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "ms," in line] \
        == ["| 1", "| 8", "| 9"]
    assert text.startswith("CPU ")  # the host line heads the report
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    timings = {(t["path"], t["rows"]) for t in payload["timings"]}
    assert timings == {(p, n) for p in [*ran, linear_paths.READ] for n in (1, 8, 9)}
    assert all(len(t["samples_ms"]) == 1 and t["ms"] > 0 for t in payload["timings"])
    if kind == "hybrid":
        assert any("in_proj_qkv" in s["name"] for s in payload["shapes"])  # the GDN layers' projections


def test_a_wrong_path_fails_before_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def off_by_one(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) + 1

    monkeypatch.setattr(linear_paths, "run_torch", off_by_one)
    monkeypatch.setattr(linear_paths, "measure", lambda *a: pytest.fail("timed a wrong path"))
    with pytest.raises(RuntimeError, match="path torch is wrong at 1 rows"):
        linear_paths.main([*TINY, "--dtypes", "fp32", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_the_report_name_says_what_changes_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in linear_paths.ISA_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    assert linear_paths.result_name("dense", 1024, 16, 2, "auto", None) == "linear-paths-dense"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert linear_paths.result_name("hybrid", 1024, 16, 4, "fp32", Path("/tmp/lib_avx2.so")) \
        == "linear-paths-hybrid-t4-fp32-lib-lib_avx2-onednn-avx2-mkl-avx2"
