"""What a request asks of the sampler: OpenAI-style parameters, validated once at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound; -100 effectively bans a token, +100 forces it
# Temperatures below this sample greedily (as vLLM does): dividing logits by a denormal
# like 1e-45 overflows to inf, and the softmax of that is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the end of the context (the engine's one rule)
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()

    def length_limit(self, prompt_tokens: int, max_model_len: int) -> int:
        """The most tokens the sequence may hold, prompt included."""
        if self.max_tokens is None:
            return max_model_len
        return min(prompt_tokens + self.max_tokens, max_model_len)

    def __post_init__(self) -> None:
        # Callers (the gateway) often hold lists or a dict for logit_bias; store
        # tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        self._validate()

    def _validate(self) -> None:
        # `not (lo <= x <= hi)` rather than `x < lo or x > hi` so NaN is rejected too.
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not (_INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        if not (1 <= self.n <= MAX_CHOICES):
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}, got {self.n}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            if token_id in seen:
                raise ValueError(f"logit_bias lists token id {token_id} more than once")
            seen.add(token_id)
            if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, "
                    f"got {bias} for token {token_id}"
                )

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or below GREEDY_BELOW_TEMPERATURE): take the argmax, draw nothing."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids this request names must exist in the model (ValueError naming the field)."""
        for i, t in enumerate(self.stop_token_ids):
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids[{i}] = {t} is outside the vocabulary (0..{vocab_size - 1})")
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs this request's token history (prompt and output)."""
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        raise ValueError(f"{name} must be between {lo:g} and {hi:g}, got {value}")
