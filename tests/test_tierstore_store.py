"""TierStore logic in process: write path, leases, spill/restore/evict in the one order, budgets, Match."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from ignis.v1 import common_pb2, tierstore_pb2
from tierstore.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound
from tierstore.metrics import store_registry
from tierstore.registry import Registration
from tierstore.state import checksum
from tierstore.store import DISK, RAM, Hit, StoreConfig, TierStore

AGENT = common_pb2.REQUEST_CLASS_AGENT
INTERACTIVE = common_pb2.REQUEST_CLASS_INTERACTIVE
CHECKPOINT, PREFIX = common_pb2.REUSE_KIND_CHECKPOINT, common_pb2.REUSE_KIND_PREFIX
NS = b"N" * 16  # attention-only namespace (registered below)
NS_HYBRID = b"H" * 16
SIZE = 3 * 4096  # every state in these tests: 12 KiB
DISK_SLOT = SIZE + 4096  # what one takes on disk: its bytes and the block of its blob header


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def h(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def make_data(name: str, n: int = SIZE) -> bytes:
    seed = name.encode() * (n // len(name) + 1)
    return bytes(b ^ (i % 251) for i, b in enumerate(seed[:n]))


def make_store(tmp_path: Path, clock: Clock, *, ram: int = 3, disk: int = 10, ttl: float = 0.0) -> TierStore:
    return TierStore(StoreConfig(ram * SIZE, str(tmp_path / "kv-disk"), disk * DISK_SLOT, interactive_ttl=ttl,
                                 lease_seconds=30, reservation_seconds=60), clock=clock)


def make_meta(name: str, *, ns: bytes = NS, pages: tuple[str, ...] = (), tokens: int = 16, cls: int = 0,
              nbytes: int = SIZE, kind: int = CHECKPOINT) -> tierstore_pb2.StateMetadata:
    return tierstore_pb2.StateMetadata(namespace=ns, tokens=tokens, kind=kind,  # type: ignore[arg-type]
                                       request_class=cls,  # type: ignore[arg-type]
                                       page_hashes=[h(p) for p in pages], nbytes=nbytes)


def put(store: TierStore, name: str, *, cls: int = AGENT, protect: float = 0.0, **meta: object) -> bytes:
    """Reserve, write into the arena by offset, Commit; returns the bytes written."""
    data = make_data(name)
    extent = store.reserve(h(name), len(data), cls, protect)
    assert extent is not None, f"no room for {name}"
    store.arena.slice(extent.offset, extent.length)[:] = data
    store.commit(h(name), make_meta(name, **meta))  # type: ignore[arg-type]
    return data


def where(store: TierStore) -> dict[str, str]:
    """name -> 'ram' | 'disk' | 'ram+disk' for every stored state."""
    out = {}
    for key, state in store._states.items():
        tiers = (["ram"] if state.extent is not None else []) + (["disk"] if store._disk and key in store._disk else [])
        out[key.rstrip(b".").decode()] = "+".join(tiers)
    return out


def match_hits(store: TierStore, namespace: bytes, pages: list[bytes], tail: bytes | None = None) -> list[Hit]:
    """Match without anchored candidates: the best hit per tier."""
    return store.match_anchored(namespace, pages, tail, anchored=False)[0]


def read_back(store: TierStore, name: str) -> tuple[bytes, int]:
    lease = store.acquire(h(name))
    assert lease is not None
    data = bytes(store.arena.slice(lease.extent.offset, lease.extent.length))
    store.release(lease.lease_id)
    return data, lease.from_tier


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[TierStore]:
    s = make_store(tmp_path, clock)
    s.register(Registration(NS, "m", 16, "layout-a", 1024, 0))
    s.register(Registration(NS_HYBRID, "h", 16, "layout-h", 1024, 4096))
    yield s
    s.check_integrity()
    s.close()


def test_write_by_offset_then_read_back_bit_exact(store: TierStore) -> None:
    data = put(store, "a", cls=INTERACTIVE)
    lease = store.acquire(h("a"), lease_seconds=5)
    assert lease is not None and lease.from_tier == RAM
    assert lease.extent.length == SIZE and bytes(store.arena.slice(lease.extent.offset, SIZE)) == data
    assert lease.info.checksum == checksum(data)  # filled in at commit
    assert lease.info.request_class == INTERACTIVE
    assert store.stats().leases_active == 1
    store.check_integrity()
    store.release(lease.lease_id)
    s = store.stats()
    assert (s.states_ram, s.states_disk, s.leases_active, s.arena_bytes_used) == (1, 0, 0, SIZE)


def test_refusals(store: TierStore) -> None:
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.reserve(b"short", SIZE)
    with pytest.raises(InvalidArgument):
        store.reserve(h("z"), 0)
    with pytest.raises(InvalidArgument):
        match_hits(store, NS, [b"x" * 15])
    assert store.reserve(h("huge"), 4 * SIZE) is None  # larger than the arena: room, not an error
    put(store, "a")
    with pytest.raises(AlreadyExists):
        store.reserve(h("a"), SIZE)
    assert store.reserve(h("b"), SIZE) is not None
    with pytest.raises(AlreadyExists):
        store.reserve(h("b"), SIZE)
    with pytest.raises(FailedPrecondition, match="Reserve first"):
        store.commit(h("c"), make_meta("c"))
    with pytest.raises(InvalidArgument, match="nbytes"):
        store.commit(h("b"), make_meta("b", nbytes=SIZE - 1))
    wrong = make_meta("b")
    wrong.checksum = b"\x00" * 16
    with pytest.raises(FailedPrecondition, match="checksum"):
        store.commit(h("b"), wrong)
    assert store.stats().reservations_pending == 1 and store.stats().checksum_failures == 1  # kept to rewrite
    with pytest.raises(NotFound):
        store.acquire(h("nope"))
    with pytest.raises(NotFound):
        store.release(12345)
    long_tag = make_meta("b")
    long_tag.engine_tag = b"t" * 65
    with pytest.raises(InvalidArgument, match="engine_tag"):
        store.commit(h("b"), long_tag)
    assert store.drop(h("b")) and not store.drop(h("b"))  # abandons the reservation


def test_the_engine_tag_is_kept_verbatim_in_every_tier_and_across_a_restart(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=1)
    tag = bytes(range(32))  # an engine's MAC the store cannot check or make
    meta = make_meta("a")
    meta.engine_tag = tag
    extent = store.reserve(h("a"), SIZE, AGENT)
    assert extent is not None
    store.arena.slice(extent.offset, SIZE)[:] = make_data("a")
    store.commit(h("a"), meta)
    clock.t += 1
    put(store, "b")  # a moves down to disk
    lease = store.acquire(h("a"))
    assert lease is not None and lease.from_tier == DISK and lease.info.to_proto().engine_tag == tag
    store.release(lease.lease_id)
    store.close()
    again = make_store(tmp_path, clock, ram=1)
    try:
        assert again.open_read(h("a"))[0].to_proto().engine_tag == tag
    finally:
        again.close()


def test_another_layout_replaces_a_registration_with_nothing_on_disk(store: TierStore, clock: Clock) -> None:
    """A registration is never a lock: the first registrant (a squatter, an engine since upgraded) cannot
    keep the owner out while nothing is stored under it; the states in RAM under the old layout go."""
    put(store, "a")
    put(store, "other", ns=NS_HYBRID)
    squatter = Registration(NS, "squatter", 16, "layout-b", 1, 0)
    store.register(squatter)
    assert where(store) == {"other": "ram"} and store._registry.get(NS) == squatter
    owner = Registration(NS, "m", 16, "layout-a", 1024, 0)
    store.register(owner)  # and back: again nothing on disk under "layout-b"
    assert store._registry.get(NS) == owner
    store.register(owner)  # the same layout again changes nothing
    assert store.drop(h("other"))
    for name in ("b", "c", "d", "e"):
        clock.t += 1
        put(store, name)
    assert where(store)["b"] == "disk"
    with pytest.raises(FailedPrecondition, match="another state layout"):
        store.register(squatter)  # states on disk were written under the owner's layout: they stay readable
    assert store._registry.get(NS) == owner and where(store)["b"] == "disk"
    store.register(Registration(NS_HYBRID, "x", 16, "layout-x", 1, 4096))  # NS_HYBRID has nothing on disk


def test_ram_pressure_spills_in_the_one_eviction_order(store: TierStore, clock: Clock) -> None:
    put(store, "a_old", cls=AGENT)
    clock.t += 1
    put(store, "i_old", cls=INTERACTIVE)
    clock.t += 1
    put(store, "a_new", cls=AGENT)
    clock.t += 1
    read_back(store, "a_old")  # use makes a_old the most recent agent state
    clock.t += 1
    put(store, "x1", cls=INTERACTIVE)  # arena full: the least recent agent state goes down
    assert where(store) == {"a_old": "ram", "i_old": "ram", "a_new": "disk", "x1": "ram"}
    clock.t += 1
    put(store, "x2", cls=INTERACTIVE)  # agents go before interactive states, however old those are
    assert where(store)["a_old"] == "disk" and where(store)["i_old"] == "ram"
    clock.t += 1
    put(store, "x3", cls=INTERACTIVE)  # now only interactive states: least recent first
    assert where(store) == {"a_old": "disk", "i_old": "disk", "a_new": "disk", "x1": "ram", "x2": "ram",
                            "x3": "ram"}
    s = store.stats()
    assert (s.spills, s.restores, s.evictions, s.states_ram, s.states_disk) == (3, 0, 0, 3, 3)
    store.check_integrity()


def test_protection_keeps_a_state_in_ram(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=2, ttl=300)
    try:
        put(store, "prefix", cls=AGENT, protect=60)  # a retained prefix in use by a burst
        clock.t += 1
        put(store, "i_in_ttl", cls=INTERACTIVE)
        clock.t += 1
        put(store, "a_plain", cls=AGENT)
        # Both residents are protected; the class rank comes first, so the agent prefix goes down.
        assert where(store) == {"prefix": "disk", "i_in_ttl": "ram", "a_plain": "ram"}
        clock.t += 1
        put(store, "a_next", cls=AGENT)  # the unprotected agent goes before the interactive state in its TTL
        assert where(store) == {"prefix": "disk", "i_in_ttl": "ram", "a_plain": "disk", "a_next": "ram"}
        clock.t += 400  # TTL over: now the interactive state is unprotected but still outranks agents
        put(store, "a_last", cls=AGENT)
        assert where(store)["a_next"] == "disk" and where(store)["i_in_ttl"] == "ram"
        store.check_integrity()
    finally:
        store.close()


def test_leased_states_never_move(store: TierStore) -> None:
    for name in ("a", "b", "c"):
        put(store, name)
    leases = [store.acquire(h(n)) for n in ("a", "b", "c")]
    assert store.reserve(h("d"), SIZE) is None  # every extent pinned: no room even after spilling
    assert store.stats().spills == 0
    store.release(leases[1].lease_id)  # type: ignore[union-attr]
    assert store.reserve(h("d"), SIZE) is not None
    assert where(store)["b"] == "disk" and where(store)["a"] == where(store)["c"] == "ram"
    for lease in (leases[0], leases[2]):
        store.release(lease.lease_id)  # type: ignore[union-attr]


def test_restore_from_disk_bit_exact_and_keeps_the_disk_copy(store: TierStore, clock: Clock) -> None:
    data = put(store, "a")
    for name in ("b", "c", "d"):
        clock.t += 1
        put(store, name)
    assert where(store)["a"] == "disk"
    clock.t += 1
    back, tier = read_back(store, "a")  # restore: spills the LRU state (b) to make room
    assert back == data and tier == DISK
    assert where(store)["a"] == "ram+disk" and where(store)["b"] == "disk"
    disk_used = store.stats().disk_bytes_used
    assert read_back(store, "a") == (data, RAM)
    clock.t += 1
    for name in ("c", "d"):  # make "a" the least recent, then push it out again
        read_back(store, name)
    clock.t += 1
    put(store, "e")
    assert where(store)["a"] == "disk" and store.stats().disk_bytes_used == disk_used  # no second write
    s = store.stats()
    assert (s.spills, s.restores, s.evictions) == (3, 1, 0)


def test_disk_pressure_drops_lower_ranked_states_and_keeps_the_budget(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=1, disk=2)
    try:
        for name in ("a", "b", "c"):
            put(store, name, cls=AGENT)
            clock.t += 1
        assert where(store) == {"a": "disk", "b": "disk", "c": "ram"}
        put(store, "d", cls=AGENT)  # c comes down; the disk drops a (ranked below c)
        assert where(store) == {"b": "disk", "c": "disk", "d": "ram"}
        s = store.stats()
        assert (s.spills, s.evictions, s.disk_bytes_used, s.disk_bytes_total) == (3, 1, 2 * DISK_SLOT, 2 * DISK_SLOT)
        store.check_integrity()
    finally:
        store.close()


def test_a_spill_that_ranks_below_the_whole_disk_is_dropped(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=1, disk=2, ttl=300)
    try:
        put(store, "i1", cls=INTERACTIVE)
        put(store, "i2", cls=INTERACTIVE)
        put(store, "a1", cls=AGENT)  # i1 and i2 (interactive, in their TTL) now fill the disk
        assert where(store) == {"i1": "disk", "i2": "disk", "a1": "ram"}
        assert match_hits(store, NS, [h("a1")])[0].tier == RAM
        put(store, "a2", cls=AGENT)  # a1 ranks below both disk states: it is dropped, they stay
        assert where(store) == {"i1": "disk", "i2": "disk", "a2": "ram"}
        s = store.stats()
        assert (s.evictions, s.disk_bytes_used) == (1, 2 * DISK_SLOT)
        assert match_hits(store, NS, [h("a1")]) == []
        store.check_integrity()
    finally:
        store.close()


def fill_with_interactive_states(store: TierStore, clock: Clock, claimed: bool = True) -> None:
    """i1..i4, one second apart, each restored once (the TTL protects only a claimed state) unless told:
    the two oldest spilled to a full disk, the two newest in a full RAM."""
    for name in ("i1", "i2", "i3", "i4"):
        put(store, name, cls=INTERACTIVE)
        if claimed:
            lease = store.acquire(h(name))
            assert lease is not None
            store.release(lease.lease_id)
        clock.t += 1
    assert where(store) == {"i1": "disk", "i2": "disk", "i3": "ram", "i4": "ram"}  # protected states move down


def test_protected_states_refuse_a_same_class_reserve_rather_than_be_dropped(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=2, disk=2, ttl=300)
    try:
        fill_with_interactive_states(store, clock)
        # i3 would have to come down, and the disk could only take it by dropping i1 (in its TTL).
        assert store.reserve(h("i5"), SIZE, INTERACTIVE) is None
        assert where(store) == {"i1": "disk", "i2": "disk", "i3": "ram", "i4": "ram"}
        s = store.stats()
        assert (s.protected_refusals, s.evictions, s.spills, s.reservations_pending) == (1, 0, 2, 0)
        text = generate_latest(store_registry(store.stats)).decode()
        assert "ignis_kv_protected_refusals_total 1.0" in text
        store.check_integrity()
        clock.t = 1300.5  # i1 (used at 1000) is past its TTL; i2, i3 and i4 are not
        assert store.reserve(h("i5"), SIZE, INTERACTIVE) is not None
        assert where(store) == {"i2": "disk", "i3": "disk", "i4": "ram"}
        assert (store.stats().evictions, store.stats().protected_refusals) == (1, 1)
        store.check_integrity()
    finally:
        store.close()


def test_states_nobody_restored_do_not_refuse_a_same_class_reserve(tmp_path: Path, clock: Clock) -> None:
    """Inside the TTL but never claimed: the full tiers take the newcomer by dropping the LRU state, as
    without a TTL (a small full tier of single-use states refused most spills in the soak)."""
    store = make_store(tmp_path, clock, ram=2, disk=2, ttl=300)
    try:
        fill_with_interactive_states(store, clock, claimed=False)
        assert store.reserve(h("i5"), SIZE, INTERACTIVE) is not None
        assert where(store) == {"i2": "disk", "i3": "disk", "i4": "ram"}  # i1 went: the least recent
        assert (store.stats().protected_refusals, store.stats().evictions) == (0, 1)
        store.check_integrity()
    finally:
        store.close()


def test_without_a_ttl_the_same_reserve_evicts_the_lru_state(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=2, disk=2, ttl=0)
    try:
        fill_with_interactive_states(store, clock)
        assert store.reserve(h("i5"), SIZE, INTERACTIVE) is not None
        assert where(store) == {"i2": "disk", "i3": "disk", "i4": "ram"}  # i1 went: the least recent
        s = store.stats()
        assert (s.protected_refusals, s.evictions, s.spills) == (0, 1, 3)
        store.check_integrity()
    finally:
        store.close()


def test_an_agent_reserve_never_displaces_an_interactive_state(tmp_path: Path, clock: Clock) -> None:
    store = TierStore(StoreConfig(2 * SIZE, str(tmp_path / "unused"), 0, interactive_ttl=0), clock=clock)
    try:
        put(store, "i1", cls=INTERACTIVE)
        clock.t += 1
        put(store, "i2", cls=INTERACTIVE)
        clock.t += 1
        assert store.reserve(h("a"), SIZE, AGENT) is None  # no disk tier: room only by dropping one
        assert where(store) == {"i1": "ram", "i2": "ram"}
        assert (store.stats().protected_refusals, store.stats().evictions) == (1, 0)
        assert store.reserve(h("x"), SIZE, INTERACTIVE) is not None  # unprotected (no TTL): its own class may
        assert where(store) == {"i2": "ram"}
        assert (store.stats().protected_refusals, store.stats().evictions) == (1, 1)
        store.check_integrity()
    finally:
        store.close()


@pytest.mark.parametrize("ttl", [300.0, 0.0])
def test_a_prefix_in_its_ttl_is_kept_from_an_agent_and_yields_to_an_interactive_reserve(
        tmp_path: Path, clock: Clock, ttl: float) -> None:
    store = make_store(tmp_path, clock, ram=1, disk=1, ttl=ttl)
    try:
        for name in ("p1", "p2"):  # agent retained prefixes: the shared heads of two bursts, each claimed
            put(store, name, kind=PREFIX)
            lease = store.acquire(h(name))
            assert lease is not None
            store.release(lease.lease_id)
            clock.t += 1
        assert where(store) == {"p1": "disk", "p2": "ram"}
        agent = store.reserve(h("a"), SIZE, AGENT)  # p2 must come down, and the disk drop p1 for it
        if ttl:
            assert agent is None and where(store) == {"p1": "disk", "p2": "ram"}
            assert (store.stats().protected_refusals, store.stats().evictions) == (1, 0)
            assert store.reserve(h("x"), SIZE, INTERACTIVE) is not None  # a higher class takes p1's room
        else:
            assert agent is not None and store.stats().protected_refusals == 0
        assert where(store) == {"p2": "disk"}  # the lower ranked p1 went, not p2
        assert store.stats().evictions == 1
        store.check_integrity()
    finally:
        store.close()


def test_a_restore_is_live_work_and_takes_room_in_rank_order(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=1, disk=2, ttl=300)
    try:
        for name in ("i1", "i2", "i3"):
            put(store, name, cls=INTERACTIVE)
            clock.t += 1
        assert where(store) == {"i1": "disk", "i2": "disk", "i3": "ram"}
        assert read_back(store, "i1") == (make_data("i1"), DISK)
        # i3 came down; the disk dropped i2 (ranked below it) although it is inside its TTL.
        assert where(store) == {"i1": "ram+disk", "i3": "disk"}
        s = store.stats()
        assert (s.protected_refusals, s.evictions, s.restores) == (0, 1, 1)
        store.check_integrity()
    finally:
        store.close()


def test_without_a_disk_tier_ram_pressure_evicts(tmp_path: Path, clock: Clock) -> None:
    store = TierStore(StoreConfig(2 * SIZE, str(tmp_path / "unused"), 0), clock=clock)
    try:
        put(store, "a")
        clock.t += 1
        put(store, "b")
        clock.t += 1
        put(store, "c")
        assert where(store) == {"b": "ram", "c": "ram"}
        s = store.stats()
        assert (s.spills, s.evictions, s.disk_bytes_total) == (0, 1, 0)
        store.check_integrity()
    finally:
        store.close()


def test_match_longest_per_tier_pages_prefixes_and_tails(store: TierStore, clock: Clock) -> None:
    p = ("p1", "p2", "p3")
    put(store, "p3", pages=p, tokens=48)  # attention-only namespace: every page-aligned prefix is a state
    hits = match_hits(store, NS, [h(x) for x in ("p1", "p2", "p3", "p4", "p5")])
    assert [(x.hash, x.state_hash, x.tokens, x.tier) for x in hits] == [(h("p3"), h("p3"), 48, RAM)]
    assert hits[0].extent is not None and hits[0].extent.length == SIZE and hits[0].nbytes == SIZE
    # A prompt that diverges after page 2 still gets the first two pages of the stored state.
    hits = match_hits(store, NS, [h("p1"), h("p2"), h("q3")])
    assert [(x.hash, x.state_hash, x.tokens, x.tier) for x in hits] == [(h("p2"), h("p3"), 32, RAM)]
    assert match_hits(store, b"O" * 16, [h("p1"), h("p2"), h("p3")]) == []  # another namespace never matches

    # A hybrid model's checkpoint ends mid-page, named by its tail hash, and is not sliceable.
    put(store, "tail", ns=NS_HYBRID, pages=("a1", "a2"), tokens=37)
    hits = match_hits(store, NS_HYBRID, [h("a1"), h("a2")], h("tail"))
    assert [(x.hash, x.tokens, x.tier) for x in hits] == [(h("tail"), 37, RAM)]
    assert match_hits(store, NS_HYBRID, [h("a1"), h("a2")]) == []

    # Per tier: the RAM hit, then a longer disk hit.
    clock.t += 1
    put(store, "p1", pages=("p1",), tokens=16)
    clock.t += 1
    put(store, "filler")  # spills the least recent: p3
    assert where(store)["p3"] == "disk"
    hits = match_hits(store, NS, [h(x) for x in ("p1", "p2", "p3")])
    assert [(x.hash, x.state_hash, x.tokens, x.tier) for x in hits] == [(h("p1"), h("p1"), 16, RAM),
                                                                     (h("p3"), h("p3"), 48, DISK)]
    assert hits[1].extent is None
    # A page prefix on disk, found through the LMDB page index.
    hits = match_hits(store, NS, [h("p1"), h("p2"), h("q3")])
    assert [(x.hash, x.state_hash, x.tokens, x.tier) for x in hits] == [(h("p1"), h("p1"), 16, RAM),
                                                                     (h("p2"), h("p3"), 32, DISK)]
    # A disk hit no longer than the RAM hit is left out (ties go up).
    assert [x.tier for x in match_hits(store, NS, [h("p1")])] == [RAM]


def test_anchored_match_lists_states_ending_mid_page_after_a_prompt_page(tmp_path: Path, clock: Clock) -> None:
    """A previous turn's checkpoint ends mid-page: listed as a candidate by its last full page, longest first."""
    store = make_store(tmp_path, clock, ram=2)
    store.register(Registration(NS_HYBRID, "h", 16, "layout-h", 1024, 4096))
    try:
        put(store, "t1", ns=NS_HYBRID, pages=("a1",), tokens=21)  # ends 5 tokens into page 2
        clock.t += 1
        put(store, "t2", ns=NS_HYBRID, pages=("a1", "a2", "a3"), tokens=40)
        clock.t += 1
        put(store, "aligned", ns=NS_HYBRID, pages=("a1", "aligned"), tokens=32)  # page-aligned: not a candidate
        assert where(store)["t1"] == "disk"  # spilled: candidates come from every tier
        prompt = [h("a1"), h("a2"), h("a3"), h("a4")]
        hits, candidates = store.match_anchored(NS_HYBRID, prompt)
        assert hits == []
        assert [(c.hash, c.tokens, c.tier) for c in candidates] == [(h("t2"), 40, RAM), (h("t1"), 21, DISK)]
        assert store.match_anchored(NS_HYBRID, prompt, None, False)[1] == []  # only when asked
        assert store.match_anchored(NS, prompt)[1] == []  # another namespace never sees them
        assert [c.hash for c in store.match_anchored(NS_HYBRID, [h("a1"), h("b2")])[1]] == [h("t1")]
        assert store.drop(h("t2"))
        assert [c.hash for c in store.match_anchored(NS_HYBRID, prompt)[1]] == [h("t1")]
        store.check_integrity()
    finally:
        store.close()
    again = make_store(tmp_path, clock, ram=2)  # the anchor index is rebuilt from what survived on disk
    try:
        assert [c.hash for c in again.match_anchored(NS_HYBRID, [h("a1")])[1]] == [h("t1")]
    finally:
        again.close()


def test_drop_while_leased_frees_the_extent_at_release(store: TierStore) -> None:
    data = put(store, "a")
    lease = store.acquire(h("a"))
    assert lease is not None
    assert store.drop(h("a"))
    assert match_hits(store, NS, [h("a")]) == [] and store.stats().states_ram == 0
    assert bytes(store.arena.slice(lease.extent.offset, SIZE)) == data  # still valid for the holder
    assert store.stats().arena_bytes_used == SIZE
    store.check_integrity()
    put(store, "a")  # the name can be stored again meanwhile, elsewhere in the arena
    store.release(lease.lease_id)
    assert store.stats().arena_bytes_used == SIZE
    store.check_integrity()


def test_leases_and_reservations_expire(store: TierStore, clock: Clock) -> None:
    put(store, "a")
    lease = store.acquire(h("a"), lease_seconds=5)
    assert lease is not None
    assert store.reserve(h("r"), SIZE) is not None
    clock.t += 5
    store.expire()
    s = store.stats()
    assert (s.leases_active, s.reservations_pending, s.arena_bytes_used) == (0, 1, 2 * SIZE)
    with pytest.raises(NotFound):
        store.release(lease.lease_id)
    clock.t += 60
    store.expire()
    assert store.stats().reservations_pending == 0 and store.stats().arena_bytes_used == SIZE
    with pytest.raises(FailedPrecondition):
        store.commit(h("r"), make_meta("r"))


def test_open_read_pins_ram_and_reads_disk_without_restoring(store: TierStore, clock: Clock) -> None:
    data_a = put(store, "a")
    for name in ("b", "c"):
        clock.t += 1
        put(store, name)
    info, view, done = store.open_read(h("a"))
    assert bytes(view) == data_a and info.hash == h("a")
    clock.t += 1
    put(store, "d")  # a is pinned by the read: the next least recent (b) goes instead
    assert where(store)["a"] == "ram" and where(store)["b"] == "disk"
    done()
    info, blob, done = store.open_read(h("b"))
    assert blob == make_data("b") and store.stats().restores == 0
    done()


def test_restart_serves_what_reached_disk(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=1)
    store.register(Registration(NS, "m", 16, "layout-a", 1024, 0))
    written = {name: put(store, name, pages=(name,)) for name in ("a", "b", "c")}
    arena_path = store.arena.path
    store.close()
    assert not arena_path.exists()  # the shared-memory file goes with the instance

    again = make_store(tmp_path, clock, ram=1)
    try:
        s = again.stats()
        assert (s.states_ram, s.states_disk) == (0, 2)  # RAM died with the process; disk survived
        assert match_hits(again, NS, [h("b")])[0].tier == DISK
        assert read_back(again, "b") == (written["b"], DISK)
        with pytest.raises(FailedPrecondition):  # the registered layout survived too
            again.register(Registration(NS, "m", 16, "layout-b", 1024, 0))
        again.check_integrity()
    finally:
        again.close()


def arena_offset(store: TierStore, name: str) -> int:
    """Where the state's bytes start in the arena now (an Acquire's lease, released)."""
    lease = store.acquire(h(name))
    assert lease is not None
    store.release(lease.lease_id)
    return lease.extent.offset


def flip_byte(store: TierStore, at: int) -> None:
    """Scribbles over one committed byte of the arena (what a misbehaving engine could do)."""
    view = store.arena.slice(at, 1)
    view[0] ^= 0xFF


def test_a_scribbled_arena_is_caught_before_it_reaches_disk(store: TierStore, clock: Clock) -> None:
    put(store, "a")
    flip_byte(store, arena_offset(store, "a"))
    for name in ("b", "c", "d"):
        clock.t += 1
        put(store, name)
    assert "a" not in where(store)
    s = store.stats()
    assert (s.checksum_failures, s.states_disk, s.spills) == (1, 0, 0)


def test_a_flipped_byte_on_disk_is_dropped_and_counted(store: TierStore, clock: Clock, tmp_path: Path) -> None:
    put(store, "a", pages=("a",))
    for name in ("b", "c", "d"):
        clock.t += 1
        put(store, name)
    blob = tmp_path / "kv-disk" / "blobs" / h("a").hex()
    raw = bytearray(blob.read_bytes())
    raw[5000] ^= 0x40
    blob.write_bytes(raw)
    with pytest.raises(DataLoss):
        store.acquire(h("a"))
    s = store.stats()
    assert (s.checksum_failures, s.restores) == (1, 0)
    assert "a" not in where(store)  # (the restore had already spilled b to make room)
    assert match_hits(store, NS, [h("a")]) == [] and not blob.exists()
    with pytest.raises(NotFound):
        store.acquire(h("a"))


# ------------------------------------------------------------ a Match that leases (one round trip per claim)

def _hits_of(store: TierStore, name: str) -> int:
    return store._states[h(name)].hits


def test_a_leasing_match_pins_the_ram_states_it_names_and_only_those(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, ram=3)
    store.register(Registration(NS_HYBRID, "h", 16, "layout-h", 1024, 4096))
    try:
        put(store, "t1", ns=NS_HYBRID, pages=("a1",), tokens=21)  # a candidate, spilled below
        clock.t += 1
        t2 = put(store, "t2", ns=NS_HYBRID, pages=("a1", "a2", "a3"), tokens=40)  # a candidate in RAM
        clock.t += 1
        put(store, "a2", ns=NS_HYBRID, pages=("a1", "a2"), tokens=32)  # the page hit, in RAM
        clock.t += 1
        put(store, "x")  # pushes the oldest (t1) down to disk
        assert where(store)["t1"] == "disk"
        prompt = [h("a1"), h("a2"), h("a3"), h("a4")]
        plain = store.match_anchored(NS_HYBRID, prompt)
        assert all(hit.lease_id == 0 and hit.info is None for hit in (*plain[0], *plain[1]))
        assert store.stats().leases_active == 0  # no lease unless asked for
        hits, candidates = store.match_anchored(NS_HYBRID, prompt, lease_seconds=5)
        assert [(c.hash, c.tier) for c in candidates] == [(h("t2"), RAM), (h("t1"), DISK)]
        [page_hit] = hits
        assert page_hit.hash == h("a2") and page_hit.lease_id and page_hit.info is not None
        assert page_hit.info.hash == h("a2") and page_hit.info.nbytes == SIZE
        ram_candidate, disk_candidate = candidates
        assert ram_candidate.lease_id not in (0, page_hit.lease_id) and disk_candidate.lease_id == 0  # never a restore
        assert store.stats().leases_active == 2
        # The leased extents stay put: a newcomer that needs room spills only what is not leased.
        assert store.reserve(h("y"), SIZE) is not None and where(store)["x"] == "disk"
        assert store.reserve(h("z"), SIZE) is None  # the rest is pinned
        assert bytes(store.arena.slice(ram_candidate.extent.offset, SIZE)) == t2  # type: ignore[union-attr]
        # Release: the used one counts a hit (as Acquire would); the unused one none.
        before = (_hits_of(store, "a2"), _hits_of(store, "t2"))
        clock.t += 2
        store.release(page_hit.lease_id, [ram_candidate.lease_id])
        assert (_hits_of(store, "a2"), _hits_of(store, "t2")) == (before[0] + 1, before[1])
        assert store._states[h("a2")].last_used == clock.t
        assert store.stats().leases_active == 0
        store.drop(h("y"))
        store.check_integrity()
    finally:
        store.close()


def test_match_leases_expire_and_unknown_ones_are_not_found(store: TierStore, clock: Clock) -> None:
    put(store, "a")
    put(store, "b")
    [a] = store.match_anchored(NS, [h("a")], lease_seconds=5)[0]
    [b] = store.match_anchored(NS, [h("b")], lease_seconds=50)[0]
    with pytest.raises(InvalidArgument):
        store.match_anchored(NS, [h("a")], lease_seconds=-1)
    with pytest.raises(InvalidArgument):
        store.match_anchored(NS, [h("a")], lease_seconds=float("nan"))
    clock.t += 5
    store.expire()
    assert store.stats().leases_active == 1  # a's ran out, b's did not
    with pytest.raises(NotFound, match=str(a.lease_id)):
        store.release(a.lease_id, [b.lease_id])  # the known one is released all the same
    assert store.stats().leases_active == 0
    with pytest.raises(NotFound):
        store.release(0, [b.lease_id])
    store.release(0, [])  # nothing named: nothing to do


def test_a_match_on_a_broken_arena_leases_nothing(store: TierStore, clock: Clock) -> None:
    put(store, "a")
    store._arena_fault = "deleted (a test)"  # as after a failed recreation: no extent may be handed out
    hits = store.match_anchored(NS, [h("a")], lease_seconds=5)[0]
    assert all(hit.lease_id == 0 for hit in hits) and store.stats().leases_active == 0
    store._arena_fault = None


def test_match_now_never_waits_for_the_lock(store: TierStore) -> None:
    """The server runs a Match on its event loop only through match_now: with the lock held (a spill or
    restore moving bytes) it does nothing and says so, and the Match goes to the pool instead."""
    put(store, "a")
    with store._lock:
        assert store.match_now(NS, [h("a")], lease_seconds=5) is None
    assert store.stats().leases_active == 0  # nothing was leased by the refused try
    found = store.match_now(NS, [h("a")], lease_seconds=5)
    assert found is not None and [hit.hash for hit in found[0]] == [h("a")] and found[0][0].lease_id
    store.release(found[0][0].lease_id)
