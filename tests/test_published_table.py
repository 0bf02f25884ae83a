"""The published table (tierstore/published_table.py, engine/tiers/published_table.py): a claim from
KV-RAM found without a Match, against a real `python -m tierstore` and the engine's real TierLink and
TierClient over a CPU cache.

A claim through the table copies the bytes the engine wrote, and asks nothing; a state evicted in the
middle of its copy, its extent rewritten by another state, runs cold and is never served; an entry
forged by a process that can write the table is refused by the engine's tag; a store restarted (killed
or stopped) leaves its table unused; the store still counts the claim. And the table alone: its
seqlock, its bounded probing, a full window (then the table says it is incomplete), removal.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import engine.tiers.checked_copy as checked_copy
from common.published_layout import (EPOCH_OFFSET, PROBE, STATE_SLOT_BYTES, UNPUBLISHED_OFFSET, Geometry,
                                     PageRecord, StateRecord, key_words)
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.kv.chain_hash import StateHash, page_hashes, state_name
from engine.kv.device_cache import CacheGeometry, DeviceCache, StateShape
from engine.tiers.client import TierClient
from engine.tiers.codec import StateCodec
from engine.tiers.integrity import IntegrityKey
from engine.tiers.link import Spillable, TierHit, TierLink
from engine.tiers.published_table import PublishedTable as EngineTable, SlotBusy
from ignis.v1 import common_pb2, tierstore_pb2
from services import RunningService, start_tierstore
from tierstore.client import TierStoreClient
from tierstore.published_table import PublishedTable

P = 16
MiB = 1 << 20
NS = StateHash(b"published-table!")
VOCAB = 512
DENSE = StateShape((0, 1, 2, 3), 2, 64)  # attention only: 64 KiB a page, every page-aligned prefix a state
HYBRID = StateShape((1,), 2, 64, linear_layers=(0,), linear_value_heads=2, linear_key_dim=16, linear_value_dim=16,
                    conv_dim=32, conv_kernel=4)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Rig:
    """A tierstore process, the engine's link to it over a CPU cache, an admin client, and the Matches sent."""

    store: RunningService
    link: TierLink
    admin: TierStoreClient
    clock: Clock
    matches: list[int] = field(default_factory=list)  # one entry per Match the engine's client sent

    @property
    def cache(self) -> DeviceCache:
        return self.link.codec.cache

    @property
    def client(self) -> TierClient:
        return self.link.client

    def socket_matches(self) -> int:
        return self.client.local.calls if self.client.local is not None else 0


def start_store(tmp_path: Path, arena: int, disk: int) -> RunningService:
    return start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(arena), "--kv-disk-path",
                                             str(tmp_path / "kv-disk"), "--kv-disk-bytes", str(disk)])


@contextmanager
def rig(tmp_path: Path, shape: StateShape = DENSE, arena: int = 16 * MiB, disk: int = 0, pages: int = 256
        ) -> Iterator[Rig]:
    store = start_store(tmp_path, arena, disk)
    cache = DeviceCache(shape, CacheGeometry(P, pages, 4, torch.float32), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for t in (cache.kv, cache.recurrent, cache.conv):
        t.copy_(torch.randn(t.shape, generator=gen))
    codec = StateCodec(cache, VOCAB)
    clock = Clock()
    client = TierClient(store.address, model="m", page_size=P, layout=codec.layout(),
                        kv_bytes_per_token=codec.kv_bytes_per_token, fixed_state_bytes=codec.fixed_state_bytes,
                        timeout=10.0, clock=clock)
    link = TierLink(client, codec, IntegrityKey.ephemeral())
    made = Rig(store, link, TierStoreClient(store.address), clock)
    match = client.match

    def counted(*args, **kwargs):
        made.matches.append(1)
        return match(*args, **kwargs)
    client.match = counted  # type: ignore[method-assign]
    try:
        assert link.connect(NS) and client.table is not None, "the engine did not map the published table"
        yield made
    finally:
        made.admin.close()
        link.close()
        made.store.stop()


def tokens_of(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def write(r: Rig, tokens: list[int], n: int, pages: list[int], slot: int | None = None, logits: bool = True,
          kind: ReuseKind = ReuseKind.CHECKPOINT) -> StateHash:
    """The state of tokens[:n] from `pages` (and `slot`) spilled to KV-RAM as the engine spills it."""
    hashes = page_hashes(NS, tokens, P)
    name = state_name(NS, hashes, tokens, n, P)
    out = torch.randn(VOCAB, generator=torch.Generator().manual_seed(n)) if logits else None
    assert r.link.spill(Spillable(name, NS, n, kind, RequestClass.INTERACTIVE, tuple(hashes[:n // P]), slot,
                                  pages, out))
    return name


def find(r: Rig, tokens: list[int]) -> TierHit | None:
    return r.link.find(NS, page_hashes(NS, tokens, P), tokens)


def restore(r: Rig, hit: TierHit, pages: list[int], slot: int | None = None
            ) -> tuple[ReuseTier, torch.Tensor | None] | None:
    return r.link.restore(NS, hit, slot, pages[:-(-hit.tokens // P)])


def same_pages(r: Rig, got: list[int], want: list[int]) -> bool:
    return torch.equal(r.cache.kv[got], r.cache.kv[want])


def drain(r: Rig) -> None:
    """Wait for the engine client's background calls (Release, the reports of table claims)."""
    r.client._releaser.submit(lambda: None).result()


def listed(r: Rig) -> list[tierstore_pb2.StoredStateRow]:
    return list(r.admin.stub.ListStates(tierstore_pb2.ListStatesRequest(namespaces=[NS]), timeout=10).states)


def hits_of(r: Rig, name: bytes) -> int:
    rows = [row for row in listed(r) if row.hash == name]
    assert rows, "the store does not hold the state"
    return rows[0].hits


# --- (a) a claim from KV-RAM through the table, no Match ---------------------------------------
def test_a_whole_prompt_checkpoint_is_claimed_from_the_table_without_a_match(tmp_path: Path) -> None:
    """Hybrid (a recurrent slot): the whole prompt's state, ending mid-page, with its logits."""
    with rig(tmp_path, HYBRID) as r:
        prompt = tokens_of(1, 5 * P + 7)
        n = len(prompt)
        name = write(r, prompt, n, [10, 11, 12, 13, 14, 15], slot=0)
        socket_before = r.socket_matches()
        hit = find(r, prompt)
        assert hit is not None and (hit.state_hash, hit.tokens, hit.tier) == (name, n, ReuseTier.RAM)
        r.cache.kv[[40, 41, 42, 43, 44, 45]] = 0
        r.cache.state_rows[1] = 0
        got = restore(r, hit, [40, 41, 42, 43, 44, 45], slot=1)
        assert got is not None and got[0] is ReuseTier.RAM
        assert got[1] is not None and torch.equal(got[1], torch.randn(VOCAB, generator=torch.Generator().manual_seed(n)))
        assert same_pages(r, [40, 41, 42, 43, 44, 45], [10, 11, 12, 13, 14, 15])
        assert torch.equal(r.cache.state_rows[1], r.cache.state_rows[0])
        assert r.matches == [] and r.socket_matches() == socket_before  # no Match, on the socket or over gRPC
        assert (r.link.table_answers, r.link.table_claims, r.link.match_leases_used) == (1, 1, 0)
        drain(r)
        assert r.admin.stats().leases_active == 0


def test_a_page_aligned_prefix_is_claimed_from_the_table_when_nothing_longer_exists(tmp_path: Path) -> None:
    """Attention only: a chain of six pages, claimed by a prompt that goes on past it (the state named by its
    last page), and its first four pages by a prompt that leaves it after them (a prefix of a longer state)."""
    with rig(tmp_path) as r:
        chain = tokens_of(2, 6 * P)
        name = write(r, chain, 6 * P, [20, 21, 22, 23, 24, 25], logits=False, kind=ReuseKind.PAGES)
        longer = chain + tokens_of(3, 20)
        hit = find(r, longer)
        assert hit is not None and (hit.state_hash, hit.tokens, hit.kind) == (name, 6 * P, ReuseKind.PAGES)
        assert restore(r, hit, [50, 51, 52, 53, 54, 55]) is not None
        assert same_pages(r, [50, 51, 52, 53, 54, 55], [20, 21, 22, 23, 24, 25])
        other = chain[:4 * P] + tokens_of(4, 3 * P + 5)
        hit = find(r, other)
        assert hit is not None and (hit.state_hash, hit.tokens) == (name, 4 * P)  # the longer state, sliced
        r.cache.kv[[60, 61, 62, 63]] = 0
        assert restore(r, hit, [60, 61, 62, 63]) is not None
        assert same_pages(r, [60, 61, 62, 63], [20, 21, 22, 23])
        assert find(r, tokens_of(5, 4 * P + 3)) is None  # nothing anywhere: a miss, proven by the table
        assert r.matches == [] and (r.link.table_answers, r.link.table_claims) == (3, 2)


def test_what_the_table_cannot_prove_is_asked_of_match(tmp_path: Path) -> None:
    """A longer state on disk (the table only says something not in RAM answers a longer page) and a
    state ending mid-page after one of the prompt's pages (an anchored candidate): Match is asked, and
    its answer is the one taken, as before the table."""
    with rig(tmp_path, arena=1 * MiB, disk=64 * MiB) as r:
        chain = tokens_of(6, 8 * P)
        whole = write(r, chain, 8 * P, list(range(0, 8)), logits=False, kind=ReuseKind.PAGES)  # 512 KiB
        for seed in (7, 8):  # two more of its size: the first one moves down to disk
            write(r, tokens_of(seed, 8 * P), 8 * P, list(range(8, 16)), logits=False, kind=ReuseKind.PAGES)
        write(r, chain, 4 * P, [0, 1, 2, 3], logits=False, kind=ReuseKind.PAGES)  # its first half, in RAM
        hit = find(r, chain + tokens_of(9, 5))
        assert r.matches == [1] and hit is not None and (hit.state_hash, hit.tier) == (whole, ReuseTier.DISK)
    with rig(tmp_path / "anchored", HYBRID) as r:
        first = tokens_of(10, 3 * P + 5)  # a previous turn's opener: it ends mid-page
        opener = write(r, first, len(first), [0, 1, 2, 3], slot=0)
        second = first + tokens_of(11, 2 * P)
        hit = find(r, second)
        assert r.matches == [1] and hit is not None and (hit.state_hash, hit.tokens) == (opener, len(first))
        assert restore(r, hit, [30, 31, 32, 33], slot=1) is not None
        assert r.link.table_claims == 0 and r.link.match_leases_used == 1


def test_an_incomplete_table_still_answers_the_whole_prompt_and_asks_match_for_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a key found no room in its window, the absence of a key proves nothing: a prefix is asked of
    Match; the whole prompt's state, found, is still the best there is."""
    with rig(tmp_path) as r:
        chain = tokens_of(12, 6 * P)
        write(r, chain, 6 * P, [20, 21, 22, 23, 24, 25], kind=ReuseKind.CHECKPOINT)  # with its logits
        assert r.client.table is not None
        monkeypatch.setattr(type(r.client.table), "complete", property(lambda self: False))
        assert find(r, chain) is not None and r.matches == []
        hit = find(r, chain + tokens_of(13, 9))
        assert r.matches == [1] and hit is not None and hit.tokens == 6 * P


def test_the_table_answers_what_match_answers_or_leaves_it_to_match(tmp_path: Path) -> None:
    """Many states over a few shared prompts, attention-only (every page-aligned prefix claimable): chains
    without logits and checkpoints with them ending mid-page, in a 2 MiB arena that moves most of them on
    to disk, some dropped. For prompts around them, whatever the table answers alone is what the lookup
    through Match answers (the same state and tokens, or nothing), and what it cannot prove it leaves to
    Match."""
    rng = torch.Generator().manual_seed(7)

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=rng))

    with rig(tmp_path, arena=2 * MiB, disk=64 * MiB) as r:
        bases = [tokens_of(30 + i, 12 * P) for i in range(3)]
        bases += [bases[0][:5 * P] + tokens_of(40, 7 * P), bases[1][:2 * P + 3] + tokens_of(41, 9 * P)]
        written: list[StateHash] = []
        prompts: list[list[int]] = []  # each state's own tokens: asked again as they are
        for _ in range(40):
            base = bases[pick(len(bases))]
            n = P * (1 + pick(8)) + (0 if pick(2) else 1 + pick(P - 1))
            name = write(r, base, n, list(range(-(-n // P))), logits=n % P != 0,
                         kind=ReuseKind.PAGES if n % P == 0 else ReuseKind.CHECKPOINT)
            written.append(name)
            prompts.append(base[:n])
            if pick(6) == 0:
                r.admin.drop(written[pick(len(written))])
        table = r.client.table
        assert table is not None
        answered = asked = 0
        for i in range(150):
            base = bases[pick(len(bases))]
            prompt = prompts[pick(len(prompts))] if i % 3 == 0 else \
                base[:P + pick(11 * P)] + (tokens_of(100 + pick(50), 1 + pick(2 * P)) if pick(2) else [])
            hashes = page_hashes(NS, prompt, P)
            n = len(prompt)
            pages, tail = hashes[:n // P], state_name(NS, hashes, prompt, n, P) if n % P else None
            alone = r.link._from_table(table, NS, pages, tail, n)
            r.client.table = None  # the same lookup through Match
            try:
                via_match = find(r, prompt)
            finally:
                r.client.table = table
            if alone is None:
                asked += 1
                continue
            answered += 1
            entry, tokens = alone
            want = None if via_match is None else (via_match.state_hash, via_match.tokens, via_match.tier)
            assert (None if entry is None else (entry.name, tokens, ReuseTier.RAM)) == want, prompt
        assert answered >= 20 and asked >= 20, (answered, asked)  # both kinds of answer were put to the test


# --- (b) a state evicted while it is copied ------------------------------------------------------
def test_a_state_evicted_in_the_middle_of_its_copy_is_never_served(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is held after its first 4 MiB segment; meanwhile the state is dropped and another state of
    the same size is written into the same extent. The rest of the copy reads the other state's bytes: the
    restore fails (the entry's slot changed), counted as a race, not as a forgery, and nothing is served."""
    with rig(tmp_path) as r:
        chain = tokens_of(14, 100 * P)  # 6.25 MiB: two segments of the tag and more
        name = write(r, chain, 100 * P, list(range(100)), kind=ReuseKind.CHECKPOINT)
        hit = find(r, chain)
        assert hit is not None and r.matches == []
        r.link.claim_threads = 1  # one thread: segments in order, the pause after the first one
        paused, resume = threading.Event(), threading.Event()
        segment = checked_copy._segment

        def held(index: int, *args):
            segment(index, *args)
            if index == 0:
                paused.set()
                assert resume.wait(60)
        monkeypatch.setattr(checked_copy, "_segment", held)
        results: list[object] = []
        claim = threading.Thread(target=lambda: results.append(restore(r, hit, list(range(100, 200)))))
        claim.start()
        assert paused.wait(60), "the restore never copied its first segment"
        lease = r.admin.acquire(name)  # where it lies, to show the other state lands there
        r.admin.release(lease.lease_id)
        assert r.admin.drop(name)
        r.admin.register(NS, page_size=P, layout=r.link.codec.layout())
        data = bytes(range(256)) * (lease.metadata.nbytes // 256) + bytes(lease.metadata.nbytes % 256)
        other = r.admin.store(b"o" * 16, data, tierstore_pb2.StateMetadata(
            namespace=NS, tokens=100 * P, kind=common_pb2.REUSE_KIND_CHECKPOINT,
            request_class=common_pb2.REQUEST_CLASS_INTERACTIVE, nbytes=len(data)))
        assert other.offset == lease.extent.offset, "the other state did not take the extent"
        resume.set()
        claim.join(60)
        assert results == [None]
        assert (r.link.table_races, r.link.rejected, r.link.restore_failures, r.link.restores) == (1, 0, 1, 0)


# --- (c) a forged entry ---------------------------------------------------------------------
def forge(r: Rig, key: bytes, **fields: object) -> None:
    """A local process of the store's user rewrites the table: the slot of `key` (or, with `into`, an empty
    slot of that key's window) gets `fields` changed, its sequence number left as it was."""
    from common.published_layout import STATE_BODY, home
    names = ["lo", "hi", "used", "kind", "offset", "nbytes", "tokens", "tag_len", "namespace", "tag"]
    into = fields.pop("into", None)

    def rewrite(buf: mmap.mmap, g: Any, at: int, body: dict[str, Any]) -> int:
        if isinstance(into, bytes):  # the same entry under another name, in that name's window
            body["lo"], body["hi"] = key_words(into)
            start = home(body["lo"], g.states)
            at = next(g.states_at + ((start + d) % g.states) * STATE_SLOT_BYTES for d in range(PROBE)
                      if not struct.unpack_from("<I", buf, g.states_at + ((start + d) % g.states)
                                                * STATE_SLOT_BYTES + 24)[0])
        body.update(fields)
        return at

    _forge_slot(r, key, "states", STATE_SLOT_BYTES, STATE_BODY, names, rewrite)


def forge_page(r: Rig, page: bytes, **fields: object) -> None:
    """As `forge`, for the page slot of `page`."""
    from common.published_layout import PAGE_BODY, PAGE_SLOT_BYTES

    def rewrite(buf: mmap.mmap, g: Any, at: int, body: dict[str, Any]) -> int:
        body.update(fields)
        return at

    _forge_slot(r, page, "pages", PAGE_SLOT_BYTES, PAGE_BODY,
                ["lo", "hi", "used", "tokens", "holder", "nbytes"], rewrite)


def _forge_slot(r: Rig, key: bytes, region: str, slot_bytes: int, layout: struct.Struct, names: list[str],
                rewrite: Callable[[mmap.mmap, Any, int, dict[str, Any]], int]) -> None:
    """Opens the table for writing, finds `key`'s slot in `region` ("states" or "pages"), lets `rewrite`
    change its fields (and say where they go), and writes them there."""
    table = r.client.table
    assert table is not None
    g = table.geometry
    first, count = getattr(g, f"{region}_at"), getattr(g, region)
    fd = os.open(table.path, os.O_RDWR)
    try:
        with mmap.mmap(fd, g.nbytes) as buf:
            slot = next(s for s in range(count) if buf[first + s * slot_bytes + 8:][:16] == key)
            at = first + slot * slot_bytes
            body = dict(zip(names, layout.unpack_from(buf, at + 8)))
            at = rewrite(buf, g, at, body)
            layout.pack_into(buf, at + 8, *body.values())
    finally:
        os.close(fd)


def test_a_forged_entry_is_caught_by_the_tag_and_runs_cold(tmp_path: Path) -> None:
    """Two states of one size. The entry of the first is pointed at the second's bytes; then the second's
    entry is copied under the name of a prompt nobody stored, with that prompt's length. Both are found in
    the table, copied, refused by the engine's tag (they are not what the names say) and run cold."""
    with rig(tmp_path) as r:
        a, b = tokens_of(15, 6 * P + 3), tokens_of(16, 6 * P + 3)
        write(r, a, len(a), [0, 1, 2, 3, 4, 5, 6])
        b_name = write(r, b, len(b), [7, 8, 9, 10, 11, 12, 13])
        assert r.client.table is not None
        b_entry = r.client.table.state(b_name)
        assert b_entry is not None
        a_hash = page_hashes(NS, a, P)
        forge(r, state_name(NS, a_hash, a, len(a), P), offset=b_entry.offset)
        hit = find(r, a)
        assert hit is not None and r.matches == []
        assert restore(r, hit, list(range(40, 47))) is None
        assert (r.link.rejected, r.link.table_races) == (1, 0)
        c = b[:6 * P] + tokens_of(17, 5)  # B's pages, another tail: a longer prompt nobody stored
        c_name = state_name(NS, page_hashes(NS, c, P), c, len(c), P)
        forge(r, b_name, into=c_name, tokens=len(c))
        hit = find(r, c)
        assert hit is not None and hit.state_hash == c_name and r.matches == []
        assert restore(r, hit, list(range(40, 47))) is None
        assert (r.link.rejected, r.link.table_races, r.link.table_claims) == (2, 0, 0)
        hit = find(r, b)  # the entries not forged are served as ever
        assert hit is not None and restore(r, hit, list(range(40, 47))) is not None
        assert same_pages(r, list(range(40, 47)), [7, 8, 9, 10, 11, 12, 13])


@pytest.mark.parametrize("field", ["tokens", "nbytes"])
def test_a_page_slot_that_disagrees_with_its_holder_is_asked_of_match(tmp_path: Path, field: str) -> None:
    """Which state holds a page is trusted as Match's answer is (the tag proves only the holder's own bytes),
    so the slot must at least agree with the holder's entry: a page's token count one page too many (a
    longer slice of the holder than the prompt shares) or a length not the holder's sends the lookup to
    Match, which answers what the store holds."""
    with rig(tmp_path) as r:
        chain = tokens_of(2, 6 * P)
        name = write(r, chain, 6 * P, [20, 21, 22, 23, 24, 25], logits=False, kind=ReuseKind.PAGES)
        other = chain[:4 * P] + tokens_of(4, 3 * P + 5)
        forged = {"tokens": 5 * P} if field == "tokens" else {"nbytes": 12345}
        forge_page(r, page_hashes(NS, chain, P)[3], **forged)
        hit = find(r, other)
        assert r.matches == [1] and r.link.table_answers == 0
        assert hit is not None and (hit.state_hash, hit.tokens) == (name, 4 * P)


def test_a_slot_written_through_every_read_is_asked_of_match_not_taken_as_absent(tmp_path: Path) -> None:
    """The store in the middle of writing the slot of the one state that answers (its sequence number odd):
    the table cannot say what it holds, so a Match does, and finds the state."""
    with rig(tmp_path) as r:
        prompt = tokens_of(1, 5 * P + 7)
        name = write(r, prompt, len(prompt), [10, 11, 12, 13, 14, 15])
        table = r.client.table
        assert table is not None
        entry = table.state(name)
        assert entry is not None
        fd = os.open(table.path, os.O_RDWR)
        try:
            with mmap.mmap(fd, table.geometry.nbytes) as buf:
                seq = struct.unpack_from("<Q", buf, entry.slot_at)[0]
                struct.pack_into("<Q", buf, entry.slot_at, seq + 1)
                hit = find(r, prompt)
                struct.pack_into("<Q", buf, entry.slot_at, seq)
        finally:
            os.close(fd)
        assert r.matches == [1] and hit is not None and (hit.state_hash, hit.tokens) == (name, len(prompt))


def test_an_entry_changed_between_lookup_and_restore_is_acquired_not_copied(tmp_path: Path) -> None:
    """The slot of the entry a lookup found is rewritten before the restore (the state moved): the restore
    does not copy from the entry (which the after-copy check would refuse) but Acquires the state."""
    with rig(tmp_path) as r:
        prompt = tokens_of(1, 5 * P + 7)
        write(r, prompt, len(prompt), [10, 11, 12, 13, 14, 15])
        hit = find(r, prompt)
        assert hit is not None and r.matches == []
        table = r.client.table
        assert table is not None
        entry = table.state(hit.state_hash)
        assert entry is not None
        fd = os.open(table.path, os.O_RDWR)
        try:
            with mmap.mmap(fd, table.geometry.nbytes) as buf:
                seq = struct.unpack_from("<Q", buf, entry.slot_at)[0]
                struct.pack_into("<Q", buf, entry.slot_at, seq + 2)  # a write came and went
        finally:
            os.close(fd)
        assert restore(r, hit, [40, 41, 42, 43, 44, 45]) is not None
        assert same_pages(r, [40, 41, 42, 43, 44, 45], [10, 11, 12, 13, 14, 15])
        assert (r.link.table_claims, r.link.table_races, r.link.restores) == (0, 0, 1)


# --- (d) a tierstore restart ----------------------------------------------------------------
@pytest.mark.parametrize("how", ["killed", "stopped", "arena deleted", "table truncated"])
def test_the_table_of_a_store_gone_is_never_used(tmp_path: Path, how: str) -> None:
    """The store is killed -9 (nothing closes its table: only its lock goes with it) or stopped, and a
    fresh one starts on the same socket; or it recreates its arena (deleted behind its back), a new
    instance; or its table is truncated behind its back (a read past the end would be SIGBUS), and it
    recreates both. The engine still maps the old table, whose entries are where the old arena's bytes
    still are: they are not claimed, before the fresh store starts nor after; Match is asked (the new
    instance holds nothing), and once the engine registers with the new instance its table serves again."""
    with rig(tmp_path) as r:
        prompt = tokens_of(18, 4 * P + 9)
        write(r, prompt, len(prompt), [0, 1, 2, 3, 4])
        old = r.admin.stats().instance_id
        answers = r.link.table_answers
        if how in ("arena deleted", "table truncated"):
            if how == "arena deleted":
                os.unlink(r.admin.stats().arena_path)
            else:
                assert r.client.table is not None
                os.truncate(r.client.table.path, 4096)
            deadline = time.monotonic() + 30
            while r.admin.stats().instance_id == old:
                assert time.monotonic() < deadline, "the store never recreated its arena"
                time.sleep(0.05)
        else:
            if how == "killed":
                r.store.process.send_signal(signal.SIGKILL)
                r.store.process.wait()
            else:
                assert r.store.stop() == 0
            assert find(r, prompt) is None and r.link.table_answers == answers  # no store: its table unused
            assert r.matches == [1]  # asked, and the store is down
            r.clock.t += r.client.retry_seconds  # past the back-off
            r.store = start_store(tmp_path, 16 * MiB, 0)
            r.admin.close()
            r.admin = TierStoreClient(r.store.address)
        assert r.client.table is not None and r.client.table.instance_id == old  # the old one, still mapped
        asked = len(r.matches)
        assert find(r, prompt) is None
        assert r.link.table_answers == answers and len(r.matches) == asked + 1
        r.clock.t += r.client.retry_seconds  # past any backoff the restart caused
        write(r, prompt, len(prompt), [0, 1, 2, 3, 4])  # registers with the new instance: its table
        assert r.client.instance_id not in ("", old)
        hit = find(r, prompt)
        assert hit is not None and r.link.table_answers == answers + 1 and len(r.matches) == asked + 1
        assert restore(r, hit, [40, 41, 42, 43, 44]) is not None
        assert same_pages(r, [40, 41, 42, 43, 44], [0, 1, 2, 3, 4])


# --- (e) the store's view of a claim through the table -----------------------------------------
def test_the_store_counts_a_claim_through_the_table(tmp_path: Path) -> None:
    """No lease, no Match: the store learns of the use from the background report (a Release naming it),
    counts the hit and ranks the state by that use (it leaves RAM after a state written later)."""
    with rig(tmp_path) as r:
        first, second = tokens_of(19, 3 * P + 2), tokens_of(20, 3 * P + 2)
        a = write(r, first, len(first), [0, 1, 2, 3])
        b = write(r, second, len(second), [4, 5, 6, 7])

        def order() -> list[bytes]:
            rows = [row for row in listed(r) if row.tier == common_pb2.REUSE_TIER_RAM]
            return [row.hash for row in sorted(rows, key=lambda row: row.rank)]
        assert order() == [a, b] and hits_of(r, a) == 0
        hit = find(r, first)
        assert hit is not None and restore(r, hit, [40, 41, 42, 43]) is not None and r.matches == []
        drain(r)
        assert hits_of(r, a) == 1 and hits_of(r, b) == 0
        assert order() == [b, a]


# --- (f) the table itself -------------------------------------------------------------------
INSTANCE = "0123456789abcdef" * 2


@contextmanager
def table_pair(tmp_path: Path) -> Iterator[tuple[PublishedTable, EngineTable]]:
    """A store's table in a scratch folder and the engine's read-only mapping of it."""
    writer = PublishedTable(tmp_path / "arena.table", Geometry(1024, 4096, 1 << 15), INSTANCE)
    reader = EngineTable(str(writer.path), writer.nbytes, INSTANCE)
    try:
        yield writer, reader
    finally:
        reader.close()
        writer.close()


def as_keys(*keys: bytes) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, 16)


def record(i: int) -> StateRecord:
    return StateRecord(offset=4096 * i, nbytes=1000 + i, tokens=16 + i, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                       namespace=bytes(NS), engine_tag=bytes([i]) * 32)


def test_a_table_entry_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    """The seqlock: a slot being written (odd) is not read; an entry read before a write is no longer
    unchanged after it; a removed one is gone."""
    with table_pair(tmp_path) as (writer, reader):
        key = b"k" * 16
        writer.put_state(key, record(1))
        entry = reader.state(key)
        assert entry is not None and (entry.offset, entry.nbytes, entry.tokens, entry.engine_tag) == \
            (4096, 1001, 17, bytes([1]) * 32)
        assert reader.unchanged(entry) and reader.current() and reader.complete
        at = entry.slot_at
        seq = struct.unpack_from("<Q", writer._buf, at)[0]
        struct.pack_into("<Q", writer._buf, at, seq + 1)  # the store in the middle of writing it
        with pytest.raises(SlotBusy):  # not "absent": what it holds is unknown (the lookup asks Match)
            reader.state(key)
        assert not reader.unchanged(entry)
        struct.pack_into("<Q", writer._buf, at, seq)
        assert reader.state(key) == entry
        writer.put_state(key, record(2))  # rewritten: the entry read before is stale
        assert not reader.unchanged(entry)
        fresh = reader.state(key)
        assert fresh is not None and fresh.offset == 2 * 4096 and reader.unchanged(fresh)
        assert reader.maybe(as_keys(key)).tolist() == [[True, False, False]]
        writer.put_state(key, None)
        assert reader.state(key) is None and not reader.unchanged(fresh)
        assert reader.maybe(as_keys(key)).tolist() == [[False, False, False]]
        writer.check_integrity()


def test_keys_of_one_home_fill_their_window_then_wait_for_room(tmp_path: Path) -> None:
    """Bounded probing: PROBE keys of one home slot take the window; one more has no room and the header
    says the table is incomplete (a key not found proves nothing); a removal in the window lets it in."""
    with table_pair(tmp_path) as (writer, reader):
        keys = [struct.pack("<QQ", 7 + 1024 * i, i) for i in range(PROBE + 1)]  # one home slot, 7
        for i, key in enumerate(keys):
            writer.put_state(key, record(i))
        assert [reader.state(k) is not None for k in keys] == [True] * PROBE + [False]
        assert not reader.complete and struct.unpack_from("<Q", writer._buf, UNPUBLISHED_OFFSET)[0] == 1
        found = [reader.state(k) for k in keys[:PROBE]]
        assert [e.slot_at for e in found if e is not None] == \
            [writer.geometry.states_at + (7 + i) * STATE_SLOT_BYTES for i in range(PROBE)]
        writer.put_state(keys[3], None)
        assert reader.complete and reader.state(keys[3]) is None
        last = reader.state(keys[-1])
        assert last is not None and last.slot_at == writer.geometry.states_at + (7 + 3) * STATE_SLOT_BYTES
        writer.check_integrity()


def test_pages_and_filters(tmp_path: Path) -> None:
    """A page's holder; the filter's columns (in RAM, elsewhere, anchored after), each key counted once
    however often it is said, and gone once unsaid."""
    with table_pair(tmp_path) as (writer, reader):
        page = b"p" * 16
        writer.put_page(page, PageRecord(b"h" * 16, 48, 5000))
        got = reader.page(page)
        assert got is not None and (got.holder, got.tokens, got.nbytes) == (b"h" * 16, 48, 5000)
        assert reader.maybe(as_keys(page)).tolist() == [[True, False, False]]
        writer.put_page(page, None)
        assert reader.page(page) is None and reader.maybe(as_keys(page)).tolist() == [[False, False, False]]
        a, b = b"a" * 16, b"a" * 4 + b"b" * 12  # the same first word (not an index), other indices
        assert reader.maybe(as_keys(a, b)).tolist() == [[False] * 3] * 2
        writer.set_elsewhere(a, True)
        writer.set_elsewhere(a, True)  # said twice: counted once
        writer.set_anchored(b, True)
        assert reader.maybe(as_keys(a, b)).tolist() == [[False, True, False], [False, False, True]]
        writer.set_elsewhere(a, False)
        assert reader.maybe(as_keys(a, b)).tolist() == [[False, False, False], [False, False, True]]


def test_the_engine_maps_only_a_private_table_of_the_instance_and_sees_it_close(tmp_path: Path) -> None:
    """Another instance's table, or one open to others, is not mapped; a table the store closed is not used."""
    with table_pair(tmp_path) as (writer, reader):
        with pytest.raises(OSError):
            EngineTable(str(writer.path), writer.nbytes, "another instance")
        os.chmod(writer.path, 0o644)
        with pytest.raises(OSError):
            EngineTable(str(writer.path), writer.nbytes, INSTANCE)
        os.chmod(writer.path, 0o600)
        assert reader.current()
        struct.pack_into("<Q", writer._buf, EPOCH_OFFSET, 0)  # as close() does first
        assert not reader.current()


def test_a_truncated_table_is_not_read(tmp_path: Path) -> None:
    """Truncated behind the store's back: reading a slot past the end would be SIGBUS, so the engine sees
    the file is short before it reads anything but the header, and the store calls it broken."""
    with table_pair(tmp_path) as (writer, reader):
        writer.put_state(b"k" * 16, record(1))
        assert reader.current() and writer.fault() is None
        os.truncate(writer.path, 4096)
        assert not reader.current()
        fault = writer.fault()
        assert fault is not None and "truncated" in fault


def test_the_table_is_made_before_its_arena_so_its_name_cannot_be_taken_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user who sees the arena's name appear in /dev/shm could create `<arena>.table` before the
    store and leave it without a table; the store makes the table first, under a name nobody can guess,
    at start and when it recreates its arena."""
    import tierstore.store as store_module
    from tierstore.store import StoreConfig, TierStore

    seen: list[bool] = []
    make_arena = store_module.Arena

    def arena_after_its_table(nbytes: int, *, instance_id: str, directory: Path) -> Any:
        table = store_module.arena_path(directory, instance_id).with_name(
            store_module.arena_path(directory, instance_id).name + ".table")
        seen.append(table.exists())
        return make_arena(nbytes, instance_id=instance_id, directory=directory)

    monkeypatch.setattr(store_module, "Arena", arena_after_its_table)
    store = TierStore(StoreConfig(4 * MiB, str(tmp_path / "disk"), 0), arena_dir=tmp_path)
    try:
        store.arena.path.unlink()  # deleted behind its back: a new arena (and table) at the next check
        assert store._check_arena(sweep=True)
        assert seen == [True, True] and store._table is not None
        assert store._table.path == store.arena.path.with_name(store.arena.path.name + ".table")
    finally:
        store.close()
