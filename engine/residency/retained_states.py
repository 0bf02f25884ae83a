"""Where retained states live on the engine's side, and every move between those places.

A retained state (engine/residency/retained_state.py) is the whole sequence state at one
position. It lives in a device retained slot (its recurrent state and conv taps in a
slot reserved at load, its full KV pages shared, a partial last page private) or in a
host slot (all of it, logits too, in one slot of the host block), or it has left the
engine for the tierstore. This module owns those places and the moves between them:
placing a capture (device slot, host slot through the staging ring, or straight to
KV-RAM), copying a claimed state into its claimant (a host claim moves the state up
to a free device slot: promote), writing the state that leaves next ahead of need off
the step, and evicting by the one order (common/eviction.py): a capture that finds no
free slot displaces the lowest-ranked state only if the order lets it, and a state
that leaves moves down a tier rather than being dropped.

What a state is for (which prompt matches it, where a prefill is cut to capture one,
which lineage it belongs to) is the reuse policy's (engine/cache/retained.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from common.eviction import EvictionOrder
from common.logs import log_event
from engine.residency.retained_state import RetainedState, StateView
from engine.residency.state_index import StateIndex
from engine.residency.counters import ReuseCounters
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.kv.chain_hash import StateHash
from engine.kv.device_cache import DeviceCache
from engine.kv.host_slots import HostSlots
from engine.kv.page_pool import PagePool
from engine.request import EngineSequence
from engine.residency.copy_worker import CopyJob, CopyWorker
from engine.residency.captures_below import CapturesBelow
from engine.residency.staging import StagedCopy, StagingRing, stage_changing_part, staged_write
from engine.tiers.codec import StateCodec
from engine.tiers.link import Spillable, TierLink

log = logging.getLogger("ignis.request")


class RetainedStates:
    def __init__(self, cache: DeviceCache, pages: PagePool, first_slot: int, num_slots: int,
                 interactive_ttl: float, counters: ReuseCounters, max_per_lineage: int = 2,
                 tiers: TierLink | None = None, host: HostSlots | None = None, codec: StateCodec | None = None,
                 ring: StagingRing | None = None, worker: CopyWorker | None = None, ahead_pages: int = 0) -> None:
        if (host is not None or ring is not None) and codec is None:
            raise ValueError("host slots and staging need the state codec: this is a bug")
        self.counters = counters  # the reuse strategy's: one set of counters for captures, spills and claims
        self.tiers = tiers
        self.host, self.codec, self.ring = host, codec, ring
        # One worker runs staged copies and writes ahead (the ring's, unless one is given).
        self.worker = worker if worker is not None else (ring.worker if ring is not None else None)
        self.ahead_pages = ahead_pages  # write ahead once fewer device pages than this are free
        self._ahead: RetainedState | None = None  # the state being written ahead now (one at a time)
        self._releasing: list[RetainedState] = []  # dropped while a copy still reads them: freed once it is done
        self.cache = cache
        # An attention-only model's states (kept prompt ends) have no recurrent state: their "slots" are
        # only a count that bounds how many are held, and nothing is copied for them.
        self.slotted = cache.shape.has_recurrent_state
        self.pages = pages
        self.page_size = cache.page_size
        self.order = EvictionOrder(interactive_ttl)
        self._free_slots = deque(range(first_slot, first_slot + num_slots))
        self.num_slots = num_slots
        self.index = StateIndex(max_per_lineage)
        self.pending: list[RetainedState] = []  # captures whose staged copy is not done: claimable soon
        self.below = CapturesBelow(tiers, pages, self.page_size, counters, self.pending, codec, ring)
        # Called with a state's page hashes once a copy of it is committed in KV-RAM, whichever way it went
        # (written ahead, on eviction, or captured straight there): an attention-only model's page chains
        # stop tracking what it covers (its pages are indexed there), lower-tier answers are asked again.
        self.on_written_below: Callable[[tuple[StateHash, ...]], None] = lambda hashes: None
        self.below.on_written = lambda hashes: self.on_written_below(hashes)

    # --- what is held --------------------------------------------------------------
    def __bool__(self) -> bool:
        return bool(self.index)

    def anchored(self, anchor: StateHash) -> Iterable[RetainedState]:
        """The states whose last full page (or namespace, for none) is `anchor`."""
        return self.index.anchored(anchor)

    def touch(self, name: StateHash, logits: torch.Tensor | None) -> bool:
        """A capture of a state already held (a retry, a burst mate): it is used now, and keeps the
        logits if it had none. False if no state is held under `name`."""
        existing = self.index.get(name)
        if existing is None:
            return False
        existing.last_used = time.monotonic()
        if existing.logits is None and logits is not None:
            existing.logits = logits.clone()
        return True

    # --- claims: a held state copied into its claimant -------------------------------
    def revived_pages(self, state: RetainedState) -> int:
        """Free pages a claim of `state` takes besides the prompt's rest: a host state's are all fresh."""
        return state.num_tokens // self.page_size if state.tier is ReuseTier.HOST else 0

    def copy_into(self, seq: EngineSequence, state: RetainedState) -> None:
        """Copy `state` into `seq` (its slot is allocated); a host state moves up to a free device slot."""
        if state.tier is ReuseTier.HOST:
            self._claim_from_host(seq, state)
            self._promote(seq, state)
        else:
            self._claim_from_device(seq, state)
        (self.index.get(state.name) or state).last_used = time.monotonic()  # the device copy, if promoted

    def _claim_from_host(self, seq: EngineSequence, state: RetainedState) -> None:
        """One host-to-device copy: the slot, then fresh pages."""
        assert self.host is not None and self.codec is not None and self._has_slot(seq)
        got = self.pages.allocate(-(-state.num_tokens // self.page_size))
        if got is None:
            raise RuntimeError("host claim admitted without its pages: this is a bug")
        nbytes = self.codec.nbytes(state.num_tokens, state.logits is not None)
        self.codec.unpack(self.host.block, self.host.offset(state.slot), state.num_tokens, nbytes, seq.slot, got)
        seq.adopt(got, state.num_tokens, state.logits)

    def _promote(self, seq: EngineSequence, state: RetainedState) -> None:
        """A host state claimed while a device retained slot is free moves up to it: the claimant's
        fresh pages and slot hold exactly that state now, so this is a device capture (pages
        shared, the partial page and the slot copied), and the host slot is given back. The next
        claim of a hot state shares its pages instead of copying them all from the host."""
        if not self._free_slots or not state.ready or (self.worker is not None and self.worker.pending(state)):
            return  # no slot to spare, or a copy still reads the host slot
        assert self.host is not None
        held = self._hold_on_device(seq, state.num_tokens)
        if held is None:
            return
        self.host.release(state.slot)
        up = dataclasses.replace(state, tier=ReuseTier.DEVICE, slot=held[0], pages=held[1])
        self.index.replace(state, up)  # the claim in hand still names the host state: it reports `host`
        self.counters.promotions += 1

    def _hold_on_device(self, seq: EngineSequence, m: int) -> tuple[int, list[int]] | None:
        """`seq`'s state at `m` kept in a free retained slot: (slot, pages), its full pages shared, its
        partial last page and slot copied; None (nothing taken) when no page is free for the copy."""
        assert self._has_slot(seq)
        full = m // self.page_size
        private: list[int] = []
        if m % self.page_size:
            got = self.pages.allocate(1)
            if got is None:
                return None
            private = got
            self.cache.copy_page(seq.page_table[full], got[0])
        shared = seq.page_table[:full]
        self.pages.share(shared)
        slot = self._free_slots.popleft()
        self._copy_slot(seq.slot, slot)
        return slot, shared + private

    def _has_slot(self, seq: EngineSequence) -> bool:
        return seq.slot is not None or not self.slotted

    def _copy_slot(self, src: int | None, dst: int | None) -> None:
        if self.slotted:
            assert src is not None and dst is not None
            self.cache.copy_slot(src, dst)

    def _claim_from_device(self, seq: EngineSequence, state: RetainedState) -> None:
        assert self._has_slot(seq)
        full = state.num_tokens // self.page_size
        shared = state.pages[:full]
        self.pages.share(shared)
        table = list(shared)
        if state.num_tokens % self.page_size:
            got = self.pages.allocate(1)
            if got is None:
                raise RuntimeError("claim admitted without its private page: this is a bug")
            self.cache.copy_page(state.pages[full], got[0])
            table.append(got[0])
        self._copy_slot(state.slot, seq.slot)
        seq.adopt(table, state.num_tokens, state.logits)

    # --- captures: where a new state goes ---------------------------------------------
    def keep(self, seq: EngineSequence, name: StateHash, m: int, kind: ReuseKind, logits: torch.Tensor | None,
             lineage: int | None) -> None:
        """Retain `seq`'s state at `m` unless one is held under `name` already (a retry, a burst mate:
        it is used now). A state claimed whole from a tier below and held here again keeps the
        protection its claim earned."""
        if self.touch(name, logits):
            return
        self.capture(seq, name, m, kind, logits, lineage)
        held = self.index.get(name)
        if held is not None and m == seq.num_cached and seq.reuse.tier in (ReuseTier.RAM, ReuseTier.DISK):
            held.hits += 1

    def capture(self, seq: EngineSequence, name: StateHash, m: int, kind: ReuseKind, logits: torch.Tensor | None,
                lineage: int | None) -> None:
        """Retain `seq`'s state at `m` under `name`: in a host slot, a device slot, or the tier below, as
        the free slots and the eviction order allow; skipped and counted when none can take it."""
        if not self._has_slot(seq):
            return
        now = time.monotonic()
        if self.host is not None and m <= self.host_capacity_tokens and \
                (self.host.num_free or self._displace_for(seq.request.request_class, now, ReuseTier.HOST)):
            self._capture_to_host(seq, name, m, kind, logits, lineage)
            return
        if not self._free_slots and not self._displace_for(seq.request.request_class, now, ReuseTier.DEVICE):
            self.below.capture(seq, name, m, kind, logits)  # no slot it may take: straight down a tier
            return
        full = m // self.page_size
        if len(seq.page_hashes) < full:
            raise RuntimeError("page hashes shorter than the computed state: this is a bug")
        held = self._hold_on_device(seq, m)
        if held is None:
            self.counters.slot_skips += 1
            return
        self._index(RetainedState(
            name=name, anchor=seq.page_hashes[full - 1] if full else seq.namespace, num_tokens=m, kind=kind,
            tier=ReuseTier.DEVICE, slot=held[0], pages=held[1], request_class=seq.request.request_class,
            lineage=lineage, logits=None if logits is None else logits.clone(),
            namespace=seq.namespace, page_hashes=tuple(seq.page_hashes[:full]),
        ))

    @property
    def host_capacity_tokens(self) -> int:
        """The longest state a host slot holds."""
        if self.host is None or self.codec is None:
            return 0
        return self.codec.tokens_fitting(self.host.slot_bytes)

    def _capture_to_host(self, seq: EngineSequence, name: StateHash, m: int, kind: ReuseKind,
                         logits: torch.Tensor | None, lineage: int | None) -> None:
        """The whole state (slot, pages, logits) into one host slot: no device page or slot kept.
        With the staging ring only the slot and the partial last page are copied on the step."""
        assert self.host is not None and self.codec is not None and self._has_slot(seq)
        buffer = self.ring.acquire() if self.ring is not None else None
        if self.ring is not None and buffer is None:
            self.counters.staging_skips += 1  # both buffers busy: skipped, never torn
            return
        slot = self.host.allocate()
        assert slot is not None, "captured to a full host block: this is a bug"
        full = m // self.page_size
        state = RetainedState(
            name=name, anchor=seq.page_hashes[full - 1] if full else seq.namespace, num_tokens=m, kind=kind,
            tier=ReuseTier.HOST, slot=slot, pages=[], request_class=seq.request.request_class,
            lineage=lineage, logits=None if logits is None else logits.clone(),
            namespace=seq.namespace, page_hashes=tuple(seq.page_hashes[:full]),
        )
        if buffer is None:  # synchronous capture
            self.codec.pack(self.host.block, self.host.offset(slot), m, seq.slot,
                            seq.page_table[:-(-m // self.page_size)], logits)
        else:
            self._stage(seq, state, buffer)
        self._index(state)

    def _stage(self, seq: EngineSequence, state: RetainedState, buffer: int) -> None:
        """On the step: the slot and the partial last page into the ring buffer, a reference to
        the full pages. Off the step (worker): all of it into the host slot."""
        assert self.ring is not None and self.host is not None and self.codec is not None and self._has_slot(seq)
        codec, host, m = self.codec, self.host, state.num_tokens
        state.pages, partial = stage_changing_part(codec, self.ring.buffers[buffer], seq.slot, seq.page_table, m)
        self.pages.share(state.pages)  # immutable full pages, kept alive until the copy is done
        state.ready = False
        self.pending.append(state)
        offset = host.offset(state.slot)
        staged = staged_write(codec, m, list(state.pages), partial, state.logits)

        def copy(buf: torch.Tensor) -> None:  # worker thread
            staged(buf, host.block, offset)

        def done(copied: bool) -> None:  # engine thread
            self.pending.remove(state)
            pages, state.pages = state.pages, []
            self.pages.release(pages)
            state.ready = True  # the copy is over, whichever way it went
            indexed = self.index.holds(state)
            if indexed and not copied:
                self._drop(state)
            elif not indexed:  # dropped (a lineage's third) while it was copying
                host.release(state.slot)

        self.ring.submit(StagedCopy(buffer, copy, done))

    # --- off the step -----------------------------------------------------------------
    def write_ahead(self) -> None:
        """Write the state the device gives up next to KV-RAM now, off the step, so that its eviction
        is free: the lowest-ranked device state once no retained slot (or fewer than `ahead_pages`
        pages) is free, the lowest-ranked host state once the host block is full. One at a time;
        a state is tried once."""
        if self.tiers is None or self.worker is None or self._ahead is not None or not self.ahead_pages \
                or not self.tiers.client.available:
            return
        pressed = []
        if self.num_slots and (not self._free_slots or self.pages.num_free < self.ahead_pages):
            pressed.append(ReuseTier.DEVICE)
        if self.host is not None and not self.host.num_free:
            pressed.append(ReuseTier.HOST)
        now = time.monotonic()
        for tier in pressed:
            ranked = self.eviction_order(now, tier)
            if ranked and not ranked[0].below and not ranked[0].ahead_tried:
                self._submit_ahead(ranked[0])
                return

    def _submit_ahead(self, state: RetainedState) -> None:
        assert self.worker is not None
        state.ahead_tried = True
        self._ahead = state
        run = self._writer(state)  # on the worker: the state's memory is immutable while it is retained

        def done(written: bool) -> None:  # engine thread
            self._ahead = None
            if written:
                state.below = True
                self.counters.spills_ahead += 1
                self.on_written_below(state.page_hashes)
            if state in self._releasing:  # dropped while it was being written
                self._releasing.remove(state)
                self._release_memory(state)

        self.worker.submit(CopyJob(state, run, done))

    def _index(self, state: RetainedState) -> None:
        self.counters.captures += 1
        for old in self.index.add(state):
            self._drop(old)

    # --- eviction -------------------------------------------------------------
    def eviction_order(self, now: float | None = None, tier: ReuseTier | None = None) -> list[RetainedState]:
        """Every retained state (of `tier`, if given), the first to leave first."""
        states = [s for s in self.index if s.ready and (tier is None or s.tier is tier)]
        return self.order.order(states, time.monotonic() if now is None else now, RetainedState.resident)

    def _displace_for(self, newcomer: RequestClass, now: float, tier: ReuseTier) -> bool:
        """Free a slot of `tier` for a new capture by evicting its lowest-ranked state, if the
        order lets the newcomer displace it; False (no slot there) otherwise."""
        ranked = self.eviction_order(now, tier)
        if not ranked:
            return False
        victim = ranked[0]
        if not self.order.may_displace(victim.resident(), newcomer is RequestClass.INTERACTIVE, now):
            if self.order.is_protected(victim.resident(), now):
                self.counters.protected_skips += 1
            return False
        self._evict(victim)
        return True

    def reclaim(self, pages_needed: int, kept: RetainedState | None = None) -> bool:
        """Evict device states in the one order until `pages_needed` pages are free (live work comes
        first), never `kept` (the state a waiting claim is about to copy)."""
        for victim in self.eviction_order(tier=ReuseTier.DEVICE):  # host states hold no device pages
            if self.pages.num_free >= pages_needed:
                break
            if victim is not kept:
                self._evict(victim)
        return self.pages.num_free >= pages_needed

    def _evict(self, state: RetainedState) -> None:
        """Its slot (or pages) are needed: move the state down a tier if there is one, then free it.
        A state written ahead is below already; one being written ahead is waited for."""
        if self.worker is not None and self.worker.pending(state):
            self.worker.wait_for(state)  # its write reads the memory about to be reused
        spilled = state.below
        if not spilled and self.tiers is not None:
            self.counters.spills_on_step += 1
            spilled = self._writer(state)()
            if spilled:
                self.on_written_below(state.page_hashes)
        if not spilled:
            log_event(log, "ignis.request.evicted", hash=state.name.hex(), tokens=state.num_tokens,
                      kind=state.kind.value, tier="device")
        self._drop(state)
        self.counters.evictions += 1

    def _writer(self, state: RetainedState) -> Callable[[], bool]:
        """() -> whether `state` was written to KV-RAM: run now (an eviction on the step) or on the
        copy worker (written ahead)."""
        tiers, host, codec = self.tiers, self.host, self.codec
        assert tiers is not None
        if state.tier is ReuseTier.HOST:  # already in the arena's layout: one copy
            assert host is not None and codec is not None
            data = host.view(state.slot, codec.nbytes(state.num_tokens, state.logits is not None))
            return lambda: tiers.spill_bytes(state.name, state.namespace, state.num_tokens, state.kind,
                                             state.request_class, state.page_hashes, data)
        spillable = Spillable(state.name, state.namespace, state.num_tokens, state.kind, state.request_class,
                              state.page_hashes, state.slot if self.slotted else None, list(state.pages),
                              state.logits)
        return lambda: tiers.spill(spillable)

    def _drop(self, state: RetainedState) -> None:
        if not self.index.remove(state):
            return
        if state.tier is ReuseTier.HOST and not state.ready:  # its staged copy is running: done() frees it
            return
        if self.worker is not None and self.worker.pending(state):  # being written ahead: freed once written
            self._releasing.append(state)
            return
        self._release_memory(state)

    def _release_memory(self, state: RetainedState) -> None:
        """Give back the slot (and device pages) of a state no longer indexed."""
        if state.tier is ReuseTier.HOST:
            assert self.host is not None
            self.host.release(state.slot)
        else:
            self.pages.release(state.pages)
            self._free_slots.append(state.slot)

    # --- introspection ------------------------------------------------------------
    def describe(self) -> list[StateView]:
        """Every indexed state as a copy (the Monitor; engine thread): one list walk, no ranking."""
        shape, geometry = self.cache.shape, self.cache.geometry
        page_bytes = shape.kv_bytes_per_page(self.page_size, geometry.page_dtype)
        slot_bytes = shape.state_bytes_per_slot(geometry.dtype)
        views = []
        for s in self.index:
            if s.tier is ReuseTier.HOST and self.codec is not None:
                nbytes = self.codec.nbytes(s.num_tokens, s.logits is not None)
            else:  # the pages it keeps alive, its slot, its logits
                nbytes = len(s.pages) * page_bytes + slot_bytes + (s.logits.nbytes if s.logits is not None else 0)
            views.append(s.view(nbytes))
        return views

    def held_pages(self) -> set[int]:
        return {p for s in [*self.index, *self.pending, *self._releasing] for p in s.pages}

    @property
    def retained_slots(self) -> tuple[int, int]:
        return (self.num_slots, self.num_slots - len(self._free_slots))

    @property
    def host_slots(self) -> tuple[int, int]:
        """(total, used) retained-state slots on the host."""
        return (self.host.num_slots, self.host.num_used) if self.host is not None else (0, 0)

    def check_integrity(self) -> None:
        on_host = {s for s in [*self.index, *self.pending, *self._releasing] if s.tier is ReuseTier.HOST}
        if self.host is not None:
            self.host.check_used({s.slot for s in on_host})
        elif on_host:
            raise AssertionError("host states without host slots")
        device = [s for s in [*self.index, *self._releasing] if s.tier is ReuseTier.DEVICE]
        used = {s.slot for s in device}
        if len(used) != len(device) or used & set(self._free_slots):
            raise AssertionError("retained slots are double-booked")
        if len(used) + len(self._free_slots) != self.num_slots:
            raise AssertionError("retained slots leaked")
        self.index.check_integrity()
        for state in device:
            for page in state.pages:
                if self.pages.refcount(page) <= 0:
                    raise AssertionError(f"retained state holds free page {page}")

