"""Live sequences moving down a tier and back (docs/architecture.md, "Live sequences under pressure").

When a request ranked above a running sequence needs its room, the scheduler
does not throw that sequence's state away: it hands the sequence here. Its state
(KV pages up to its computed tokens, and its recurrent slot) is written into a
KV-RAM reservation a window of pages per step, between decode rounds, while the
sequence stands still; once the bytes are committed its pages and slot are freed.
It waits in the queue as it was (sampler, stop-string buffer and output are
Python objects that never move) and resumes by copying the state back: the same
tokens and logprobs as if it had never stopped.

The state is filed under a private name (never found by a prompt match) and
dropped once restored or when the request is cancelled. Without a tierstore, or
when the store cannot take it, the sequence is recomputed instead (counted).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import xxhash

from common.logs import log_event
from engine.facts import ReuseKind, ReuseTier
from engine.kv.chain_hash import StateHash
from engine.request import EngineSequence, MovedState
from engine.tiers.link import Reservation, TierHit, TierLink

log = logging.getLogger("ignis.request")

# A live state outranks everything of its class in the store's order for this long: it is
# part of a request in flight, not a cache entry.
LIVE_PROTECT_SECONDS = 3600.0


@dataclass(slots=True)
class _Move:
    seq: EngineSequence
    reservation: Reservation
    tokens: int  # computed tokens being written
    num_pages: int
    written: int = 0  # pages written so far
    started: float = 0.0


@dataclass(slots=True)
class MoveCounters:
    moved: dict[ReuseTier, int]  # committed below, by the tier they went to
    restore_failures: int = 0  # moved down, but the state could not be copied back: recomputed
    restored: int = 0
    # Moved down again having computed nothing since it last resumed: the scheduler's rules make
    # this impossible (a resumed sequence keeps its room for a hold), so each one is a bug to look at.
    thrash: int = 0


class LiveMoves:
    def __init__(self, link: TierLink | None, page_size: int, window_pages: int) -> None:
        if window_pages <= 0:
            raise ValueError(f"engine.spill_window_pages must be >= 1, got {window_pages}")
        self.link = link
        self.page_size = page_size
        self.window_pages = window_pages
        self._moving: dict[int, _Move] = {}  # seq_id -> move in progress
        self.counters = MoveCounters(moved={ReuseTier.RAM: 0})
        self._nonce = os.urandom(16)  # private names: nobody else can compute them

    @property
    def moving(self) -> list[EngineSequence]:
        return [m.seq for m in self._moving.values()]

    def begin(self, seq: EngineSequence) -> bool:
        """Reserve room below for `seq`'s computed state; False when no tier can take it."""
        if self.link is None or not self.link.client.available or not seq.namespace:
            return False
        tokens = seq.num_computed
        if tokens == 0:
            return False  # nothing computed: recomputing costs nothing
        nbytes = self.link.codec.nbytes(tokens, with_logits=False)
        name = StateHash(xxhash.xxh3_128_digest(self._nonce + seq.seq_id.to_bytes(8, "little")
                                                + seq.moves.to_bytes(4, "little")))
        reservation = self.link.reserve(name, seq.namespace, nbytes, seq.request.request_class, LIVE_PROTECT_SECONDS)
        if reservation is None:
            return False
        if seq.moved_without_progress:
            self.counters.thrash += 1
            log.warning("request %s moved down again with no token computed since it resumed (move %d): "
                        "this is a bug", seq.request.request_id, seq.moves + 1)
        self._moving[seq.seq_id] = _Move(seq, reservation, tokens, -(-tokens // self.page_size),
                                         started=time.perf_counter())
        seq.start_moving()
        return True

    def pages_in_flight(self) -> list[int]:
        """Pages that moves in progress will hand back once committed."""
        return [p for m in self._moving.values() for p in m.seq.page_table]

    def advance(self) -> tuple[list[tuple[EngineSequence, MovedState]], list[EngineSequence]]:
        """Write the next window of each move; returns (committed, failed). The caller frees both's
        memory; a committed sequence then waits to resume from below, a failed one is recomputed."""
        assert self.link is not None or not self._moving
        done: list[tuple[EngineSequence, MovedState]] = []
        failed: list[EngineSequence] = []
        for seq_id, move in list(self._moving.items()):
            ok = self._write_window(move)
            if ok and move.written < move.num_pages:
                continue
            del self._moving[seq_id]
            moved = self._commit(move) if ok else None
            if moved is not None:
                done.append((move.seq, moved))
            else:
                failed.append(move.seq)  # counted by the scheduler as preempted (recomputed)
        return done, failed

    def _write_window(self, move: _Move) -> bool:
        link = self.link
        assert link is not None
        arena = link.arena_for(move.reservation)
        if arena is None:
            return False  # the store restarted: the reservation is gone with its arena
        first = move.written
        window = move.seq.page_table[first:min(move.num_pages, first + self.window_pages)]
        link.codec.pack_window(arena, move.reservation.offset, move.tokens, move.seq.slot, window, first)
        move.written += len(window)
        return True

    def _commit(self, move: _Move) -> MovedState | None:
        assert self.link is not None
        seq = move.seq
        if not self.link.commit(move.reservation, move.tokens, ReuseKind.CHECKPOINT, seq.request.request_class):
            return None
        self.counters.moved[ReuseTier.RAM] += 1
        log_event(log, "ignis.request.spilled", request_id=seq.request.request_id, tokens=move.tokens,
                  kind="live", tier="ram", bytes=move.reservation.nbytes,
                  ms=round((time.perf_counter() - move.started) * 1000, 3))
        return MovedState(move.reservation.name, move.tokens)

    def restore(self, seq: EngineSequence, moved: MovedState, pages: list[int]) -> bool:
        """Copy a moved-down state back into `pages` and the sequence's slot, then drop it below."""
        assert self.link is not None
        hit = TierHit(moved.name, moved.tokens, ReuseKind.CHECKPOINT, ReuseTier.RAM)
        result = self.link.restore(seq.namespace, hit, seq.slot, pages, request_id=seq.request.request_id)
        self.link.drop(moved.name)
        if result is None:
            self.counters.restore_failures += 1
            return False
        self.counters.restored += 1
        return True

    def cancel(self, seq: EngineSequence) -> None:
        """The request went away: leave nothing of it in any tier."""
        move = self._moving.pop(seq.seq_id, None)
        if move is not None and self.link is not None:
            self.link.drop(move.reservation.name)
        moved = seq.take_moved()
        if moved is not None and self.link is not None:
            self.link.drop(moved.name)
