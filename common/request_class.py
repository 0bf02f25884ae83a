"""The request class, one vocabulary for the gateway, the engine and the tierstore (DESIGN.md, "Request classes").

Every request is `interactive` (the default) or `agent`. A name comes from the gateway's header or
body field, a number from the protobuf enum; both are read here and nowhere else. One rule for
what is neither: an unknown name or number is the caller's mistake (ValueError, naming the
choices), in every service. Rank runs one way everywhere: a lower value ranks higher (admitted
first, preempted and evicted last).
"""

from __future__ import annotations

import enum

from ignis.v1 import common_pb2


class RequestClass(enum.IntEnum):
    INTERACTIVE = 0  # ranked above agent work: admitted first, preempted last, evicted last
    AGENT = 1

    @property
    def label(self) -> str:
        """Its name as clients, logs and metrics spell it: "interactive" or "agent"."""
        return self.name.lower()

    @property
    def pb(self) -> common_pb2.RequestClass:
        return _TO_PB[self]


_TO_PB = {RequestClass.INTERACTIVE: common_pb2.REQUEST_CLASS_INTERACTIVE, RequestClass.AGENT: common_pb2.REQUEST_CLASS_AGENT}
_FROM_PB: dict[int, RequestClass] = {common_pb2.REQUEST_CLASS_UNSPECIFIED: RequestClass.INTERACTIVE,
                                     **{int(v): k for k, v in _TO_PB.items()}}
NAMES = tuple(c.label for c in RequestClass)


def from_pb(value: int) -> RequestClass:
    """The protobuf enum's class (UNSPECIFIED is interactive); ValueError for a number it does not define."""
    try:
        return _FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown request_class {value}: one of {', '.join(NAMES)} "
                         f"({', '.join(str(int(v)) for v in _TO_PB.values())}, or 0 for the default)") from None


def from_name(name: str) -> RequestClass:
    """"interactive" or "agent" (any case); ValueError naming the choices otherwise."""
    try:
        return RequestClass[name.upper()]
    except KeyError:
        raise ValueError(f"the request class must be one of {', '.join(NAMES)}, got {name!r}") from None
