"""The prepared device check (scripts/gpu_check.sh, make gpu-check) and bench/gpu.py, on any machine:
the dry run lists the stages within the 8-minute budget and checks the environment, a real run
without a GPU stops at its first stage and says so, and the benchmark runs at a tiny size."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels.select import kernels_for

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STAGES = ["env", "install", "kernels", "cuda", "bench", "report"]
PUBLISHED = ROOT / "bench" / "results" / "gpu.md"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def published_state() -> float | None:
    return PUBLISHED.stat().st_mtime if PUBLISHED.exists() else None


def test_dry_run_lists_the_stages_within_the_budget(tmp_path: Path) -> None:
    before = published_state()
    done = run_script("--dry-run", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    limits = dict(re.findall(r"^\s+(\w+)\s+timeout\s+(\d+)s", done.stdout, flags=re.M))
    assert list(limits) == STAGES
    assert sum(int(v) for v in limits.values()) + 5 * (len(STAGES) - 1) <= 480  # with each stage's kill grace
    assert re.search(r"worst case, .*: (\d+)s \(budget 480s\)", done.stdout)
    assert "-m cuda" in done.stdout and "tests/test_triton_kernels.py" in done.stdout
    assert "tests/test_cuda.py" in done.stdout and "bench.gpu" in done.stdout
    assert "pin: torch==2.13.0 (as pyproject.toml)" in done.stdout
    assert done.stdout.rstrip().endswith("dry run: ok")
    assert (tmp_path / "out" / "plan.txt").read_text() == done.stdout
    assert published_state() == before  # a dry run writes nothing outside its folder


def test_the_script_needs_an_output_folder() -> None:
    done = run_script()
    assert done.returncode == 2 and "usage:" in done.stderr


def test_make_gpu_check_runs_the_script(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("no make")
    done = subprocess.run(["make", "-s", "gpu-check", f"OUT={tmp_path / 'out'}", "ARGS=--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run: ok" in done.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_a_gpu_a_real_run_stops_at_the_env_stage(tmp_path: Path) -> None:
    before = published_state()
    done = run_script(str(tmp_path / "out"))
    assert done.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| env | failed (rc 1)" in summary
    for stage in STAGES[1:-1]:
        assert f"| {stage} | skipped (env failed)" in summary
    assert "no NVIDIA GPU" in (tmp_path / "out" / "logs" / "env.log").read_text()
    assert published_state() == before


def test_the_gpu_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    from bench import gpu

    assert gpu.main(["--tiny", "--out", str(tmp_path / "bench"), "--models", str(tmp_path / "models")]) == 0
    table = (tmp_path / "bench" / "gpu.md").read_text()
    for section in ("1. State clone", "2. Decode attention", "3. Gated DeltaNet", "4. Reused vs cold TTFT",
                    "5. Claim of a retained state"):
        assert section in table
    results = json.loads((tmp_path / "bench" / "gpu.json").read_text())["results"]
    assert results["kernels"] == ("triton" if torch.cuda.is_available() else kernels_for(torch.device("cpu")).name)
    assert [r["retry_tier"] for r in results["ttft"]] == ["device", "device"]
    assert all(r["retry_cached"] == r["tokens"] for r in results["ttft"])
    assert [r["tier"] for r in results["host"]] == ["device", "device", "host", "host"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_full_gpu_benchmark_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import gpu

    assert gpu.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
