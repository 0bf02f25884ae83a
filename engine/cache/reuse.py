"""Prompt reuse: the contract between the scheduler and a reuse strategy.

Two strategies sit behind it: page-level sharing for attention-only models
(any page-aligned prefix), and retained states (checkpoints and prefixes) for
models with recurrent layers, which cannot be rewound. `NoReuse` is the
strategy when `reuse.prompt` is off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.facts import ReuseKind, ReuseTier
from engine.request import EngineSequence
from engine.residency.counters import ReuseCounters
from engine.residency.retained_state import RetainedState
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


class PromptReuse(ABC):
    """Reuse policy: what a prompt matches, how a claim is applied, where a prefill is cut to capture
    state, what is published. Where retained state lives and how it moves is engine/residency/'s."""

    def __init__(self, counters: ReuseCounters | None = None) -> None:
        self.counters = counters if counters is not None else ReuseCounters()

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
            self.counters.count_hit(seq, claim.kind, claim.num_tokens, claim.tier)
            if isinstance(claim.source, HeldState):
                claim.source.state.hits += 1


class NoReuse(PromptReuse):
    def match(self, seq: EngineSequence) -> Claim | None:
        return None

    def after_decodes(self, seqs: list[EngineSequence]) -> None:
        pass

    def apply(self, seq: EngineSequence, claim: Claim) -> None:
        raise RuntimeError("NoReuse never claims: this is a bug")

    def record(self, seq: EngineSequence, claim: Claim | None) -> None:
        pass
