"""KeptDecodes: a decode batch moved on from one step to the next is, step after step, the batch a fresh
build from the sequences gives, as each takes pages (the longest past the tables' width)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.batch import ForwardBatch, pad_tables
from engine.model.kept_decodes import KeptDecodes
from tests.test_forward_batch import _same

PAGE = 4  # small pages: sequences enter new pages (and go past the tables' width) often
CPU = torch.device("cpu")


@dataclasses.dataclass(eq=False)
class Decoding:
    """What the runner reads of a decoding sequence."""

    table: list[int]
    start: int
    token: int
    slot: int | None

    def step(self, next_page: int, spare: int = 0) -> None:
        """One decode: the position moves on; a position past the table takes pages (EngineSequence.grow)."""
        self.start += 1
        if self.start >= len(self.table) * PAGE:
            self.table.extend(range(next_page, next_page + 1 + spare))
        self.token = (self.token * 31 + 7) % 5000


def _fresh(seqs: list[Decoding]) -> ForwardBatch:
    return ForwardBatch.for_decodes([s.token for s in seqs], [s.start for s in seqs], [s.table for s in seqs],
                                    [s.slot for s in seqs], PAGE, CPU)


def _build(kept: KeptDecodes, seqs: list[Decoding]) -> ForwardBatch:
    return kept.build(seqs, [s.token for s in seqs], [s.start for s in seqs], [s.table for s in seqs],
                      [s.slot for s in seqs])


def _advance(kept: KeptDecodes, seqs: list[Decoding]) -> ForwardBatch:
    return kept.advance([s.token for s in seqs], lambda i: seqs[i].table)


def _check(got: ForwardBatch, fresh: ForwardBatch) -> None:
    for f in dataclasses.fields(ForwardBatch):
        _same(getattr(got, f.name), getattr(fresh, f.name))  # decode: the positions the kernel reads, any width


def _decoding(i: int, start: int, spare: int = 0) -> Decoding:
    return Decoding([100 * i + p for p in range(start // PAGE + 1 + spare)], start, i, i)


@settings(max_examples=60, deadline=None)
@given(starts=st.lists(st.integers(1, 30), min_size=1, max_size=8), steps=st.integers(1, 3 * PAGE + 2),
       spare=st.integers(0, 2), data=st.data())
def test_a_kept_batch_moved_on_is_the_one_a_fresh_build_gives(starts: list[int], steps: int, spare: int,
                                                              data: st.DataObject) -> None:
    kept = KeptDecodes(PAGE, CPU)
    seqs = [_decoding(i, start, data.draw(st.integers(0, 2))) for i, start in enumerate(starts)]
    pages = iter(range(1000, 9000, 4))
    _check(_build(kept, seqs), _fresh(seqs))
    for _ in range(steps):
        for s in seqs:
            s.step(next(pages), spare)  # a table may take more pages than its position needs
        _check(_advance(kept, seqs), _fresh(seqs))
        kept.check([s.start for s in seqs], [s.table for s in seqs], [s.slot for s in seqs])
    assert kept.builds == 1 and kept.holds(seqs) and not kept.holds(list(seqs))


def test_a_table_that_did_not_grow_with_its_tokens_is_refused() -> None:
    kept = KeptDecodes(PAGE, CPU)
    seq = _decoding(0, PAGE - 1)
    _build(kept, [seq])
    seq.start += 1  # the next page's first position, without the page
    with pytest.raises(ValueError, match="page table has 1 pages"):
        _advance(kept, [seq])
    with pytest.raises(ValueError, match="page table has 1 pages"):
        pad_tables([seq.table], [2], 2, CPU)


def test_a_kept_batch_takes_one_token_a_row() -> None:
    kept = KeptDecodes(PAGE, CPU)
    seqs = [_decoding(0, 5), _decoding(1, 9)]
    _build(kept, seqs)
    with pytest.raises(ValueError, match="1 tokens for a batch of 2"):
        kept.advance([3], lambda i: seqs[i].table)


def test_forget_lets_go_of_the_batch() -> None:
    kept = KeptDecodes(PAGE, CPU)
    seqs = [_decoding(0, 5)]
    _build(kept, seqs)
    kept.forget()
    assert not kept.holds(seqs)
