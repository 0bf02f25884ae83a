"""The engine's integrity tag (engine/tiers/integrity.py): AES-256-GMAC in segments under a key derived per tag.

What a restore trusts: a tag verifies only for the bytes, name, namespace and token count it
was made over, under the key that made it, however the bytes are fed; anything else changed,
the tag, the key or one byte, and it does not."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from engine.tiers.integrity import NONCE_BYTES, SEGMENT_BYTES, TAG_BYTES, Gmac, IntegrityKey

NAME, NAMESPACE, TOKENS = b"n" * 16, b"s" * 16, 48


def verifies(key: IntegrityKey, tag: bytes, name: bytes, namespace: bytes, tokens: int,
             data: memoryview | bytes) -> bool:
    """A restore's check, over bytes given whole: the MAC of `tag`'s nonce fed `data` gives `tag`."""
    mac = key.hasher(name, namespace, tokens, len(data), tag)
    mac.update(data)
    return key.matches(tag, mac)


def data_of(n: int, seed: int = 0) -> bytes:
    return (blake3.blake3(seed.to_bytes(4, "little")).digest(length=n) if n else b"")


def test_a_tag_verifies_only_what_it_was_made_over() -> None:
    key = IntegrityKey.ephemeral()
    data = data_of(2 * SEGMENT_BYTES + 5)  # several segments and a ragged end
    tag = key.tag(NAME, NAMESPACE, TOKENS, data)
    assert len(tag) == TAG_BYTES
    assert verifies(key, tag, NAME, NAMESPACE, TOKENS, data)
    assert verifies(key, tag, NAME, NAMESPACE, TOKENS, memoryview(data))
    flipped = bytearray(data)
    for at in (0, SEGMENT_BYTES - 1, SEGMENT_BYTES, len(data) - 1):  # a byte anywhere, at a segment's edges too
        flipped[at] ^= 1
        assert not verifies(key, tag, NAME, NAMESPACE, TOKENS, bytes(flipped))
        flipped[at] ^= 1
    assert not verifies(key, tag, b"m" * 16, NAMESPACE, TOKENS, data)
    assert not verifies(key, tag, NAME, b"t" * 16, TOKENS, data)
    assert not verifies(key, tag, NAME, NAMESPACE, TOKENS + 1, data)
    assert not verifies(key, tag, NAME, NAMESPACE, TOKENS, data[:-1])  # the length is in the header
    assert not verifies(key, tag, NAME, NAMESPACE, TOKENS, data + b"\0")
    assert not verifies(IntegrityKey.ephemeral(), tag, NAME, NAMESPACE, TOKENS, data)


def test_a_changed_or_cut_tag_is_refused() -> None:
    key = IntegrityKey.ephemeral()
    data = data_of(4096)
    tag = key.tag(NAME, NAMESPACE, TOKENS, data)
    for at in (0, NONCE_BYTES - 1, NONCE_BYTES, TAG_BYTES - 1):  # the nonce's bytes and the MAC's
        forged = bytearray(tag)
        forged[at] ^= 0x80
        assert not verifies(key, bytes(forged), NAME, NAMESPACE, TOKENS, data)
    assert not verifies(key, tag[:-1], NAME, NAMESPACE, TOKENS, data)
    assert not verifies(key, tag + b"\0", NAME, NAMESPACE, TOKENS, data)
    assert not verifies(key, b"", NAME, NAMESPACE, TOKENS, data)
    assert not verifies(key, bytes(TAG_BYTES), NAME, NAMESPACE, TOKENS, data)
    # The keyed BLAKE3 tag of earlier versions (32 bytes too) is not a tag: such a state runs cold.
    old = blake3.blake3(NAME + NAMESPACE + TOKENS.to_bytes(8, "little") + len(data).to_bytes(8, "little") + data,
                        key=key._key).digest()
    assert not verifies(key, old, NAME, NAMESPACE, TOKENS, data)


def test_each_tag_has_a_fresh_nonce_and_each_verifies() -> None:
    key = IntegrityKey.ephemeral()
    data = data_of(1000)
    tags = {key.tag(NAME, NAMESPACE, TOKENS, data) for _ in range(16)}
    assert len(tags) == 16 and len({t[:NONCE_BYTES] for t in tags}) == 16
    assert all(verifies(key, t, NAME, NAMESPACE, TOKENS, data) for t in tags)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 2 * SEGMENT_BYTES + 99), cuts=st.lists(st.integers(0, 2 * SEGMENT_BYTES + 99), max_size=6))
def test_fed_in_any_pieces_the_tag_is_the_whole_one(n: int, cuts: list[int]) -> None:
    """A restore feeds its copies piece by piece (engine/tiers/unpacked_tag.py)."""
    key = IntegrityKey(b"k" * 32)
    data = data_of(n, seed=n)
    tag = key.tag(NAME, NAMESPACE, TOKENS, data)
    mac = key.hasher(NAME, NAMESPACE, TOKENS, n, tag)
    edges = [0, *sorted(min(c, n) for c in cuts), n]
    for start, end in zip(edges, edges[1:]):
        mac.update(memoryview(data)[start:end])
    assert IntegrityKey.matches(tag, mac) and mac.digest() == tag  # the digest can be asked twice


def test_segments_fed_in_any_order_give_the_tag_and_each_is_bound_to_its_place() -> None:
    """A claim from KV-RAM feeds segments on several threads in any order (engine/tiers/checked_copy.py);
    swapping two segments' bytes, or leaving one out, is another tag."""
    key = IntegrityKey(b"k" * 32)
    data = memoryview(data_of(3 * SEGMENT_BYTES + 17, seed=3))
    tag = key.tag(NAME, NAMESPACE, TOKENS, data)

    def fed(order: list[int], segment_bytes=lambda i: data[i * SEGMENT_BYTES:(i + 1) * SEGMENT_BYTES]):  # type: ignore[no-untyped-def]
        mac = key.hasher(NAME, NAMESPACE, TOKENS, len(data), tag)
        for i in order:
            one = mac.segment(i)
            one.update(segment_bytes(i))
            mac.put(i, one.mac())
        return mac

    assert IntegrityKey.matches(tag, fed([2, 0, 3, 1]))
    swapped = fed([0, 1, 2, 3], lambda i: data[((1 - i) if i < 2 else i) * SEGMENT_BYTES:][:SEGMENT_BYTES])
    assert not IntegrityKey.matches(tag, swapped)
    with pytest.raises(RuntimeError, match="this is a bug"):  # a segment missing is never a tag
        fed([0, 2, 3]).digest()


def test_the_gmac_gives_a_known_answer_and_takes_memory_by_address() -> None:
    """GCM's test case 13 (McGrew and Viega): AES-256, zero key and IV, nothing fed. Memory fed by address
    (a claim's copies, engine/tiers/checked_copy.py) gives the MAC of the same bytes fed as a buffer."""
    assert Gmac(bytes(32), bytes(12)).mac().hex() == "530f8afbc74536b9a963b4f1c4cb738b"
    data = np.frombuffer(data_of(5000, seed=7), dtype=np.uint8).copy()
    whole, by_address = Gmac(b"k" * 32, b"i" * 12), Gmac(b"k" * 32, b"i" * 12)
    whole.update(data.tobytes())
    for start, end in ((0, 1), (1, 1), (1, 4096), (4096, 5000)):
        by_address.update_at(data.ctypes.data + start, end - start)
    assert by_address.mac() == whole.mac() and whole.mac() == whole.mac()


def test_the_key_file_is_made_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "integrity.key"
    key = IntegrityKey.from_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    data = data_of(777)
    tag = key.tag(NAME, NAMESPACE, TOKENS, data)
    assert verifies(IntegrityKey.from_file(path), tag, NAME, NAMESPACE, TOKENS, data)  # a restart reads it back
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError):
        IntegrityKey.from_file(path)
    with pytest.raises(ValueError):
        IntegrityKey(b"short")


def test_the_tag_format_has_a_known_answer() -> None:
    """The format, written out from its description (engine/tiers/integrity.py) with a fixed key and
    nonce over two segments: MAC key = keyed BLAKE3 of label || nonce; segment i's MAC is AES-256-GMAC
    with IV i; the tag is nonce || GMAC(IV all ones) of the header and the segments' MACs. A change to
    any of it (a label, an IV, the header's layout) fails here and must be made on purpose: it
    invalidates every state already written."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key, nonce = bytes(range(32)), bytes(range(100, 116))
    data = bytes((i * 7 + 3) % 251 for i in range(SEGMENT_BYTES + 5))
    mac = IntegrityKey(key).hasher(NAME, NAMESPACE, TOKENS, len(data), nonce + bytes(16))
    mac.update(data)
    got = mac.digest()
    gmac = AESGCM(blake3.blake3(b"ignis state tag key, AES-256-GMAC in 4 MiB segments, v3" + nonce, key=key).digest())
    segments = [gmac.encrypt(i.to_bytes(12, "big"), b"", data[i * SEGMENT_BYTES:(i + 1) * SEGMENT_BYTES])
                for i in range(2)]
    header = NAME + NAMESPACE + TOKENS.to_bytes(8, "little") + len(data).to_bytes(8, "little")
    assert got == nonce + gmac.encrypt(b"\xff" * 12, b"", header + b"".join(segments))
    assert got.hex() == "6465666768696a6b6c6d6e6f7071727323c9200d29e10b51bb32760140a39494"
