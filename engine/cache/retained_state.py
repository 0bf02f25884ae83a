"""One retained state on the device: the record the retained-state index keeps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.eviction import Resident
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.kv.chain_hash import BlockHash


@dataclass(eq=False)
class RetainedState:
    """The whole sequence state at one position. On the device: its recurrent state and conv
    taps in a slot reserved at load, and its KV pages (full pages shared, a partial last page
    private). On the host: all of it, and its logits, in one host slot. Immutable once
    captured: a claim copies it."""

    name: BlockHash
    anchor: BlockHash  # hash of the last full page at or before the end (the index key)
    num_tokens: int
    kind: ReuseKind  # CHECKPOINT | PREFIX
    tier: ReuseTier  # DEVICE: a device slot and device pages; HOST: one host slot holds it all
    slot: int  # device slot, or host slot
    pages: list[int]  # device pages (none for a host state)
    request_class: RequestClass
    lineage: int | None
    logits: torch.Tensor | None  # next-token logits at the end (opener checkpoints): a retry prefills nothing
    namespace: BlockHash  # h0 of its chain (for the tierstore)
    page_hashes: tuple[BlockHash, ...]  # hashes of its full pages (for the tierstore)
    last_used: float = field(default_factory=time.monotonic)
    ready: bool = True  # False while a staged copy is still filling its host slot: not claimable yet

    def resident(self) -> Resident:
        """What the one eviction order needs to know about it."""
        return Resident(interactive=self.request_class is RequestClass.INTERACTIVE, last_used=self.last_used,
                        prefix=self.kind is ReuseKind.PREFIX, tiebreak=self.name)
