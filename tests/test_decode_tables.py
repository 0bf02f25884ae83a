"""DecodeTables: the padded page tables kept from one decode step to the next give, step after step,
the batch a fresh build gives; only a change of the batch's sequences builds them afresh."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.batch import ForwardBatch
from engine.model.decode_tables import DecodeTables, pad_tables
from tests.test_forward_batch import _same

PAGE = 4  # small pages: sequences cross into new pages (and past the table's width) often
CPU = torch.device("cpu")


@dataclasses.dataclass
class Decoding:
    """What the runner reads of a decoding sequence."""

    table: list[int]
    start: int
    token: int
    slot: int | None

    def step(self, next_page: int) -> None:
        """One decode: the position moves on; a position past the table takes a page (EngineSequence.grow)."""
        self.start += 1
        if self.start >= len(self.table) * PAGE:
            self.table.append(next_page)
        self.token = (self.token * 31 + 7) % 5000


def _batches(kept: DecodeTables, seqs: list[Decoding]) -> tuple[ForwardBatch, ForwardBatch]:
    args = ([s.token for s in seqs], [s.start for s in seqs], [s.table for s in seqs], [s.slot for s in seqs],
            PAGE, CPU)
    return ForwardBatch.for_decodes(*args, kept), ForwardBatch.for_decodes(*args)


def _check(kept_batch: ForwardBatch, fresh: ForwardBatch) -> None:
    for f in dataclasses.fields(ForwardBatch):
        if f.name != "decode":
            _same(getattr(kept_batch, f.name), getattr(fresh, f.name))
    assert kept_batch.decode is not None and fresh.decode is not None
    _same(kept_batch.decode, fresh.decode)  # the positions the kernel reads, whatever the table's width


def _decoding(i: int, start: int, spare: int = 0) -> Decoding:
    return Decoding([100 * i + p for p in range(start // PAGE + 1 + spare)], start, i, i)


def test_the_steady_state_builds_the_tables_once_and_follows_every_new_page() -> None:
    kept = DecodeTables(CPU)
    seqs = [_decoding(i, start) for i, start in enumerate([1, 3, 6, 13])]
    pages = iter(range(1000, 2000))
    for _ in range(3 * PAGE + 1):  # every sequence takes pages, the longest past the first width
        _check(*_batches(kept, seqs))
        for s in seqs:
            s.step(next(pages))
    assert kept.rebuilds == 1


def test_a_change_of_the_batchs_sequences_builds_afresh() -> None:
    kept = DecodeTables(CPU)
    a, b, c = _decoding(0, 5), _decoding(1, 9), _decoding(2, 2)
    for batch in ([a, b], [a, b], [b, a], [a], [a, c], [a, c]):
        _check(*_batches(kept, batch))
    assert kept.rebuilds == 4  # the first, the reorder, the one that left and the one that joined
    _check(*_batches(kept, [a, b]))
    b.table = list(b.table)  # a new list (adopt, fork_from): even in the same place it is not the one kept
    _check(*_batches(kept, [a, b]))
    assert kept.rebuilds == 6


def test_a_sequence_that_moved_back_builds_afresh() -> None:
    """The same list, fewer pages wanted than its row holds (not what a decode does): built again."""
    kept = DecodeTables(CPU)
    seq = _decoding(0, 9)
    _check(*_batches(kept, [seq]))
    seq.start = 2
    _check(*_batches(kept, [seq]))
    assert kept.rebuilds == 2


def test_a_table_that_did_not_grow_with_its_tokens_is_refused() -> None:
    kept = DecodeTables(CPU)
    seq = _decoding(0, PAGE - 1)
    _batches(kept, [seq])
    seq.start += 1  # the next page's first position, without the page
    with pytest.raises(ValueError, match="page table has 1 pages"):
        ForwardBatch.for_decodes([0], [seq.start], [seq.table], [0], PAGE, CPU, kept)
    with pytest.raises(ValueError, match="page table has 1 pages"):
        pad_tables([seq.table], [2], 2, CPU)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_kept_tables_match_a_fresh_build_whatever_the_batch_does(data: st.DataObject) -> None:
    kept = DecodeTables(CPU)
    pool = [_decoding(i, data.draw(st.integers(1, 20)), data.draw(st.integers(0, 2))) for i in range(6)]
    batch = pool[:3]
    pages = iter(range(1000, 5000))
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["decode", "decode", "decode", "leave", "join", "swap", "new list"]))
        if action == "leave" and len(batch) > 1:
            batch.pop(data.draw(st.integers(0, len(batch) - 1)))
        elif action == "join":
            batch.append(data.draw(st.sampled_from(pool)))
        elif action == "swap" and len(batch) > 1:
            batch = batch[1:] + batch[:1]
        elif action == "new list":
            target = data.draw(st.sampled_from(batch))
            target.table = list(target.table)
        _check(*_batches(kept, batch))
        for s in dict.fromkeys(map(id, batch)):  # each sequence decodes once, even if listed twice
            next(x for x in batch if id(x) == s).step(next(pages))
