"""The reuse key: a hash chain over tokens, 16-byte xxh3-128 at every page boundary.

    h0  = xxh3_128(namespace)
    h_i = xxh3_128(h_{i-1} || tokens of page i as little-endian uint32)
    a state ending at n is named h_{n/P} when n is page-aligned, else xxh3_128(h_{n//P} || tail tokens)

The namespace covers everything that makes state incompatible: model identity
(config and weights), KV dtype, page size, the tenant's cache_salt, and the LoRA
adapter the state was computed with (its digest: engine/lora/adapter.py). An image is in
the chain through its span's key ids, drawn from its digest (engine/vision/media.py).
"""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from common.state_hash import StateHash
from kernels.cpu import chain_hash as c_chain



@dataclass(frozen=True, slots=True)
class Namespace:
    model_fingerprint: bytes
    kv_dtype: str
    page_size: int
    cache_salt: str = ""
    drafter: str = ""  # what else a page holds ("mtp1": the MTP layer's K/V); "" keeps the roots as they were
    adapter: bytes = b""  # the LoRA adapter's digest; b"": the base model (its roots as they were)

    def digest(self) -> StateHash:
        """h0, the root of every chain in this namespace."""
        fields: list[object] = [self.model_fingerprint.hex(), self.kv_dtype, self.page_size, self.cache_salt]
        if self.drafter:
            fields.append(self.drafter)
        if self.adapter:
            fields.append({"lora": self.adapter.hex()})  # an object: never equal to a drafter's string
        payload = json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogatepass")
        return StateHash(xxhash.xxh3_128_digest(payload))


def model_fingerprint(config_fields: dict[str, object], weights_digest: bytes) -> bytes:
    payload = json.dumps(config_fields, sort_keys=True, default=str).encode() + weights_digest
    return xxhash.xxh3_128_digest(payload)


_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)
# Ids at or above this are an image's key ids (engine/vision/media.py): its content in the chain, in place of
# its placeholder tokens. No vocabulary reaches them.
MEDIA_KEY_BASE = 1 << 31


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Explicit little-endian uint32, never numpy's platform default integer. From a list the
    stdlib array is twice as fast as numpy's conversion (7 vs 15 ns a token): the hash
    chain's cost is mostly this conversion."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype("<u4", copy=False).tobytes()
    packed = array(_UINT32, tokens)  # OverflowError for an id outside uint32 (validated before)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def chain(parent: StateHash, page_tokens: bytes) -> StateHash:
    return StateHash(xxhash.xxh3_128_digest(parent + page_tokens))


# The chain in one C call (kernels/cpu/chain_hash.c); None without the built library.
_C_PAGES = c_chain.load()
_C_FROM_PAGES = 4  # below this, the call's fixed cost is more than the Python loop's


def page_hashes(namespace: StateHash, tokens: Sequence[int], page_size: int, start: int = 0,
                parent: StateHash | None = None) -> list[StateHash]:
    """Hashes of the full pages of `tokens` from page index `start` on (parent = hash before it)."""
    width = 4 * page_size
    h = namespace if parent is None else parent
    end = len(tokens) // page_size
    raw = token_bytes(tokens[start * page_size : end * page_size] if start else tokens)
    if _C_PAGES is not None and end - start >= _C_FROM_PAGES:
        hashes = _C_PAGES(h, raw[: (end - start) * width], page_size)
        if hashes is not None:
            return hashes  # type: ignore[return-value]  # StateHash is bytes
    return python_page_hashes(h, raw, page_size)


def python_page_hashes(parent: StateHash, raw: bytes, page_size: int) -> list[StateHash]:
    """The chain over the full pages of `raw` (little-endian uint32 ids) in Python: the C kernel's
    oracle, and what runs without it."""
    width = 4 * page_size
    h, out = parent, []
    for i in range(len(raw) // width):
        h = chain(h, raw[i * width : (i + 1) * width])
        out.append(h)
    return out


def extend_page_hashes(namespace: StateHash, hashes: list[StateHash], tokens: Sequence[int], num_tokens: int,
                       page_size: int) -> None:
    """Grow `hashes` in place to cover the full pages of tokens[:num_tokens] (generated tokens)."""
    full = num_tokens // page_size
    have = len(hashes)
    if full > have:
        hashes.extend(page_hashes(namespace, tokens[: full * page_size], page_size, start=have,
                                  parent=hashes[-1] if have else None))


def common_pages(a: Sequence[StateHash], b: Sequence[StateHash], limit: int) -> int:
    """How many leading pages two chains share (at most `limit`). A page's hash covers every
    page before it, so equality is monotone: bisect for the last equal one."""
    lo, hi = 0, min(limit, len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def state_name(namespace: StateHash, hashes: Sequence[StateHash], tokens: Sequence[int], n: int,
               page_size: int) -> StateHash:
    """The name of the state after the first n tokens, given the page hashes of `tokens`."""
    full = n // page_size
    base = namespace if full == 0 else hashes[full - 1]
    if n % page_size == 0:
        return base
    return StateHash(xxhash.xxh3_128_digest(base + token_bytes(tokens[full * page_size : n])))


def state_matches(name: bytes, num_tokens: int, namespace: StateHash, hashes: Sequence[StateHash],
                  tokens: Sequence[int], page_size: int) -> bool:
    """Whether a state of `num_tokens` named `name` is the state of these tokens' first
    `num_tokens`: the one test before any retained state is claimed."""
    if num_tokens > len(tokens) or num_tokens // page_size > len(hashes):
        return False
    return name == state_name(namespace, hashes, tokens, num_tokens, page_size)
