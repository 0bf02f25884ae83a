"""Markdown tables and JSON results for the benchmarks."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def save(name: str, payload: dict[str, Any], table: str, out: Path = RESULTS) -> Path:
    """`<name>.json` (the machine it ran on, then `payload`) and `<name>.md` (`table`) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str))
    (out / f"{name}.md").write_text(table + "\n")
    return path
