"""The engine's integrity tag on state it writes below the device.

The tierstore keeps its own xxh3 checksum against corruption, but a checksum any
process can recompute proves nothing against a local attacker who can write the
arena or the blob files. Every state the engine spills is tagged with a keyed
BLAKE3 over its name, namespace, length and bytes, with a key only the engine
holds (a 0600 file in a 0700 folder, made on first start); a restore whose tag
does not verify is refused and the state is served cold. Forged, swapped or
zeroed bytes are never served, whatever the store says.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import blake3

KEY_BYTES = 32


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
        so states on disk stay readable across engine restarts."""
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
        if path.stat().st_mode & 0o077:
            raise PermissionError(f"the integrity key {path} is readable by others: chmod 600 it")
        return cls(path.read_bytes())

    def hasher(self, name: bytes, namespace: bytes, tokens: int, nbytes: int) -> blake3.blake3:
        """The tag's keyed hash, its header fed: update it with the state's `nbytes` bytes, in order."""
        h = blake3.blake3(key=self._key, max_threads=blake3.blake3.AUTO)
        h.update(name + namespace + tokens.to_bytes(8, "little") + nbytes.to_bytes(8, "little"))
        return h

    def tag(self, name: bytes, namespace: bytes, tokens: int, data: memoryview | bytes) -> bytes:
        h = self.hasher(name, namespace, tokens, len(data))
        h.update(data)
        return h.digest()

    def verify(self, tag: bytes, name: bytes, namespace: bytes, tokens: int, data: memoryview | bytes) -> bool:
        return len(tag) == 32 and hmac.compare_digest(tag, self.tag(name, namespace, tokens, data))

    @staticmethod
    def matches(tag: bytes, hashed: blake3.blake3) -> bool:
        """Whether a hasher fed the whole state (from `hasher`) gives `tag`."""
        return len(tag) == 32 and hmac.compare_digest(tag, hashed.digest())
