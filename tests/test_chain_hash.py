"""The chain hash against hand-computed values."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.chain_hash import Namespace, page_hashes, state_name, token_bytes


def test_page_hashes_chain_by_hand() -> None:
    seed = Namespace(b"\x01" * 16, "float32", 4).digest()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    h1 = xxhash.xxh3_128_digest(seed + struct.pack("<4I", 1, 2, 3, 4))
    h2 = xxhash.xxh3_128_digest(h1 + struct.pack("<4I", 5, 6, 7, 8))
    hashes = page_hashes(seed, tokens, 4)
    assert hashes == [h1, h2]
    assert all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
    # Aligned state names are page hashes; a tail is hashed onto the last full page.
    assert state_name(seed, hashes, tokens, 8, 4) == h2
    assert state_name(seed, hashes, tokens, 10, 4) == xxhash.xxh3_128_digest(h2 + struct.pack("<2I", 9, 10))
    assert state_name(seed, hashes, tokens, 2, 4) == xxhash.xxh3_128_digest(seed + struct.pack("<2I", 1, 2))
    assert state_name(seed, hashes, tokens, 0, 4) == seed


def test_incremental_hashing_continues_the_chain() -> None:
    seed = Namespace(b"\x02" * 16, "float32", 2).digest()
    tokens = list(range(100, 120))
    whole = page_hashes(seed, tokens, 2)
    head = page_hashes(seed, tokens[:8], 2)
    rest = page_hashes(seed, tokens, 2, start=4, parent=head[-1])
    assert head + rest == whole


def test_namespace_separates_salts_and_geometry() -> None:
    base = Namespace(b"\x03" * 16, "float32", 16)
    seeds = {base.digest(), Namespace(b"\x03" * 16, "float32", 16, "tenant-a").digest(),
             Namespace(b"\x03" * 16, "bfloat16", 16).digest(), Namespace(b"\x03" * 16, "float32", 32).digest(),
             Namespace(b"\x04" * 16, "float32", 16).digest()}
    assert len(seeds) == 5
    tokens = list(range(32))
    assert page_hashes(base.digest(), tokens, 16) != page_hashes(Namespace(b"\x03" * 16, "float32", 16, "x").digest(),
                                                               tokens, 16)


def test_token_encoding_is_uint32_little_endian() -> None:
    seed = Namespace(b"\x05" * 16, "float32", 1).digest()
    big = 70000  # does not fit 16 bits: the encoding must not truncate
    assert page_hashes(seed, [big], 1) == [xxhash.xxh3_128_digest(seed + struct.pack("<I", big))]


def test_common_pages_bisects_the_chain() -> None:
    from engine.kv.chain_hash import common_pages

    seed = b"n" * 16
    a = page_hashes(seed, list(range(40)), 4)  # type: ignore[arg-type]
    for diverge in (0, 1, 5, 9, 10):
        b = page_hashes(seed, list(range(diverge * 4)) + [999] * (40 - diverge * 4), 4)  # type: ignore[arg-type]
        assert common_pages(a, b, 10) == diverge
        assert common_pages(a, b, 3) == min(diverge, 3)
    assert common_pages(a, a[:4], 10) == 4
    assert common_pages(a, [], 10) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=64))
def test_token_bytes_is_the_same_from_a_list_a_tuple_and_an_array(tokens: list[int]) -> None:
    want = struct.pack(f"<{len(tokens)}I", *tokens)
    assert token_bytes(tokens) == token_bytes(tuple(tokens)) == want
    assert token_bytes(np.asarray(tokens, dtype=np.int64)) == want


def test_token_bytes_refuses_ids_outside_uint32() -> None:
    for bad in ([-1], [2**32]):
        with pytest.raises(OverflowError):
            token_bytes(bad)
