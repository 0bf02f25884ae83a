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


@dataclass(frozen=True, slots=True)
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
    page_table: torch.Tensor  # int64 [n_pages]
    state_slot: int | None

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
    decode: DecodeGather | None = None  # set when two or more decodes run as one padded call (_pad_decodes)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> "ForwardBatch":
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

        # Every page table is a view of one tensor: one host-to-device copy, not one per sequence.
        flat = tensor([page for table in tables for page in table])
        seqs: list[SeqView] = []
        at = 0
        for (offset, length, start, slot), table in zip(views, tables):
            seqs.append(SeqView(offset=offset, length=length, start=start, page_table=flat[at:at + len(table)],
                                state_slot=slot))
            at += len(table)

        decoding = [i for i, s in enumerate(seqs) if s.is_decode]
        decodes = [seqs[i] for i in decoding]
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
            decode=decode,
        )


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
