"""The explicit per-step metadata a forward pass runs on.

A step is a flat run of tokens from several sequences: some prefilling a chunk,
some decoding one token. Each sequence says where its chunk starts, which KV
pages hold it, and (hybrid models) which state slot carries its recurrent state.
"""

from __future__ import annotations

import operator
from array import array
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Sequence, overload

import torch

from kernels.paged_attention import positional
from kernels.select import kernels_for



class LogitsWanted(Enum):
    NONE = "none"  # a middle chunk of a long prefill
    LAST = "last"  # the next-token distribution
    ALL = "all"  # every position (prompt logprobs, tests)
    TAIL = "tail"  # the last `tail` positions (a verify of drafted tokens: the pending token's and each draft's)


@dataclass(frozen=True, slots=True)
class ChunkMedia:
    """A chunk's rows of a sequence whose prompt has images, as its forward pass needs them (made by
    engine/vision/media.py)."""

    positions: Sequence[int]  # each row's rotary position (M-RoPE's t row; a text row's three are equal)
    rope_rows: Sequence[int]  # rows (from the chunk's first) at image tokens, whose h and w positions differ
    rope_positions: torch.Tensor  # [3, len(rope_rows)] int64
    embeds: tuple[tuple[int, torch.Tensor], ...]  # (first row, [n, hidden] vision tower output) for image rows


@dataclass(slots=True)  # not frozen: made per sequence every step, and a frozen init costs 4x
class SequenceChunk:
    """One sequence's part of a step, as the scheduler describes it."""

    token_ids: Sequence[int]
    start: int  # tokens of this sequence already in the cache
    page_table: Sequence[int]  # pages holding positions 0 .. start+len-1, in order
    state_slot: int | None = None  # recurrent-state slot (hybrid models)
    logits: LogitsWanted = LogitsWanted.LAST
    tail: int = 0  # LogitsWanted.TAIL: how many
    shift: int = 0  # added to each row's index for its rotary position (M-RoPE past a prompt with images)
    media: ChunkMedia | None = None  # a prompt with images: the rows' positions and their image embeddings

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a sequence chunk needs at least one token")
        if self.logits is LogitsWanted.TAIL and not 0 < self.tail <= len(self.token_ids):
            raise ValueError(f"a tail of {self.tail} logits rows for a chunk of {len(self.token_ids)} tokens")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")


@dataclass(slots=True)  # not frozen: made per sequence every step, and a frozen init costs 3x
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


class _LazyViews(abc.Sequence[SeqView]):
    """Views made when asked, indexed like a tuple: a subclass says how long it is and makes view i."""

    __slots__ = ()

    def _view(self, i: int) -> SeqView:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> SeqView: ...

    @overload
    def __getitem__(self, i: slice) -> list[SeqView]: ...

    def __getitem__(self, i: int | slice) -> SeqView | list[SeqView]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._view(i)


class DecodeViews(_LazyViews):
    """The views of a decode-only batch, made when asked: its forward pass reads the gather and
    `decode_slots` instead, and 64 views a step would be made for nothing."""

    __slots__ = ("_starts", "_needed", "_slots", "_pages", "_width")

    def __init__(self, starts: Sequence[int], needed: Sequence[int], slots: Sequence[int | None],
                 pages: torch.Tensor, width: int) -> None:
        """pages: [B, width], every sequence's page table padded to `width`."""
        self._starts, self._needed, self._slots, self._pages, self._width = starts, needed, slots, pages, width

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def slots(self) -> tuple[int | None, ...]:
        return tuple(self._slots)

    @property
    def furthest(self) -> int:
        """The furthest position any of them decodes."""
        return max(self._starts)

    def _view(self, i: int) -> SeqView:
        return SeqView(i, 1, self._starts[i], self._pages.view(-1), i * self._width, self._needed[i], self._slots[i])


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """Single-token decodes of a step, padded so attention runs once for all of them: as pages/offsets/
    valid [B, L], or (a decode-only step whose kernels take it) as each one's page table and length."""

    rows: torch.Tensor  # [B] rows of the flat token run
    pages: torch.Tensor | None  # [B, L] page id of each context position (padding: any valid page)
    offsets: torch.Tensor | None  # [B, L] offset inside the page
    valid: torch.Tensor | None  # [B, L] bool: position < context length
    every_row: bool = False  # rows are all the step's rows, in order (a decode-only step): no picking
    table: torch.Tensor | None = None  # [B, W] each one's page table, padded (then pages/offsets/valid are None)
    lengths: torch.Tensor | None = None  # [B] each one's context length
    page_size: int = 0

    def positional(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pages, offsets, valid) [B, L], made from the table when that is the form held."""
        if self.pages is not None and self.offsets is not None and self.valid is not None:
            return self.pages, self.offsets, self.valid
        assert self.table is not None and self.lengths is not None
        return positional(self.table, self.lengths, self.page_size)


class KeptInputs:
    """A verify step's recurrent-layer inputs of the sequences that may roll back (by the state slot they run
    on): each linear-attention layer's projections of their rows, before the conv, kept so that a partial
    acceptance replays the recurrence over the tokens that stood from the state before the step
    (engine/verify_step.py) instead of running them through the whole model again."""

    __slots__ = ("slots", "by_slot")

    def __init__(self, slots: set[int]) -> None:
        self.slots = slots
        # slot -> layer -> (mixed [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])
        self.by_slot: dict[int, dict[int, tuple[torch.Tensor, ...]]] = {slot: {} for slot in slots}

    def keep(self, slot: int, layer: int, inputs: tuple[torch.Tensor, ...]) -> None:
        self.by_slot[slot][layer] = tuple(t.clone() for t in inputs)


@dataclass(frozen=True, slots=True)
class BatchMedia:
    """The rows of a step that hold image tokens: their embeddings and their 3-D M-RoPE positions."""

    rows: torch.Tensor  # [M] rows of the flat run
    embeds: torch.Tensor  # [M, hidden]
    positions: torch.Tensor  # [3, M]

    @classmethod
    def of(cls, rows: list[int], embeds: list[torch.Tensor], positions: list[torch.Tensor],
           device: torch.device) -> BatchMedia:
        return cls(int64_tensor(rows, device), torch.cat(embeds).to(device),
                   torch.cat(positions, dim=1).to(device))


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_pages: torch.Tensor  # [T] page id each token's K/V is written to
    kv_offsets: torch.Tensor  # [T] offset inside that page
    seqs: Sequence[SeqView]
    logits_rows: torch.Tensor  # [R] rows of the flat run whose logits are returned
    logits_counts: tuple[int, ...]  # rows per sequence, in order
    decodes: Sequence[SeqView]  # the sequences decoding one token, in order (picked once, not per layer)
    others: tuple[SeqView, ...]  # the rest (prefill chunks), in order
    decode: DecodeGather | None = None  # set when two or more decodes run as one padded call (_pad_decodes)
    decodes_only: bool = False  # every sequence decodes one token and wants its logits: row i is sequence i's
    decode_slots: tuple[int | None, ...] = ()  # each decode's state slot, in order (read once a layer)
    media: BatchMedia | None = None  # rows at image tokens (prompts with images)
    kept_inputs: KeptInputs | None = None  # a hybrid verify step: what a rollback replays

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> "ForwardBatch":
        if all(c.start > 0 and len(c.token_ids) == 1 and c.logits is LogitsWanted.LAST and c.media is None
               for c in chunks):
            return cls._decodes_only(chunks, page_size, device)
        return cls._any(chunks, page_size, device)

    @classmethod
    def _decodes_only(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> "ForwardBatch":
        shifts = [c.shift for c in chunks]
        return cls.for_decodes(
            [c.token_ids[0] for c in chunks], [c.start for c in chunks], [c.page_table for c in chunks],
            [c.state_slot for c in chunks], page_size, device, shifts if any(shifts) else None)

    @classmethod
    def for_decodes(cls, tokens: list[int], starts: list[int], tables: Sequence[Sequence[int]],
                    slots: list[int | None], page_size: int, device: torch.device,
                    shifts: Sequence[int] | None = None) -> "ForwardBatch":
        """A step of single-token decodes only (the steady state): sequence i decodes `tokens[i]` at
        position `starts[i]` (> 0) over its page table, and wants its logits. The batch `_any` builds
        (tests/test_forward_batch.py), from two host-to-device copies and a few torch calls instead of
        work per sequence (engine/model/kept_decodes.py moves one on to the next step). `shifts`: added
        to each one's position for its rotary angle (M-RoPE after images), None for none."""
        views, padded, values = _decode_rows(tokens, starts, tables, slots, page_size, device, shifts)
        return decode_only_batch(int64_tensor(values, device).view(5, len(tokens)), views, padded, page_size, device)

    @classmethod
    def _any(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> "ForwardBatch":
        r = _ChunkRows.of(chunks, page_size, 0)
        seqs = _seq_views(r.views, r.tables, r.flat, device)
        decodes = [seqs[i] for i in r.decoding]
        picked = set(r.decoding)
        others = tuple(s for i, s in enumerate(seqs) if i not in picked)
        decode = None
        if _pad_decodes(decodes, device):
            decode = _decode_gather(decodes, [r.tables[i] for i in r.decoding], page_size, device, len(r.ids))
        return cls(
            input_ids=int64_tensor(r.ids, device),
            positions=int64_tensor(r.positions, device),
            kv_pages=int64_tensor(r.pages, device),
            kv_offsets=int64_tensor(r.offsets, device),
            seqs=tuple(seqs),
            logits_rows=int64_tensor(r.rows, device),
            logits_counts=tuple(r.counts),
            decodes=tuple(decodes),
            others=others,
            decode=decode,
            decode_slots=tuple(s.state_slot for s in decodes),
            media=r.batch_media(device),
        )

    @classmethod
    def mixed(cls, tokens: list[int], starts: list[int], tables: Sequence[Sequence[int]], slots: list[int | None],
              rest: Sequence[SequenceChunk], page_size: int, device: torch.device,
              shifts: Sequence[int] | None = None) -> "ForwardBatch":
        """A step of single-token decodes first (sequence i decodes `tokens[i]` at `starts[i]` > 0 and wants
        its logits), then the chunks of `rest`, none of them a single-token decode past position 0: the
        batch `_any` builds from the decodes' chunks and `rest` (tests/test_forward_batch.py), without a
        chunk, a view or a per-token list entry for each decode (they are most of a step with prefills)."""
        count = len(tokens)
        r = _ChunkRows.of(rest, page_size, count)
        if r.decoding:
            raise ValueError("mixed(): a single-token decode among the rest belongs with the decodes or in _any")
        views, padded, values = _decode_rows(tokens, starts, tables, slots, page_size, device, shifts)
        ids, positions, kv_pages, kv_offsets, lengths = (values[k * count:(k + 1) * count] for k in range(5))
        others = tuple(_seq_views(r.views, r.tables, r.flat, device))
        decode = None
        if _pads(count, lambda: max(starts) + 1, device):
            decode = _gather(every_row(count, device), padded, int64_tensor(lengths, device), max(starts) + 1,
                             page_size, device, every=not rest)
        return cls(
            input_ids=int64_tensor(ids + r.ids, device),
            positions=int64_tensor(positions + r.positions, device),
            kv_pages=int64_tensor(kv_pages + r.pages, device),
            kv_offsets=int64_tensor(kv_offsets + r.offsets, device),
            seqs=_Joined(views, others),
            logits_rows=int64_tensor(array("q", range(count)) + r.rows, device),
            logits_counts=(1,) * count + tuple(r.counts),
            decodes=views,
            others=others,
            decode=decode,
            decode_slots=views.slots,
            media=r.batch_media(device),
        )


@dataclass(slots=True)
class _ChunkRows:
    """The flat token run's host lists for `chunks`, their rows counted from `base`."""

    ids: array
    positions: array
    pages: array
    offsets: array
    rows: array  # the logits rows
    counts: list[int]  # logits rows per chunk
    views: list[tuple[int, int, int, int | None]]  # (offset, length, start, slot) of each sequence
    tables: list[Sequence[int]]  # the pages each sequence's positions need
    flat: array  # every sequence's page table, one after another
    decoding: list[int]  # indices of the single-token decodes
    media: list[tuple[int, ChunkMedia]] | None = None  # (first row, media) of the chunks with images

    def batch_media(self, device: torch.device) -> BatchMedia | None:
        """The step's image rows, when a chunk has any."""
        if not self.media:
            return None
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        for at, media in self.media:
            if media.rope_rows:
                rows.extend(at + row for row in media.rope_rows)
                embeds.extend(e for _, e in media.embeds)
                positions.append(media.rope_positions)
        return BatchMedia.of(rows, embeds, positions, device) if rows else None

    @classmethod
    def of(cls, chunks: Sequence[SequenceChunk], page_size: int, base: int) -> _ChunkRows:
        ids, positions, pages, offsets, rows = array("q"), array("q"), array("q"), array("q"), array("q")
        counts: list[int] = []
        views: list[tuple[int, int, int, int | None]] = []
        tables: list[Sequence[int]] = []
        decoding: list[int] = []
        flat = array("q")
        media: list[tuple[int, ChunkMedia]] | None = None
        for i, chunk in enumerate(chunks):
            table, start = chunk.page_table, chunk.start
            n = len(chunk.token_ids)
            end = start + n
            needed = -(-end // page_size)
            if len(table) < needed:
                raise ValueError(f"page table has {len(table)} pages but {end} tokens need {needed}")
            at = base + len(ids)
            if chunk.media is not None:
                media = media or []
                media.append((at, chunk.media))
            if n == 1:  # a decode (most of a step's sequences): no range or generator for one position
                ids.append(chunk.token_ids[0])
                positions.append(chunk.media.positions[0] if chunk.media is not None else start + chunk.shift)
                pages.append(table[start // page_size])
                offsets.append(start % page_size)
                if start > 0:
                    decoding.append(i)
            else:
                ids.extend(chunk.token_ids)
                pos = range(start, end)
                if chunk.media is not None:
                    positions.extend(chunk.media.positions)
                else:
                    positions.extend(range(start + chunk.shift, end + chunk.shift) if chunk.shift else pos)
                pages.extend(table[p // page_size] for p in pos)
                offsets.extend(p % page_size for p in pos)
            if chunk.logits is LogitsWanted.LAST:
                rows.append(at + n - 1)
                counts.append(1)
            elif chunk.logits is LogitsWanted.ALL:
                rows.extend(range(at, at + n))
                counts.append(n)
            elif chunk.logits is LogitsWanted.TAIL:
                rows.extend(range(at + n - chunk.tail, at + n))
                counts.append(chunk.tail)
            else:
                counts.append(0)
            views.append((at, n, start, chunk.state_slot))
            needed_table = table if len(table) == needed else table[:needed]  # no copy when it is all needed
            tables.append(needed_table)
            flat.extend(needed_table)
        return cls(ids, positions, pages, offsets, rows, counts, views, tables, flat, decoding, media)


class _Joined(_LazyViews):
    """A mixed batch's views: the decodes' (made when asked), then the rest's."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: Sequence[SeqView], second: Sequence[SeqView]) -> None:
        self._first, self._second = first, second

    def __len__(self) -> int:
        return len(self._first) + len(self._second)

    def _view(self, i: int) -> SeqView:
        n = len(self._first)
        return self._first[i] if i < n else self._second[i - n]


def _decode_rows(tokens: list[int], starts: list[int], tables: Sequence[Sequence[int]], slots: list[int | None],
                 page_size: int, device: torch.device, shifts: Sequence[int] | None = None
                 ) -> tuple[DecodeViews, torch.Tensor, array]:
    """Single-token decodes' part of a batch: their views, their page tables padded to [B, W], and the host
    buffer of their rows (decode_values). Raises ValueError for a table shorter than its need."""
    needed = [start // page_size + 1 for start in starts]
    padded = pad_tables(tables, needed, max(needed), device)
    last_pages = [table[n - 1] for table, n in zip(tables, needed)]  # pad_tables checked their lengths
    values, _ = decode_values(tokens, starts, last_pages, [start % page_size for start in starts], shifts)
    return DecodeViews(starts, needed, tuple(slots), padded, padded.shape[1]), padded, values


def decode_values(tokens: Sequence[int], starts: Sequence[int], last_pages: Sequence[int],
                  offsets: Sequence[int], shifts: Sequence[int] | None = None) -> tuple[array, list[int]]:
    """What a decode batch needs from the host, in one buffer for one copy: the ids, positions (each start
    plus its shift, where there are shifts), the pages and offsets the new K/V go to, and the context
    lengths (returned too: the next step's starts)."""
    lengths = [start + 1 for start in starts]
    values = array("q", tokens)
    values.extend(starts if shifts is None else map(operator.add, starts, shifts))
    values.extend(last_pages)
    values.extend(offsets)
    values.extend(lengths)
    return values, lengths


def decode_only_batch(rows: torch.Tensor, views: DecodeViews, padded: torch.Tensor, page_size: int,
                      device: torch.device) -> ForwardBatch:
    """A decode-only ForwardBatch from its parts: rows [5, B] (ids, positions, K/V pages, K/V offsets,
    context lengths), the sequences' views, and the page tables padded to [B, W] (W at least the
    widest's need)."""
    count = rows.shape[1]
    ids, positions, kv_pages, kv_offsets, lengths = rows.unbind(0)  # one call for the five rows
    every = every_row(count, device)  # the logits rows and decode rows: all of them
    decode = None
    if kernels_for(device).paged_decode_from_table is not None or _pads(count, lambda: views.furthest + 1, device):
        decode = _gather(every, padded, lengths, views.furthest + 1, page_size, device, every=True)
    return ForwardBatch(
        input_ids=ids, positions=positions, kv_pages=kv_pages, kv_offsets=kv_offsets, seqs=views,
        logits_rows=every, logits_counts=(1,) * count, decodes=views, others=(), decode=decode,
        decodes_only=True, decode_slots=views.slots,
    )


def with_views(batch: ForwardBatch, views: DecodeViews) -> ForwardBatch:
    """`batch` (decode-only) with the tensors it holds, for sequences seen through `views`: a kept batch whose
    rows were written in place (engine/model/kept_decodes.py)."""
    return ForwardBatch(
        input_ids=batch.input_ids, positions=batch.positions, kv_pages=batch.kv_pages, kv_offsets=batch.kv_offsets,
        seqs=views, logits_rows=batch.logits_rows, logits_counts=batch.logits_counts, decodes=views, others=(),
        decode=batch.decode, decodes_only=True, decode_slots=views.slots,
    )


def pad_tables(tables: Sequence[Sequence[int]], needed: Sequence[int], widest: int,
               device: torch.device) -> torch.Tensor:
    """[B, widest] int64, row i tables[i][:needed[i]] then zeros, from one buffer and one copy (a row
    assignment per sequence was ~3 µs each). Raises ValueError for a table shorter than its need."""
    values = array("q")
    for table, n in zip(tables, needed):
        if len(table) < n:
            raise ValueError(f"page table has {len(table)} pages but its tokens need {n}")
        values.extend(table if len(table) == n else table[:n])
        if n < widest:
            values.extend(zero_pages(widest - n))
    host = torch.frombuffer(values, dtype=torch.int64).view(len(needed), widest)
    return host if device.type == "cpu" else host.to(device)


def _seq_views(views: Sequence[tuple[int, int, int, int | None]], tables: Sequence[Sequence[int]],
               flat: array, device: torch.device) -> list[SeqView]:
    """Each sequence's view, from its (offset, length, start, slot) and page table; every page table is a
    slice of one tensor of `flat` (the tables one after another): one host-to-device copy, not one each."""
    pages = int64_tensor(flat, device)
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


def _pad_decodes(decodes: Sequence[SeqView], device: torch.device) -> bool:
    """Whether this step's single-token decodes run as one padded attention call."""
    return bool(decodes) and _pads(len(decodes), lambda: max(s.end for s in decodes), device)


def _pads(count: int, furthest_end: Callable[[], int], device: torch.device) -> bool:
    """_pad_decodes for `count` decodes (at least one); `furthest_end()`: where the furthest ends (asked
    only when it matters)."""
    if kernels_for(device).decode_in_place:  # the C kernel on the CPU: no cost per padded position
        return True
    if count < 2:
        return False
    return device.type != "cpu" or furthest_end() < CPU_PADDED_DECODE_MAX_CONTEXT


def _decode_gather(seqs: list[SeqView], tables: list[Sequence[int]], page_size: int, device: torch.device,
                   total_rows: int) -> DecodeGather:
    """The gather of a step's single-token decodes; `tables`: each one's page table, sliced to the pages its
    positions need."""
    offsets = [s.offset for s in seqs]
    needed = [len(t) for t in tables]
    ends = [s.end for s in seqs]
    return _gather(int64_tensor(offsets, device), pad_tables(tables, needed, max(needed), device),
                   int64_tensor(ends, device), max(ends), page_size, device, every=offsets == list(range(total_rows)))


def _gather(rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, furthest_end: int, page_size: int,
            device: torch.device, every: bool) -> DecodeGather:
    """The gather of decodes at `rows` of the run, from their page tables padded to [B, W] and their context
    lengths: the tables as they are where the kernels read them, else [B, L] pages/offsets/valid."""
    if kernels_for(device).paged_decode_from_table is not None:  # attention reads the tables as they are
        return DecodeGather(rows=rows, pages=None, offsets=None, valid=None, every_row=every, table=table,
                            lengths=lengths, page_size=page_size)
    positions, page_of, offset_of = _position_tables(furthest_end, page_size, device)
    return DecodeGather(rows=rows, pages=table[:, page_of], offsets=offset_of.expand(table.shape[0], -1),
                        valid=positions[None, :] < lengths[:, None], every_row=every)


_ZERO_PAGES = array("q", bytes(8 * 4096))  # padding for page tables


def zero_pages(count: int) -> array:
    return _ZERO_PAGES[:count] if count <= len(_ZERO_PAGES) else array("q", bytes(8 * count))


def int64_tensor(values: Sequence[int] | array, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.int64, device=device)`, 4-5x faster for a list of ints: the
    list goes into an `array` (the tensor shares its memory) instead of through torch's element loop."""
    buffer = values if isinstance(values, array) else array("q", values)
    if not buffer:
        return torch.empty(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(buffer, dtype=torch.int64)
    return host if device.type == "cpu" else host.to(device)


_EVERY_ROW: dict[tuple[torch.device, int], torch.Tensor] = {}


def every_row(count: int, device: torch.device) -> torch.Tensor:
    """arange(count) as int64 on `device`, kept per count (a decode batch's logits and decode rows: one
    slice a step fewer; the counts are batch sizes, at most max_num_seqs of them)."""
    key = (device, count)
    rows = _EVERY_ROW.get(key)
    if rows is None:
        rows = _EVERY_ROW[key] = torch.arange(count, dtype=torch.int64, device=device)
    return rows


_POSITIONS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _position_tables(length: int, page_size: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(arange(length), the page index and the offset inside the page of each position), sliced from
    tables kept per device and page size and grown by doubling: three torch calls a step fewer."""
    key = (device, page_size)
    tables = _POSITIONS.get(key)
    if tables is None or tables[0].shape[0] < length:
        size = max(length, 2 * tables[0].shape[0] if tables is not None else 1024)
        positions = torch.arange(size, dtype=torch.int64, device=device)
        tables = (positions, positions // page_size, positions % page_size)
        _POSITIONS[key] = tables
    return tables[0][:length], tables[1][:length], tables[2][:length]
