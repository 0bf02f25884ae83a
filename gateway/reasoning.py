"""Reasoning blocks (``<think>…</think>``) split off the text: `reasoning_content` on chat,
reasoning items on /v1/responses, counted in `reasoning_tokens`.

- qwen3: the output may open with ``<think>``; what follows until ``</think>`` is reasoning.
  An output that does not open with it is all content.
- deepseek_r1: the template opens the block in the prompt, so the output starts inside it
  (a leading ``<think>`` is dropped too); until ``</think>`` is reasoning, all of it if the
  block never closes.
Whitespace between the block and the answer is formatting and is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_calls import partial_suffix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ReasoningStream:
    """Incremental splitter for one choice: feed text, get (reasoning | content) pieces in order."""

    starts_inside: bool  # deepseek_r1: the prompt opened the block
    _buf: str = ""
    _state: str = "opening"  # opening (a leading <think> may come) | reasoning | content
    _after_end: bool = False  # drop the whitespace that follows </think>

    @classmethod
    def for_parser(cls, name: str) -> ReasoningStream:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}")
        return cls(starts_inside=name == "deepseek_r1")

    @property
    def in_block(self) -> bool:
        """Inside the reasoning block: tokens fed while inside (or that close it) are reasoning tokens."""
        return self._state == "reasoning"

    def feed(self, text: str) -> list[ReasoningDelta | str]:
        self._buf += text
        out: list[ReasoningDelta | str] = []
        if self._state == "opening":
            head = self._buf.lstrip()
            if not head or (START.startswith(head) and head != START):
                return out  # may still be the opening tag
            if head.startswith(START):
                self._buf, self._state = head[len(START):], "reasoning"
            else:
                self._state = "reasoning" if self.starts_inside else "content"
        if self._state == "reasoning":
            end = self._buf.find(END)
            if end < 0:
                hold = partial_suffix(self._buf, END)
                safe, self._buf = self._buf[:len(self._buf) - hold], self._buf[len(self._buf) - hold:]
                if safe:
                    out.append(ReasoningDelta(safe))
                return out
            if end:
                out.append(ReasoningDelta(self._buf[:end]))
            self._buf, self._state, self._after_end = self._buf[end + len(END):], "content", True
        if self._after_end:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._after_end = False
        if self._buf:
            out.append(self._buf)
            self._buf = ""
        return out

    def finish(self) -> list[ReasoningDelta | str]:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        if self._state == "reasoning" or (self._state == "opening" and self.starts_inside):
            return [ReasoningDelta(buf)]
        return [] if self._after_end and not buf.strip() else [buf]
