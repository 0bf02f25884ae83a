"""Markdown tables and JSON results for the benchmarks.

A suite's `<name>.md` is its table and ends with the machine it ran on (a comment line, read back by
bench/report.py); its `<name>.json` is the raw figures. In the committed bench/results/ only the
Markdown is kept: the JSON goes to bench/results/raw/, which git ignores. Any other folder (a
benchmark's --out) holds both side by side."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from engine import cpu_host

RESULTS = Path(__file__).resolve().parent / "results"
RAW = RESULTS / "raw"  # ignored by git (.gitignore)
MACHINE = "<!-- machine: "  # how a table's last line starts: the machine it ran on, as JSON


def markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpu": cpu_host.describe().part, "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def raw_folder(out: Path) -> Path:
    """Where the JSON of the results in `out` goes: raw/ for the committed folder, else `out` itself."""
    return RAW if out.resolve() == RESULTS else out


def machine_of(table: str) -> dict[str, Any] | None:
    """The machine a table's last line names (see `save`), or None for a table without one."""
    last = table.rstrip().rsplit("\n", 1)[-1]
    if not (last.startswith(MACHINE) and last.endswith(" -->")):
        return None
    return dict(json.loads(last[len(MACHINE):-len(" -->")]))


def without_machine(table: str) -> str:
    """The table without its machine line."""
    lines = table.rstrip().split("\n")
    return "\n".join(lines[:-1] if machine_of(table) is not None else lines).rstrip()


def save(name: str, payload: dict[str, Any], table: str, out: Path = RESULTS) -> Path:
    """`<name>.md` in `out` (`table`, then the machine it ran on) and `<name>.json` (that machine, then
    `payload`) in `raw_folder(out)`; returns the JSON's path."""
    where = machine()
    json_out = raw_folder(out)
    json_out.mkdir(parents=True, exist_ok=True)
    path = json_out / f"{name}.json"
    path.write_text(json.dumps({"machine": where, **payload}, indent=2, default=str))
    (out / f"{name}.md").write_text(f"{table}\n\n{MACHINE}{json.dumps(where)} -->\n")
    return path
