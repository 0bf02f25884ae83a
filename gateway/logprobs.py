"""Engine `TokenLogprob`s in the three OpenAI shapes (chat, legacy completions, responses)."""

from __future__ import annotations

from typing import Iterable

from gateway.aliases import JSONObject
from ignis.v1 import engine_pb2


def _text(lp: engine_pb2.TokenLogprob | engine_pb2.TopLogprob) -> str:
    return lp.token_bytes.decode("utf-8", errors="replace") if lp.token_bytes else lp.token


def chat_content(items: Iterable[engine_pb2.TokenLogprob]) -> list[JSONObject]:
    """Chat `logprobs.content` entries (also the Responses API's `logprobs` on output_text)."""
    return [
        {"token": _text(lp), "logprob": lp.logprob, "bytes": list(lp.token_bytes),
         "top_logprobs": [{"token": _text(t), "logprob": t.logprob, "bytes": list(t.token_bytes)}
                          for t in lp.top_logprobs]}
        for lp in items
    ]


class CompletionLogprobs:
    """Legacy completions `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}), built up per delta."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset  # characters of text before the next token

    def add(self, items: Iterable[engine_pb2.TokenLogprob], first_has_no_logprob: bool = False,
            first_text: str | None = None) -> JSONObject:
        """`first_text` stands in for the first token's text (the echoed prompt's first token, see prompt_first_token)."""
        out: JSONObject = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, lp in enumerate(items):
            text = first_text if i == 0 and first_text is not None else _text(lp)
            unscored = first_has_no_logprob and i == 0 and not lp.HasField("logprob")
            out["tokens"].append(text)
            out["token_logprobs"].append(None if unscored else lp.logprob)
            out["top_logprobs"].append(None if unscored else {_text(t): t.logprob for t in lp.top_logprobs})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def merge_completion(parts: Iterable[JSONObject]) -> JSONObject:
    out: JSONObject = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out


def prompt_first_token(prompt: str, items: list[engine_pb2.TokenLogprob]) -> str | None:
    """The text of an echoed prompt's first token, when the engine leaves it empty.

    The engine scores no first prompt token and may send it bare; for a text
    prompt, its text is what the prompt has before the other tokens' text.
    """
    if not items or items[0].token_bytes or items[0].token:
        return None
    rest = prompt_text(items[1:])
    return prompt[: len(prompt) - len(rest)] if prompt.endswith(rest) else None


def prompt_text(items: Iterable[engine_pb2.TokenLogprob]) -> str:
    """The prompt's text from its echoed tokens' bytes (for a prompt sent as token ids)."""
    return b"".join(lp.token_bytes for lp in items).decode("utf-8", errors="replace")
