"""ForwardBatch.build's decode-only path gives the batch its general path gives, field by field."""

from __future__ import annotations

import dataclasses

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
    elif isinstance(a, (tuple, DecodeViews)):  # a decode-only batch's views are made when asked
        assert isinstance(b, (tuple, DecodeViews)) and len(a) == len(b)
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


def test_without_the_table_kernel_a_decode_only_batch_holds_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference kernels take only [B, L]: the fast path then builds those, as the general one does."""
    from engine.model import batch

    cpu = torch.device("cpu")
    chosen = batch.kernels_for
    monkeypatch.setattr(batch, "kernels_for", lambda device: dataclasses.replace(
        chosen(device), paged_decode_from_table=None))
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
