"""`python -m bench.tiers`: the lower tiers against the raw copies they are built on.

One ~150 MiB state, side by side in one run, through a real tierstore process:

- KV-RAM: the engine's copy into / out of the shared-memory arena by offset
  (and the whole Reserve+copy+Commit) vs a raw numpy memcpy of the same bytes;
  a claim the way the engine makes it (engine/tiers/link.py: the state found in the
  store's published table, no Match and no lease, the copy, its slot checked after it,
  the use reported in the background; with and without the integrity check), and the
  way it did before the table (one Match on the store's Match socket that leases the hit,
  the copy, Release in the background),
  the same with the integrity check a CPU engine makes on what it copied (an
  AES-GMAC in segments, copied and checked on two threads: engine/tiers/checked_copy.py;
  beside it a memcpy on two threads, and the keyed BLAKE3 the GMAC replaced),
  the same with that Match over gRPC, and the way the example client does
  (tierstore/client.py: Match, Acquire, copy, Release, each waited for);
- KV-disk: a spill (checksum, write, fsync, rename, LMDB) and a cold restore
  (read, checksum, into the arena) vs a raw sequential write+fsync / cold read
  of a file of the same size in the same folder (page cache dropped with
  posix_fadvise(DONTNEED) before each cold read, blob and raw file alike); the
  cold read with O_DIRECT is shown too (the restore reads that way where it can);
- a claim from disk the engine's way (Match, AcquireStream restoring it while each part
  that has landed is copied out, Release in the background), also with the engine's
  integrity check fed each copy as it is made, and after the whole copy as it was before;
  and the cross-host path
  (Put / Get streams over loopback gRPC);
- a first copy into a fresh shared-memory mapping, each page faulted in by the copy, vs
  one whose pages were mapped in beforehand (common/prefault.py, as the tierstore and
  the engine map the arena's in the background).

The engine's claims before its last changes are measured in the same rounds too
(Match over gRPC; Match then Acquire from RAM; Acquire then copy from disk), so each
change shows against what it replaced. Every figure is the median of --repeats runs, each round measuring the
baselines and the tiers one after the other (interleaved), with the 1-minute load average
before and after. Prints a Markdown table, writes bench/results/tiers.md (and raw/tiers.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import tier_claims
from bench.table import markdown, save
from bench.tier_baselines import MiB, RawCopies
from bench.tier_paths import TierPaths, engine_clients, meta, register
from common.launch import Service, launch_tierstore
from tierstore.client import TierStoreClient


def launch_store(folder: Path, n: int) -> Service:
    """A tierstore whose arena holds one state of `n` bytes but not two, on an otherwise quiet disk: with copies
    ahead of need on, the copy of the previous repeat's state would run under the next one (tier_claims
    measures what they buy, end to end)."""
    return launch_tierstore(folder, arena_bytes=n + n // 2 + MiB, disk_bytes=4 * n + 64 * MiB,
                            env={"IGNIS_LOG_LEVEL": "WARNING", "IGNIS_KV_DISK__COPY_AHEAD": "false"})


def ram_rounds(paths: TierPaths, repeats: int) -> None:
    """KV-RAM: the baseline memcpy and the tiers interleaved, round by round."""
    raw, samples, c = paths.raw, paths.samples, paths.store_client
    for _ in range(repeats):
        samples.add(raw_memcpy=raw.memcpy())
        paths.ram_write()
        c.store(paths.held, raw.src_bytes, meta(raw.n))
        samples.add(raw_memcpy=raw.memcpy())
        paths.ram_claim_table()
        samples.add(raw_memcpy=raw.memcpy())
        paths.ram_claim_table(checked=True)
        samples.add(raw_memcpy=raw.memcpy())
        paths.ram_claim(paths.engine, "ram_claim_engine")
        samples.add(raw_memcpy=raw.memcpy(), raw_memcpy_threads=raw.memcpy_threads())
        paths.ram_claim(paths.engine, "ram_claim_checked", checked=True)
        samples.add(raw_memcpy=raw.memcpy())
        paths.ram_claim(paths.engine_grpc, "ram_claim_grpc")
        samples.add(raw_memcpy=raw.memcpy())
        paths.ram_claim_acquire()
        paths.ram_claim_sync()
        c.drop(paths.held)
        samples.add(raw_memcpy=raw.memcpy(), fresh_copy_faulting=raw.fresh_mapping_copy(False))
        samples.add(raw_memcpy=raw.memcpy(), fresh_copy_prefaulted=raw.fresh_mapping_copy(True))
    assert np.array_equal(raw.dst, raw.src)


def disk_rounds(paths: TierPaths, repeats: int) -> None:
    """KV-disk: the raw file's write and cold reads beside each spill and restore, round by round."""
    raw, samples = paths.raw, paths.samples
    for _ in range(repeats):
        samples.add(raw_write_fsync=raw.write(), raw_read_cold=raw.read())
        paths.disk_round()
        paths.disk_round("landing")
        samples.add(raw_read_cold=raw.read())
        paths.disk_round("after")
        samples.add(raw_read_cold=raw.read(), raw_read_cold_direct=raw.read(direct=True))
        paths.disk_round_acquire()
    assert np.array_equal(raw.dst, raw.src)


def measure(paths: TierPaths, repeats: int, ram_only: bool = False) -> dict[str, Any]:
    """Every round, after an uncounted write that faults the arena mapping in; the medians, every sample,
    the 1-minute load average before and after, and the store's own counts. `ram_only`: the KV-RAM rounds."""
    paths.ram_write()
    paths.samples.runs.clear()
    load_before = os.getloadavg()[0]
    ram_rounds(paths, repeats)
    if not ram_only:
        disk_rounds(paths, repeats)
        for _ in range(max(1, repeats // 2)):
            paths.stream()
    load_after = os.getloadavg()[0]
    stats = paths.store_client.stats()
    return {"bytes": paths.raw.n, "repeats": repeats, "seconds": paths.samples.medians(),
            "samples": paths.samples.runs, "load_1min": [load_before, load_after],
            "stats": {"spills": stats.spills, "restores": stats.restores, "checksum_failures": stats.checksum_failures}}


def run(n: int, repeats: int, folder: Path, ram_only: bool = False) -> dict[str, Any]:
    """One state of `n` bytes through a tierstore in `folder`, each path beside its raw baseline."""
    threads = max(1, torch.get_num_threads())  # as the engine: its CPU threads (engine/tiers/link.py)
    helpers = ThreadPoolExecutor(max(1, threads - 1))
    raw = RawCopies(n, folder, helpers)
    store = launch_store(folder, n)
    engine, engine_grpc = engine_clients(store)
    try:
        with TierStoreClient(store.address, timeout=120) as c:
            register(c, engine, engine_grpc)
            return measure(TierPaths(raw, c, engine, engine_grpc, folder / "kv-disk" / "blobs", helpers, threads),
                           repeats, ram_only)
    finally:
        engine.close()
        engine_grpc.close()
        helpers.shutdown()
        store.stop()


# The table's rows: (path, what, the sample's key, the baseline's key or None).
TABLE_ROWS: list[tuple[str, str, str, str | None]] = [
    ("raw", "numpy memcpy", "raw_memcpy", None),
    ("raw", "numpy memcpy in halves on two threads", "raw_memcpy_threads", "raw_memcpy"),
    ("KV-RAM write", "copy into the arena by offset", "ram_write_copy", "raw_memcpy"),
    ("KV-RAM write", "Reserve + copy + Commit (checksum)", "ram_write_e2e", "raw_memcpy"),
    ("KV-RAM read", "copy out of the arena", "ram_read_copy", "raw_memcpy"),
    ("KV-RAM claim", "engine: found in the published table (no Match, no lease) + copy, the slot checked "
     "unchanged after it, the use reported in the background", "ram_claim_table", "raw_memcpy"),
    ("KV-RAM claim", "engine, its integrity check too: found in the published table + copy and AES-GMAC in "
     "4 MiB segments on two threads, the slot checked after it, the use reported in the background",
     "ram_claim_table_checked", "raw_memcpy"),
    ("Match", "a claim's lookup in the published table instead (no Match), right after a copy",
     "ram_claim_table_find", "ram_claim_engine_match"),
    ("KV-RAM claim", "engine before the published table: Match on the Match socket (leases the hit) + copy, "
     "Release in the background", "ram_claim_engine", "raw_memcpy"),
    ("KV-RAM claim", "engine before the table, its integrity check too: Match on the Match socket + copy and "
     "AES-GMAC in 4 MiB "
     "segments on two threads (each 256 KiB hashed once copied), Release in the background", "ram_claim_checked",
     "raw_memcpy"),
    ("integrity", "the AES-GMAC of the copy alone (one core)", "ram_claim_checked_tag", "raw_memcpy"),
    ("integrity", "the keyed BLAKE3 of the same copy (both cores): the tag before AES-GMAC", "blake3_of_copy",
     "raw_memcpy"),
    ("KV-RAM claim", "engine before the Match socket: Match over gRPC (leases the hit) + copy, Release behind",
     "ram_claim_grpc", "raw_memcpy"),
    ("Match", "a claim's Match (RAM hit, leased) on the Match socket, right after a copy", "ram_claim_engine_match",
     "ram_claim_grpc_match"),
    ("Match", "a claim's Match (RAM hit, leased) over gRPC, right after a copy", "ram_claim_grpc_match", None),
    ("KV-RAM claim", "engine before the leasing Match: Match + Acquire + copy, Release in the background",
     "ram_claim_acquire", "raw_memcpy"),
    ("KV-RAM claim", "example client: Match + Acquire + copy + Release, each waited for",
     "ram_claim_sync", "raw_memcpy"),
    ("first touch", "numpy memcpy into a fresh shared-memory mapping: each page faulted in by the copy",
     "fresh_copy_faulting", "raw_memcpy"),
    ("first touch", "the same, its pages mapped in beforehand in the background (common/prefault.py, as the "
     "arena's are in the tierstore and the engine)", "fresh_copy_prefaulted", "raw_memcpy"),
    ("raw", "file write + fsync", "raw_write_fsync", None),
    ("raw", "file read, cold", "raw_read_cold", None),
    ("raw", "file read, cold, O_DIRECT", "raw_read_cold_direct", "raw_read_cold"),
    ("KV-disk spill", "checksum + write + fsync + rename + LMDB", "disk_spill", "raw_write_fsync"),
    ("KV-disk restore", "AcquireStream: read + checksum into the arena, cold (till verified)",
     "disk_restore_cold", "raw_read_cold"),
    ("KV-disk claim", "engine: Match + AcquireStream(restore, copied as it lands), Release in the background",
     "disk_claim_cold", "raw_read_cold"),
    ("KV-disk claim", "engine, its integrity check too: as above + AES-GMAC of each copy as it is made",
     "disk_claim_checked_landing", "raw_read_cold"),
    ("KV-disk claim", "engine before the check fed copy by copy: as above, the whole copy hashed after the read",
     "disk_claim_checked_after", "raw_read_cold"),
    ("KV-disk claim", "engine before AcquireStream: Match + Acquire(restore), then the copy",
     "disk_claim_cold_acquire", "raw_read_cold"),
    ("gRPC Put", "stream in 1 MiB chunks (loopback)", "grpc_put", "raw_memcpy"),
    ("gRPC Get", "stream in 1 MiB chunks (loopback)", "grpc_get", "raw_memcpy"),
]


def table(res: dict[str, Any]) -> tuple[str, list[list[Any]]]:
    n, s = res["bytes"], res["seconds"]

    def gibs(key: str) -> float:
        return n / s[key] / (1 << 30)

    rows: list[list[Any]] = []

    def row(path: str, what: str, key: str, base: str | None) -> None:
        vs = f"{s[key] / s[base]:.2f}x the time" if base else "-"
        rate = "-" if path == "Match" else round(gibs(key), 2)  # moves no bytes
        ms = round(s[key] * 1e3, 3 if path == "Match" else 1)
        rows.append([path, what, ms, rate, base or "-", vs])

    for entry in TABLE_ROWS:
        if entry[2] in s:  # a --ram-only run measures the KV-RAM rows alone
            row(*entry)
    headers = ["path", "what", "ms", "GiB/s", "baseline", "vs baseline"]
    return markdown(headers, rows), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=150, help="state size in MiB (default 150)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs per measurement; the median counts")
    parser.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: $TMPDIR)")
    parser.add_argument("--claims", action=argparse.BooleanOptionalAction, default=True,
                        help="also claim a state of that size through the engine vs re-prefilling it (default on)")
    parser.add_argument("--hidden", type=int, default=1024, help="dense checkpoint of the engine claims")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ram-only", action="store_true",
                        help="only the KV-RAM rounds (the claims from RAM against memcpy), no claims through the "
                             "engine; printed, not saved (bench/results/tiers.md is a whole run's)")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="ignis-bench-tiers-", dir=args.dir))
    try:
        res = run(args.mib * MiB, args.repeats, folder, args.ram_only)
        res["scratch"] = str(folder)
        text, rows = table(res)
        if args.claims and not args.ram_only:
            claims = tier_claims.measure(args.mib, folder, args.hidden, args.layers)
            res["engine_claims"] = claims
            claim_rows = tier_claims.rows(claims)
            text += (f"\n\n#### Claims through the engine: dense h{args.hidden}/{args.layers} layers, "
                     f"{claims['tokens']} tokens = {claims['state_bytes'] / MiB:.0f} MiB of KV (one run)\n\n"
                     + markdown(tier_claims.CLAIM_HEADERS, claim_rows))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    load = res["load_1min"]
    title = (f"### Tiers: one {args.mib} MiB state (medians of {args.repeats}, interleaved; "
             f"load {load[0]:.2f} -> {load[1]:.2f})")
    print(title + "\n\n" + text)
    if args.ram_only:
        return 0
    path = save("tiers", {**res, "rows": rows}, title + "\n\n" + text)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
