"""Stored responses (the Responses API's `store`): one LMDB environment of the engine's own.

The gateway is stateless, so a response's record (its JSON, opaque here) is
kept by the engine that served it, under its id and a scope (a digest of the
client's API key and cache_salt, computed by the gateway). A read with another
scope is a miss, as an unknown id is: another tenant cannot tell it exists.

Bounded two ways: at most `max_stored` records (the oldest go first) and, when
`ttl` > 0, none older than `ttl` seconds (expired ones are dropped as they are
met and, oldest first, on every put). Records sit in creation order in a second
table, so both bounds look at its front only.

The folder is private (0700, its files 0600): records hold conversations. The
engine id (resp_<engine_id>_<hex>) is made on first open and kept in the
folder, so it survives restarts and ids handed out before one still resolve.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb

log = logging.getLogger("ignis.engine")

_HEADER = struct.Struct(">dQH")  # created (Unix s), order sequence, scope length; then scope, record
_SEQ = struct.Struct(">Q")
MAX_SCOPE = 128
MAX_ID = 200
_PUT_TRIES = 4


class StoreError(ValueError):
    """A put that cannot be kept (bad id or scope, a record larger than the store)."""


@dataclass(frozen=True, slots=True)
class StoredRecord:
    scope: str
    created: float
    record: bytes


def private_folder(path: Path) -> None:
    """`path` made (with parents) a folder of this user's alone, mode 0700; another user's is refused."""
    if not path.exists():
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a folder")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                              "stored conversations need a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


class ResponseStore:
    def __init__(self, path: str | os.PathLike[str], max_stored: int = 10000, ttl: float = 0.0,
                 map_size: int = 1 << 30, clock: Callable[[], float] = time.time) -> None:
        if max_stored < 1 or ttl < 0:
            raise ValueError("max_stored must be >= 1 and ttl >= 0")
        self.path = Path(path)
        self.max_stored = max_stored
        self.ttl = ttl
        self._now = clock
        self._map_size = map_size
        private_folder(self.path)
        self._env = lmdb.open(str(self.path), map_size=map_size, max_dbs=3, subdir=True, mode=0o700)
        for file in self.path.iterdir():  # LMDB makes its files with the umask's mode
            if file.is_file() and file.stat().st_mode & 0o777 != 0o600:
                os.chmod(file, 0o600)
        self._records = self._env.open_db(b"records")
        self._order = self._env.open_db(b"order")
        self._meta = meta = self._env.open_db(b"meta")
        self._lock = threading.Lock()  # one writer at a time, and the sequence counter
        with self._env.begin(write=True) as txn:
            engine_id = txn.get(b"engine_id", db=meta)
            if engine_id is None:
                engine_id = secrets.token_hex(6).encode()
                txn.put(b"engine_id", engine_id, db=meta)
            with txn.cursor(db=self._order) as cur:
                self._seq = _SEQ.unpack(cur.key()[:8])[0] + 1 if cur.last() else 0
        self.engine_id = engine_id.decode()

    def close(self) -> None:
        self._env.close()

    def __len__(self) -> int:
        with self._env.begin() as txn:
            return int(txn.stat(self._records)["entries"])

    def put(self, rid: str, scope: str, record: bytes) -> None:
        if not rid or len(rid) > MAX_ID or not scope or len(scope) > MAX_SCOPE:
            raise StoreError(f"a stored response needs an id (at most {MAX_ID} characters) and a scope "
                             f"(at most {MAX_SCOPE})")
        key, scope_b = rid.encode(), scope.encode()
        if len(record) > self._map_size // 2:
            raise StoreError(f"the record ({len(record)} bytes) is larger than half the store's map "
                             f"({self._map_size} bytes)")
        with self._lock:
            # LMDB reuses the pages a commit frees only a commit or two later: shed and retry a few times.
            for _ in range(_PUT_TRIES):
                try:
                    with self._env.begin(write=True) as txn:
                        self._put(txn, key, scope_b, record)
                    return
                except lmdb.MapFullError:
                    self._shed(len(record))
            raise StoreError(f"the record ({len(record)} bytes) does not fit in the store")

    def _put(self, txn: lmdb.Transaction, key: bytes, scope: bytes, record: bytes) -> None:
        now = self._now()
        old = txn.get(key, db=self._records)
        if old is not None:
            created, seq, n = _HEADER.unpack_from(old)
            if old[_HEADER.size:_HEADER.size + n] != scope:
                raise StoreError("that response id is taken")
            txn.delete(_SEQ.pack(seq) + key, db=self._order)
        seq, self._seq = self._seq, self._seq + 1
        txn.put(key, _HEADER.pack(now, seq, len(scope)) + scope + record, db=self._records)
        txn.put(_SEQ.pack(seq) + key, b"", db=self._order)
        count = int(txn.stat(self._records)["entries"])
        with txn.cursor(db=self._order) as cur:
            cur.first()
            while cur.key():
                okey = cur.key()
                value = txn.get(okey[8:], db=self._records)
                expired = value is not None and self.ttl > 0 and _HEADER.unpack_from(value)[0] + self.ttl < now
                if count <= self.max_stored and not expired:
                    break
                if okey[8:] == key:  # never evict the record being put
                    break
                txn.delete(okey[8:], db=self._records)
                cur.delete()  # moves to the next entry
                count -= 1

    def _shed(self, need: int) -> None:
        """The map is full: drop the oldest records until about `need` bytes (twice over) are free.
        Commits even when nothing is left to drop: that commit is what makes freed pages reusable."""
        freed, dropped = 0, 0
        with self._env.begin(write=True) as txn:
            txn.put(b"sheds", b"%d" % (int(txn.get(b"sheds", b"0", db=self._meta)) + 1), db=self._meta)
            with txn.cursor(db=self._order) as cur:
                cur.first()
                while cur.key() and freed < 2 * need + self._map_size // 64:
                    value = txn.get(cur.key()[8:], db=self._records)
                    freed += len(value or b"")
                    txn.delete(cur.key()[8:], db=self._records)
                    cur.delete()
                    dropped += 1
        if dropped:
            log.warning("response store full: dropped the %d oldest records", dropped)

    def get(self, rid: str, scope: str) -> StoredRecord | None:
        """The record under `rid` for `scope`; None when unknown, expired or another scope's."""
        with self._env.begin() as txn:
            value = txn.get(rid.encode(), db=self._records)
        if value is None:
            return None
        created, _seq, n = _HEADER.unpack_from(value)
        stored_scope = bytes(value[_HEADER.size:_HEADER.size + n]).decode()
        if stored_scope != scope:
            return None
        if self.ttl > 0 and created + self.ttl < self._now():
            self.delete(rid, scope)
            return None
        return StoredRecord(stored_scope, created, bytes(value[_HEADER.size + n:]))

    def delete(self, rid: str, scope: str) -> bool:
        key = rid.encode()
        with self._lock, self._env.begin(write=True) as txn:
            value = txn.get(key, db=self._records)
            if value is None:
                return False
            created, seq, n = _HEADER.unpack_from(value)
            if bytes(value[_HEADER.size:_HEADER.size + n]) != scope.encode():
                return False
            txn.delete(key, db=self._records)
            txn.delete(_SEQ.pack(seq) + key, db=self._order)
            return not (self.ttl > 0 and created + self.ttl < self._now())  # an expired one was not there
