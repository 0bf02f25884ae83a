"""The one eviction order: class, then protection, then recency. Exact orders only."""

from __future__ import annotations

import pytest

from ignis.v1 import common_pb2
from tierstore.policy import Candidate, EvictionPolicy

AGENT = common_pb2.REQUEST_CLASS_AGENT
INTERACTIVE = common_pb2.REQUEST_CLASS_INTERACTIVE
UNSPECIFIED = common_pb2.REQUEST_CLASS_UNSPECIFIED
NOW = 10_000.0
TTL = 300.0


def make_candidate(name: str, cls: int, age: float, *, protect_for: float = 0.0, leased: bool = False) -> Candidate:
    """A state last used ``age`` seconds ago, protected ``protect_for`` more seconds."""
    return Candidate(name.encode().ljust(16, b"."), cls, NOW - age, NOW + protect_for if protect_for else 0.0,
                     leased)


def order(*cands: Candidate, ttl: float = TTL) -> list[str]:
    return [c.hash.rstrip(b".").decode() for c in EvictionPolicy(ttl).order(cands, NOW)]


def test_recency_alone_is_lru() -> None:
    assert order(make_candidate("new", AGENT, 1), make_candidate("old", AGENT, 50),
                 make_candidate("mid", AGENT, 10)) == ["old", "mid", "new"]


def test_class_first_even_against_recency() -> None:
    # Interactive states past their TTL (unprotected) still outrank a fresher agent state.
    assert order(make_candidate("i_old", INTERACTIVE, 900), make_candidate("a_new", AGENT, 1),
                 make_candidate("i_older", INTERACTIVE, 1000), make_candidate("a_old", AGENT, 500)) \
        == ["a_old", "a_new", "i_older", "i_old"]


def test_unspecified_class_is_interactive() -> None:
    assert order(make_candidate("u", UNSPECIFIED, 900), make_candidate("a", AGENT, 1)) == ["a", "u"]


def test_protection_within_a_class() -> None:
    cands = [
        make_candidate("a_leased_old", AGENT, 800, leased=True),  # a retained prefix in use by a burst
        make_candidate("a_window", AGENT, 700, protect_for=30),  # inside its protect window
        make_candidate("a_window_over", AGENT, 600),
        make_candidate("a_plain_new", AGENT, 5),
    ]
    # Protection is one rank: within it, recency orders (the leased one was used longer ago).
    assert order(*cands) == ["a_window_over", "a_plain_new", "a_leased_old", "a_window"]


def test_interactive_ttl_protects_recent_interactive_states_only() -> None:
    cands = [
        make_candidate("i_in_ttl_old", INTERACTIVE, 200),  # within the 300 s TTL: protected
        make_candidate("i_in_ttl_new", INTERACTIVE, 10),
        make_candidate("i_past_ttl", INTERACTIVE, 301),  # past the TTL: unprotected
        make_candidate("a_recent", AGENT, 10),  # agents get no TTL protection
    ]
    assert order(*cands) == ["a_recent", "i_past_ttl", "i_in_ttl_old", "i_in_ttl_new"]
    # With the TTL at 0 only recency orders the interactive states.
    assert order(*cands, ttl=0) == ["a_recent", "i_past_ttl", "i_in_ttl_old", "i_in_ttl_new"]
    assert order(make_candidate("i_new", INTERACTIVE, 10), make_candidate("i_old", INTERACTIVE, 200), ttl=0) \
        == ["i_old", "i_new"]
    assert order(make_candidate("i_new", INTERACTIVE, 10), make_candidate("i_past", INTERACTIVE, 400),
                 make_candidate("i_old", INTERACTIVE, 200)) == ["i_past", "i_old", "i_new"]


def test_full_mixed_order() -> None:
    cands = [
        make_candidate("i_leased", INTERACTIVE, 5000, leased=True),
        make_candidate("i_ttl", INTERACTIVE, 100),
        make_candidate("i_stale_a", INTERACTIVE, 4000),
        make_candidate("i_stale_b", INTERACTIVE, 350),
        make_candidate("i_window", INTERACTIVE, 3000, protect_for=60),
        make_candidate("a_prefix_window", AGENT, 2000, protect_for=5),
        make_candidate("a_leased", AGENT, 1, leased=True),
        make_candidate("a_stale", AGENT, 3000),
        make_candidate("a_fresh", AGENT, 2),
    ]
    assert order(*cands) == [
        "a_stale", "a_fresh",  # agent, unprotected, LRU
        "a_prefix_window", "a_leased",  # agent, protected, LRU
        "i_stale_a", "i_stale_b",  # interactive, unprotected, LRU
        "i_leased", "i_window", "i_ttl",  # interactive, protected, LRU
    ]


def test_a_window_expires() -> None:
    c = make_candidate("a", AGENT, 10, protect_for=5)
    policy = EvictionPolicy(TTL)
    assert policy.is_protected(c, NOW) and policy.is_protected(c, NOW + 4.9)
    assert not policy.is_protected(c, NOW + 5)


def test_equal_times_break_ties_by_hash() -> None:
    assert order(make_candidate("b", AGENT, 3), make_candidate("a", AGENT, 3)) == ["a", "b"]


def test_negative_ttl_is_refused() -> None:
    with pytest.raises(ValueError):
        EvictionPolicy(-1)
