"""The LoRA benchmark (bench/lora.py) at a tiny size: its adapters are PEFT's format as ignis reads it,
the table has a row per configuration and the load times, and base-model requests with LoRA on equal
LoRA off's (the run fails otherwise). No time is checked (those are the benchmark's figures)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import lora
from bench.table import raw_folder


def test_the_report_has_every_configuration(tmp_path: Path) -> None:
    args = ["--hidden", "64", "--layers", "2", "--kinds", "dense,hybrid", "--decode", "4", "--repeats", "1",
            "--cache", str(tmp_path / "cache"), "--out", str(tmp_path)]
    assert lora.main(args) == 0
    text = (tmp_path / "lora.md").read_text()
    payload = json.loads(raw_folder(tmp_path).joinpath("lora.json").read_text())
    rows = [(r["kind"], r["batch"], r["adapters"]) for r in payload["rows"]]
    configs = [(8, "base, LoRA on"), (8, "1 adapter"), (8, "4 adapters"), (8, "8 adapters"), (8, "8 adapters, bf16 weights"),
               (1, "1 adapter")]
    assert rows == [(kind, batch, label) for kind in ("dense", "hybrid") for batch, label in configs]
    assert all(r["lora_tps"] > 0 and r["base_tps"] > 0 for r in payload["rows"])
    assert len(payload["loads"]) == 2 * lora.ADAPTERS and all(x["total_s"] >= x["read_s"] > 0 for x in payload["loads"])
    assert "8 adapters" in text and "read, check and place ms" in text
