"""Requests the tierstore refuses. server.py maps each class to its gRPC status code.

Running out of room is not an error here: the store returns ``None`` and the
server answers RESOURCE_EXHAUSTED.
"""

from __future__ import annotations


class TierStoreError(Exception):
    """Base of the refusals below; the message is what the client sees."""


class InvalidArgument(TierStoreError, ValueError):
    """A malformed request: a hash that is not 16 bytes, a size of 0, a bad kind."""


class NotFound(TierStoreError):
    """No such state, reservation or lease."""


class AlreadyExists(TierStoreError):
    """The state is already stored or reserved under that hash."""


class FailedPrecondition(TierStoreError):
    """Commit without a reservation, a layout that differs from the registered one."""


class DataLoss(TierStoreError):
    """A blob failed its checksum: it was dropped and counted, never served."""


class Unavailable(TierStoreError):
    """A lower tier cannot serve this now (a failing disk, an arena being recreated); the store is up.

    ``tier`` ("disk" or "arena") travels in the reply's trailing metadata (``ignis-tier-fault``), so a
    client can tell it from the store being unreachable.
    """

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(message)
        self.tier = tier
