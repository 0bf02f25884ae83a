"""The completions API's four prompt forms -> one engine input each.

A string, an array of strings, an array of token ids, or an array of arrays
of token ids. Each prompt is one Generate call; its choices are numbered
``prompt_index * n + choice``, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import invalid
from gateway.routing import text_head, token_head
from ignis.v1 import engine_pb2

MAX_PROMPTS = 64


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def apply(self, request: engine_pb2.GenerateRequest) -> None:
        if self.text is not None:
            request.text = self.text
        else:
            request.token_ids.ids.extend(self.token_ids or ())

    @property
    def head(self) -> str:
        return text_head(self.text) if self.text is not None else token_head(self.token_ids or ())


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _tokens(value: list[Any], param: str) -> tuple[int, ...]:
    if not value:
        raise invalid(f"'{param}' must not be an empty array of token ids", param="prompt")
    if not all(_is_token(t) for t in value):
        raise invalid(f"'{param}' must hold token ids (integers >= 0)", param="prompt")
    return tuple(value)


def parse_prompts(raw: Any) -> list[Prompt]:
    if raw is None:
        raise invalid("'prompt' is required", param="prompt")
    if isinstance(raw, str):
        return [Prompt(text=raw)]
    if not isinstance(raw, list) or not raw:
        raise invalid("'prompt' must be a string, an array of strings, an array of token ids or an array of "
                      "arrays of token ids", param="prompt")
    if all(isinstance(p, str) for p in raw):
        prompts = [Prompt(text=p) for p in raw]
    elif all(isinstance(p, list) for p in raw):
        prompts = [Prompt(token_ids=_tokens(p, f"prompt[{i}]")) for i, p in enumerate(raw)]
    else:
        return [Prompt(token_ids=_tokens(raw, "prompt"))]
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt")
    return prompts
