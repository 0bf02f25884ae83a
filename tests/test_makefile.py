"""The Makefile's installs (issue 47 item 10): on a fresh machine `make run` installs the runtime only;
`make test`, `make lint` and `make bench` install the test extras on top of it. Read off `make -n`
(which prints the recipes and runs none) for a venv that does not exist yet."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned_installs(target: str, venv: Path) -> list[str]:
    """The pip commands `make TARGET` would run, in order, with `venv` as the venv."""
    out = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [line.removeprefix(f"{venv}/bin/python -m pip install ").strip()
            for line in out.splitlines() if " -m pip install " in line]


def runtime(installs: list[str]) -> list[str]:
    assert installs[0].startswith('"torch=='), installs  # the pinned CPU torch first
    return installs[1:]


def test_make_run_installs_the_runtime_only(tmp_path: Path) -> None:
    assert runtime(planned_installs("run", tmp_path / "venv")) == ["-e . --config-settings editable_mode=compat"]


@pytest.mark.parametrize("target", ["test", "lint", "bench"])
def test_the_test_extras_come_on_top_of_the_runtime(target: str, tmp_path: Path) -> None:
    assert runtime(planned_installs(target, tmp_path / "venv")) == [
        "-e . --config-settings editable_mode=compat", '-e ".[test]" --config-settings editable_mode=compat']
