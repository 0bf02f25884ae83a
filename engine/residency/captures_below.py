"""Captures that go straight to the tier below: a state with no device or host slot it may take is
written to KV-RAM from the sequence's own slot and pages.

With the staging ring, only the part that keeps changing (the slot, the partial last page) is copied
on the step; the worker reserves room in the store, writes the state in the arena's layout and commits,
while claimants held for it wait (`pending`) instead of prefilling it again. With both buffers busy,
or no ring, it is written on the step. Without a tier below the capture is skipped and counted: a
state is never given memory on the fly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.facts import ReuseKind, ReuseTier
from engine.kv.chain_hash import StateHash
from engine.kv.page_pool import PagePool
from engine.request import EngineSequence
from engine.residency.counters import ReuseCounters
from engine.residency.retained_state import RetainedState
from engine.residency.staging import StagedCopy, StagingRing, stage_changing_part, staged_write
from engine.tiers.codec import StateCodec
from engine.tiers.link import Spillable, TierLink


class CapturesBelow:
    def __init__(self, tiers: TierLink | None, pages: PagePool, page_size: int, counters: ReuseCounters,
                 pending: list[RetainedState], codec: StateCodec | None = None, ring: StagingRing | None = None
                 ) -> None:
        if ring is not None and codec is None:
            raise ValueError("staging needs the state codec: this is a bug")
        self.tiers, self.pages, self.page_size, self.counters = tiers, pages, page_size, counters
        self.pending = pending  # the retained states' list of captures in flight: a claimant waits for these
        self.codec, self.ring = codec, ring
        # Called with its page hashes once a capture landed in the tier below (RetainedStates.on_written_below).
        self.on_written: Callable[[tuple[StateHash, ...]], None] = lambda hashes: None

    def capture(self, seq: EngineSequence, name: StateHash, m: int, kind: ReuseKind,
                logits: torch.Tensor | None) -> None:
        """Write `seq`'s state at `m` to the tier below under `name` (staged when a buffer is free).
        The codec refuses a missing slot where the model has recurrent state."""
        if self.tiers is not None and self.ring is not None and self.tiers.client.available:
            buffer = self.ring.acquire()
            if buffer is not None:
                self._stage(seq, name, m, kind, logits, buffer)
                return
        hashes = tuple(seq.page_hashes[:m // self.page_size])
        spilled = self.tiers is not None and self.tiers.spill(Spillable(
            name, seq.namespace, m, kind, seq.request.request_class, hashes, seq.slot,
            seq.page_table[:-(-m // self.page_size)], logits))
        if spilled:
            self.counters.captures_below += 1
            self.on_written(hashes)
        else:
            self.counters.slot_skips += 1

    def _stage(self, seq: EngineSequence, name: StateHash, m: int, kind: ReuseKind,
               logits: torch.Tensor | None, buffer: int) -> None:
        """On the step the slot and the partial page into the buffer and a reference to the full
        pages; the worker reserves, writes them in the arena's layout and commits."""
        assert self.ring is not None and self.tiers is not None and self.codec is not None
        codec, tiers = self.codec, self.tiers
        pages, partial = stage_changing_part(codec, self.ring.buffers[buffer], seq.slot, seq.page_table, m)
        self.pages.share(pages)  # immutable full pages, kept alive until the write is done
        namespace, cls, hashes = seq.namespace, seq.request.request_class, tuple(seq.page_hashes[:len(pages)])
        # Held claimants wait for it (in_flight) instead of prefilling it again.
        pending = RetainedState(
            name=name, anchor=hashes[-1] if hashes else namespace, num_tokens=m, kind=kind, tier=ReuseTier.RAM,
            slot=-1, pages=pages, request_class=cls, lineage=None, logits=logits, namespace=namespace,
            page_hashes=hashes, ready=False)
        self.pending.append(pending)
        write = staged_write(codec, m, pages, partial, logits)
        nbytes = codec.nbytes(m, logits is not None)

        def copy(buf: torch.Tensor) -> bool:  # worker thread; False: the store did not take it (no room, down)
            return tiers.write_state(name, namespace, m, kind, cls, hashes, nbytes,
                                     lambda arena, offset: write(buf, arena, offset), source="staged")

        def done(written: bool) -> None:  # engine thread
            self.pending.remove(pending)
            self.pages.release(pages)
            if written:
                self.counters.captures_below += 1
                self.on_written(hashes)
            else:
                self.counters.slot_skips += 1

        self.ring.submit(StagedCopy(buffer, copy, done))
