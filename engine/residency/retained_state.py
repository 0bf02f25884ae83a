"""One retained state on the device: the record the retained-state index keeps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.eviction import Resident
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.kv.chain_hash import StateHash


@dataclass(eq=False)
class RetainedState:
    """The whole sequence state at one position. On the device: its recurrent state and conv
    taps in a slot reserved at load, and its KV pages (full pages shared, a partial last page
    private). On the host: all of it, and its logits, in one host slot. Immutable once
    captured: a claim copies it."""

    name: StateHash
    anchor: StateHash  # hash of the last full page at or before the end (the index key)
    num_tokens: int
    kind: ReuseKind  # CHECKPOINT | PREFIX
    tier: ReuseTier  # DEVICE: a device slot and device pages; HOST: one host slot holds it all
    slot: int  # device slot, or host slot
    pages: list[int]  # device pages (none for a host state)
    request_class: RequestClass
    lineage: int | None
    logits: torch.Tensor | None  # next-token logits at the end (opener checkpoints): a retry prefills nothing
    namespace: StateHash  # h0 of its chain (for the tierstore)
    page_hashes: tuple[StateHash, ...]  # hashes of its full pages (for the tierstore)
    last_used: float = field(default_factory=time.monotonic)
    ready: bool = True  # False while a staged copy is still filling its host slot: not claimable yet
    below: bool = False  # a copy is committed in KV-RAM (written ahead of its eviction): leaving costs no copy
    ahead_tried: bool = False  # a write ahead was attempted (it is not tried again)
    created: float = field(default_factory=time.monotonic)  # for the Monitor's age column
    hits: int = 0  # claims of it (counted by PromptReuse.record)

    def resident(self) -> Resident:
        """What the one eviction order needs to know about it."""
        return Resident(interactive=self.request_class is RequestClass.INTERACTIVE, last_used=self.last_used,
                        prefix=self.kind is ReuseKind.PREFIX, tiebreak=self.name, claimed=self.hits > 0)

    def view(self, nbytes: int) -> StateView:
        """A copy for the Monitor (taken on the engine thread; read anywhere after)."""
        return StateView(self.name, self.kind, self.tier, self.request_class, self.num_tokens, nbytes,
                         len(self.pages), self.created, self.resident(), self.hits, self.ready)


@dataclass(frozen=True, slots=True)
class StateView:
    """One retained state (or an attention-only page chain) as the Monitor lists it."""

    name: StateHash
    kind: ReuseKind
    tier: ReuseTier
    request_class: RequestClass
    tokens: int
    nbytes: int
    pages: int  # device pages it holds
    created: float | None  # monotonic; None when not known (a page chain)
    resident: Resident | None  # what the eviction order ranks; None: not ranked by it (a page chain)
    hits: int = 0
    ready: bool = True
