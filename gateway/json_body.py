"""JSON out of the gateway: one encoder (orjson) for SSE chunks and whole answers alike."""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import JSONResponse

from gateway.aliases import JSONObject


def dumps(data: JSONObject) -> bytes:
    """Compact UTF-8 JSON, the same bytes as ``json.dumps(ensure_ascii=False, separators=(",", ":"))``
    but for floats under 1e-4 (0.00001, not 1e-05) and NaN/Infinity (null, which is JSON). orjson: a
    chunk in ~0.2 us instead of ~4 us, once per streamed token."""
    try:
        return orjson.dumps(data)
    except TypeError:  # an integer beyond 64 bits (a client's schema or metadata echoed back): the stdlib's
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


class JSONBody(JSONResponse):
    """Starlette's JSONResponse, encoded with `dumps` (~1 us for an answer instead of ~15 us)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
