"""bench.tiers runs end to end on a small state (a real tierstore process): every row is measured,
through the paths the engine takes (the published table from RAM, AcquireStream from disk), beside
the ones they replaced (a leased Match on the Match socket, that Match over gRPC)."""

from __future__ import annotations

from pathlib import Path

from bench import tiers


def test_the_tiers_bench_measures_every_row(tmp_path: Path) -> None:
    res = tiers.run(4 * tiers.MiB, 2, tmp_path)
    text, rows = tiers.table(res)
    assert len(rows) == len(tiers.TABLE_ROWS) == 30 and all(row[2] > 0 for row in rows)  # ms of every row
    assert len(res["samples"]["raw_memcpy"]) == 9 * 2  # interleaved
    assert len(res["samples"]["ram_claim_engine"]) == len(res["samples"]["ram_claim_grpc"]) == 2
    assert len(res["samples"]["ram_claim_table"]) == len(res["samples"]["ram_claim_table_checked"]) == 2
    assert len(res["samples"]["ram_claim_checked"]) == len(res["samples"]["disk_claim_checked_landing"]) == 2
    assert res["stats"]["restores"] == 4 * 2 and res["stats"]["checksum_failures"] == 0
    assert len(res["load_1min"]) == 2 and "AcquireStream" in text
