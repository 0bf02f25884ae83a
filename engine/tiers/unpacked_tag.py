"""Feeding a restored state's integrity tag the bytes the engine copied, as it copies them.

A tag checked on a CPU cache covers exactly what is used (StateCodec.unpacked_tag): each
section the restore copied is read from the copy, the rest of the blob (alignment, pages
past a prefix, logits not taken) from the arena, all in arena order. A restore from disk
waits on the read between its copies, so it hashes each copy as it is made: the check then
costs the last copy's hash instead of a pass over the whole state after the read. (A claim
from RAM copies and checks segment by segment on several threads: engine/tiers/checked_copy.py.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.tiers.checked_copy import Piece


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, zero copy (any dtype: numpy has no bfloat16)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().data


@dataclass(slots=True)
class UnpackedTag:
    """`pieces`: the copies, each at its start relative to `offset`, in arena order; the logits,
    if copied, come to `finish` (they exist only after the last copy)."""
    hasher: Any
    arena: torch.Tensor
    offset: int
    pieces: list[Piece]
    logits_at: int
    nbytes: int
    _fed: int = field(default=0, init=False)  # the state's bytes the hasher has, from its start
    _next: int = field(default=0, init=False)  # the first piece not yet fed

    def through(self, end: int) -> None:
        """Feed every piece that ends by `end`: call it once the copies of the bytes before `end` are made."""
        while self._next < len(self.pieces):
            piece = self.pieces[self._next]
            if piece.end > end:
                return
            self._copied(piece.start, piece.copy)
            self._next += 1

    def finish(self, logits: torch.Tensor | None) -> None:
        """Feed the rest, `logits` (the copy the restore returned, if any) included."""
        self.through(self.nbytes)
        if logits is not None:
            self._copied(self.logits_at, logits)
        self._arena_to(self.nbytes)

    def _copied(self, start: int, copy: torch.Tensor) -> None:
        self._arena_to(start)
        self.hasher.update(bytes_of(copy))
        self._fed = start + nbytes_of(copy)

    def _arena_to(self, end: int) -> None:
        if end > self._fed:
            self.hasher.update(bytes_of(self.arena[self.offset + self._fed:self.offset + end]))
            self._fed = end
