"""AES-256-GMAC (GCM over associated data only) of one message, from OpenSSL's libcrypto.

The engine's integrity tag (engine/tiers/integrity.py) is made of these. libcrypto is
called through ctypes, which lets go of the GIL for each call: a restore checks its
segments on two threads at once, and a spill's MAC on the copy worker no longer holds
the step thread back (the `cryptography` package's GCM holds the GIL while it runs).
Where libcrypto cannot be loaded, `cryptography` (OpenSSL too) computes the same MAC
under the GIL; tests/test_gmac.py checks that both give the same tags.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32
IV_BYTES = 12
MAC_BYTES = 16
_EVP_CTRL_GCM_GET_TAG = 0x10
_FALLBACK_STEP = 1 << 20  # cryptography holds the GIL per update: another thread waits at most one step


class Gmac(Protocol):
    def update(self, data: memoryview | bytes) -> None: ...
    def update_at(self, address: int, nbytes: int) -> None: ...
    def mac(self) -> bytes: ...


def _load_libcrypto() -> ctypes.CDLL | None:
    for name in (ctypes.util.find_library("crypto"), "libcrypto.so.3"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            lib.EVP_aes_256_gcm  # noqa: B018 - present in every OpenSSL from 1.0.1 on
        except (OSError, AttributeError):
            continue
        lib.EVP_CIPHER_CTX_new.restype = ctypes.c_void_p
        lib.EVP_CIPHER_CTX_new.argtypes = []
        lib.EVP_aes_256_gcm.restype = ctypes.c_void_p
        lib.EVP_aes_256_gcm.argtypes = []
        lib.EVP_EncryptInit_ex.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                           ctypes.c_char_p]
        lib.EVP_EncryptUpdate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                          ctypes.c_void_p, ctypes.c_int]
        lib.EVP_EncryptFinal_ex.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        lib.EVP_CIPHER_CTX_ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.EVP_CIPHER_CTX_free.argtypes = [ctypes.c_void_p]
        lib.EVP_CIPHER_CTX_free.restype = None
        return lib
    return None


_LIB = _load_libcrypto()
_MAX_UPDATE = (1 << 31) - 1  # EVP_EncryptUpdate's length is an int


class LibcryptoGmac:
    """One GMAC through libcrypto's EVP interface; each call lets go of the GIL."""

    __slots__ = ("_ctx", "_outl", "_mac")

    def __init__(self, key: bytes, iv: bytes) -> None:
        self._ctx: int | None = None
        if _LIB is None:
            raise RuntimeError("libcrypto could not be loaded")
        _check_key_iv(key, iv)
        self._ctx = _LIB.EVP_CIPHER_CTX_new()
        if not self._ctx:
            raise MemoryError("EVP_CIPHER_CTX_new failed")
        self._outl = ctypes.c_int()
        self._mac: bytes | None = None
        if _LIB.EVP_EncryptInit_ex(self._ctx, _LIB.EVP_aes_256_gcm(), None, key, iv) != 1:
            self._free()
            raise RuntimeError("EVP_EncryptInit_ex failed for AES-256-GCM")

    def update(self, data: memoryview | bytes) -> None:
        array = np.frombuffer(data, dtype=np.uint8)  # any buffer, read-only too: its address, no copy
        if array.size:
            self.update_at(array.ctypes.data, array.size)

    def update_at(self, address: int, nbytes: int) -> None:
        """Feed the `nbytes` bytes at `address` (memory the caller keeps alive for the call)."""
        if self._mac is not None:
            raise RuntimeError("this GMAC is finished: this is a bug")
        while nbytes > 0:
            step = min(nbytes, _MAX_UPDATE)
            if _LIB.EVP_EncryptUpdate(self._ctx, None, ctypes.byref(self._outl), address, step) != 1:  # type: ignore[union-attr]
                raise RuntimeError("EVP_EncryptUpdate failed")
            address += step
            nbytes -= step

    def mac(self) -> bytes:
        if self._mac is None:
            assert _LIB is not None
            tag = ctypes.create_string_buffer(MAC_BYTES)
            ok = _LIB.EVP_EncryptFinal_ex(self._ctx, tag, ctypes.byref(self._outl)) == 1 and \
                _LIB.EVP_CIPHER_CTX_ctrl(self._ctx, _EVP_CTRL_GCM_GET_TAG, MAC_BYTES, tag) == 1
            self._free()
            if not ok:
                raise RuntimeError("finishing the GMAC failed")
            self._mac = tag.raw
        return self._mac

    def _free(self) -> None:
        if self._ctx:
            _LIB.EVP_CIPHER_CTX_free(self._ctx)  # type: ignore[union-attr]
            self._ctx = None

    def __del__(self) -> None:
        self._free()


class CryptographyGmac:
    """The same MAC from the `cryptography` package, which holds the GIL while it runs."""

    __slots__ = ("_gcm", "_mac")

    def __init__(self, key: bytes, iv: bytes) -> None:
        _check_key_iv(key, iv)
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()
        self._mac: bytes | None = None

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _FALLBACK_STEP):
            self._gcm.authenticate_additional_data(view[start:start + _FALLBACK_STEP])

    def update_at(self, address: int, nbytes: int) -> None:
        if nbytes > 0:
            self.update(memoryview((ctypes.c_char * nbytes).from_address(address)))

    def mac(self) -> bytes:
        if self._mac is None:
            self._gcm.finalize()
            self._mac = self._gcm.tag
        return self._mac


def _check_key_iv(key: bytes, iv: bytes) -> None:
    if len(key) != KEY_BYTES or len(iv) != IV_BYTES:
        raise ValueError(f"AES-256-GMAC takes a {KEY_BYTES}-byte key and a {IV_BYTES}-byte IV")


def gmac(key: bytes, iv: bytes) -> Gmac:
    """A GMAC to feed: libcrypto's (lets go of the GIL) where it loads, else cryptography's."""
    return LibcryptoGmac(key, iv) if _LIB is not None else CryptographyGmac(key, iv)


def releases_the_gil() -> bool:
    return _LIB is not None
