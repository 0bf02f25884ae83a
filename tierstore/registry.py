"""Namespaces the engines registered: their page size and state layout.

A namespace (h0) is registered by the engine that serves it. The layout string is
compared on every re-register, across restarts too (the disk tier persists it),
so a state written under one layout is never read under another:

- the same layout (and page size) again: nothing changes;
- another layout while the namespace has states on disk: FAILED_PRECONDITION to
  the newcomer, and the registration stays (those states were written under it);
- another layout while it has none on disk: the new registration replaces the old
  one and the store drops the states (in RAM) written under the old one. A
  registration is thus never a lock: whoever registered first (a squatter, an
  engine since upgraded) cannot keep the owner out once nothing is stored under it.

Unregistered namespaces (cache_salt tenants) still store and match, but only by
exact name: without a page size a page-prefix hit cannot be sized.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tierstore.errors import FailedPrecondition, InvalidArgument
from tierstore.state import check_hash, short


@dataclass(frozen=True, slots=True)
class Registration:
    namespace: bytes
    model: str
    page_size: int
    layout: str
    kv_bytes_per_token: int
    fixed_state_bytes: int  # 0: attention-only, every page-aligned prefix of a state is a state

    def __post_init__(self) -> None:
        check_hash(self.namespace, "namespace")
        if self.page_size <= 0:
            raise InvalidArgument("page_size must be > 0")

    @property
    def attention_only(self) -> bool:
        return self.fixed_state_bytes == 0

    def encode(self) -> bytes:
        fields = asdict(self)
        fields["namespace"] = self.namespace.hex()
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Registration:
        fields = json.loads(raw)
        fields["namespace"] = bytes.fromhex(fields["namespace"])
        return cls(**fields)


class NamespaceRegistry:
    def __init__(self, known: dict[bytes, Registration] | None = None,
                 persist: Callable[[Registration], None] | None = None) -> None:
        self._known = dict(known or {})
        self._persist = persist

    def get(self, namespace: bytes) -> Registration | None:
        return self._known.get(namespace)

    def register(self, reg: Registration, *, stored: Callable[[bytes], bool]) -> Registration | None:
        """Records ``reg``; returns the registration it replaced when the layout changed (the caller drops
        the states written under that one), else None.

        ``stored(namespace)`` says whether states of the namespace are on disk: then another
        layout is FailedPrecondition and nothing changes.
        """
        old = self._known.get(reg.namespace)
        conflict = old is not None and (old.layout != reg.layout or old.page_size != reg.page_size)
        if conflict and stored(reg.namespace):
            assert old is not None
            raise FailedPrecondition(
                f"namespace {short(reg.namespace)} is registered with another state layout or page size "
                f"(model {old.model!r}) and states stored under it are on disk; they cannot be read with this one")
        if old != reg:
            self._known[reg.namespace] = reg
            if self._persist is not None:
                self._persist(reg)
        return old if conflict else None

    def __len__(self) -> int:
        return len(self._known)
