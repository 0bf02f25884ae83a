"""`python -m bench.tiers`: the lower tiers against the raw copies they are built on.

One ~150 MiB state, side by side in one run, through a real tierstore process:

- KV-RAM: the engine's copy into / out of the shared-memory arena by offset
  (and the whole Reserve+copy+Commit) vs a raw numpy memcpy of the same bytes;
  a claim the way the engine makes it (engine/tiers/client.py: one Match on the
  store's Match socket that leases the hit, the copy, Release in the background),
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
before and after. Prints a Markdown table, writes bench/results/tiers.json.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from bench import tier_claims
from common.launch import launch_tierstore
from bench.table import markdown, save
from common.prefault import Prefault
from engine.tiers.client import TierClient
from engine.tiers.integrity import IntegrityKey
from engine.tiers.checked_copy import Piece, copy_and_check
from ignis.v1 import common_pb2, tierstore_pb2
from tierstore.client import TierStoreClient

MiB = 1 << 20
NS = b"bench-namespace!"
MODEL, PAGE, LAYOUT = "bench", 16, "bytes"  # one registration for both clients: one namespace


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_cache(path: Path) -> None:
    """Evicts a file's pages from the page cache (clean pages: no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def meta(n: int) -> tierstore_pb2.StateMetadata:
    return tierstore_pb2.StateMetadata(namespace=NS, tokens=16, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                                       request_class=common_pb2.REQUEST_CLASS_AGENT, page_hashes=[], nbytes=n)


class Names:
    def __init__(self) -> None:
        self.i = 0

    def __call__(self) -> bytes:
        self.i += 1
        return self.i.to_bytes(16, "big")


class Samples:
    """Seconds per measurement name, collected round by round."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}

    def add(self, **seconds: float) -> None:
        for key, value in seconds.items():
            self.runs.setdefault(key, []).append(value)

    def medians(self) -> dict[str, float]:
        return {key: statistics.median(values) for key, values in self.runs.items()}


def run(n: int, repeats: int, folder: Path) -> dict[str, Any]:
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)  # page-aligned, as O_DIRECT needs
    src_bytes = memoryview(src.data).cast("B")
    out = memoryview(dst.data).cast("B")
    raw_file = folder / "raw.bin"
    samples = Samples()
    integrity = IntegrityKey.ephemeral()

    dst_tensor = torch.from_numpy(dst)
    threads = max(1, torch.get_num_threads())  # as the engine: its CPU threads (engine/tiers/link.py)
    helpers = ThreadPoolExecutor(max(1, threads - 1))

    def checked_copy(arena: memoryview, hashed: Any) -> None:
        """The engine's copy and check of a claim from KV-RAM (engine/tiers/checked_copy.py): segment by
        segment on its threads, each hashed from the copy a stride at a time."""
        copy_and_check([Piece(0, dst_tensor)], torch.frombuffer(arena, dtype=torch.uint8), hashed, helpers, threads)
        hashed.digest()

    def tag_of(data: memoryview) -> bytes:
        """The tag over `data` in order on this thread: every segment's GMAC and the tag's own."""
        mac = integrity.hasher(b"n" * 16, NS, n // PAGE, n)
        mac.update(data)
        return mac.digest()

    def raw_memcpy_threads() -> float:
        """A memcpy of the same bytes in halves on two threads (ctypes' memmove lets go of the GIL): the
        copy's own floor on two cores."""
        half = n // 2

        def copy() -> None:
            other = helpers.submit(ctypes.memmove, dst.ctypes.data, src.ctypes.data, half)
            ctypes.memmove(dst.ctypes.data + half, src.ctypes.data + half, n - half)
            other.result()
        return timed(copy)

    def raw_memcpy() -> float:
        return timed(lambda: np.copyto(dst, src))

    def raw_write() -> float:
        def write() -> None:
            fd = os.open(raw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            view = src_bytes
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.close(fd)
        return timed(write)

    def raw_read(direct: bool = False) -> float:
        drop_cache(raw_file)

        def read() -> None:
            fd = os.open(raw_file, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                pos = 0
                while pos < n:
                    pos += os.readv(fd, [out[pos:pos + 8 * MiB]]) or 0
            finally:
                os.close(fd)
        return timed(read)

    def fresh_mapping_copy(prefault: bool) -> float:
        """The first copy into a fresh shared-memory file's mapping, as into never-touched arena pages:
        its pages faulted in by the copy itself, or mapped in beforehand (untimed) by common/prefault.py
        as the tierstore and the engine do for the arena."""
        fd, path = tempfile.mkstemp(prefix="ignis-bench-fresh-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        try:
            os.posix_fallocate(fd, 0, n)
            mapping = mmap.mmap(fd, n)
            if prefault:
                assert Prefault(mapping, "bench").done.wait(120)
            fresh = np.frombuffer(mapping, dtype=np.uint8)
            seconds = timed(lambda: np.copyto(fresh, src))
            del fresh
            mapping.close()
            return seconds
        finally:
            os.close(fd)
            os.unlink(path)

    np.copyto(dst, src)  # fault the destination in once
    raw_write()

    # Each row times one operation against a raw baseline on an otherwise quiet disk: with copies ahead of
    # need on, the copy of the previous repeat's state would run under the next one (tier_claims measures
    # what they buy, end to end).
    store = launch_tierstore(folder, arena_bytes=n + n // 2 + MiB, disk_bytes=4 * n + 64 * MiB,
                             env={"IGNIS_LOG_LEVEL": "WARNING", "IGNIS_KV_DISK__COPY_AHEAD": "false"})
    name = Names()
    engine, engine_grpc = (TierClient(store.address, model=MODEL, page_size=PAGE, layout=LAYOUT,
                                      kv_bytes_per_token=0, fixed_state_bytes=0, timeout=120, local_match=local)
                           for local in (True, False))
    try:
        with TierStoreClient(store.address, timeout=120) as c:
            c.register(NS, model=MODEL, page_size=PAGE, layout=LAYOUT)
            assert engine.ensure(NS) and engine_grpc.ensure(NS), "the engine's client could not map the arena"
            assert engine.local is not None and engine_grpc.local is None, "the store serves no Match socket"
            blobs = folder / "kv-disk" / "blobs"

            def drain() -> None:
                """Waits for the engine clients' background Releases (outside the timed part)."""
                for client in (engine, engine_grpc):
                    client._releaser.submit(lambda: None).result()

            def ram_write() -> None:
                h = name()
                t0 = time.perf_counter()
                extent = c.reserve(h, n)
                t1 = time.perf_counter()
                c.write(extent, src_bytes)
                t2 = time.perf_counter()
                c.commit(h, meta(n))
                t3 = time.perf_counter()
                c.drop(h)
                samples.add(ram_write_copy=t2 - t1, ram_write_e2e=t3 - t0)

            held = name()

            def ram_claim(client: TierClient, key: str, checked: bool = False) -> None:
                """The engine's claim from RAM with `client`: the Match leases the hit, the copy, Release behind.
                `checked`: also the engine's integrity check on a CPU cache (engine/tiers/link.py), its MAC
                (AES-GMAC) over what was copied, which a claim from the store cannot skip."""
                local_calls = client.local.calls if client.local is not None else 0
                t0 = time.perf_counter()
                [hit], _ = client.match(NS, [], held, lease_seconds=3.0)
                assert hit.lease_id, "a RAM hit comes leased"
                tm = time.perf_counter()
                if checked:  # as the engine: copied and checked segment by segment on its threads
                    checked_copy(client.arena_bytes(hit.extent.offset, n), integrity.hasher(held, NS, n // PAGE, n))
                else:
                    np.copyto(dst, np.frombuffer(client.arena_bytes(hit.extent.offset, n), dtype=np.uint8))
                tc = time.perf_counter()
                client.release(hit.lease_id, (), client.match_instance)
                t1 = time.perf_counter()
                drain()
                assert (client.local.calls if client.local is not None else 0) == local_calls + (client is engine)
                samples.add(**{key: t1 - t0, f"{key}_match": tm - t0, f"{key}_copy": tc - tm})
                if checked:  # the tag alone over the same copy, and the keyed BLAKE3 before it (untimed in the claim)
                    samples.add(**{f"{key}_tag": timed(lambda: tag_of(out))})
                    samples.add(blake3_of_copy=timed(lambda: blake3.blake3(out, key=b"k" * 32,
                                                                           max_threads=blake3.blake3.AUTO).digest()))

            def ram_claim_acquire() -> None:
                """The engine's way before the Match could lease: Match, then Acquire, copy, Release behind
                (all over gRPC, as it was then)."""
                t0 = time.perf_counter()
                [hit], _ = engine_grpc.match(NS, [], held)
                lease = engine_grpc.acquire(hit.state_hash)
                assert lease is not None
                np.copyto(dst, np.frombuffer(engine_grpc.arena_bytes(lease.extent.offset, n), dtype=np.uint8))
                engine_grpc.release(lease.lease_id, (), lease.instance_id)
                t1 = time.perf_counter()
                drain()
                samples.add(ram_claim_acquire=t1 - t0)

            def ram_claim_sync() -> None:
                t0 = time.perf_counter()
                [hit] = c.match(NS, [], tail_hash=held)
                lease = c.acquire(hit.state_hash)
                t1 = time.perf_counter()
                view = c.read(lease.extent)
                np.copyto(dst, np.frombuffer(view, dtype=np.uint8))
                t2 = time.perf_counter()
                view.release()
                c.release(lease.lease_id)
                t3 = time.perf_counter()
                samples.add(ram_read_copy=t2 - t1, ram_claim_sync=t3 - t0)

            def disk_round_acquire() -> None:
                """The claim from disk before AcquireStream: the whole restore, then the copy."""
                victim, pusher = name(), name()
                c.store(victim, src_bytes, meta(n))
                c.reserve(pusher, n)
                c.drop(pusher)
                drop_cache(blobs / victim.hex())
                t0 = time.perf_counter()
                [hit], _ = engine.match(NS, [], victim, lease_seconds=3.0)
                lease = engine.acquire(hit.state_hash)
                assert lease is not None and lease.from_tier == common_pb2.REUSE_TIER_DISK
                np.copyto(dst, np.frombuffer(engine.arena_bytes(lease.extent.offset, n), dtype=np.uint8))
                engine.release(lease.lease_id, (), lease.instance_id)
                t1 = time.perf_counter()
                drain()
                c.drop(victim)
                samples.add(disk_claim_cold_acquire=t1 - t0)

            def disk_round(check: str = "") -> None:
                """A claim from disk the engine's way. `check`: also the engine's integrity check on what it
                copied, "landing": each copy hashed as it is made (engine/tiers/unpacked_tag.py, the engine
                now), "after": the whole copy hashed once the read is through (the engine before)."""
                victim, pusher = name(), name()
                c.store(victim, src_bytes, meta(n))
                spill = timed(lambda: c.reserve(pusher, n))  # no room for two: the victim goes to disk
                c.drop(pusher)
                assert c.match(NS, [], tail_hash=victim)[0].tier == common_pb2.REUSE_TIER_DISK
                drop_cache(blobs / victim.hex())
                hashed = integrity.hasher(victim, NS, n // PAGE, n)
                t0 = time.perf_counter()
                [hit], _ = engine.match(NS, [], victim, lease_seconds=3.0)
                t1 = time.perf_counter()
                assert hit.tier == common_pb2.REUSE_TIER_DISK and not hit.lease_id
                # As the engine restores into a CPU cache: each part copied out as soon as it has landed.
                lease, copied, verified, restored = None, 0, False, 0.0
                for message in engine.acquire_stream(hit.state_hash):
                    if message.HasField("lease"):
                        lease = message.lease
                        arena = np.frombuffer(engine.arena_bytes(lease.extent.offset, n), dtype=np.uint8)
                    ready, verified = message.ready_bytes, message.verified
                    if verified:
                        restored = time.perf_counter()
                    if ready > copied:
                        np.copyto(dst[copied:ready], arena[copied:ready])
                        if check == "landing":
                            hashed.update(out[copied:ready])
                        copied = ready
                if check == "after":
                    hashed.update(out)
                if check:
                    hashed.digest()
                assert lease is not None and verified and lease.from_tier == common_pb2.REUSE_TIER_DISK
                engine.release(lease.lease_id, (), lease.instance_id)
                t3 = time.perf_counter()
                del arena
                drain()
                c.drop(victim)
                if check:
                    samples.add(**{f"disk_claim_checked_{check}": t3 - t0})
                else:
                    samples.add(disk_spill=spill, disk_match=t1 - t0, disk_restore_cold=restored - t1,
                                disk_claim_cold=t3 - t0)

            def stream() -> None:
                h = name()
                put = timed(lambda: c.put(h, src_bytes, meta(n)))
                t0 = time.perf_counter()
                _, data = c.get(h)
                get = time.perf_counter() - t0
                assert len(data) == n
                c.drop(h)
                samples.add(grpc_put=put, grpc_get=get)

            ram_write()  # the first run faults the arena mapping in: not counted
            samples.runs.clear()
            load_before = os.getloadavg()[0]
            for _ in range(repeats):  # RAM: baseline and tiers interleaved, round by round
                samples.add(raw_memcpy=raw_memcpy())
                ram_write()
                c.store(held, src_bytes, meta(n))
                samples.add(raw_memcpy=raw_memcpy())
                ram_claim(engine, "ram_claim_engine")
                samples.add(raw_memcpy=raw_memcpy(), raw_memcpy_threads=raw_memcpy_threads())
                ram_claim(engine, "ram_claim_checked", checked=True)
                samples.add(raw_memcpy=raw_memcpy())
                ram_claim(engine_grpc, "ram_claim_grpc")
                samples.add(raw_memcpy=raw_memcpy())
                ram_claim_acquire()
                ram_claim_sync()
                c.drop(held)
                samples.add(raw_memcpy=raw_memcpy(), fresh_copy_faulting=fresh_mapping_copy(False))
                samples.add(raw_memcpy=raw_memcpy(), fresh_copy_prefaulted=fresh_mapping_copy(True))
            assert np.array_equal(dst, src)
            for _ in range(repeats):  # disk: the raw file's write and cold reads beside each spill and restore
                samples.add(raw_write_fsync=raw_write(), raw_read_cold=raw_read())
                disk_round()
                disk_round("landing")
                samples.add(raw_read_cold=raw_read())
                disk_round("after")
                samples.add(raw_read_cold=raw_read(), raw_read_cold_direct=raw_read(direct=True))
                disk_round_acquire()
            assert np.array_equal(dst, src)
            for _ in range(max(1, repeats // 2)):
                stream()
            load_after = os.getloadavg()[0]
            stats = c.stats()
    finally:
        engine.close()
        engine_grpc.close()
        helpers.shutdown()
        store.stop()
    return {"bytes": n, "repeats": repeats, "seconds": samples.medians(), "samples": samples.runs,
            "load_1min": [load_before, load_after],
            "stats": {"spills": stats.spills, "restores": stats.restores, "checksum_failures": stats.checksum_failures}}


# The table's rows: (path, what, the sample's key, the baseline's key or None).
TABLE_ROWS: list[tuple[str, str, str, str | None]] = [
    ("raw", "numpy memcpy", "raw_memcpy", None),
    ("raw", "numpy memcpy in halves on two threads", "raw_memcpy_threads", "raw_memcpy"),
    ("KV-RAM write", "copy into the arena by offset", "ram_write_copy", "raw_memcpy"),
    ("KV-RAM write", "Reserve + copy + Commit (checksum)", "ram_write_e2e", "raw_memcpy"),
    ("KV-RAM read", "copy out of the arena", "ram_read_copy", "raw_memcpy"),
    ("KV-RAM claim", "engine: Match on the Match socket (leases the hit) + copy, Release in the background",
     "ram_claim_engine", "raw_memcpy"),
    ("KV-RAM claim", "engine, its integrity check too: Match on the Match socket + copy and AES-GMAC in 4 MiB "
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
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="ignis-bench-tiers-", dir=args.dir))
    try:
        res = run(args.mib * MiB, args.repeats, folder)
        res["scratch"] = str(folder)
        text, rows = table(res)
        if args.claims:
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
    path = save("tiers", {**res, "rows": rows}, title + "\n\n" + text)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
