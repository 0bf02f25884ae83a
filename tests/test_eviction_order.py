"""The one eviction order (common/eviction.py): exact orders, and the decisions protection changes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.eviction import EvictionOrder, Resident

NOW = 10_000.0
TTL = 300.0


def make_resident(name: str, *, interactive: bool, age: float, prefix: bool = False, leased: bool = False,
                  protect_for: float = 0.0, claimed: bool = True) -> Resident:
    """A state last used ``age`` seconds ago, inside an explicit window for ``protect_for`` more seconds;
    claimed once unless told (the TTL protects only a claimed state)."""
    return Resident(interactive, NOW - age, prefix=prefix, leased=leased,
                    protect_until=NOW + protect_for if protect_for else 0.0, tiebreak=name.encode(), claimed=claimed)


def names(residents: list[Resident], ttl: float = TTL, now: float = NOW) -> list[str]:
    return [r.tiebreak.decode() for r in EvictionOrder(ttl).order(residents, now, resident=lambda r: r)]


def test_recency_alone_is_lru_then_tiebreak() -> None:
    rs = [make_resident(n, interactive=False, age=a) for n, a in (("new", 1), ("old", 50), ("mid", 10), ("b", 3),
                                                                  ("a", 3))]
    assert names(rs) == ["old", "mid", "a", "b", "new"]


def test_class_first_even_against_recency() -> None:
    rs = [make_resident("i_old", interactive=True, age=900), make_resident("a_new", interactive=False, age=1),
          make_resident("i_older", interactive=True, age=1000), make_resident("a_old", interactive=False, age=500)]
    assert names(rs) == ["a_old", "a_new", "i_older", "i_old"]


def test_full_mixed_order() -> None:
    rs = [
        make_resident("i_leased", interactive=True, age=5000, leased=True),
        make_resident("i_ttl", interactive=True, age=100),
        make_resident("i_stale_a", interactive=True, age=4000),
        make_resident("i_stale_b", interactive=True, age=350),
        make_resident("i_window", interactive=True, age=3000, protect_for=60),
        make_resident("a_prefix_ttl", interactive=False, age=250, prefix=True),
        make_resident("a_prefix_stale", interactive=False, age=400, prefix=True),
        make_resident("a_window", interactive=False, age=2000, protect_for=5),
        make_resident("a_leased", interactive=False, age=1, leased=True),
        make_resident("a_stale", interactive=False, age=3000),
        make_resident("a_fresh", interactive=False, age=2),  # an agent checkpoint gets no TTL
    ]
    assert names(rs) == [
        "a_stale", "a_prefix_stale", "a_fresh",  # agent, unprotected, LRU
        "a_window", "a_prefix_ttl", "a_leased",  # agent, protected, LRU
        "i_stale_a", "i_stale_b",  # interactive, unprotected, LRU
        "i_leased", "i_window", "i_ttl",  # interactive, protected, LRU
    ]


def test_the_ttl_changes_the_order_not_only_recency() -> None:
    # An old state in its window and a recent one: inside the TTL both are protected and
    # recency orders them; with no TTL the recent one is unprotected and goes first.
    rs = [make_resident("i_window_old", interactive=True, age=3000, protect_for=60),
          make_resident("i_recent", interactive=True, age=10)]
    assert names(rs, ttl=TTL) == ["i_window_old", "i_recent"]
    assert names(rs, ttl=0) == ["i_recent", "i_window_old"]
    # A retained prefix inside its TTL outlasts a fresher plain agent state.
    rs = [make_resident("a_prefix", interactive=False, age=10, prefix=True),
          make_resident("a_plain", interactive=False, age=5)]
    assert names(rs, ttl=TTL) == ["a_plain", "a_prefix"]
    assert names(rs, ttl=0) == ["a_prefix", "a_plain"]


def test_ttl_protection_and_its_end() -> None:
    order = EvictionOrder(TTL)
    recent = make_resident("i", interactive=True, age=10)
    assert order.is_protected(recent, NOW)
    assert order.is_protected(recent, NOW + TTL - 10.5)
    assert not order.is_protected(recent, NOW + TTL - 10)  # exactly ttl since last use: over
    assert not EvictionOrder(0).is_protected(recent, NOW)
    assert not order.is_protected(make_resident("a", interactive=False, age=10), NOW)  # agents: no TTL


def test_a_window_expires() -> None:
    r = make_resident("a", interactive=False, age=10, protect_for=5)
    order = EvictionOrder(TTL)
    assert order.is_protected(r, NOW) and order.is_protected(r, NOW + 4.9)
    assert not order.is_protected(r, NOW + 5)


def test_a_recent_interactive_state_is_displaced_by_an_interactive_newcomer_only_without_a_ttl() -> None:
    victim = make_resident("i", interactive=True, age=10)
    assert not EvictionOrder(TTL).may_displace(victim, True, NOW)
    assert EvictionOrder(0).may_displace(victim, True, NOW)
    assert EvictionOrder(TTL).may_displace(victim, True, NOW + TTL)  # its TTL over


@pytest.mark.parametrize("prefix", [False, True], ids=["interactive", "prefix"])
def test_the_ttl_protects_only_a_state_someone_claimed(prefix: bool) -> None:
    """Single-use states must not hold a tier for the whole TTL: inside it, one never claimed ranks with
    the unprotected (LRU) and a newcomer of its class may take its room; once claimed it is protected."""
    order = EvictionOrder(TTL)
    unclaimed = make_resident("fresh", interactive=not prefix, prefix=prefix, age=5, claimed=False)
    claimed = make_resident("hot", interactive=not prefix, prefix=prefix, age=50)
    assert not order.is_protected(unclaimed, NOW) and order.is_protected(claimed, NOW)
    assert names([claimed, unclaimed]) == ["fresh", "hot"]  # the older, claimed one stays
    assert order.may_displace(unclaimed, newcomer_interactive=not prefix, now=NOW)
    assert not order.may_displace(claimed, newcomer_interactive=not prefix, now=NOW)
    explicit = make_resident("moving", interactive=False, age=5, protect_for=30, claimed=False)
    assert order.is_protected(explicit, NOW)  # a window (a live move's reservation) needs no claim


def test_an_agent_newcomer_never_displaces_an_interactive_state() -> None:
    for ttl in (TTL, 0.0):
        order = EvictionOrder(ttl)
        assert not order.may_displace(make_resident("i_stale", interactive=True, age=5000), False, NOW)
        assert not order.may_displace(make_resident("i_recent", interactive=True, age=1), False, NOW)


def test_a_prefix_inside_its_ttl_is_protected_from_its_own_class() -> None:
    prefix = make_resident("p", interactive=False, age=10, prefix=True)
    assert not EvictionOrder(TTL).may_displace(prefix, False, NOW)
    assert EvictionOrder(0).may_displace(prefix, False, NOW)
    assert EvictionOrder(TTL).may_displace(prefix, True, NOW)  # a higher class takes it
    plain = make_resident("a", interactive=False, age=10)
    assert EvictionOrder(TTL).may_displace(plain, False, NOW)  # no TTL for a plain agent state


def test_a_window_protects_from_the_same_class_only() -> None:
    order = EvictionOrder(0)
    windowed = make_resident("a", interactive=False, age=100, protect_for=30)
    assert not order.may_displace(windowed, False, NOW)
    assert order.may_displace(windowed, True, NOW)
    assert order.may_displace(windowed, False, NOW + 30)


def test_a_leased_state_is_never_displaced() -> None:
    order = EvictionOrder(0)
    for interactive in (False, True):
        leased = make_resident("l", interactive=interactive, age=5000, leased=True)
        assert order.is_protected(leased, NOW)
        assert not order.may_displace(leased, True, NOW)
        assert not order.may_displace(leased, False, NOW)


def test_order_takes_any_item_through_resident() -> None:
    @dataclass
    class Slot:
        name: str
        interactive: bool
        age: float

    slots = [Slot("i", True, 1), Slot("a_new", False, 1), Slot("a_old", False, 9)]
    got = EvictionOrder(TTL).order(slots, NOW, resident=lambda s: Resident(s.interactive, NOW - s.age,
                                                                           tiebreak=s.name.encode()))
    assert [s.name for s in got] == ["a_old", "a_new", "i"]


def test_negative_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="retained_interactive_ttl"):
        EvictionOrder(-1)
