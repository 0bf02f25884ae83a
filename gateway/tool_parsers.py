"""Each model family's tool-call syntax -> OpenAI `tool_calls`, whole and streamed alike.

- hermes (Qwen2.5/Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the text (gateway/tool_calls.py).
- qwen3_coder: the same blocks with an XML body,
  ``<function=NAME><parameter=P>value</parameter></function>``; values are typed by the tool's schema.
- llama3_json (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``, several separated by ``;``); output that does not start so is text.
- mistral: text, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` (or, newer
  tokenizers, ``[TOOL_CALLS]name[ARGS]{...}`` per call).

Every parser follows the Hermes rules: a call that does not parse stays content verbatim, and
arguments are a JSON string. The whole-output families hold their calls until the choice ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.tool_calls import ContentDelta, Event, ToolCall, ToolCallDelta, ToolCallStream, \
    new_call_id, partial_suffix

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class ToolParser(Protocol):
    calls: list[ToolCall]

    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


def make_tool_parser(name: str, tools_json: str = "") -> ToolParser:
    if name == "llama3_json":
        return TrailingCalls(marker="", parse=_llama_calls, bare_json=True)
    if name == "mistral":
        return TrailingCalls(marker=MISTRAL_CALLS, parse=_mistral_calls)
    if name == "qwen3_coder":
        types = _parameter_types(tools_json)
        return ToolCallStream(parse=lambda body: _coder_call(body, types))
    if name in ("", "hermes"):
        return ToolCallStream()
    raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(TOOL_PARSERS)}")


def _call(name: object, args: object) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {}, ensure_ascii=False, separators=(", ", ": "))
    return ToolCall(id=new_call_id(), name=name, arguments=args)


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Consecutive JSON values in `text`, split by whitespace and `separators`; None if anything else."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _llama_calls(body: str) -> list[ToolCall] | None:
    values = _json_values(body.replace(PYTHON_TAG, ""), ";")
    if not values:
        return None
    calls = [_call(v.get("name"), v.get("parameters", v.get("arguments"))) if isinstance(v, dict) else None
             for v in values]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


def _mistral_calls(body: str) -> list[ToolCall] | None:
    out: list[ToolCall] = []
    for part in body.split(MISTRAL_CALLS):
        if not part.strip():
            continue
        if MISTRAL_ARGS in part:  # newer tokenizers: name[ARGS]{json}
            name, _, args = part.partition(MISTRAL_ARGS)
            values = _json_values(args, "")
            call = _call(name.strip(), values[0]) if values and len(values) == 1 else None
            if call is None:
                return None
            out.append(call)
            continue
        values = _json_values(part, "")
        if values is None or len(values) != 1:
            return None
        items = values[0] if isinstance(values[0], list) else [values[0]]
        for item in items:
            call = _call(item.get("name"), item.get("arguments")) if isinstance(item, dict) else None
            if call is None:
                return None
            out.append(call)
    return out or None


def _parameter_types(tools_json: str) -> dict[str, dict[str, str]]:
    """function name -> parameter name -> its JSON schema type (when it names one)."""
    try:
        tools = json.loads(tools_json) if tools_json else []
    except json.JSONDecodeError:
        return {}
    out: dict[str, dict[str, str]] = {}
    for tool in tools if isinstance(tools, list) else []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = {k: str(v["type"]) for k, v in props.items() if isinstance(v, dict)
                           and isinstance(v.get("type"), str)}
    return out


def _coder_call(body: str, types: dict[str, dict[str, str]]) -> ToolCall | None:
    m = _FUNCTION.fullmatch(body.strip())
    if m is None:
        return None
    name = m.group(1).strip()
    known = types.get(name, {})
    args: dict[str, Any] = {}
    for pm in _PARAMETER.finditer(m.group(2)):
        key, raw = pm.group(1).strip(), pm.group(2)
        args[key] = raw if known.get(key) == "string" else _typed(raw)
    return _call(name, args)


def _typed(raw: str) -> Any:
    """A parameter value without a string schema: JSON when it reads as JSON, else the text."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


@dataclass(slots=True)
class TrailingCalls:
    """Families whose calls fill the rest of the output: text until `marker` (or, `bare_json`, an
    output that starts as a JSON object), then calls parsed whole when the choice ends."""

    marker: str
    parse: Any  # Callable[[str], list[ToolCall] | None]
    bare_json: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _mode: str = "undecided"  # undecided (bare_json only) | text | calls

    def __post_init__(self) -> None:
        if not self.bare_json:
            self._mode = "text"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []  # may still become a call
            self._mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "text"
        if self._mode == "calls":
            return []
        if self.marker:
            at = self._buf.find(self.marker)
            if at >= 0:
                before, self._buf = self._buf[:at], self._buf[at:]
                self._mode = "calls"
                return _content(before.rstrip())
            hold = partial_suffix(self._buf, self.marker)
        else:
            hold = 0
        # Trailing whitespace waits too: before the marker it is formatting, and is dropped.
        safe = self._buf[:len(self._buf) - hold]
        stripped = safe.rstrip()
        self._buf = self._buf[len(stripped):]
        return _content(stripped)

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._mode != "calls":
            return _content(buf)
        body = buf[len(self.marker):] if self.marker and buf.startswith(self.marker) else buf
        calls = self.parse(body)
        if not calls:
            return _content(buf)
        self.calls.extend(calls)
        return [ToolCallDelta(i, c) for i, c in enumerate(calls)]


def _content(text: str) -> list[Event]:
    return [ContentDelta(text)] if text else []
