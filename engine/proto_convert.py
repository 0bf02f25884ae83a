"""Between the protobuf messages and enums and the engine's own records: the one
place engine code converts either way (the tier link and the gRPC servicer both
use it)."""

from __future__ import annotations

from collections.abc import Callable

from common.request_class import from_pb as class_from_pb
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.guided.spec import GuideKind, GuidedSpec
from engine.outputs import RequestUpdate, TokenLogprob
from engine.request import CommitPolicy, FinishReason
from engine.sampling.defaults import SamplingDefaults
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from ignis.v1 import common_pb2, engine_pb2

_FINISH = {
    None: engine_pb2.FINISH_REASON_NONE,
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
}
_TIER_PB = {ReuseTier.NONE: common_pb2.REUSE_TIER_NONE, ReuseTier.DEVICE: common_pb2.REUSE_TIER_DEVICE,
            ReuseTier.HOST: common_pb2.REUSE_TIER_HOST, ReuseTier.RAM: common_pb2.REUSE_TIER_RAM,
            ReuseTier.DISK: common_pb2.REUSE_TIER_DISK}
_KIND_PB = {ReuseKind.NONE: common_pb2.REUSE_KIND_NONE, ReuseKind.CHECKPOINT: common_pb2.REUSE_KIND_CHECKPOINT,
            ReuseKind.PREFIX: common_pb2.REUSE_KIND_PREFIX, ReuseKind.PAGES: common_pb2.REUSE_KIND_PAGES}
_TIER_FROM_PB = {v: k for k, v in _TIER_PB.items()}
_KIND_FROM_PB = {v: k for k, v in _KIND_PB.items()}


def request_class(value: int) -> RequestClass:
    """UNSPECIFIED is interactive; a number the enum does not define is ValueError (INVALID_ARGUMENT)."""
    return class_from_pb(value)


def request_class_pb(value: RequestClass) -> common_pb2.RequestClass:
    return value.pb


def reuse_tier_pb(tier: ReuseTier) -> common_pb2.ReuseTier:
    return _TIER_PB[tier]


def reuse_tier(value: int, default: ReuseTier = ReuseTier.NONE) -> ReuseTier:
    return _TIER_FROM_PB.get(value, default)  # type: ignore[call-overload]


def reuse_kind_pb(kind: ReuseKind) -> common_pb2.ReuseKind:
    return _KIND_PB[kind]


def reuse_kind(value: int, default: ReuseKind = ReuseKind.NONE) -> ReuseKind:
    return _KIND_FROM_PB.get(value, default)  # type: ignore[call-overload]


def lookup_enabled(value: int) -> bool:
    """Whether a request's ReusePolicy.lookup lets it claim retained state (all but LOOKUP_BYPASS)."""
    return value != engine_pb2.ReusePolicy.LOOKUP_BYPASS


def commit_policy(value: int) -> CommitPolicy:
    if value == engine_pb2.ReusePolicy.COMMIT_PREFILL_STATE_ONLY:
        return CommitPolicy.PREFILL_STATE_ONLY
    if value == engine_pb2.ReusePolicy.COMMIT_INCLUDING_GENERATED_TOKENS:
        return CommitPolicy.INCLUDING_GENERATED_TOKENS
    if value == engine_pb2.ReusePolicy.COMMIT_NONE:
        return CommitPolicy.NONE
    raise ValueError(f"reuse.commit value {value} is not supported")


def sampling_params(msg: engine_pb2.SamplingParams, defaults: SamplingDefaults = SamplingDefaults(),
                    room: int | None = None) -> SamplingParams:
    """Proto -> validated params; a field left unset takes `defaults` (the checkpoint's generation_config.json,
    engine/sampling/defaults.py), and max_tokens unset there too means "up to the end of the context".
    `room`: the tokens the context leaves after the prompt, which a default max_tokens never asks past."""
    default_max = defaults.max_tokens
    if default_max is not None and room is not None:
        default_max = min(default_max, max(room, 0))
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else defaults.repetition_penalty),
        seed=_signed_seed(msg.seed) if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max,
        min_tokens=msg.min_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        n=msg.n if msg.HasField("n") else 1,
        logprobs=msg.logprobs or msg.top_logprobs > 0,
        top_logprobs=msg.top_logprobs,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )


def guided_spec(msg: engine_pb2.GuidedDecoding, tool_format: str) -> GuidedSpec | None:
    """Proto -> the request's guide (None: unconstrained); `tool_format`: the checkpoint's call syntax."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return GuidedSpec(GuideKind.JSON_OBJECT) if msg.json_object else None
    if kind == "choice":
        return GuidedSpec(GuideKind.CHOICE, choices=tuple(msg.choice.choices))
    if kind == "tool_calls":
        t = msg.tool_calls
        parallel = t.parallel_tool_calls if t.HasField("parallel_tool_calls") else True
        return GuidedSpec(GuideKind.TOOL_CALLS, source=t.tools_json, tool_choice=t.tool_choice,
                          tool_format=t.format or tool_format, parallel_tool_calls=parallel)
    source: str = getattr(msg, kind)
    return GuidedSpec(GuideKind(kind), source=source)  # `strict` changes nothing: a schema holds as written


def _signed_seed(value: int) -> int:
    """The proto field is uint64: a client's negative seed arrives in two's complement."""
    return value - 2**64 if value >= 2**63 else value


def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def logprob_message(tokenizer: Tokenizer, lp: TokenLogprob) -> engine_pb2.TokenLogprob:
    text, raw = _token_text(tokenizer, lp.token_id)
    msg = engine_pb2.TokenLogprob(token_id=lp.token_id, token=text, token_bytes=raw)
    if lp.logprob is not None:  # unset for the first prompt token
        msg.logprob = lp.logprob
    for tid, value in lp.top:
        t_text, t_raw = _token_text(tokenizer, tid)
        msg.top_logprobs.add(token_id=tid, token=t_text, logprob=value, token_bytes=t_raw)
    return msg


def update_messages(tokenizer: Tokenizer, update: RequestUpdate, prompt_ids: tuple[int, ...] | None
                    ) -> list[engine_pb2.GenerateResponse]:
    """One GenerateResponse per choice delta; usage rides on the last one (or its own)."""
    return fill_update_messages(tokenizer, update, prompt_ids, engine_pb2.GenerateResponse)


def fill_update_messages(tokenizer: Tokenizer, update: RequestUpdate, prompt_ids: tuple[int, ...] | None,
                         new: Callable[[], engine_pb2.GenerateResponse]) -> list[engine_pb2.GenerateResponse]:
    """update_messages into messages `new()` gives: a session fills its events' responses in place
    (building each and copying it in cost twice as much, per token of every stream)."""
    out = []
    for delta in update.deltas:
        msg = new()
        msg.index = delta.choice
        msg.token_ids.extend(delta.token_ids)
        msg.text = delta.text
        msg.finish_reason = _FINISH[delta.finish_reason]
        if delta.logprobs:
            msg.logprobs.extend(logprob_message(tokenizer, lp) for lp in delta.logprobs)
        if isinstance(delta.stop_reason, str):
            msg.stop_string = delta.stop_reason
        elif isinstance(delta.stop_reason, int):
            msg.stop_token_id = delta.stop_reason
        out.append(msg)
    if update.usage is not None:
        if not out:
            out.append(new())
        u = update.usage
        out[-1].usage.CopyFrom(engine_pb2.Usage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
            cached_tokens=u.cached_tokens, time_to_first_token_ms=u.time_to_first_token_ms,
            draft_tokens=u.draft_tokens, accepted_tokens=u.accepted_tokens, images=u.images,
            images_reused=u.images_reused,
            reuse=engine_pb2.ReuseInfo(tier=reuse_tier_pb(u.reuse.tier), kind=reuse_kind_pb(u.reuse.kind),
                                       reused_tokens=u.reuse.reused_tokens),
        ))
    if out and prompt_ids is not None:
        out[0].prompt_token_ids.extend(prompt_ids)
        if update.prompt_logprobs is not None:
            out[0].prompt_logprobs.extend(logprob_message(tokenizer, lp) for lp in update.prompt_logprobs)
    return out
