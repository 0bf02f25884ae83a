"""Token accounting and the reuse report, as the client sees them.

`usage.prompt_tokens_details.cached_tokens` (chat, completions) or
`usage.input_tokens_details.cached_tokens` (responses), plus the `ignis`
object naming the tier and kind of the reused state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from gateway.aliases import JSONObject
from ignis.v1 import common_pb2, engine_pb2



def _api_names(enum: Any, prefix: str) -> dict[int, str]:
    """The API's names of a proto enum's values: REUSE_TIER_RAM -> "ram" (built once)."""
    return {value: name.removeprefix(prefix).lower() for name, value in enum.items()}


_TIERS = _api_names(common_pb2.ReuseTier, "REUSE_TIER_")
_KINDS = _api_names(common_pb2.ReuseKind, "REUSE_KIND_")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    tier: str = "none"
    kind: str = "none"
    reused_tokens: int = 0
    time_to_first_token_ms: float = 0.0
    reasoning_tokens: int = 0  # counted by the gateway's reasoning parser (gateway/reasoning.py)
    draft_tokens: int = 0  # speculative decoding: drafted and verified
    accepted_tokens: int = 0  # of those, kept
    images: int = 0  # images in the prompt
    images_reused: int = 0  # of those, the ones the vision tower did not run for

    @classmethod
    def from_proto(cls, u: engine_pb2.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                   _TIERS.get(u.reuse.tier, "none"), _KINDS.get(u.reuse.kind, "none"), u.reuse.reused_tokens,
                   u.time_to_first_token_ms, draft_tokens=u.draft_tokens, accepted_tokens=u.accepted_tokens,
                   images=u.images, images_reused=u.images_reused)

    @classmethod
    def total(cls, parts: Iterable[Usage]) -> Usage:
        """Several prompts of one completions request: sums; the tier and kind of the largest reuse."""
        items = list(parts)
        if not items:
            return cls()
        best = max(items, key=lambda u: u.reused_tokens)
        return cls(sum(u.prompt_tokens for u in items), sum(u.completion_tokens for u in items),
                   sum(u.cached_tokens for u in items), best.tier, best.kind,
                   sum(u.reused_tokens for u in items), max(u.time_to_first_token_ms for u in items),
                   draft_tokens=sum(u.draft_tokens for u in items),
                   accepted_tokens=sum(u.accepted_tokens for u in items),
                   images=sum(u.images for u in items), images_reused=sum(u.images_reused for u in items))

    def openai(self) -> JSONObject:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def responses(self) -> JSONObject:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def ignis(self) -> JSONObject:
        report: JSONObject = {"tier": self.tier, "kind": self.kind, "reused_tokens": self.reused_tokens,
                              "time_to_first_token_ms": round(self.time_to_first_token_ms, 3)}
        if self.draft_tokens:  # a request speculative decoding drafted for
            report["speculative"] = {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}
        if self.images:  # a prompt with images
            report["images"] = {"count": self.images, "reused": self.images_reused}
        return report


def close_stream(chunks: list[JSONObject], usage: Usage, include_usage: bool,
                 empty_chunk: Callable[[], JSONObject]) -> None:
    """Finish a chat or completions stream: a usage chunk when the client asked for one
    (stream_options.include_usage), and the `ignis` reuse report on the last chunk either way."""
    if include_usage:
        final = empty_chunk()
        final["usage"] = usage.openai()
        chunks.append(final)
    elif not chunks:
        chunks.append(empty_chunk())
    chunks[-1]["ignis"] = usage.ignis()
