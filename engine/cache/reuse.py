"""Prompt reuse: the contract between the scheduler and a reuse strategy.

Two strategies sit behind it: page-level sharing for attention-only models
(any page-aligned prefix), and retained states (checkpoints and prefixes) for
models with recurrent layers, which cannot be rewound. `NoReuse` is the
strategy when `reuse.prompt` is off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.cache.retained_state import RetainedState, StateView
from engine.facts import ReuseKind, ReuseReport, ReuseTier
from engine.request import EngineSequence
from engine.tiers.link import TierHit


@dataclass(frozen=True, slots=True)
class DevicePages:
    """Registered pages on the device, shared page by page (attention-only models)."""

    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HeldState:
    """A retained state the engine holds, in a device or a host slot (models with recurrent layers)."""

    state: RetainedState


@dataclass(frozen=True, slots=True)
class LowerTier:
    """A state in KV-RAM or KV-disk, restored through the tierstore."""

    hit: TierHit


ClaimSource = DevicePages | HeldState | LowerTier


@dataclass(frozen=True, slots=True)
class Claim:
    """What a waiting sequence would get from retained state (decided before admission)."""

    num_tokens: int  # tokens whose state is copied instead of prefilled
    kind: ReuseKind
    source: ClaimSource

    @property
    def tier(self) -> ReuseTier:
        if isinstance(self.source, LowerTier):
            return self.source.hit.tier
        return self.source.state.tier if isinstance(self.source, HeldState) else ReuseTier.DEVICE


def _per_tier() -> dict[ReuseTier, int]:
    return {tier: 0 for tier in ReuseTier if tier is not ReuseTier.NONE}


@dataclass(slots=True)
class ReuseCounters:
    hits: int = 0
    misses: int = 0
    reused_tokens: dict[ReuseTier, int] = field(default_factory=_per_tier)
    prefix_reused_tokens: int = 0
    slot_skips: int = 0  # captures lost: no slot, no state the newcomer may displace, no tier below took it
    protected_skips: int = 0  # captures that found the lowest-ranked state protected (not displaced)
    captures_below: int = 0  # captures written straight to the tier below (no device slot to take)
    staging_skips: int = 0  # host captures skipped because both staging buffers were busy
    spills_ahead: int = 0  # states written to KV-RAM off the step, before the device gave them up
    spills_on_step: int = 0  # states written to KV-RAM on the step, as the device gave them up
    promotions: int = 0  # host states moved up to a free device slot when claimed
    inflight_holds: int = 0  # admissions held back while a running sequence computed what they would claim
    captures: int = 0
    evictions: int = 0

    def count_hit(self, seq: EngineSequence, claim: Claim, tier: ReuseTier) -> None:
        self.hits += 1
        self.reused_tokens[tier] += claim.num_tokens
        if claim.kind is ReuseKind.PREFIX:
            self.prefix_reused_tokens += claim.num_tokens
        seq.record_reuse(ReuseReport(tier, claim.kind, claim.num_tokens))


class PromptReuse(ABC):
    def __init__(self) -> None:
        self.counters = ReuseCounters()

    @abstractmethod
    def match(self, seq: EngineSequence) -> Claim | None:
        """The best reuse for `seq` now, without side effects."""

    @abstractmethod
    def apply(self, seq: EngineSequence, claim: Claim) -> None:
        """Copy the claimed state into `seq` (its slot is allocated); sets pages and num_computed."""

    def revived_free_pages(self, claim: Claim) -> int:
        """Pages the claim takes off the free list besides the fresh ones of the prompt's rest."""
        return 0

    def in_flight(self, seq: EngineSequence, claim: Claim | None, running: list[EngineSequence]) -> bool:
        """Whether state that `seq` would claim beyond `claim` is being made right now: computed
        by a running sequence, or still being copied into its slot.

        Admitting `seq` before that state is published would compute it twice: a swarm's
        agents starting together all send the same system+tools head. The scheduler holds
        `seq` back until the state is there (the running one finishes it or leaves).
        """
        return False

    def cut_point(self, seq: EngineSequence) -> int | None:
        """A position the next prefill chunk must end at (to capture state there), if any."""
        return None

    def after_compute(self, seq: EngineSequence, next_logits: torch.Tensor | None) -> None:
        """Called after each step that computed tokens of `seq`. `next_logits`: the logits after them
        where the step computed the prompt's last token (a checkpoint there keeps them); None on
        the decode road (engine/core.py `_decoded`), whose sequences are all past that token."""

    def after_decodes(self, seqs: list[EngineSequence]) -> None:
        """after_compute(seq, None) for each sequence of a decode-only step, which computed one generated
        token of each; a strategy with nothing to do for most of them says so once a step, not once each."""
        for seq in seqs:
            self.after_compute(seq, None)

    def on_finish(self, seq: EngineSequence) -> None:
        """Called when `seq` finishes normally, before its pages and slot are released."""

    def reclaim(self, pages_needed: int, keep: Claim | None = None) -> bool:
        """Free device pages held by retained state until `pages_needed` are free (live work
        comes first), never the state `keep` claims."""
        return False

    def record(self, seq: EngineSequence, claim: Claim | None) -> None:
        if claim is None:
            self.counters.misses += 1
        else:
            self.counters.count_hit(seq, claim, claim.tier)
            if isinstance(claim.source, HeldState):
                claim.source.state.hits += 1

    def describe(self) -> list[StateView]:
        """A copy of what it retains, one row per state (engine thread; the Monitor's listing)."""
        return []

    def held_pages(self) -> set[int]:
        """Pages kept in use by retained state (not by any live sequence)."""
        return set()

    @property
    def retained_slots(self) -> tuple[int, int]:
        """(total, used) retained-state slots on the device."""
        return (0, 0)

    @property
    def host_slots(self) -> tuple[int, int]:
        """(total, used) retained-state slots on the host."""
        return (0, 0)

    def poll(self) -> None:
        """At the start of each step, and when idle after `notify_copies` fired: finish work done
        off the step (staged copies, writes ahead) and start what is due."""

    def notify_copies(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from the copy worker) whenever a copy off the step is through."""

    @property
    def copying(self) -> bool:
        """Copies off the step are in flight (the engine polls them even when it has no work)."""
        return False

    @property
    def copy_waits(self) -> int:
        """Times a step waited for a copy off the step to finish before reusing the memory it read."""
        return 0

    def close(self) -> None:
        """The engine stops: finish or drop work in flight."""

    def check_integrity(self) -> None:
        pass


class NoReuse(PromptReuse):
    def match(self, seq: EngineSequence) -> Claim | None:
        return None

    def after_decodes(self, seqs: list[EngineSequence]) -> None:
        pass

    def apply(self, seq: EngineSequence, claim: Claim) -> None:
        raise RuntimeError("NoReuse never claims: this is a bug")

    def record(self, seq: EngineSequence, claim: Claim | None) -> None:
        pass
