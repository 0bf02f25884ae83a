"""Which tool-call and reasoning syntax a checkpoint writes, read off its own chat template.

The template is rendered on a probe conversation (an assistant turn with reasoning and one
tool call) and the output is matched against each family's markers: the template is the
checkpoint's own statement of the syntax it was trained on, so nothing depends on the
model's name. The gateway's parsers and the tool-call grammar use the names found here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.guided.matcher import ReasoningTokens
from engine.text.tokenizer import Tokenizer

TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder")
REASONING_FORMATS = ("qwen3", "deepseek_r1")

_PROBE_NAME = "ignis_probe_fn"
_PROBE_REASONING = "ignis probe reasoning"
_PROBE: list[dict[str, Any]] = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "", "reasoning_content": _PROBE_REASONING,
     "tool_calls": [{"id": "call_0", "type": "function",
                     "function": {"name": _PROBE_NAME, "arguments": {"x": 1}}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
]
_PROBE_TOOLS = [{"type": "function", "function": {"name": _PROBE_NAME, "parameters": {"type": "object"}}}]


@dataclass(frozen=True, slots=True)
class ModelFormats:
    tool_call: str = ""  # one of TOOL_FORMATS, "" when the template writes none we know
    reasoning: str = ""  # one of REASONING_FORMATS, ""  when the template has no reasoning block

    def reasoning_tokens(self, tokenizer: Tokenizer) -> ReasoningTokens | None:
        """The block's markers as single tokens (None: no reasoning block, or markers split over tokens)."""
        start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
        if not self.reasoning or start is None or end is None:
            return None
        return ReasoningTokens(start, end, starts_inside=self.reasoning == "deepseek_r1")


def infer_formats(tokenizer: Tokenizer) -> ModelFormats:
    """The families the checkpoint's chat template writes; empty names when it has none or fails."""
    if not tokenizer.has_chat_template:
        return ModelFormats()
    try:
        text = tokenizer.apply_chat_template(_PROBE, tools=_PROBE_TOOLS, add_generation_prompt=True)
    except Exception:  # a template that refuses the probe (strict role order, ...) tells us nothing
        return ModelFormats()
    return ModelFormats(tool_call=_tool_format(text), reasoning=_reasoning_format(text, tokenizer))


def _tool_format(text: str) -> str:
    if "<tool_call>" in text:
        return "qwen3_coder" if f"<function={_PROBE_NAME}>" in text else "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if f'"name": "{_PROBE_NAME}"' in text and '"parameters"' in text:
        return "llama3_json"
    return ""


def _reasoning_format(text: str, tokenizer: Tokenizer) -> str:
    if tokenizer.token_to_id("<think>") is None and "<think>" not in text:
        return ""
    if "<｜Assistant｜>" in text or "<｜end▁of▁sentence｜>" in text:
        return "deepseek_r1"
    return "qwen3" if "<think>" in text else ""
