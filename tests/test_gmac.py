"""engine/tiers/gmac.py: the GMAC through libcrypto is the GMAC of the `cryptography` package (the oracle),
fed whole, in pieces or by address, and it lets other threads run while it hashes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tiers import gmac as gmac_module
from engine.tiers.gmac import CryptographyGmac, LibcryptoGmac, gmac, releases_the_gil

KEY, IV = bytes(range(32)), bytes(range(12))
needs_libcrypto = pytest.mark.skipif(not releases_the_gil(), reason="libcrypto could not be loaded")


def test_the_engine_uses_libcrypto_here() -> None:
    """Debian ships libcrypto.so.3 (libssl3) with every Python: the engine's GMAC should find it."""
    assert releases_the_gil() and isinstance(gmac(KEY, IV), LibcryptoGmac)


@needs_libcrypto
@settings(max_examples=80, deadline=None)
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=5),
       key=st.binary(min_size=32, max_size=32), iv=st.binary(min_size=12, max_size=12))
def test_libcrypto_gives_cryptographys_mac_however_fed(data: bytes, cuts: list[int], key: bytes, iv: bytes) -> None:
    oracle = CryptographyGmac(key, iv)
    oracle.update(data)
    ours, by_address = LibcryptoGmac(key, iv), LibcryptoGmac(key, iv)
    array = np.frombuffer(data, dtype=np.uint8).copy()
    edges = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    for start, end in zip(edges, edges[1:]):
        ours.update(memoryview(data)[start:end])
        by_address.update_at(array.ctypes.data + start, end - start)
    assert ours.mac() == by_address.mac() == oracle.mac() and ours.mac() == oracle.mac()  # asked twice


@needs_libcrypto
def test_a_known_answer() -> None:
    """GCM's test case 13 of the original specification (McGrew and Viega): AES-256, zero key and IV, no data."""
    empty = LibcryptoGmac(bytes(32), bytes(12))
    assert empty.mac().hex() == "530f8afbc74536b9a963b4f1c4cb738b"


def test_a_finished_mac_takes_no_more_bytes_and_keys_are_checked() -> None:
    mac = gmac(KEY, IV)
    mac.mac()
    if isinstance(mac, LibcryptoGmac):
        with pytest.raises(RuntimeError, match="finished"):
            mac.update(b"x")
    with pytest.raises(ValueError):
        gmac(b"short", IV)
    with pytest.raises(ValueError):
        gmac(KEY, b"short")


@needs_libcrypto
def test_it_lets_another_thread_run_while_it_hashes() -> None:
    """A thread counting in Python gets on while 256 MiB are hashed: libcrypto's calls let go of the GIL
    (the `cryptography` package's hold it). A count, not a timing: the check is that it moved at all."""
    data = np.ones(256 << 20, dtype=np.uint8)
    counted = [0]
    hashing = threading.Event()
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            if hashing.is_set():
                counted[0] += 1
            time.sleep(0)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.01)
        mac = LibcryptoGmac(KEY, IV)
        hashing.set()
        mac.update_at(data.ctypes.data, data.size)  # one call: the GIL is let go for all of it
        hashing.clear()
    finally:
        stop.set()
        counter.join()
    assert counted[0] > 0


def test_without_libcrypto_the_same_mac_comes_from_cryptography(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 40
    whole = gmac(KEY, IV)
    whole.update(data)
    expected = whole.mac()
    monkeypatch.setattr(gmac_module, "_LIB", None)
    fallback = gmac(KEY, IV)
    assert isinstance(fallback, CryptographyGmac) and not gmac_module.releases_the_gil()
    array = np.frombuffer(data, dtype=np.uint8).copy()
    fallback.update_at(array.ctypes.data, 100)
    fallback.update(data[100:])
    assert fallback.mac() == expected
