"""The published table's bytes: what KV-RAM holds, in a shared-memory file the tierstore writes
and engines on its host map read-only (protos/ignis/v1/tierstore.proto, "published table").

Both ends use this layout: the store (tierstore/published_table.py) and the engine
(engine/tiers/published_table.py). They meet only here and in the protos, as the Match socket's
two ends meet in common/frames.py.

The file is a 4 KiB header, then three regions, each 64-byte aligned:

- **states**: one slot per state in KV-RAM, keyed by its name: its extent's offset, its stored
  nbytes, tokens, kind, namespace and engine_tag (what a restore checks, as Acquire answers);
- **pages**: one slot per page hash of the attention-only ("sliceable") states in KV-RAM: which
  of them holds it as a page-aligned prefix (the smallest, as Match picks), how many tokens that
  prefix covers and that state's nbytes;
- **filter**: three counting filters side by side (FILTER_COLUMNS counters per index, one per
  filter), over the same indices of a key: RAM (the key has a slot in states or pages),
  ELSEWHERE (a state *not* in KV-RAM answers the key, as its name or one of its pages: a Match
  would list it as a disk hit) and ANCHORED (some state, any tier, ends mid-page right after this
  page: a Match would list it as an anchored candidate). A prompt's page hashes are looked up in
  the filter all at once (one gather), and only the few it says "maybe" for are looked up in
  the hash tables, one by one.

Both hash tables are open addressing with bounded linear probing: a key lies within PROBE
slots of its home slot (its low 64 bits modulo the capacity), so a lookup reads that window
and nothing else, and a removal just empties its slot (no tombstones). A key that finds no
free slot in its window is not published; the header counts such keys (`unpublished`), and
while any is counted the absence of a key proves nothing. Each slot starts with its sequence
number (a seqlock): odd while the store writes the slot, so a reader reads it, the slot, and
it again, and uses the slot only if the two are equal and even. The filters have no seqlock:
a counter read mid-update is at worst a false "maybe", or misses a state arriving right now.
A counter that reaches 255 stays there (never decremented: it may stand for more).

All integers are little-endian. A slot holds its key (an xxh3_128 chain hash) as its 16 bytes,
packed as two u64s (bytes 0-7 low, 8-15 high); the low one picks the home slot, and bytes 4-15,
as three u32s, the filter's indices.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"IGNPTAB1"
VERSION = 1
HEADER_BYTES = 4096
PROBE = 16  # a key lies in one of the PROBE slots from its home slot on
FILTER_HASHES = 3  # indices per key in the filter: the key's u32 words 1, 2 and 3, each modulo its size
FILTER_COLUMNS = 3  # the counters at each index: RAM, ELSEWHERE, ANCHORED
RAM, ELSEWHERE, ANCHORED = range(FILTER_COLUMNS)
SATURATED = 255

# magic, version, states capacity, pages capacity, filter indices, probe, filter columns,
# epoch (the instance's, nonzero while the store serves the table; 0 once it closed it),
# unpublished keys (both tables), instance id (ASCII, NUL-padded).
HEADER = struct.Struct("<8sIIIIIIQQ32s")
EPOCH_OFFSET = 32
UNPUBLISHED_OFFSET = 40

# The slots after their sequence number (u64 at offset 0). A `used` of 0 is an empty slot.
STATE_BODY = struct.Struct("<QQIIQQII16s64s")  # key lo, key hi, used, kind, offset, nbytes, tokens, tag length, namespace, tag
PAGE_BODY = struct.Struct("<QQII16sQ")  # key lo, key hi, used, prefix tokens, holder's name, holder's nbytes
STATE_SLOT_BYTES = 8 + STATE_BODY.size  # 136
PAGE_SLOT_BYTES = 8 + PAGE_BODY.size  # 56
MAX_TAG = 64




def _align(n: int) -> int:
    return -(-n // 64) * 64


def _pow2(n: int, low: int, high: int) -> int:
    return max(low, min(high, 1 << max(0, int(n) - 1).bit_length()))


@dataclass(frozen=True, slots=True)
class StateRecord:
    """A state in KV-RAM as a restore needs it (what Acquire would answer): a states slot's body."""

    offset: int
    nbytes: int
    tokens: int
    kind: int
    namespace: bytes
    engine_tag: bytes


@dataclass(frozen=True, slots=True)
class PageRecord:
    """A page hash of a sliceable state in KV-RAM: that state (`holder`) holds it as the prefix of `tokens`."""

    holder: bytes
    tokens: int
    nbytes: int  # the holder's


@dataclass(frozen=True, slots=True)
class Geometry:
    """The table's sizes (powers of two) and where each region starts."""

    states: int
    pages: int
    filter: int  # indices of the filter (each FILTER_COLUMNS counters)

    @classmethod
    def for_tiers(cls, arena_bytes: int, disk_bytes: int) -> Geometry:
        """Room for four times the keys the tiers hold with states of 256 KiB and pages of 64 KiB (a page of
        a real model is 1-2 MiB): a state slot per 64 KiB of arena, a page slot per 16 KiB, and 4 filter
        indices per 64 KiB of either tier (about 6% false "maybe"s when full). 7 MiB for a 1 GiB arena
        and a 4 GiB disk; capped at 21 MiB. Smaller states and pages only send more lookups to Match."""
        return cls(states=_pow2(4 * arena_bytes // (256 << 10), 1024, 1 << 16),
                   pages=_pow2(4 * arena_bytes // (64 << 10), 4096, 1 << 17),
                   filter=_pow2(4 * (arena_bytes + disk_bytes) // (64 << 10), 1 << 15, 1 << 21))

    @property
    def states_at(self) -> int:
        return HEADER_BYTES

    @property
    def pages_at(self) -> int:
        return _align(self.states_at + self.states * STATE_SLOT_BYTES)

    @property
    def filter_at(self) -> int:
        return _align(self.pages_at + self.pages * PAGE_SLOT_BYTES)

    @property
    def nbytes(self) -> int:
        return -(-(self.filter_at + self.filter * FILTER_COLUMNS) // 4096) * 4096

    def check(self) -> None:
        for name in ("states", "pages", "filter"):
            size = getattr(self, name)
            if size < PROBE or size & (size - 1):
                raise ValueError(f"the published table's {name} size {size} is not a power of two >= {PROBE}")


def header_bytes(geometry: Geometry, epoch: int, unpublished: int, instance_id: str) -> bytes:
    return HEADER.pack(MAGIC, VERSION, geometry.states, geometry.pages, geometry.filter, PROBE, FILTER_COLUMNS,
                       epoch, unpublished, instance_id.encode()[:32])


def epoch_of(instance_id: str) -> int:
    """The epoch a table of `instance_id` carries while open: nonzero, and another instance's differs."""
    try:
        value = int(instance_id[:16], 16)
    except ValueError:
        value = int.from_bytes(instance_id.encode()[:8].ljust(8, b"\0"), "little")
    return value | 1


def key_words(key: bytes) -> tuple[int, int]:
    """(low, high) u64s of a 16-byte key."""
    lo, hi = struct.unpack("<QQ", key)
    return lo, hi


def home(key_lo: int, capacity: int) -> int:
    return key_lo & (capacity - 1)


def filter_indices(key: bytes, size: int) -> tuple[int, ...]:
    """The indices of `key` in a filter of `size` indices (a power of two)."""
    words = struct.unpack("<IIII", key)
    return tuple(words[1 + i] & (size - 1) for i in range(FILTER_HASHES))


def filter_indices_many(keys: np.ndarray, size: int) -> np.ndarray:
    """`filter_indices` of each row of `keys` (uint8 [n, 16]): [n, FILTER_HASHES]."""
    return keys.view("<u4").reshape(-1, 4)[:, 1:1 + FILTER_HASHES] & np.uint32(size - 1)
