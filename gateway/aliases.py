"""Type aliases used across the gateway, in one place."""

from __future__ import annotations

from typing import Any, TypeAlias

JSONObject: TypeAlias = dict[str, Any]
# One Server-Sent Event, already encoded ("event: ...\ndata: ...\n\n").
SSEBytes: TypeAlias = bytes
