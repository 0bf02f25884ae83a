"""Reading a JSON request body, and typed field access whose errors name the field.

`Fields` wraps one JSON object; every getter checks the JSON type (a bool is
not a number) and range, and raises a 400 `OpenAIError` whose `param` is the
full path of the field (``ignis.class``, ``messages[2].content``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

import anyio.to_thread
from starlette.requests import ClientDisconnect, Request

from gateway.body_encoding import codings, decode
from gateway.errors import OpenAIError, invalid
from gateway.aliases import JSONObject

# Deeper JSON is refused before it is parsed: json.loads (and every later walk, json.dumps, the
# engine's template) recurses once per level, and no OpenAI request needs more than a handful.
MAX_JSON_DEPTH = 64

# A JSON string (escapes included) and the bytes that are not brackets: removed before depth is counted.
# An unclosed string runs to the end of the text: otherwise the scan restarts at every escaped quote
# (quadratic: 64 KiB of \" took 4 s on the event loop).
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
# Decoded text holds a surrogate only through a \uD800-\uDFFF escape (UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb'\\u[dD][89a-fA-F]')
# Bodies larger than this are parsed on a worker thread: a 16 MiB body takes seconds to check and parse.
PARSE_OFF_LOOP_BYTES = 256 << 10
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_FOLD = bytes.maketrans(b"{}", b"[]")  # depth does not care which kind of bracket
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: Request, max_bytes: int) -> JSONObject:
    """The body as a JSON object.

    415 unless the declared type is JSON, 413 above `max_bytes` (never buffering more), 400 when it
    is not a JSON object, nests deeper than MAX_JSON_DEPTH or holds an unpaired surrogate. A gzip,
    deflate or zstd body (Content-Encoding) is inflated to at most `max_bytes` too
    (gateway/body_encoding.py), on a worker thread.
    """
    _check_media_type(request.headers.get("content-type", ""))
    encoded = codings(request.headers.get("content-encoding", ""))
    too_large = OpenAIError(413, f"the request body is larger than the limit of {max_bytes} bytes",
                            code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large  # before reading any of it
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise OpenAIError(499, "the client closed the request", code="client_closed_request") from None
    raw = b"".join(chunks)
    if encoded:
        return await anyio.to_thread.run_sync(lambda: parse_json_object(decode(raw, encoded, max_bytes)))
    if len(raw) > PARSE_OFF_LOOP_BYTES:  # keep every other stream moving meanwhile
        return await anyio.to_thread.run_sync(parse_json_object, raw)
    return parse_json_object(raw)


def _check_media_type(content_type: str) -> None:
    # Only JSON: a browser may send text/plain or form bodies cross-site without asking first (no CORS
    # preflight), so accepting them would let any web page spend a loopback gateway's compute.
    media = content_type.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = f"got {media!r}" if media else "none was given"
    raise OpenAIError(415, f"the request body must be JSON: send 'Content-Type: application/json' ({got})",
                      code="unsupported_media_type")


def parse_json_object(raw: bytes) -> JSONObject:
    """`raw` as a JSON object, checked for depth before parsing and for unpaired surrogates after."""
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object")
    check_depth(raw)
    try:
        # UTF-8 only (RFC 8259); json.loads would guess UTF-16/32 from the first bytes.
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # otherwise no string can hold one: no second walk of the body
        check_strings(data)
    return data


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def check_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """400 when the JSON text nests deeper than `limit`; counts brackets outside strings, recursing nowhere.

    Each pass removes the innermost pairs, so `limit` passes empty a balanced text of depth <= `limit`
    (a run of more than `limit` openers ends it early). What an unbalanced text leaves is a run of
    unmatched brackets; json.loads then fails on it after recursing at most 2 * `limit` levels.
    """
    too_deep = invalid(f"the request body nests deeper than {limit} levels")
    run = b"[" * (limit + 1)  # that many openers in a row nest too deep, whatever follows
    brackets = _STRING.sub(b"", raw).translate(_FOLD, _NOT_BRACKETS)
    for _ in range(limit):
        if run in brackets:
            raise too_deep
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):
            break
        brackets = inner
    if b"[]" in brackets or brackets.count(b"[") > limit:
        raise too_deep


def check_strings(data: JSONObject) -> None:
    """400 naming the field when a string or key holds an unpaired surrogate (a "\\ud800" escape).

    Such a string has no UTF-8 form: protobuf and the engine could not carry it. Walks with a stack.
    """
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise invalid(f"'{path}' contains an unpaired surrogate: strings must be valid Unicode",
                              param=path)
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if not key.isascii() and _SURROGATE.search(key):
                    where = f"an object key in '{path}'" if path else "a top-level key"
                    raise invalid(f"{where} contains an unpaired surrogate: strings must be valid Unicode",
                                  param=path or None)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            for i in range(len(value) - 1, -1, -1):
                if isinstance(value[i], (str, dict, list)):
                    stack.append((value[i], f"{path}[{i}]"))


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
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(name, "a number")
        try:
            number = float(value)  # an integer too large for a float raises OverflowError
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise invalid(f"'{self.path(name)}' must be a finite number", param=self.path(name))
        self._check_range(name, number, lo, hi)
        return number

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
