"""The tierstore's side of the one order: a stored state as a Resident, and the last tier's room rule."""

from __future__ import annotations

from common.eviction import EvictionOrder, Resident
from ignis.v1 import common_pb2
from tierstore.policy import last_tier_room, resident
from tierstore.state import StateHash, StateInfo

AGENT = common_pb2.REQUEST_CLASS_AGENT
INTERACTIVE = common_pb2.REQUEST_CLASS_INTERACTIVE
UNSPECIFIED = common_pb2.REQUEST_CLASS_UNSPECIFIED
CHECKPOINT, PREFIX, PAGES = common_pb2.REUSE_KIND_CHECKPOINT, common_pb2.REUSE_KIND_PREFIX, common_pb2.REUSE_KIND_PAGES
NOW = 10_000.0
TTL = 300.0
BLOCK = 4096


def make_info(name: str, cls: int, kind: int = CHECKPOINT) -> StateInfo:
    return StateInfo(StateHash(name.encode().ljust(16, b".")), b"N" * 16, 16, kind, cls, (), b"\0" * 16, BLOCK)


def make_resident(name: str, cls: int, age: float, *, kind: int = CHECKPOINT, protect_for: float = 0.0,
                  leased: bool = False, claimed: bool = True) -> Resident:
    """A stored state last used ``age`` seconds ago, protected ``protect_for`` more seconds; restored
    into an engine once unless told (the TTL protects only a claimed state)."""
    return resident(make_info(name, cls, kind), last_used=NOW - age,
                    protect_until=NOW + protect_for if protect_for else 0.0, leased=leased, claimed=claimed)


def name_of(r: Resident) -> str:
    return r.tiebreak.rstrip(b".").decode()


def order(*rs: Resident, ttl: float = TTL) -> list[str]:
    return [name_of(r) for r in EvictionOrder(ttl).order(rs, NOW, resident=lambda r: r)]


def test_resident_maps_the_record() -> None:
    info = make_info("x", AGENT, PREFIX)
    assert resident(info, last_used=12.5, protect_until=40.0, leased=True) == \
        Resident(interactive=False, last_used=12.5, prefix=True, leased=True, protect_until=40.0, tiebreak=info.hash)
    for cls, interactive in ((AGENT, False), (INTERACTIVE, True), (UNSPECIFIED, True)):
        assert resident(make_info("x", cls), last_used=0, protect_until=0, leased=False).interactive is interactive
    for kind, prefix in ((CHECKPOINT, False), (PREFIX, True), (PAGES, False)):
        assert resident(make_info("x", AGENT, kind), last_used=0, protect_until=0, leased=False).prefix is prefix


def test_stored_states_in_the_one_order() -> None:
    rs = [
        make_resident("i_leased", INTERACTIVE, 5000, leased=True),
        make_resident("i_ttl", INTERACTIVE, 100),
        make_resident("u_stale", UNSPECIFIED, 4000),  # UNSPECIFIED counts as interactive
        make_resident("i_window", INTERACTIVE, 3000, protect_for=60),
        make_resident("a_prefix_ttl", AGENT, 200, kind=PREFIX),  # a retained prefix: TTL-protected
        make_resident("a_leased", AGENT, 1, leased=True),
        make_resident("a_stale", AGENT, 3000),
        make_resident("a_fresh", AGENT, 2),
    ]
    assert order(*rs) == ["a_stale", "a_fresh", "a_prefix_ttl", "a_leased", "u_stale", "i_leased", "i_window",
                          "i_ttl"]
    # Without a TTL the prefix and the recent interactive state are only as old as they are.
    assert order(*rs, ttl=0) == ["a_stale", "a_prefix_ttl", "a_fresh", "a_leased", "u_stale", "i_ttl",
                                 "i_leased", "i_window"]


def room(incoming: Resident, *held: Resident, newcomer: bool | None, free: int = 0, need: int = BLOCK,
         ttl: float = TTL) -> list[str] | None:
    return last_tier_room(EvictionOrder(ttl), incoming, ((name_of(r), r, BLOCK) for r in held),
                          newcomer_interactive=newcomer, free=free, need=need, now=NOW)


def test_room_that_is_free_drops_nothing() -> None:
    assert room(make_resident("in", AGENT, 1), make_resident("d", AGENT, 9), newcomer=False, free=BLOCK) == []


def test_room_takes_only_states_ranked_below_the_incoming_one_in_order() -> None:
    held = [make_resident("a_new", AGENT, 5), make_resident("a_old", AGENT, 50), make_resident("a_mid", AGENT, 20)]
    incoming = make_resident("in", AGENT, 10)
    assert room(incoming, *held, newcomer=False, need=2 * BLOCK) == ["a_old", "a_mid"]
    assert room(incoming, *held, newcomer=False, need=3 * BLOCK) is None  # a_new outranks it: kept
    assert room(incoming, *held, newcomer=False, need=3 * BLOCK, free=BLOCK) == ["a_old", "a_mid"]


def test_room_never_drops_a_protected_state_for_a_same_class_newcomer() -> None:
    held = [make_resident("i_old", INTERACTIVE, 100), make_resident("i_older", INTERACTIVE, 200)]
    incoming = make_resident("in", INTERACTIVE, 10)
    assert room(incoming, *held, newcomer=True) is None  # both inside their TTL
    assert room(incoming, *held, newcomer=True, ttl=0) == ["i_older"]
    assert room(incoming, *held, newcomer=None) == ["i_older"]  # live work (a restore): rank alone


def test_room_protection_follows_the_newcomer_class_not_the_one_coming_down() -> None:
    held = [make_resident("a_prefix", AGENT, 100, kind=PREFIX)]
    incoming = make_resident("a_in", AGENT, 10, kind=PREFIX)
    assert room(incoming, *held, newcomer=False) is None  # an agent newcomer may not drop a protected agent prefix
    assert room(incoming, *held, newcomer=True) == ["a_prefix"]  # an interactive one may
    # An interactive state coming down for an agent newcomer still may not drop a protected agent state.
    assert room(make_resident("i_in", INTERACTIVE, 10), *held, newcomer=False) is None


def test_room_takes_an_unclaimed_state_inside_its_ttl_for_a_same_class_newcomer() -> None:
    """A full small tier of states nobody restored must not refuse every newer spill (the soak saw 5,650
    spills refused against 1,130 taken): inside the TTL, only a claimed state is protected."""
    cold, hot = make_resident("cold", INTERACTIVE, 10, claimed=False), make_resident("hot", INTERACTIVE, 20)
    incoming = make_resident("new", INTERACTIVE, 0, claimed=False)
    assert room(incoming, cold, hot, newcomer=True) == ["cold"]
    assert room(incoming, cold, hot, newcomer=True, need=2 * BLOCK) is None  # "hot" was restored: it stays


def test_room_never_takes_a_leased_state_for_a_newcomer() -> None:
    held = [make_resident("a_leased", AGENT, 100, leased=True)]
    assert room(make_resident("i_in", INTERACTIVE, 10), *held, newcomer=True) is None
