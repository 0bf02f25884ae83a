"""OpenAI sampling fields -> `engine_pb2.SamplingParams`.

Types and obvious ranges are checked here so the 400 names the OpenAI field;
the engine re-validates everything (its INVALID_ARGUMENT maps to a 400 too).

Token limit: `max_completion_tokens` (chat), then `max_tokens`. When neither is
given, chat and responses leave `max_tokens` unset, which the engine reads as
"up to the end of the context" (what OpenAI and vLLM do for chat); completions
default to 16, the legacy OpenAI (and vLLM) default for that endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.body import Fields
from gateway.errors import invalid
from ignis.v1 import engine_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20

LogprobsStyle = Literal["chat", "completions", "responses"]


@dataclass(frozen=True, slots=True)
class TokenLimit:
    """Which body fields set the limit, in order of precedence, and the default."""

    fields: tuple[str, ...]
    default: int | None
    minimum: int = 1  # completions with echo may ask for 0 (score the prompt only)

    @property
    def param(self) -> str:
        return self.fields[0]


def sampling_params(body: Fields, limit: TokenLimit, style: LogprobsStyle) -> engine_pb2.SamplingParams:
    p = engine_pb2.SamplingParams()
    if (t := body.number("temperature", lo=0.0, hi=2.0)) is not None:
        p.temperature = t
    if (v := body.number("top_p", lo=0.0, hi=1.0)) is not None:
        p.top_p = v
    for name in ("presence_penalty", "frequency_penalty"):
        if (v := body.number(name, lo=-2.0, hi=2.0)) is not None:
            setattr(p, name, v)
    if (seed := body.integer("seed", lo=-(2**63), hi=2**63 - 1)) is not None:
        # The proto field is uint64: a negative seed travels in two's complement and the engine reads
        # it back as the signed value (so -5 is -5 there, not 2**64 - 5).
        p.seed = seed % 2**64
    if style != "responses" and (n := body.integer("n", lo=1, hi=2**32 - 1)) is not None:
        p.n = n
    if (stop := body.string_list("stop")) is not None:
        p.stop.extend(stop)
    _token_limit(body, limit, p)
    _logprobs(body, style, p)
    _logit_bias(body, p)
    _extensions(body, p)
    return p


def _token_limit(body: Fields, limit: TokenLimit, p: engine_pb2.SamplingParams) -> None:
    for name in limit.fields:
        value = body.integer(name, lo=limit.minimum, hi=2**32 - 1)
        if value is not None:
            p.max_tokens = value
            return
    if limit.default is not None:
        p.max_tokens = limit.default


def _logprobs(body: Fields, style: LogprobsStyle, p: engine_pb2.SamplingParams) -> None:
    if style == "completions":
        # Completions: `logprobs` is the number of alternatives (0 = just the sampled token's).
        if (k := body.integer("logprobs", lo=0, hi=MAX_TOP_LOGPROBS)) is not None:
            p.logprobs = True
            p.top_logprobs = k
        return
    if style == "chat":
        wanted = bool(body.boolean("logprobs"))
    else:  # responses: logprobs ride on output_text when `include` asks for them
        include = body.string_list("include") or []
        wanted = "message.output_text.logprobs" in include
    k = body.integer("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if k and not wanted:
        param = "include" if style == "responses" else "logprobs"
        raise invalid(f"top_logprobs needs {param} to ask for logprobs", param="top_logprobs")
    p.logprobs = wanted
    p.top_logprobs = k or 0


def _logit_bias(body: Fields, p: engine_pb2.SamplingParams) -> None:
    bias = body.obj("logit_bias")
    if bias is None:
        return
    for key, value in bias.data.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or token >= 2**32:
            raise invalid(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid(f"'logit_bias' values must be numbers between -100 and 100, got {value!r} for {key}",
                          param="logit_bias")
        p.logit_bias[token] = float(value)


def _extensions(body: Fields, p: engine_pb2.SamplingParams) -> None:
    """The vLLM extensions clients already send (extra_body): same names, same meaning."""
    if (k := body.integer("top_k", lo=-1, hi=2**32 - 1)) is not None:
        p.top_k = max(k, 0)  # vLLM spells "off" as -1
    if (v := body.number("min_p", lo=0.0, hi=1.0)) is not None:
        p.min_p = v
    if (v := body.number("repetition_penalty")) is not None:
        p.repetition_penalty = v
    if (m := body.integer("min_tokens", lo=0, hi=2**32 - 1)) is not None:
        p.min_tokens = m
    ids = body.array("stop_token_ids")
    if ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in ids):
            raise invalid("'stop_token_ids' must be an array of token ids", param="stop_token_ids")
        p.stop_token_ids.extend(ids)
    if (b := body.boolean("ignore_eos")) is not None:
        p.ignore_eos = b
    if (b := body.boolean("skip_special_tokens")) is not None:
        p.skip_special_tokens = b
