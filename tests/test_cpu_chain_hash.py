"""The hash chain in C (kernels/cpu/chain_hash.c) against the Python loop, its oracle: the same
digests over random ids (all of uint32), page sizes and parents; a page size it does not take; and
that engine.kv.chain_hash.page_hashes takes the C chain for long prompts and gives the same chain."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv import chain_hash
from engine.kv.chain_hash import StateHash, Namespace, page_hashes, python_page_hashes, token_bytes
from kernels.cpu import chain_hash as c_chain
from cpu_kernels import built_kernel


@pytest.fixture(scope="module")
def kernel() -> c_chain.ChainPages:
    return built_kernel(c_chain.load)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300),
       page_size=st.sampled_from([1, 2, 3, 16, 64, 4096]), parent=st.binary(min_size=16, max_size=16))
def test_the_c_chain_is_the_python_chain(kernel: c_chain.ChainPages, tokens: list[int], page_size: int,
                                         parent: bytes) -> None:
    raw = token_bytes(tokens)
    assert kernel(parent, raw, page_size) == python_page_hashes(StateHash(parent), raw, page_size)


def test_a_long_chain_crosses_the_digest_groups(kernel: c_chain.ChainPages) -> None:
    raw = os.urandom(4 * 16 * 1000 + 12)  # 1000 pages of 16 (4 groups of 256 digests minus some) and a tail
    got = kernel(b"\x07" * 16, raw, 16)
    assert got == python_page_hashes(StateHash(b"\x07" * 16), raw, 16)
    assert got is not None and len(got) == 1000 and all(type(h) is bytes and len(h) == 16 for h in got)


def test_a_page_size_it_does_not_take_is_left_to_python(kernel: c_chain.ChainPages) -> None:
    assert kernel(b"\0" * 16, b"\0" * 4 * 8192, 8192) is None
    with pytest.raises(ValueError):
        kernel(b"\0" * 15, b"", 16)
    seed = Namespace(b"\x01" * 16, "float32", 8192).digest()
    tokens = list(range(8192 * 5))
    assert page_hashes(seed, tokens, 8192) == python_page_hashes(seed, token_bytes(tokens), 8192)


def test_page_hashes_takes_the_c_chain_and_agrees_with_python(kernel: c_chain.ChainPages,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    seed = Namespace(b"\x02" * 16, "float32", 16).digest()
    tokens = tuple(range(7, 7 + 16 * 40 + 5))
    calls = []
    monkeypatch.setattr(chain_hash, "_C_PAGES", lambda *a: calls.append(a) or kernel(*a))
    fast = page_hashes(seed, tokens, 16)
    resumed = page_hashes(seed, tokens, 16, start=10, parent=fast[9])
    assert len(calls) == 2
    monkeypatch.setattr(chain_hash, "_C_PAGES", None)
    assert fast == page_hashes(seed, tokens, 16) and len(fast) == 40
    assert resumed == fast[10:]
