"""Which tool-call and reasoning parser reads a model's output, and the parser of one choice.

The engine reads the syntax off the checkpoint's chat template and reports it in ListModels
(`ModelCard.tool_call_parser`, `reasoning_parser`); `--tool-call-parser` and
`--reasoning-parser` override it for every model. Without either: Hermes tool calls, no
reasoning split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.engines import EnginePool
from gateway.reasoning import ReasoningDelta, ReasoningStream
from gateway.tool_calls import ContentDelta, Event, ToolCall
from gateway.tool_parsers import ToolParser, make_tool_parser

Piece = Event | ReasoningDelta


@dataclass(frozen=True, slots=True)
class OutputFormats:
    tool_call: str = "hermes"
    reasoning: str = ""  # "": reasoning stays in the content


def output_formats(pool: EnginePool, model: str, tool_flag: str, reasoning_flag: str) -> OutputFormats:
    card = next((e.models[model] for e in pool.engines if model in e.models), None)
    tool = tool_flag or (card.tool_call_parser if card is not None else "") or "hermes"
    reasoning = reasoning_flag or (card.reasoning_parser if card is not None else "")
    return OutputFormats(tool, "" if reasoning == "none" else reasoning)


@dataclass(slots=True)
class ChoiceParser:
    """One choice's text -> reasoning, content and tool calls, in order; counts reasoning tokens."""

    reasoning: ReasoningStream | None
    tools: ToolParser | None
    reasoning_tokens: int = 0
    _pieces: list[Piece] = field(default_factory=list)

    @classmethod
    def make(cls, formats: OutputFormats, tools_json: str, parse_tools: bool) -> ChoiceParser:
        reasoning = ReasoningStream.for_parser(formats.reasoning) if formats.reasoning else None
        return cls(reasoning, make_tool_parser(formats.tool_call, tools_json) if parse_tools else None)

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str, tokens: int = 0, finished: bool = False) -> list[Piece]:
        out: list[Piece] = []
        if self.reasoning is None:
            out += self._content(text)
        else:
            was = self.reasoning.in_block
            split = self.reasoning.feed(text) + (self.reasoning.finish() if finished else [])
            if was or self.reasoning.in_block:
                self.reasoning_tokens += tokens
            for piece in split:
                out += [piece] if isinstance(piece, ReasoningDelta) else self._content(piece)
        if finished and self.tools is not None:
            out += self.tools.finish()
        return out

    def _content(self, text: str) -> list[Piece]:
        if self.tools is None:
            return [ContentDelta(text)] if text else []
        return list(self.tools.feed(text))
