"""engine/tiers/checked_copy.py: a claim from KV-RAM copies and checks segment by segment on several
threads. The copies are the source's bytes, the tag is the tag of the whole (each byte a piece took
read from its copy, the rest from the source), on any number of threads; a source changed after a
copy is not in the tag, a copy changed before its hash is; a failure ends it with no copy running on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.tiers.checked_copy as checked_copy
import engine.tiers.integrity as integrity
from engine.tiers.checked_copy import Piece, copy_and_check
from engine.tiers.integrity import IntegrityKey

NAME, NAMESPACE, TOKENS = b"n" * 16, b"s" * 16, 7
SEGMENT, STRIDE = 4096, 1024  # small, so that a few KiB cross several segments and strides


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "SEGMENT_BYTES", SEGMENT)
    monkeypatch.setattr(checked_copy, "SEGMENT_BYTES", SEGMENT)
    monkeypatch.setattr(checked_copy, "STRIDE_BYTES", STRIDE)


@pytest.fixture(scope="module")
def helpers():  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(3) as pool:
        yield pool


def source_of(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def pieces_of(bounds: list[tuple[int, int]], dtype: torch.dtype = torch.uint8) -> list[Piece]:
    size = torch.tensor([], dtype=dtype).element_size()
    return [Piece(start, torch.zeros((end - start) // size, dtype=dtype)) for start, end in bounds]


def check(source: torch.Tensor, pieces: list[Piece], helpers: ThreadPoolExecutor, threads: int,
          key: IntegrityKey, tag: bytes) -> bool:
    mac = key.hasher(NAME, NAMESPACE, TOKENS, source.numel(), tag)
    copy_and_check(pieces, source, mac, helpers, threads)
    return IntegrityKey.matches(tag, mac)


@settings(max_examples=60, deadline=None)
@given(nbytes=st.integers(1, 5 * SEGMENT), cuts=st.lists(st.integers(0, 5 * SEGMENT), max_size=10),
       taken=st.lists(st.booleans(), min_size=11, max_size=11), threads=st.integers(1, 4))
def test_the_copies_are_the_source_and_the_tag_is_the_whole_ones(helpers, nbytes: int, cuts: list[int],
                                                                  taken: list[bool], threads: int) -> None:
    """Pieces anywhere (across segments and strides, with gaps between, at the ends or not), float32
    pieces too: each copy holds its bytes of the source and the tag is the one made over the source."""
    source = source_of(nbytes, seed=nbytes)
    edges = sorted({0, nbytes, *(min(c, nbytes) // 4 * 4 for c in cuts)})
    bounds = [(a, b) for (a, b), take in zip(zip(edges, edges[1:]), taken) if take and b > a]
    pieces = [Piece(a, torch.zeros((b - a) // 4, dtype=torch.float32)) if (b - a) % 4 == 0 and a % 4 == 0
              else Piece(a, torch.zeros(b - a, dtype=torch.uint8)) for a, b in bounds]
    key = IntegrityKey(b"k" * 32)
    tag = key.tag(NAME, NAMESPACE, TOKENS, source.numpy().data)
    assert check(source, pieces, helpers, threads, key, tag)
    for piece in pieces:
        assert torch.equal(piece.copy.view(-1).view(torch.uint8), source[piece.start:piece.end])


def test_without_helpers_the_calling_thread_does_it_all() -> None:
    """An engine on one CPU thread has no helper pool (TierLink._helpers): the claim runs on its own thread."""
    source = source_of(3 * SEGMENT + 7)
    key = IntegrityKey(b"k" * 32)
    tag = key.tag(NAME, NAMESPACE, TOKENS, source.numpy().data)
    pieces = pieces_of([(5, 2 * SEGMENT + 1)])
    mac = key.hasher(NAME, NAMESPACE, TOKENS, source.numel(), tag)
    copy_and_check(pieces, source, mac, None, 2)
    assert IntegrityKey.matches(tag, mac) and torch.equal(pieces[0].copy, source[5:2 * SEGMENT + 1])


def test_a_source_changed_after_its_copy_is_not_in_the_tag(helpers, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tag reads each copy, not the source: bytes changed in the source right after they were
    copied (before their hash) leave the copy and the tag as the state was written."""
    source = source_of(3 * SEGMENT + 100)
    key = IntegrityKey(b"k" * 32)
    tag = key.tag(NAME, NAMESPACE, TOKENS, source.numpy().data)
    written = source.clone()
    real = checked_copy._memmove

    def copy_then_scribble(dst: int, src: int, n: int) -> None:
        real(dst, src, n)
        real(src, bytes(n), n)  # the racing process zeroes what was just copied

    monkeypatch.setattr(checked_copy, "_memmove", copy_then_scribble)
    pieces = pieces_of([(0, 3 * SEGMENT + 100)])
    assert check(source, pieces, helpers, 2, key, tag)
    assert torch.equal(pieces[0].copy, written) and not source.any()


@pytest.mark.parametrize("meddled", ["a copy", "a gap"])
def test_a_copy_or_gap_changed_before_its_hash_fails_the_tag(helpers, monkeypatch: pytest.MonkeyPatch,
                                                             meddled: str) -> None:
    source = source_of(3 * SEGMENT)
    key = IntegrityKey(b"k" * 32)
    tag = key.tag(NAME, NAMESPACE, TOKENS, source.numpy().data)
    pieces = pieces_of([(100, SEGMENT + 300), (2 * SEGMENT, 3 * SEGMENT)])
    real = checked_copy._memmove
    if meddled == "a copy":
        def copy_then_meddle(dst: int, src: int, n: int) -> None:
            real(dst, src, n)
            real(dst, b"\xff", 1)
        monkeypatch.setattr(checked_copy, "_memmove", copy_then_meddle)
    else:
        source[SEGMENT + 400] ^= 1  # no piece takes it: hashed from the source
    assert not check(source, pieces, helpers, 2, key, tag)


def test_a_failing_copy_ends_it_and_no_copy_runs_on(helpers, monkeypatch: pytest.MonkeyPatch) -> None:
    source = source_of(12 * SEGMENT)
    key = IntegrityKey(b"k" * 32)
    pieces = pieces_of([(0, 12 * SEGMENT)])
    real = checked_copy._memmove
    running, ran = [0], [0]
    lock = threading.Lock()

    caller = threading.current_thread()

    def slow_copy(dst: int, src: int, n: int) -> None:
        """The calling thread's first copy fails while the helpers' copies are under way."""
        with lock:
            running[0] += 1
            ran[0] += 1
        try:
            if threading.current_thread() is caller:
                time.sleep(0.01)
                raise OSError("copy 3 failed")
            time.sleep(0.05)
            real(dst, src, n)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(checked_copy, "_memmove", slow_copy)
    mac = key.hasher(NAME, NAMESPACE, TOKENS, source.numel())
    with pytest.raises(OSError, match="copy 3 failed"):
        copy_and_check(pieces, source, mac, helpers, 3)
    assert running[0] == 0  # every copy in flight was through when it raised
    assert ran[0] < 12 * SEGMENT // STRIDE  # and the segments not yet taken were left


def test_pieces_that_are_not_a_host_copy_within_the_state_are_refused(helpers) -> None:
    source = source_of(SEGMENT)
    mac = IntegrityKey(b"k" * 32).hasher(NAME, NAMESPACE, TOKENS, SEGMENT)
    for pieces in ([Piece(0, torch.zeros(10, dtype=torch.uint8)), Piece(5, torch.zeros(10, dtype=torch.uint8))],
                   [Piece(SEGMENT - 5, torch.zeros(10, dtype=torch.uint8))],
                   [Piece(0, torch.zeros(20, dtype=torch.uint8)[::2])]):
        with pytest.raises(ValueError, match="this is a bug"):
            copy_and_check(pieces, source, mac, helpers, 2)
