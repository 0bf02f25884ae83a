"""The engine's vocabulary of reuse facts: request classes, and where and how a
request's state was reused. Typed here once; engine/proto_convert.py is the only
place they meet their protobuf enums."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.request_class import RequestClass

__all__ = ["RequestClass", "ReuseKind", "ReuseReport", "ReuseTier"]



class ReuseTier(enum.Enum):
    """Where reused state came from (the `ignis.tier` of a response)."""

    NONE = "none"
    DEVICE = "device"
    HOST = "host"
    RAM = "ram"
    DISK = "disk"


class ReuseKind(enum.Enum):
    """What kind of retained state was reused (the `ignis.kind` of a response)."""

    NONE = "none"
    CHECKPOINT = "checkpoint"  # whole state at a prompt's generation opener, or at a reply's end
    PREFIX = "prefix"  # the page-rounded stable head (system + tools) a burst shares
    PAGES = "pages"  # attention-only models: any page-aligned prefix, page by page


@dataclass(frozen=True, slots=True)
class ReuseReport:
    tier: ReuseTier = ReuseTier.NONE
    kind: ReuseKind = ReuseKind.NONE
    reused_tokens: int = 0
