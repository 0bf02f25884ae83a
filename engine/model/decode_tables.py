"""The page tables of a decode-only step, padded into one [B, W] tensor and kept for the next one.

Building the padded tables is the one part of a decode step's batch that costs work per page per
sequence (~1.5 µs a sequence on the CPU). Between two decode steps of the same sequences almost
nothing changes: a sequence's page table is a list that only grows by appending (EngineSequence.grow;
anything else gives it a new list), so the rows kept from the last step stay right for every
table that is the same list object, and only the pages a sequence took since are written in.
Any other change of the batch (a sequence joins, leaves or moves) builds the tensor afresh.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import is_

import torch


class DecodeTables:
    """The last decode-only step's padded page tables, and the lists they were made from."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: list[Sequence[int]] = []  # held: an id is not reused while its list is kept here
        self._needed: list[int] = []  # pages of each table in its row
        self._padded: torch.Tensor | None = None  # [B, W] int64
        self.rebuilds = 0  # fresh builds (tests: the steady state builds none)

    def padded(self, tables: list[Sequence[int]], needed: list[int], widest: int) -> torch.Tensor:
        """[B, W >= widest] int64: row i holds tables[i][:needed[i]], then zeros. Raises ValueError when a
        table holds fewer pages than its positions need. The tensor may be written for the next step:
        use it for this step only."""
        kept = self._padded
        if kept is None or len(tables) != len(self._tables) or not all(map(is_, tables, self._tables)) \
                or not self._grow(kept, tables, needed, widest):
            self._padded = pad_tables(tables, needed, widest, self.device)
            self.rebuilds += 1
        self._tables, self._needed = tables, needed
        assert self._padded is not None
        return self._padded

    def forget(self) -> None:
        self._tables, self._needed, self._padded = [], [], None

    def _grow(self, kept: torch.Tensor, tables: list[Sequence[int]], needed: list[int], widest: int) -> bool:
        """Write in the pages each row's table took since; False when a row would shrink (build afresh)."""
        before = self._needed
        if needed == before:  # compared in C: most steps, no sequence crossed into a new page
            return True
        rows: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        for i, (table, n, was) in enumerate(zip(tables, needed, before)):
            if n == was:
                continue
            if n < was:
                return False
            if len(table) < n:
                raise ValueError(f"page table has {len(table)} pages but its tokens need {n}")
            rows.extend([i] * (n - was))
            cols.extend(range(was, n))
            pages.extend(table[was:n])
        if widest > kept.shape[1]:  # the longest took a page past the width: pad every row out
            kept = torch.nn.functional.pad(kept, (0, widest - kept.shape[1]))
            self._padded = kept
        index = torch.frombuffer(array("q", rows + cols + pages), dtype=torch.int64).to(self.device).view(3, -1)
        kept.index_put_((index[0], index[1]), index[2])
        return True


def pad_tables(tables: Sequence[Sequence[int]], needed: Sequence[int], widest: int,
               device: torch.device) -> torch.Tensor:
    """[B, widest] int64, row i tables[i][:needed[i]] then zeros, from one buffer and one copy (a row
    assignment per sequence was ~3 µs each)."""
    values = array("q")
    for table, n in zip(tables, needed):
        if len(table) < n:
            raise ValueError(f"page table has {len(table)} pages but its tokens need {n}")
        values.extend(table if len(table) == n else table[:n])
        if n < widest:
            values.extend(zero_pages(widest - n))
    host = torch.frombuffer(values, dtype=torch.int64).view(len(needed), widest)
    return host if device.type == "cpu" else host.to(device)


_ZERO_PAGES = array("q", bytes(8 * 4096))  # padding for page tables


def zero_pages(count: int) -> array:
    return _ZERO_PAGES[:count] if count <= len(_ZERO_PAGES) else array("q", bytes(8 * count))
