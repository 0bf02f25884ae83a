"""The paths a state takes through a real tierstore, each one timed into `Samples` (part of
`python -m bench.tiers`): a write into KV-RAM, claims from KV-RAM the engine's way (found in the store's
published table without a Match, and before it with a Match on the Match socket, each with and without
its integrity check), over gRPC, the engine's way before the leasing Match and
the example client's way; claims from KV-disk (AcquireStream, with the check fed as each copy lands or
after the whole copy, and Acquire before AcquireStream); and Put / Get streams over loopback gRPC."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from bench.tier_baselines import RawCopies, drop_cache, timed
from common.launch import Service
from engine.tiers.checked_copy import Piece, copy_and_check
from engine.tiers.client import TierClient
from engine.tiers.integrity import IntegrityKey
from ignis.v1 import common_pb2, tierstore_pb2
from tierstore.client import TierStoreClient

NS = b"bench-namespace!"
MODEL, PAGE, LAYOUT = "bench", 16, "bytes"  # one registration for both clients: one namespace


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


def engine_clients(store: Service) -> tuple[TierClient, TierClient]:
    """The engine's client of `store` twice: Match on the store's Match socket, and Match over gRPC."""
    engine, engine_grpc = (TierClient(store.address, model=MODEL, page_size=PAGE, layout=LAYOUT,
                                      kv_bytes_per_token=0, fixed_state_bytes=0, timeout=120, local_match=local)
                           for local in (True, False))
    return engine, engine_grpc


def register(store_client: TierStoreClient, engine: TierClient, engine_grpc: TierClient) -> None:
    """The one namespace both engine clients use, registered, and the arena mapped by each."""
    store_client.register(NS, model=MODEL, page_size=PAGE, layout=LAYOUT)
    assert engine.ensure(NS) and engine_grpc.ensure(NS), "the engine's client could not map the arena"
    assert engine.local is not None and engine_grpc.local is None, "the store serves no Match socket"
    assert engine.table is not None, "the store publishes no table"


@dataclass
class TierPaths:
    """The timed paths of the module docstring on one registered namespace; `held` is the state the RAM
    claims read (stored and dropped by the caller's rounds)."""

    raw: RawCopies  # the state's bytes and the buffer every claim copies into
    store_client: TierStoreClient  # the example client: writes, spills and its own claim
    engine: TierClient
    engine_grpc: TierClient
    blobs: Path  # the store's KV-disk blobs, dropped from the page cache before each cold read
    helpers: ThreadPoolExecutor  # the engine's other CPU threads, for the checked copy
    threads: int
    samples: Samples = field(default_factory=Samples)
    integrity: IntegrityKey = field(default_factory=IntegrityKey.ephemeral)
    name: Names = field(default_factory=Names)
    held: bytes = field(init=False)
    dst_tensor: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.held = self.name()
        self.dst_tensor = torch.from_numpy(self.raw.dst)

    @property
    def n(self) -> int:
        return self.raw.n

    def checked_copy(self, arena: memoryview, hashed: Any) -> None:
        """The engine's copy and check of a claim from KV-RAM (engine/tiers/checked_copy.py): segment by
        segment on its threads, each hashed from the copy a stride at a time."""
        copy_and_check([Piece(0, self.dst_tensor)], torch.frombuffer(arena, dtype=torch.uint8), hashed,
                       self.helpers, self.threads)
        hashed.digest()

    def tag_of(self, data: memoryview) -> bytes:
        """The tag over `data` in order on this thread: every segment's GMAC and the tag's own."""
        mac = self.integrity.hasher(b"n" * 16, NS, self.n // PAGE, self.n)
        mac.update(data)
        return mac.digest()

    def drain(self) -> None:
        """Waits for the engine clients' background Releases (outside the timed part)."""
        for client in (self.engine, self.engine_grpc):
            client._releaser.submit(lambda: None).result()

    def ram_write(self) -> None:
        c, n, h = self.store_client, self.n, self.name()
        t0 = time.perf_counter()
        extent = c.reserve(h, n)
        t1 = time.perf_counter()
        c.write(extent, self.raw.src_bytes)
        t2 = time.perf_counter()
        c.commit(h, meta(n))
        t3 = time.perf_counter()
        c.drop(h)
        self.samples.add(ram_write_copy=t2 - t1, ram_write_e2e=t3 - t0)

    def ram_claim(self, client: TierClient, key: str, checked: bool = False) -> None:
        """The engine's claim from RAM with `client`: the Match leases the hit, the copy, Release behind.
        `checked`: also the engine's integrity check on a CPU cache (engine/tiers/link.py), its MAC
        (AES-GMAC) over what was copied, which a claim from the store cannot skip."""
        n, held, dst, out = self.n, self.held, self.raw.dst, self.raw.out
        local_calls = client.local.calls if client.local is not None else 0
        t0 = time.perf_counter()
        [hit], _ = client.match(NS, [], held, lease_seconds=3.0)
        assert hit.lease_id, "a RAM hit comes leased"
        tm = time.perf_counter()
        if checked:  # as the engine: copied and checked segment by segment on its threads
            self.checked_copy(client.arena_bytes(hit.extent.offset, n), self.integrity.hasher(held, NS, n // PAGE, n))
        else:
            np.copyto(dst, np.frombuffer(client.arena_bytes(hit.extent.offset, n), dtype=np.uint8))
        tc = time.perf_counter()
        client.release(hit.lease_id, (), client.match_instance)
        t1 = time.perf_counter()
        self.drain()
        assert (client.local.calls if client.local is not None else 0) == local_calls + (client is self.engine)
        self.samples.add(**{key: t1 - t0, f"{key}_match": tm - t0, f"{key}_copy": tc - tm})
        if checked:  # the tag alone over the same copy, and the keyed BLAKE3 before it (untimed in the claim)
            self.samples.add(**{f"{key}_tag": timed(lambda: self.tag_of(out))})
            self.samples.add(blake3_of_copy=timed(lambda: blake3.blake3(out, key=b"k" * 32,
                                                                        max_threads=blake3.blake3.AUTO).digest()))

    def ram_claim_table(self, checked: bool = False) -> None:
        """The engine's claim from RAM through the store's published table (engine/tiers/link.py): the state
        found in the mapped table (no Match, no lease), the copy, its slot checked unchanged after it, the use
        reported to the store in the background. `checked`: the integrity check too, as `ram_claim`."""
        client, n, held, key = self.engine, self.n, self.held, "ram_claim_table" + ("_checked" if checked else "")
        table = client.table
        assert table is not None and client.local is not None
        matches = client.local.calls
        t0 = time.perf_counter()
        entry = table.state(held) if table.current() else None
        assert entry is not None, "the state is not in the published table"
        tf = time.perf_counter()
        if checked:
            self.checked_copy(client.arena_bytes(entry.offset, n), self.integrity.hasher(held, NS, n // PAGE, n))
        else:
            np.copyto(self.raw.dst, np.frombuffer(client.arena_bytes(entry.offset, n), dtype=np.uint8))
        tc = time.perf_counter()
        assert table.unchanged(entry), "the state left KV-RAM during the copy"
        client.report_used(held, client.instance_id)
        t1 = time.perf_counter()
        self.drain()
        assert client.local.calls == matches, "a claim through the table sent a Match"
        self.samples.add(**{key: t1 - t0, f"{key}_find": tf - t0, f"{key}_copy": tc - tf})

    def ram_claim_acquire(self) -> None:
        """The engine's way before the Match could lease: Match, then Acquire, copy, Release behind
        (all over gRPC, as it was then)."""
        engine_grpc = self.engine_grpc
        t0 = time.perf_counter()
        [hit], _ = engine_grpc.match(NS, [], self.held)
        lease = engine_grpc.acquire(hit.state_hash)
        assert lease is not None
        np.copyto(self.raw.dst, np.frombuffer(engine_grpc.arena_bytes(lease.extent.offset, self.n), dtype=np.uint8))
        engine_grpc.release(lease.lease_id, (), lease.instance_id)
        t1 = time.perf_counter()
        self.drain()
        self.samples.add(ram_claim_acquire=t1 - t0)

    def ram_claim_sync(self) -> None:
        c = self.store_client
        t0 = time.perf_counter()
        [hit] = c.match(NS, [], tail_hash=self.held)
        lease = c.acquire(hit.state_hash)
        t1 = time.perf_counter()
        view = c.read(lease.extent)
        np.copyto(self.raw.dst, np.frombuffer(view, dtype=np.uint8))
        t2 = time.perf_counter()
        view.release()
        c.release(lease.lease_id)
        t3 = time.perf_counter()
        self.samples.add(ram_read_copy=t2 - t1, ram_claim_sync=t3 - t0)

    def disk_round_acquire(self) -> None:
        """The claim from disk before AcquireStream: the whole restore, then the copy."""
        c, n, engine = self.store_client, self.n, self.engine
        victim, pusher = self.name(), self.name()
        c.store(victim, self.raw.src_bytes, meta(n))
        c.reserve(pusher, n)
        c.drop(pusher)
        drop_cache(self.blobs / victim.hex())
        t0 = time.perf_counter()
        [hit], _ = engine.match(NS, [], victim, lease_seconds=3.0)
        lease = engine.acquire(hit.state_hash)
        assert lease is not None and lease.from_tier == common_pb2.REUSE_TIER_DISK
        np.copyto(self.raw.dst, np.frombuffer(engine.arena_bytes(lease.extent.offset, n), dtype=np.uint8))
        engine.release(lease.lease_id, (), lease.instance_id)
        t1 = time.perf_counter()
        self.drain()
        c.drop(victim)
        self.samples.add(disk_claim_cold_acquire=t1 - t0)

    def disk_round(self, check: str = "") -> None:
        """A claim from disk the engine's way. `check`: also the engine's integrity check on what it
        copied, "landing": each copy hashed as it is made (engine/tiers/unpacked_tag.py, the engine
        now), "after": the whole copy hashed once the read is through (the engine before)."""
        c, n, engine, dst, out = self.store_client, self.n, self.engine, self.raw.dst, self.raw.out
        victim, pusher = self.name(), self.name()
        c.store(victim, self.raw.src_bytes, meta(n))
        spill = timed(lambda: c.reserve(pusher, n))  # no room for two: the victim goes to disk
        c.drop(pusher)
        assert c.match(NS, [], tail_hash=victim)[0].tier == common_pb2.REUSE_TIER_DISK
        drop_cache(self.blobs / victim.hex())
        hashed = self.integrity.hasher(victim, NS, n // PAGE, n)
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
        self.drain()
        c.drop(victim)
        if check:
            self.samples.add(**{f"disk_claim_checked_{check}": t3 - t0})
        else:
            self.samples.add(disk_spill=spill, disk_match=t1 - t0, disk_restore_cold=restored - t1,
                             disk_claim_cold=t3 - t0)

    def stream(self) -> None:
        c, h = self.store_client, self.name()
        put = timed(lambda: c.put(h, self.raw.src_bytes, meta(self.n)))
        t0 = time.perf_counter()
        _, data = c.get(h)
        get = time.perf_counter() - t0
        assert len(data) == self.n
        c.drop(h)
        self.samples.add(grpc_put=put, grpc_get=get)
