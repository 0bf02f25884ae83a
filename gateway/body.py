"""Reading a JSON request body, and typed field access whose errors name the field.

`Fields` wraps one JSON object; every getter checks the JSON type (a bool is
not a number) and range, and raises a 400 `OpenAIError` whose `param` is the
full path of the field (``ignis.class``, ``messages[2].content``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from gateway.errors import OpenAIError, invalid
from gateway.aliases import JSONObject

MAX_BODY_BYTES = 64 << 20  # a 32k-token prompt as token ids is well under 1 MiB


async def read_json(request: Request) -> JSONObject:
    """The body as a JSON object; 413 when too large, 400 when it is not JSON or not an object."""
    too_large = OpenAIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                            code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large  # before reading any of it
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    return data


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


class Fields:
    """Typed, validated access to one JSON object of the request."""

    def __init__(self, data: JSONObject, prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def path(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def _bad(self, name: str, expected: str) -> Exception:
        got = _kind(self.data.get(name))
        return invalid(f"'{self.path(name)}' must be {expected}, got {got}", param=self.path(name))

    def string(self, name: str, *, required: bool = False, choices: tuple[str, ...] | None = None) -> str | None:
        value = self.data.get(name)
        if value is None:
            if required:
                raise invalid(f"'{self.path(name)}' is required", param=self.path(name))
            return None
        if not isinstance(value, str):
            raise self._bad(name, "a string")
        if choices is not None and value not in choices:
            raise invalid(f"'{self.path(name)}' must be one of {', '.join(choices)}, got {value!r}",
                          param=self.path(name))
        return value

    def integer(self, name: str, *, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.data.get(name)
        if value is None:
            return None
        # JSON has one number type: accept 3.0 as 3, reject 3.5 and booleans.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, "an integer")
        self._check_range(name, value, lo, hi)
        return value

    def number(self, name: str, *, lo: float | None = None, hi: float | None = None) -> float | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(name, "a number")
        self._check_range(name, value, lo, hi)
        return float(value)

    def boolean(self, name: str) -> bool | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise self._bad(name, "a boolean")
        return value

    def array(self, name: str, *, required: bool = False) -> list[Any] | None:
        value = self.data.get(name)
        if value is None:
            if required:
                raise invalid(f"'{self.path(name)}' is required", param=self.path(name))
            return None
        if not isinstance(value, list):
            raise self._bad(name, "an array")
        return value

    def obj(self, name: str) -> Fields | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._bad(name, "an object")
        return Fields(value, self.path(name))

    def string_list(self, name: str, *, max_items: int | None = None) -> list[str] | None:
        """A string or an array of strings (OpenAI's `stop`), as a list."""
        value = self.data.get(name)
        if value is None:
            return None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self._bad(name, "a string or an array of strings")
        if max_items is not None and len(items) > max_items:
            raise invalid(f"'{self.path(name)}' may hold at most {max_items} items, got {len(items)}",
                          param=self.path(name))
        return items

    def _check_range(self, name: str, value: float, lo: float | None, hi: float | None) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"between {lo:g} and {hi:g}" if lo is not None and hi is not None else (
                f">= {lo:g}" if lo is not None else f"<= {hi:g}")
            raise invalid(f"'{self.path(name)}' must be {bounds}, got {value}", param=self.path(name))
