"""Tool calls in model text (Hermes/Qwen ``<tool_call>{json}</tool_call>``) -> OpenAI `tool_calls`.

`ToolCallStream` is fed text deltas as they arrive and returns what can be
shown so far: text outside the blocks as `ContentDelta`, each complete block
as one `ToolCallDelta` (name and full arguments, emitted when its closing tag
arrives, so the arguments a client accumulates equal the non-streamed ones).
A whole (non-streamed) text is fed to the same machine at once, so streamed
and non-streamed answers agree by construction.

Rules:
- A block whose body is not a JSON object with a string ``name`` is left in
  the content verbatim (with the whitespace around it), as is an unclosed
  block at the end (a length cutoff): nothing the model wrote is dropped.
- Whitespace between the text and a parsed block is template formatting and
  is dropped; text with no parsed block is passed through unchanged.
- ``arguments`` is re-encoded with ``json.dumps`` when it is an object; a
  string is passed as-is (some models emit the JSON encoding themselves).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON-encoded, OpenAI's `function.arguments`

    def openai(self, index: int | None = None) -> dict[str, object]:
        out: dict[str, object] = {"id": self.id, "type": "function",
                                  "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int  # position among this choice's tool calls
    call: ToolCall


Event = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_block(body: str) -> ToolCall | None:
    """One block's body -> a ToolCall, or None when it is not a well-formed call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False, separators=(", ", ": "))
    return ToolCall(id=new_call_id(), name=data["name"], arguments=args)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class ToolCallStream:
    """Incremental parser for one choice. The tags and the body parser are Hermes' by default;
    Qwen3-Coder uses the same blocks with an XML body (gateway/tool_parsers.py)."""

    calls: list[ToolCall] = field(default_factory=list)
    parse: Callable[[str], ToolCall | None] = parse_block
    open_tag: str = OPEN
    close_tag: str = CLOSE
    _buf: str = ""  # unconsumed text: outside a block (held back) or a block's body so far
    _in_block: bool = False
    _ws_before: str = ""  # whitespace before the open block, restored if the block does not parse
    _after_block: bool = False  # drop whitespace that follows a parsed block

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_block:
                end = self._buf.find(self.close_tag)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.close_tag):]
                self._in_block = False
                self._close_block(body, out)
                continue
            start = self._buf.find(self.open_tag)
            if start < 0:
                self._emit_safe_prefix(out)
                return out
            before, self._buf = self._buf[:start], self._buf[start + len(self.open_tag):]
            stripped = before.rstrip()
            self._content(stripped, out)
            self._ws_before = before[len(stripped):]
            self._in_block = True

    def finish(self) -> list[Event]:
        """End of the choice: flush held text; an unclosed block stays content."""
        out: list[Event] = []
        if self._in_block:
            self._in_block = False
            self._content(self._ws_before + self.open_tag + self._buf, out, verbatim=True)
        else:
            tail = self._buf
            if self.calls:  # trailing whitespace after the last call is formatting
                tail = tail.rstrip()
            self._content(tail, out)
        self._buf = ""
        return out

    def _close_block(self, body: str, out: list[Event]) -> None:
        call = self.parse(body.strip())
        if call is None:
            self._content(self._ws_before + self.open_tag + body + self.close_tag, out, verbatim=True)
            return
        self._ws_before = ""
        self.calls.append(call)
        out.append(ToolCallDelta(len(self.calls) - 1, call))
        self._after_block = True

    def _emit_safe_prefix(self, out: list[Event]) -> None:
        # Hold back a possible start of OPEN, and trailing whitespace (it may turn
        # out to sit before a block, where it is dropped).
        hold = partial_suffix(self._buf, self.open_tag)
        safe = self._buf[: len(self._buf) - hold]
        stripped = safe.rstrip()
        if not stripped.strip() and self._after_block:
            return  # only whitespace after a block so far: keep holding it
        self._content(stripped, out)
        self._buf = safe[len(stripped):] + self._buf[len(safe):]

    def _content(self, text: str, out: list[Event], verbatim: bool = False) -> None:
        if self._after_block and not verbatim:
            text = text.lstrip()
        if not text:
            return
        self._after_block = False
        if out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + text)
        else:
            out.append(ContentDelta(text))
