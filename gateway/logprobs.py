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

    def add(self, items: Iterable[engine_pb2.TokenLogprob], first_has_no_logprob: bool = False) -> JSONObject:
        out: JSONObject = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, lp in enumerate(items):
            text = _text(lp)
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


def prompt_text(items: Iterable[engine_pb2.TokenLogprob]) -> str:
    """The prompt's text from its echoed tokens' bytes (for a prompt sent as token ids)."""
    return b"".join(lp.token_bytes for lp in items).decode("utf-8", errors="replace")
