"""Putting a request's streamed messages back together per choice (non-streamed answers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from gateway.usage import Usage
from ignis.v1 import engine_pb2

_FINISH: dict[int, str] = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",  # vLLM's name; OpenAI has none for an engine-side abort
}


def finish_reason(value: int, tool_calls: bool = False) -> str | None:
    """OpenAI's finish_reason; a stop that ended after tool calls is "tool_calls"."""
    name = _FINISH.get(value)
    if name == "stop" and tool_calls:
        return "tool_calls"
    return name


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    finish: int = engine_pb2.FINISH_REASON_NONE


@dataclass(slots=True)
class Collected:
    choices: dict[int, Choice]
    usage: Usage
    prompt_token_ids: list[int]
    prompt_logprobs: list[engine_pb2.TokenLogprob]


def accumulate(messages: Iterable[engine_pb2.GenerateResponse]) -> Collected:
    choices: dict[int, Choice] = {}
    usage = Usage()
    prompt_ids: list[int] = []
    prompt_lps: list[engine_pb2.TokenLogprob] = []
    for msg in messages:
        if msg.prompt_token_ids:
            prompt_ids.extend(msg.prompt_token_ids)
            prompt_lps.extend(msg.prompt_logprobs)
        if msg.HasField("usage"):
            usage = Usage.from_proto(msg.usage)
        c = choices.setdefault(msg.index, Choice(msg.index))
        c.text += msg.text
        c.token_ids.extend(msg.token_ids)
        c.logprobs.extend(msg.logprobs)
        if msg.finish_reason != engine_pb2.FINISH_REASON_NONE:
            c.finish = msg.finish_reason
    return Collected(dict(sorted(choices.items())), usage, prompt_ids, prompt_lps)
