"""The engine's integrity tag on state it writes below the device.

The tierstore keeps its own xxh3 checksum against corruption, but a checksum any
process can recompute proves nothing against a local attacker who can write the
arena or the blob files. Every state the engine spills is tagged with a MAC over
its name, namespace, length and bytes, with a key only the engine holds (a 0600
file in a 0700 folder, made on first start); a restore whose tag does not verify
is refused and the state is served cold. Forged, swapped or zeroed bytes are never
served, whatever the store says.

The MAC is AES-256-GMAC (GCM over associated data only; OpenSSL, through the
`cryptography` package, which lets go of the GIL while it hashes: halves of 128 MiB
on two threads take about half the time of the whole on one), chosen by measurement
over the keyed BLAKE3 it replaced:
on this project's 2-core host it runs at 18 GB/s on one core against BLAKE3's 6 GB/s
on one and 12 GB/s on both (150 MiB: 8.6 ms against 26.7 and 13.4 ms), and beside a
decode step it slows the step far less than BLAKE3's threads do (bench notes in issue
18). GMAC needs a fresh key or nonce per tag: each tag carries a random 16-byte nonce,
and its MAC key is the keyed BLAKE3 of that nonce under the engine's key, used once.

A state is MACed in segments of SEGMENT_BYTES, each under that key with its index as
the IV, and the tag's MAC is the GMAC of the header and the segments' MACs in order
(IV all ones): segments can be fed on several threads at once, each right after its
copy (engine/tiers/checked_copy.py). A tag is nonce || MAC (32 bytes).
"""

from __future__ import annotations

import ctypes
import hmac
import os
import secrets
from pathlib import Path

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from common.private_files import open_to_others

KEY_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 16
TAG_BYTES = NONCE_BYTES + MAC_BYTES
SEGMENT_BYTES = 4 << 20
_KEY_LABEL = b"ignis state tag key, AES-256-GMAC in 4 MiB segments, v3"
_TAG_IV = b"\xff" * 12  # the tag's own MAC; segment i's IV is i, big-endian (never all ones)


class Gmac:
    """One AES-256-GMAC: fed bytes in order (`update`, or `update_at` memory by address), then `mac`."""

    __slots__ = ("_gcm", "_mac")

    def __init__(self, key: bytes, iv: bytes) -> None:
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()
        self._mac: bytes | None = None

    def update(self, data: memoryview | bytes) -> None:
        self._gcm.authenticate_additional_data(data)

    def update_at(self, address: int, nbytes: int) -> None:
        """Feed the `nbytes` bytes at `address` (host memory the caller keeps alive for the call)."""
        if nbytes > 0:
            self.update(memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B"))

    def mac(self) -> bytes:
        if self._mac is None:
            self._gcm.finalize()
            self._mac = self._gcm.tag
        return self._mac


class StateMac:
    """One tag's MAC. Fed in order with `update`, or segment by segment in any order and on any thread
    (`segment(i)`, fed segment i's bytes, then `put(i, its mac())`); then `digest` (the tag; idempotent)."""

    __slots__ = ("_key", "_nonce", "_header", "_macs", "_open", "_fed", "_digest")

    def __init__(self, mac_key: bytes, nonce: bytes, header: bytes) -> None:
        self._key = mac_key
        self._nonce = nonce
        self._header = header
        self._macs: dict[int, bytes] = {}  # segment index -> its MAC
        self._open: Gmac | None = None  # the segment `update` is feeding
        self._fed = 0  # bytes `update` has fed
        self._digest: bytes | None = None

    def segment(self, index: int) -> Gmac:
        """A fresh MAC for segment `index` (its bytes: SEGMENT_BYTES from index * SEGMENT_BYTES)."""
        return Gmac(self._key, index.to_bytes(12, "big"))

    def put(self, index: int, mac: bytes) -> None:
        self._macs[index] = mac

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            index, at = divmod(self._fed, SEGMENT_BYTES)
            if self._open is None:
                self._open = self.segment(index)
            take = min(len(view), SEGMENT_BYTES - at)
            self._open.update(view[:take])
            view = view[take:]
            self._fed += take
            if at + take == SEGMENT_BYTES:
                self.put(index, self._open.mac())
                self._open = None

    def digest(self) -> bytes:
        if self._digest is None:
            if self._open is not None:
                self.put(self._fed // SEGMENT_BYTES, self._open.mac())
                self._open = None
            if sorted(self._macs) != list(range(len(self._macs))):
                raise RuntimeError(f"segments {sorted(self._macs)} were fed, not each from the first: this is a bug")
            mac = Gmac(self._key, _TAG_IV)
            mac.update(self._header + b"".join(self._macs[i] for i in range(len(self._macs))))
            self._digest = self._nonce + mac.mac()
        return self._digest


class IntegrityKey:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"an integrity key is {KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    @classmethod
    def ephemeral(cls) -> IntegrityKey:
        """A key for this process only: what it writes, only it can read back."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_file(cls, path: str | Path) -> IntegrityKey:
        """Read the key, creating the file (0600, folder 0700) with a random key if it is missing,
        so states on disk stay readable across engine restarts.

        The file is refused when others may read it (common/private_files.py: only its owner may, except
        that a root-owned file may also be group-readable, as Kubernetes mounts a Secret for a pod with an
        fsGroup; the file exists there, so nothing is created on that read-only mount)."""
        path = Path(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
        st = path.stat()
        if open_to_others(st):
            raise PermissionError(f"the integrity key {path} is open to others (mode {st.st_mode & 0o777:o}): "
                                  "chmod 600 it (group read only on a file root owns, e.g. a Kubernetes Secret's)")
        return cls(path.read_bytes())

    def hasher(self, name: bytes, namespace: bytes, tokens: int, nbytes: int, tag: bytes | None = None) -> StateMac:
        """The tag's MAC, its header fed: update it with the state's `nbytes` bytes, in order. To check
        a stored `tag`, pass it: the MAC takes its nonce (a new tag gets a fresh one)."""
        nonce = tag[:NONCE_BYTES] if tag is not None and len(tag) == TAG_BYTES else secrets.token_bytes(NONCE_BYTES)
        mac_key = blake3.blake3(_KEY_LABEL + nonce, key=self._key).digest()
        return StateMac(mac_key, nonce, name + namespace + tokens.to_bytes(8, "little") + nbytes.to_bytes(8, "little"))

    def tag(self, name: bytes, namespace: bytes, tokens: int, data: memoryview | bytes) -> bytes:
        mac = self.hasher(name, namespace, tokens, len(data))
        mac.update(data)
        return mac.digest()

    @staticmethod
    def matches(tag: bytes, mac: StateMac) -> bool:
        """Whether a MAC fed the whole state (from `hasher(..., tag)`) gives `tag`."""
        return len(tag) == TAG_BYTES and hmac.compare_digest(tag, mac.digest())
