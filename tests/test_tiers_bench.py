"""bench.tiers runs end to end on a small state (a real tierstore process): every row is measured,
through the paths the engine takes (a leased Match from RAM, AcquireStream from disk)."""

from __future__ import annotations

from pathlib import Path

from bench import tiers


def test_the_tiers_bench_measures_every_row(tmp_path: Path) -> None:
    res = tiers.run(4 * tiers.MiB, 2, tmp_path)
    text, rows = tiers.table(res)
    assert len(rows) == 16 and all(row[2] > 0 for row in rows)  # ms of every row
    assert len(res["samples"]["raw_memcpy"]) == 3 * 2 and len(res["samples"]["ram_claim_engine"]) == 2  # interleaved
    assert res["stats"]["restores"] == 4 and res["stats"]["checksum_failures"] == 0
    assert len(res["load_1min"]) == 2 and "AcquireStream" in text
