"""A decode-only batch kept for the next step of the same sequences: the steady state's batch.

A decode step's batch is each sequence's token, position, page table and the page and offset its new
K/V goes to. Building it from the sequences reads every one of them, and on the CPU that is what
costs: the forward pass has just streamed the KV cache through the caches, so each sequence object,
list and int read afterwards is a miss (building a batch of 64 costs ~3x what it costs in a loop of
its own). When the scheduler plans the same sequences again (`StepPlan.steady`: the same running
list, each one token on), the batch is last step's with every position one further on, kept in
contiguous host arrays: only the tokens are read, and the page table only of a sequence whose new
position starts a page (one in `page_size`, found from the positions without visiting the others).

`build` makes the batch from the sequences' lists and keeps it; `advance` moves the kept one on.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import torch

from engine.model.batch import (DecodeViews, ForwardBatch, decode_only_batch, decode_values, int64_tensor,
                                pad_tables, with_views)

# Row i's page table, for the sequences whose new position starts a page (the caller's lists, read
# only for those rows).
TableOf = Callable[[int], Sequence[int]]


class KeptDecodes:
    """The last decode-only batch's rows and padded page tables, and whose batch it was."""

    # Plain lists, not numpy arrays: right after a forward pass the caches are cold, and a list
    # comprehension over 64 ints costs less there than a numpy call's dispatch (measured in situ).
    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device
        self.owner: object | None = None  # the list of sequences it was built for, compared by identity
        self._lengths: list[int] = []  # each row's context length in the last batch: its position in the next
        self._needed: list[int] = []  # pages its positions need (its row of the tables)
        self._last_pages: list[int] = []  # the page of its position
        self._slots: tuple[int | None, ...] = ()
        self._shifts: Sequence[int] | None = None  # each row's rotary shift (M-RoPE after images), None: none
        self._padded: torch.Tensor | None = None  # [B, W] int64 on the device
        self._host: array | None = None  # on the CPU, the buffer the last batch's rows are
        self._last: ForwardBatch | None = None  # the last batch, when its attention reads the tables
        self.builds = 0  # batches built from the sequences (tests: the steady state builds none)

    def holds(self, owner: object) -> bool:
        return self._padded is not None and owner is self.owner

    def forget(self) -> None:
        self.owner, self._padded, self._host, self._last = None, None, None, None

    def build(self, owner: object, tokens: list[int], starts: list[int], tables: Sequence[Sequence[int]],
              slots: list[int | None], shifts: Sequence[int] | None = None) -> ForwardBatch:
        """ForwardBatch.for_decodes' batch, kept for `advance` (`owner`: what the next call names it by)."""
        page_size = self.page_size
        needed = [start // page_size + 1 for start in starts]
        padded = pad_tables(tables, needed, max(needed), self.device)
        self.owner, self._padded, self._slots, self._needed = owner, padded, tuple(slots), needed
        self._shifts = shifts
        self._host, self._last = None, None
        self._last_pages = [table[n - 1] for table, n in zip(tables, needed)]
        self.builds += 1
        return self._batch(tokens, starts, [start % page_size for start in starts])

    def advance(self, tokens: list[int], table_of: TableOf) -> ForwardBatch:
        """The kept batch's rows again, each at the next position, decoding `tokens` (row by row). Raises
        ValueError where a row's new position needs a page its table does not have. On the CPU the last
        batch's tensors are rewritten for this one: a batch is good for its own step only."""
        assert self._padded is not None, "advance without a kept batch: this is a bug"
        starts, page_size = self._lengths, self.page_size
        offsets = [start % page_size for start in starts]
        try:
            if 0 in offsets:  # some rows' new positions start a page
                self._enter_pages([i for i, offset in enumerate(offsets) if not offset], starts, table_of)
            return self._batch(tokens, starts, offsets)
        except Exception:
            self.forget()  # half moved on: the next batch is built afresh
            raise

    def check(self, starts: list[int], tables: Sequence[Sequence[int]], slots: list[int | None]) -> None:
        """AssertionError unless the kept batch is what a fresh build from these lists gives, one step on
        (tests: `starts` are the positions the last batch decoded)."""
        assert self._padded is not None
        needed = [start // self.page_size + 1 for start in starts]
        assert self._lengths == [start + 1 for start in starts] and self._needed == needed, (self._lengths, starts)
        assert self._slots == tuple(slots)
        assert self._last_pages == [table[n - 1] for table, n in zip(tables, needed)]
        fresh = pad_tables(tables, needed, self._padded.shape[1], self.device)
        assert torch.equal(self._padded.cpu(), fresh.cpu())

    def _enter_pages(self, rows: list[int], starts: list[int], table_of: TableOf) -> None:
        """Write the page each of `rows` entered into its row of the tables (widened when it is the longest)."""
        needed, last_pages, pages = self._needed, self._last_pages, []
        for i in rows:
            n = starts[i] // self.page_size + 1
            table = table_of(i)
            if len(table) < n:
                raise ValueError(f"page table has {len(table)} pages but its tokens need {n}")
            needed[i], last_pages[i] = n, table[n - 1]
            pages.append(table[n - 1])
        padded = self._padded
        assert padded is not None
        widest = max(needed[i] for i in rows)
        if widest > padded.shape[1]:
            padded = torch.nn.functional.pad(padded, (0, widest - padded.shape[1]))
            self._padded = padded
        index = array("q", rows)
        index.extend([needed[i] - 1 for i in rows])
        index.extend(pages)
        at = int64_tensor(index, self.device).view(3, -1)
        padded.index_put_((at[0], at[1]), at[2])

    def _batch(self, tokens: list[int], starts: list[int], offsets: list[int]) -> ForwardBatch:
        count = len(tokens)
        if count != len(starts):
            raise ValueError(f"{count} tokens for a batch of {len(starts)} sequences")
        values, self._lengths = decode_values(tokens, starts, self._last_pages, offsets, self._shifts)
        padded, last = self._padded, self._last
        assert padded is not None
        # The views read positions and page counts when asked: the lists are this step's (the next makes new ones).
        views = DecodeViews(starts, list(self._needed), self._slots, padded, padded.shape[1])
        if last is not None and last.decode is not None and last.decode.table is padded and self._host is not None:
            # On the CPU the rows are the host buffer itself: written in place, the last batch's tensors (and
            # its attention gather over the same tables) are this one's, with no torch call made.
            self._host[:] = values  # the same length: the buffer is never resized under its tensors
            batch = with_views(last, views)
        else:
            rows = int64_tensor(values, self.device).view(5, count)
            self._host = values if self.device.type == "cpu" else None
            batch = decode_only_batch(rows, views, padded, self.page_size, self.device)
        self._last = batch if batch.decode is not None and batch.decode.table is not None else None
        return batch
