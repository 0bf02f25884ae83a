"""The byte layout of one retained state in the arena, and the copies in and out.

A state is [recurrent slot | conv slot | KV pages | next-token logits?], each
section 64-byte aligned so a uint8 view of the arena can be reinterpreted as the
section's dtype. Each section is one tensor copy; nothing is done per element in Python.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv.device_cache import DeviceCache
from engine.tiers.checked_copy import Piece
from engine.tiers.unpacked_tag import UnpackedTag, nbytes_of

_ALIGN = 64
UNPACK_STEP_BYTES = 4 << 20  # the KV pages a restore copies per step, about: each runs once its bytes land


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """`pages` cut into runs of consecutive page numbers: (index of the run's first in `pages`, its page, length)."""
    runs = []
    i = 0
    while i < len(pages):
        run = 1
        while i + run < len(pages) and pages[i + run] == pages[i] + run:
            run += 1
        runs.append((i, pages[i], run))
        i += run
    return runs


@dataclass(frozen=True, slots=True)
class Sections:
    recurrent: int
    conv: int
    kv: int
    logits: int  # offset of the logits (also the size without them)
    end: int  # size with the logits


class StateCodec:
    def __init__(self, cache: DeviceCache, vocab_size: int) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.vocab_size = vocab_size
        self.recurrent_bytes = nbytes_of(cache.recurrent[0]) if cache.recurrent.shape[0] else 0
        self.conv_bytes = nbytes_of(cache.conv[0]) if cache.conv.shape[0] else 0
        self.page_bytes = nbytes_of(cache.kv[0])
        self.logits_bytes = 4 * vocab_size  # logits are fp32 (the model returns them so)

    @property
    def fixed_state_bytes(self) -> int:
        return self.recurrent_bytes + self.conv_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size

    def layout(self) -> str:
        """Compared by the tierstore on re-register: a state is never read under another layout."""
        c = self.cache
        return json.dumps({
            "format": "ignis.retained.v1", "align": _ALIGN,
            "recurrent": [list(c.recurrent.shape[1:]), str(c.recurrent.dtype)],
            "conv": [list(c.conv.shape[1:]), str(c.conv.dtype)],
            "kv_page": [list(c.kv.shape[1:]), str(c.kv.dtype)],
            "logits": [[self.vocab_size], "torch.float32"],
        }, sort_keys=True)

    def sections(self, tokens: int) -> Sections:
        num_pages = -(-tokens // self.page_size)
        conv = _align(self.recurrent_bytes)
        kv = conv + _align(self.conv_bytes)
        logits = kv + _align(num_pages * self.page_bytes)
        return Sections(0, conv, kv, logits, logits + self.logits_bytes)

    def nbytes(self, tokens: int, with_logits: bool) -> int:
        s = self.sections(tokens)
        return s.end if with_logits else s.logits

    def tokens_fitting(self, nbytes: int) -> int:
        """The most tokens whose whole state (logits included) fits in `nbytes`."""
        empty = self.sections(0).end
        if not self.page_bytes:
            return 1 << 30 if empty <= nbytes else 0  # no KV: a state of any length has the same size
        pages = max(0, (nbytes - empty) // self.page_bytes) + 1  # at most a few over: alignment
        while pages and self.sections(pages * self.page_size).end > nbytes:
            pages -= 1
        return pages * self.page_size

    def has_logits(self, tokens: int, nbytes: int) -> bool:
        return nbytes == self.sections(tokens).end

    @staticmethod
    def _view(arena: torch.Tensor, start: int, like: torch.Tensor, count: int | None = None) -> torch.Tensor:
        n = nbytes_of(like) * (count or 1)
        shape = like.shape if count is None else (count, *like.shape)
        return arena[start:start + n].view(like.dtype).view(shape)

    def pack(self, arena: torch.Tensor, offset: int, tokens: int, slot: int | None, pages: list[int],
             logits: torch.Tensor | None) -> None:
        """Copy a state (device slot + its pages + logits) into the arena at `offset`."""
        if len(pages) != -(-tokens // self.page_size):
            raise ValueError(f"{len(pages)} pages do not hold {tokens} tokens")
        self.pack_window(arena, offset, tokens, slot, pages, 0)
        if logits is not None:
            self.write_logits(arena, offset, tokens, logits)

    def pack_window(self, arena: torch.Tensor, offset: int, tokens: int, slot: int | None, pages: list[int],
                    first: int) -> None:
        """Copy part of a state into the arena at `offset`: its pages `pages` (the state's pages
        first .. first+len-1) and, with the first window (first == 0), its slot. A live sequence
        moves down a few pages per step this way; the whole state ends up as `pack` writes it."""
        c, s = self.cache, self.sections(tokens)
        if first + len(pages) > -(-tokens // self.page_size):
            raise ValueError(f"pages {first}..{first + len(pages) - 1} are past the {tokens} tokens of the state")
        if first == 0:
            if slot is None and self.fixed_state_bytes:
                raise ValueError("a model with recurrent state needs its slot")
            if self.recurrent_bytes:
                self._view(arena, offset + s.recurrent, c.recurrent[slot]).copy_(c.recurrent[slot])
            if self.conv_bytes:
                self._view(arena, offset + s.conv, c.conv[slot]).copy_(c.conv[slot])
        self.pack_pages(arena, offset, tokens, pages, first)

    def pack_pages(self, arena: torch.Tensor, offset: int, tokens: int, pages: list[int], first: int) -> None:
        """Copy device pages into a state's KV section as its pages first .. first+len-1."""
        if not pages:
            return
        c, s = self.cache, self.sections(tokens)
        dst = self._view(arena, offset + s.kv + first * self.page_bytes, c.kv[0], len(pages))
        idx = torch.tensor(pages, dtype=torch.long, device=c.kv.device)
        if c.kv.device.type == "cpu":
            torch.index_select(c.kv, 0, idx, out=dst)  # gather straight into the destination
        else:
            dst.copy_(c.kv.index_select(0, idx))

    def unpacked_tag(self, hasher: Any, arena: torch.Tensor, offset: int, tokens: int, nbytes: int,
                     slot: int | None, pages: list[int], step_bytes: int | None = None) -> UnpackedTag:
        """Feeds `hasher` the state's bytes in their arena order, each section that `unpack` copied
        read from the copy (the engine's own memory), the rest (alignment, pages past a prefix,
        logits not taken) from the arena, in parts (engine/tiers/unpacked_tag.py). A tag checked this
        way covers exactly what is used: bytes changed in the arena after the copy are not in it, and
        bytes changed before fail it (checking the arena first and copying after would leave that
        window open). CPU caches only: the copies are host memory. With `step_bytes`, the pages are
        cut where `unpack_steps(..., step_bytes)` cuts them, so `through(end)` after each step's copy
        hashes that copy; without, each run of consecutive pages is one update; `finish(logits)`
        hashes the rest."""
        per_step = self._pages_per_step(step_bytes, len(pages)) if step_bytes else len(pages) or 1
        pieces = self._slot_and_page_pieces(tokens, slot, pages, per_step)
        return UnpackedTag(hasher, arena, offset, pieces, self.sections(tokens).logits, nbytes)

    def claim_pieces(self, tokens: int, nbytes: int, slot: int | None, pages: list[int]
                     ) -> tuple[list[Piece], torch.Tensor | None]:
        """What a claim into a CPU cache copies, as pieces of the state (engine/tiers/checked_copy.py):
        its slot, its pages in runs of consecutive ones, and the logits if stored and the whole
        state is taken, into a fresh tensor (returned with the pieces)."""
        self._check_restore(tokens, slot, pages)
        pieces = self._slot_and_page_pieces(tokens, slot, pages, len(pages) or 1)
        logits = None
        if len(pages) == -(-tokens // self.page_size) and self.has_logits(tokens, nbytes):
            logits = torch.empty(self.vocab_size, dtype=torch.float32)
            pieces.append(Piece(self.sections(tokens).logits, logits))
        return pieces, logits

    def _slot_and_page_pieces(self, tokens: int, slot: int | None, pages: list[int], per_step: int) -> list[Piece]:
        """The slot's and `pages`' copies as pieces in state order, the pages cut every `per_step` and
        at each break in their numbers (a run of consecutive pages is one block)."""
        c, s = self.cache, self.sections(tokens)
        pieces: list[Piece] = []
        if self.recurrent_bytes and slot is not None:
            pieces.append(Piece(s.recurrent, c.recurrent[slot]))
        if self.conv_bytes and slot is not None:
            pieces.append(Piece(s.conv, c.conv[slot]))
        for first in range(0, len(pages), per_step):
            for at, page, run in page_runs(pages[first:first + per_step]):
                pieces.append(Piece(s.kv + (first + at) * self.page_bytes, c.kv[page:page + run]))
        return pieces

    def _pages_per_step(self, step_bytes: int, num_pages: int) -> int:
        return max(1, step_bytes // self.page_bytes) if self.page_bytes else num_pages or 1

    def _check_restore(self, tokens: int, slot: int | None, pages: list[int]) -> None:
        filled = -(-tokens // self.page_size)
        if slot is None and self.fixed_state_bytes:
            raise ValueError("a model with recurrent state needs its slot")
        if len(pages) != filled and self.fixed_state_bytes:
            raise ValueError("a state with recurrent layers cannot be cut to a prefix")
        if len(pages) > filled:
            raise ValueError(f"{len(pages)} pages are more than the {tokens} tokens of the state fill")

    def write_logits(self, arena: torch.Tensor, offset: int, tokens: int, logits: torch.Tensor) -> None:
        s = self.sections(tokens)
        self._view(arena, offset + s.logits, logits.float()).copy_(logits.float())

    def unpack(self, arena: torch.Tensor, offset: int, tokens: int, nbytes: int, slot: int | None,
               pages: list[int]) -> torch.Tensor | None:
        """Copy a state out of the arena into `slot` and fresh `pages`; returns its logits, if stored.

        Fewer pages than the state holds copy a page-aligned prefix (attention-only models:
        every prefix of the KV is itself a state); a prefix has no logits.
        """
        logits = None
        for _, step in self.unpack_steps(arena, offset, tokens, nbytes, slot, pages):
            logits = step()
        return logits

    def unpack_steps(self, arena: torch.Tensor, offset: int, tokens: int, nbytes: int, slot: int | None,
                     pages: list[int], step_bytes: int = UNPACK_STEP_BYTES) -> list[tuple[int, Callable[[], torch.Tensor | None]]]:
        """`unpack` as copies in arena order, each with the end of the bytes it reads (relative to
        `offset`): a restore runs each once those bytes have landed. The KV pages go in runs of
        about `step_bytes`; the last step returns the logits (None if not stored), the others None."""
        c, s = self.cache, self.sections(tokens)
        whole = len(pages) == -(-tokens // self.page_size)
        self._check_restore(tokens, slot, pages)
        steps: list[tuple[int, Callable[[], torch.Tensor | None]]] = []

        def step(end: int, fn: Callable[[], object]) -> None:
            steps.append((end, lambda: (fn(), None)[1]))

        if self.recurrent_bytes:
            step(s.recurrent + self.recurrent_bytes, lambda: c.recurrent[slot].copy_(
                self._view(arena, offset + s.recurrent, c.recurrent[slot])))
        if self.conv_bytes:
            step(s.conv + self.conv_bytes, lambda: c.conv[slot].copy_(self._view(arena, offset + s.conv, c.conv[slot])))
        run = self._pages_per_step(step_bytes, len(pages))
        for first in range(0, len(pages), run):
            part = pages[first:first + run]

            def copy_pages(first: int = first, part: list[int] = part) -> None:
                src = self._view(arena, offset + s.kv + first * self.page_bytes, c.kv[0], len(part))
                if c.kv.device.type == "cpu":  # a run of pages is one block copy: index_copy_ ran at ~0.43x a memcpy
                    for at, page, run in page_runs(part):
                        c.kv[page:page + run].copy_(src[at:at + run])
                    return
                idx = torch.tensor(part, dtype=torch.long, device=c.kv.device)
                c.kv.index_copy_(0, idx, src.to(c.kv.device))
            step(s.kv + (first + len(part)) * self.page_bytes, copy_pages)
        if whole and self.has_logits(tokens, nbytes):
            like = torch.empty(self.vocab_size, dtype=torch.float32)
            steps.append((s.end, lambda: self._view(arena, offset + s.logits, like).to(c.kv.device, copy=True)))
        else:
            steps.append((0, lambda: None))
        return steps
