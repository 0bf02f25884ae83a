"""A claim from KV-RAM into a CPU cache: the copies and their integrity check, segment by segment on
several threads at once.

The tag covers exactly what is used (StateCodec.unpacked_tag says why): each byte the claim copies
is hashed from its copy, the rest of the blob (alignment, pages past a prefix) from the arena. The
tag is cut in segments (engine/tiers/integrity.py), so each thread takes the next segment, copies
its bytes and hashes them from the copy a stride at a time while they are still in its cache. Both
the copies (memmove) and the GMAC (OpenSSL through `cryptography`) let go of the GIL, so the threads
run at once: 150 MiB checked on two threads in about the time of a one-thread memcpy (bench.tiers).
"""

from __future__ import annotations

import ctypes
import threading
from bisect import bisect_right
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from engine.tiers.integrity import SEGMENT_BYTES, StateMac

STRIDE_BYTES = 256 << 10  # copied then hashed while in the core's cache (256 KiB: fastest of 256 KiB-4 MiB)
_memmove = ctypes.memmove  # lets go of the GIL, as every ctypes call does


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [start, start + the copy's size) of the state (from its start) are copied into `copy`."""
    start: int
    copy: torch.Tensor  # contiguous, in host memory

    @property
    def end(self) -> int:
        return self.start + self.copy.numel() * self.copy.element_size()


def copy_and_check(pieces: list[Piece], source: torch.Tensor, mac: StateMac, helpers: ThreadPoolExecutor | None,
                   threads: int) -> None:
    """Copy each piece's bytes of `source` (the state's whole blob: a uint8 host tensor) into its copy and
    feed `mac` every segment of `source`, each byte a piece took read from its copy. Runs on this thread
    and `threads - 1` of `helpers`' (each taking the next segment); returns or raises only once no copy
    runs on (the copies write the claimant's pages)."""
    nbytes = source.numel()
    pieces = sorted(pieces, key=lambda p: p.start)
    for p, q in zip(pieces, pieces[1:]):
        if p.end > q.start:
            raise ValueError(f"pieces at {p.start} and {q.start} overlap: this is a bug")
    for p in pieces:
        if p.start < 0 or p.end > nbytes or p.copy.device.type != "cpu" or not p.copy.is_contiguous():
            raise ValueError(f"a piece at {p.start}..{p.end} is not a contiguous host copy within the "
                             f"{nbytes}-byte state: this is a bug")
    if source.device.type != "cpu" or source.dtype != torch.uint8 or not source.is_contiguous():
        raise ValueError("the source is a contiguous uint8 host tensor: this is a bug")
    starts = [p.start for p in pieces]
    segments = iter(range(-(-nbytes // SEGMENT_BYTES)))  # each thread takes the next (next() holds the GIL)
    failed = threading.Event()
    base = source.data_ptr()

    def take_segments() -> None:
        try:
            while not failed.is_set() and (index := next(segments, None)) is not None:
                _segment(index, pieces, starts, base, nbytes, mac)
        except BaseException:
            failed.set()  # the other threads take no further segment
            raise

    running: list[Future[None]] = []
    if helpers is not None:
        running = [helpers.submit(take_segments) for _ in range(max(0, threads - 1))]
    try:
        take_segments()
    finally:
        wait(running)
    for future in running:
        future.result()  # a helper's failure, once none runs on


def _segment(index: int, pieces: list[Piece], starts: list[int], base: int, nbytes: int, mac: StateMac) -> None:
    """Copy what the pieces take of segment `index` and put its MAC, a stride at a time."""
    start, end = index * SEGMENT_BYTES, min(nbytes, (index + 1) * SEGMENT_BYTES)
    hashed = mac.segment(index)
    at = start
    i = max(0, bisect_right(starts, start) - 1)  # the last piece starting at or before the segment
    while at < end:
        piece = pieces[i] if i < len(pieces) else None
        if piece is None or piece.start >= end:
            hashed.update_at(base + at, end - at)  # the rest of the segment: no copy takes it
            break
        if piece.end <= at:
            i += 1
            continue
        if piece.start > at:  # a gap before the piece: hashed from the source
            hashed.update_at(base + at, piece.start - at)
            at = piece.start
        to = min(end, piece.end)
        copy = piece.copy.data_ptr() - piece.start  # the copy's address of state byte 0
        while at < to:
            step = min(STRIDE_BYTES, to - at)
            _memmove(copy + at, base + at, step)
            hashed.update_at(copy + at, step)
            at += step
        i += 1
    mac.put(index, hashed.mac())
