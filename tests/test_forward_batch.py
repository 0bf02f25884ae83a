"""ForwardBatch.build's decode-only path gives the batch its general path gives, field by field."""

from __future__ import annotations

import dataclasses
from collections import abc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.batch import DecodeGather, DecodeViews, ForwardBatch, LogitsWanted, SeqView, SequenceChunk

PAGE = 16


@st.composite
def decode_steps(draw: st.DrawFn) -> list[SequenceChunk]:
    chunks = []
    for _ in range(draw(st.integers(1, 12))):
        start = draw(st.integers(1, 200))
        spare = draw(st.integers(0, 2))  # a table may hold more pages than the positions need
        table = draw(st.lists(st.integers(0, 999), min_size=start // PAGE + 1 + spare,
                              max_size=start // PAGE + 1 + spare))
        slot = draw(st.none() | st.integers(0, 31))
        chunks.append(SequenceChunk([draw(st.integers(0, 5000))], start, table, slot, LogitsWanted.LAST))
    return chunks


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, SeqView):
        assert isinstance(b, SeqView)
        assert (a.offset, a.length, a.start, a.state_slot) == (b.offset, b.length, b.start, b.state_slot)
        _same(a.page_table, b.page_table)
    elif isinstance(a, DecodeGather):  # the same positions, whether held as [B, L] or as page tables
        assert isinstance(b, DecodeGather) and a.every_row == b.every_row
        _same(a.rows, b.rows)
        _same(a.positional(), b.positional())
    elif isinstance(a, abc.Sequence):  # a decode-only or mixed batch's views are made when asked
        assert isinstance(b, abc.Sequence) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@settings(max_examples=80, deadline=None)
@given(chunks=decode_steps())
def test_the_decode_only_batch_is_the_general_one(chunks: list[SequenceChunk]) -> None:
    cpu = torch.device("cpu")
    fast = ForwardBatch.build(chunks, PAGE, cpu)
    general = ForwardBatch._any(chunks, PAGE, cpu)
    for f in dataclasses.fields(ForwardBatch):
        if f.name != "decodes_only":
            _same(getattr(fast, f.name), getattr(general, f.name))
    assert fast.decodes_only and not general.decodes_only
    assert len(fast.decodes) == len(chunks) and fast.others == ()
    assert fast.decode is not None and fast.decode.table is not None  # the CPU kernel reads the tables
    assert general.decode is not None and general.decode.table is not None  # the general path's too


@pytest.fixture
def no_table_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference kernels, which take only [B, L] positions."""
    from engine.model import batch

    chosen = batch.kernels_for
    monkeypatch.setattr(batch, "kernels_for", lambda device: dataclasses.replace(
        chosen(device), paged_decode_from_table=None))


@pytest.mark.usefixtures("no_table_kernel")
def test_without_the_table_kernel_a_decode_only_batch_holds_positions() -> None:
    """The reference kernels take only [B, L]: the fast path then builds those, as the general one does."""
    cpu = torch.device("cpu")
    chunks = [SequenceChunk([7], 40, [1, 2, 3], 5), SequenceChunk([8], 3, [9], 6)]
    fast = ForwardBatch.build(chunks, PAGE, cpu)
    assert fast.decode is not None and fast.decode.table is None and fast.decode.pages is not None
    _same(fast.decode, ForwardBatch._any(chunks, PAGE, cpu).decode)


def test_a_short_page_table_is_refused_on_both_paths() -> None:
    short = [SequenceChunk([7], 40, [1, 2], 0, LogitsWanted.LAST)]  # position 40 needs 3 pages
    for build in (ForwardBatch.build, ForwardBatch._any):
        with pytest.raises(ValueError, match="page table has 2 pages"):
            build(short, PAGE, torch.device("cpu"))


def test_a_decode_only_batchs_views_index_like_a_tuple() -> None:
    chunks = [SequenceChunk([7], 40, [1, 2, 3], 5), SequenceChunk([8], 3, [9], 6), SequenceChunk([9], 17, [4, 8], 7)]
    fast = ForwardBatch.build(chunks, PAGE, torch.device("cpu"))
    general = ForwardBatch._any(chunks, PAGE, torch.device("cpu"))
    assert isinstance(fast.seqs, DecodeViews)
    _same(tuple(fast.seqs[-1:]), general.seqs[-1:])
    _same(fast.seqs[-3], general.seqs[0])
    assert [s.state_slot for s in fast.seqs] == [5, 6, 7] == list(fast.decode_slots) == list(general.decode_slots)
    with pytest.raises(IndexError):
        fast.seqs[3]


@st.composite
def rest_chunks(draw: st.DrawFn) -> list[SequenceChunk]:
    """Chunks beside a step's decodes: prefills from the start or mid-prompt, first tokens, middle chunks."""
    chunks = []
    for _ in range(draw(st.integers(0, 4))):
        start = draw(st.integers(0, 100))
        n = draw(st.integers(1, 40)) if start == 0 else draw(st.integers(2, 40))  # no single-token decode
        table = list(range(500, 500 + -(-(start + n) // PAGE) + draw(st.integers(0, 2))))
        logits = draw(st.sampled_from(list(LogitsWanted)))
        tail = draw(st.integers(1, n)) if logits is LogitsWanted.TAIL else 0  # a verify's drafted rows
        chunks.append(SequenceChunk(list(range(n)), start, table, draw(st.none() | st.integers(0, 31)), logits, tail))
    return chunks


@settings(max_examples=120, deadline=None)
@given(decodes=decode_steps(), rest=rest_chunks())
def test_a_mixed_batch_is_the_general_one(decodes: list[SequenceChunk], rest: list[SequenceChunk]) -> None:
    """Decodes listed as the decode road lists them, then the rest as chunks: the batch _any builds of both."""
    cpu = torch.device("cpu")
    mixed = ForwardBatch.mixed([c.token_ids[0] for c in decodes], [c.start for c in decodes],
                               [c.page_table for c in decodes], [c.state_slot for c in decodes], rest, PAGE, cpu)
    general = ForwardBatch._any(decodes + rest, PAGE, cpu)
    for f in dataclasses.fields(ForwardBatch):
        _same(getattr(mixed, f.name), getattr(general, f.name))
    assert len(mixed.seqs) == len(decodes) + len(rest)
    _same(tuple(mixed.seqs), general.seqs)


@pytest.mark.usefixtures("no_table_kernel")
def test_without_the_table_kernel_a_mixed_batch_holds_positions() -> None:
    cpu = torch.device("cpu")
    decodes = [SequenceChunk([7], 40, [1, 2, 3], 5), SequenceChunk([8], 3, [9], 6)]
    rest = [SequenceChunk([1, 2, 3], 0, [4], 7)]
    mixed = ForwardBatch.mixed([7, 8], [40, 3], [[1, 2, 3], [9]], [5, 6], rest, PAGE, cpu)
    assert mixed.decode is not None and mixed.decode.table is None and mixed.decode.pages is not None
    _same(mixed.decode, ForwardBatch._any(decodes + rest, PAGE, cpu).decode)


def test_a_mixed_batch_refuses_a_decode_among_the_rest_and_a_short_table() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="single-token decode"):
        ForwardBatch.mixed([7], [40], [[1, 2, 3]], [0], [SequenceChunk([5], 20, [1, 2], 1)], PAGE, cpu)
    with pytest.raises(ValueError, match="page table has 2 pages"):
        ForwardBatch.mixed([7], [40], [[1, 2]], [0], [SequenceChunk([5, 6], 0, [1], 1)], PAGE, cpu)
