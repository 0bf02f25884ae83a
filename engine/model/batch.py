"""The explicit per-step metadata a forward pass runs on.

A step is a flat run of tokens from several sequences: some prefilling a chunk,
some decoding one token. Each sequence says where its chunk starts, which KV
pages hold it, and (hybrid models) which state slot carries its recurrent state.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import torch

from kernels.select import kernels_for


class LogitsWanted(Enum):
    NONE = "none"  # a middle chunk of a long prefill
    LAST = "last"  # the next-token distribution
    ALL = "all"  # every position (prompt logprobs, tests)


@dataclass(slots=True)  # not frozen: made per sequence every step, and a frozen init costs 4x
class SequenceChunk:
    """One sequence's part of a step, as the scheduler describes it."""

    token_ids: Sequence[int]
    start: int  # tokens of this sequence already in the cache
    page_table: Sequence[int]  # pages holding positions 0 .. start+len-1, in order
    state_slot: int | None = None  # recurrent-state slot (hybrid models)
    logits: LogitsWanted = LogitsWanted.LAST

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a sequence chunk needs at least one token")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")


@dataclass(frozen=True, slots=True)
class SeqView:
    """A sequence's slice of the flat token run, with device-side page table."""

    offset: int  # first row of this sequence in the flat token run
    length: int
    start: int
    pages: torch.Tensor  # int64: every sequence's page table of the step, one after another
    pages_at: int  # where this sequence's starts in `pages`
    pages_len: int
    state_slot: int | None

    @property
    def page_table(self) -> torch.Tensor:
        """int64 [n_pages]; sliced when asked (only a prefill's attention asks: a decode step's 64
        sequences would otherwise pay for 64 tensor views it never reads)."""
        return self.pages[self.pages_at:self.pages_at + self.pages_len]

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def is_decode(self) -> bool:
        return self.length == 1 and self.start > 0


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """Single-token decodes of a step, padded so attention runs once for all of them."""

    rows: torch.Tensor  # [B] rows of the flat token run
    pages: torch.Tensor  # [B, L] page id of each context position (padding: any valid page)
    offsets: torch.Tensor  # [B, L] offset inside the page
    valid: torch.Tensor  # [B, L] bool: position < context length
    every_row: bool = False  # rows are all the step's rows, in order (a decode-only step): no picking


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_pages: torch.Tensor  # [T] page id each token's K/V is written to
    kv_offsets: torch.Tensor  # [T] offset inside that page
    seqs: tuple[SeqView, ...]
    logits_rows: torch.Tensor  # [R] rows of the flat run whose logits are returned
    logits_counts: tuple[int, ...]  # rows per sequence, in order
    decodes: tuple[SeqView, ...]  # the sequences decoding one token, in order (picked once, not per layer)
    others: tuple[SeqView, ...]  # the rest (prefill chunks), in order
    decode: DecodeGather | None = None  # set when two or more decodes run as one padded call (_pad_decodes)
    decodes_only: bool = False  # every sequence decodes one token and wants its logits: row i is sequence i's

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> "ForwardBatch":
        if all(c.start > 0 and len(c.token_ids) == 1 and c.logits is LogitsWanted.LAST for c in chunks):
            return cls._decodes_only(chunks, page_size, device)
        return cls._any(chunks, page_size, device)

    @classmethod
    def _decodes_only(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> "ForwardBatch":
        """A step of single-token decodes only (the steady state), in fewer Python operations per
        sequence than `_any`; the same batch (tests/test_forward_batch.py)."""
        tables = []
        flat: list[int] = []
        pages = []
        for c in chunks:
            needed = c.start // page_size + 1
            if len(c.page_table) < needed:
                raise ValueError(f"page table has {len(c.page_table)} pages but {c.start + 1} tokens need {needed}")
            table = c.page_table[:needed]
            tables.append(table)
            flat.extend(table)
            pages.append(table[-1])
        positions = [c.start for c in chunks]
        seqs = _seq_views([(i, 1, c.start, c.state_slot) for i, c in enumerate(chunks)], tables, flat, device)
        decode = _decode_gather(seqs, tables, page_size, device, len(seqs)) if _pad_decodes(seqs, device) else None
        rows = list(range(len(chunks)))
        return cls(
            input_ids=torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            kv_pages=torch.tensor(pages, dtype=torch.int64, device=device),
            kv_offsets=torch.tensor([p % page_size for p in positions], dtype=torch.int64, device=device),
            seqs=tuple(seqs),
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=device),
            logits_counts=(1,) * len(chunks),
            decodes=tuple(seqs),
            others=(),
            decode=decode,
            decodes_only=True,
        )

    @classmethod
    def _any(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> "ForwardBatch":
        ids: list[int] = []
        positions: list[int] = []
        pages: list[int] = []
        offsets: list[int] = []
        rows: list[int] = []
        counts: list[int] = []
        views: list[tuple[int, int, int, int | None]] = []  # (offset, length, start, slot) of each sequence
        tables: list[Sequence[int]] = []  # the pages each sequence's positions need
        for chunk in chunks:
            n = len(chunk.token_ids)
            end = chunk.start + n
            needed = -(-end // page_size)
            if len(chunk.page_table) < needed:
                raise ValueError(
                    f"page table has {len(chunk.page_table)} pages but {end} tokens need {needed}"
                )
            base = len(ids)
            ids.extend(chunk.token_ids)
            pos = range(chunk.start, end)
            positions.extend(pos)
            pages.extend(chunk.page_table[p // page_size] for p in pos)
            offsets.extend(p % page_size for p in pos)
            if chunk.logits is LogitsWanted.LAST:
                rows.append(base + n - 1)
                counts.append(1)
            elif chunk.logits is LogitsWanted.ALL:
                rows.extend(range(base, base + n))
                counts.append(n)
            else:
                counts.append(0)
            views.append((base, n, chunk.start, chunk.state_slot))
            tables.append(chunk.page_table[:needed])

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        seqs = _seq_views(views, tables, [page for table in tables for page in table], device)

        decoding: list[int] = []  # indices of the decode rows
        rest: list[SeqView] = []
        for i, s in enumerate(seqs):
            if s.is_decode:
                decoding.append(i)
            else:
                rest.append(s)
        decodes = [seqs[i] for i in decoding]
        others = tuple(rest)
        decode = None
        if _pad_decodes(decodes, device):
            decode = _decode_gather(decodes, [tables[i] for i in decoding], page_size, device, len(ids))

        return cls(
            input_ids=tensor(ids),
            positions=tensor(positions),
            kv_pages=tensor(pages),
            kv_offsets=tensor(offsets),
            seqs=tuple(seqs),
            logits_rows=tensor(rows),
            logits_counts=tuple(counts),
            decodes=tuple(decodes),
            others=others,
            decode=decode,
        )


def _seq_views(views: Sequence[tuple[int, int, int, int | None]], tables: Sequence[Sequence[int]],
               flat: list[int], device: torch.device) -> list[SeqView]:
    """Each sequence's view, from its (offset, length, start, slot) and page table; every page table is a
    slice of one tensor of `flat` (the tables one after another): one host-to-device copy, not one each."""
    pages = torch.tensor(flat, dtype=torch.int64, device=device)
    seqs = []
    at = 0
    for (offset, length, start, slot), table in zip(views, tables):
        seqs.append(SeqView(offset, length, start, pages, at, len(table), slot))
        at += len(table)
    return seqs


# On the CPU, padded decode attention pays for every padded position and a masked (slow-path)
# SDPA; one unmasked call per sequence costs ~0.13 ms of overhead instead. Measured at 2 threads,
# 8 heads / 2 KV heads: B=8 at 2.3k tokens 15.8 ms padded vs 7.1 ms per sequence, B=64 at 64
# tokens 2.7 vs 11.4 ms. Padding wins only while contexts are short.
CPU_PADDED_DECODE_MAX_CONTEXT = 512


def _pad_decodes(decodes: list[SeqView], device: torch.device) -> bool:
    """Whether this step's single-token decodes run as one padded attention call."""
    if kernels_for(device).decode_in_place:  # the C kernel on the CPU: no cost per padded position
        return bool(decodes)
    if len(decodes) < 2:
        return False
    return device.type != "cpu" or max(s.end for s in decodes) < CPU_PADDED_DECODE_MAX_CONTEXT


def _decode_gather(seqs: list[SeqView], tables: list[Sequence[int]], page_size: int, device: torch.device,
                   total_rows: int) -> DecodeGather:
    offsets = [s.offset for s in seqs]
    longest = max(s.end for s in seqs)
    max_pages = -(-longest // page_size)
    # Built from the page lists in one call (a row assignment per sequence was ~3 µs each).
    table = torch.tensor([list(t) + [0] * (max_pages - len(t)) for t in tables], dtype=torch.int64, device=device)
    positions = torch.arange(longest, device=device)
    pages = table[:, positions // page_size]  # [B, L]
    lengths = torch.tensor([s.end for s in seqs], device=device)
    return DecodeGather(
        rows=torch.tensor(offsets, dtype=torch.int64, device=device),
        pages=pages,
        offsets=(positions % page_size).expand(len(seqs), -1),
        valid=positions[None, :] < lengths[:, None],
        every_row=offsets == list(range(total_rows)),
    )
