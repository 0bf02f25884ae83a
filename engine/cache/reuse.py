"""Prompt reuse: the contract between the scheduler and a reuse strategy.

Two strategies sit behind it: page-level sharing for attention-only models
(any page-aligned prefix), and retained states (checkpoints and prefixes) for
models with recurrent layers, which cannot be rewound. `NoReuse` is the
strategy when `reuse.prompt` is off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from engine.outputs import ReuseReport
from engine.request import Sequence


@dataclass(frozen=True, slots=True)
class Claim:
    """What a waiting sequence would get from retained state (decided before admission)."""

    num_tokens: int  # tokens whose state is copied instead of prefilled
    kind: str  # pages | checkpoint | prefix
    revived_free_pages: int  # cached pages taken back off the free list (they count against it)
    handle: object = None  # strategy-private: matched pages or the retained state


@dataclass(slots=True)
class ReuseCounters:
    hits: int = 0
    misses: int = 0
    reused_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "ram": 0, "disk": 0})
    prefix_reused_tokens: int = 0
    slot_skips: int = 0
    inflight_holds: int = 0  # admissions held back while a running sequence computed what they would claim
    captures: int = 0
    evictions: int = 0


class PromptReuse(ABC):
    def __init__(self) -> None:
        self.counters = ReuseCounters()

    @abstractmethod
    def match(self, seq: Sequence) -> Claim | None:
        """The best reuse for `seq` now, without side effects."""

    @abstractmethod
    def apply(self, seq: Sequence, claim: Claim) -> None:
        """Copy the claimed state into `seq` (its slot is allocated); sets pages and num_computed."""

    def in_flight(self, seq: Sequence, claim: Claim | None, running: list[Sequence]) -> Sequence | None:
        """A running sequence now computing state that `seq` would claim beyond `claim`, if any.

        Admitting `seq` before that state is published would compute it twice: a swarm's
        agents starting together all send the same system+tools head. The scheduler holds
        `seq` back until the state is there (the running one finishes it or leaves).
        """
        return None

    def cut_point(self, seq: Sequence) -> int | None:
        """A position the next prefill chunk must end at (to capture state there), if any."""
        return None

    def after_compute(self, seq: Sequence, next_logits: torch.Tensor | None) -> None:
        """Called after each step that computed tokens of `seq`."""

    def on_finish(self, seq: Sequence) -> None:
        """Called when `seq` finishes normally, before its pages and slot are released."""

    def reclaim(self, pages_needed: int) -> bool:
        """Free device pages held by retained state until `pages_needed` are free."""
        return False

    def record(self, seq: Sequence, claim: Claim | None) -> None:
        if claim is None:
            self.counters.misses += 1
            return
        self.counters.hits += 1
        self.counters.reused_tokens["device"] += claim.num_tokens
        if claim.kind == "prefix":
            self.counters.prefix_reused_tokens += claim.num_tokens
        seq.num_cached = claim.num_tokens
        seq.reuse = ReuseReport("device", claim.kind, claim.num_tokens)

    def held_pages(self) -> set[int]:
        """Pages kept in use by retained state (not by any live sequence)."""
        return set()

    @property
    def retained_slots(self) -> tuple[int, int]:
        """(total, used) retained-state slots on the device."""
        return (0, 0)

    def check_integrity(self) -> None:
        pass


class NoReuse(PromptReuse):
    def match(self, seq: Sequence) -> Claim | None:
        return None

    def apply(self, seq: Sequence, claim: Claim) -> None:
        raise RuntimeError("NoReuse never claims: this is a bug")

    def record(self, seq: Sequence, claim: Claim | None) -> None:
        pass
