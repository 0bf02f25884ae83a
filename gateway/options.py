"""The ignis-specific request options: class, tenant salt, reuse policy, routing key.

The request class comes from the body's ``ignis.class`` or the
``X-Ignis-Class`` header (the body wins: it is the more specific of the two);
``cache_salt`` (vLLM's name) keeps tenants' states apart; ``prompt_cache_key``
(OpenAI's routing hint for cache hits) replaces the derived routing key.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers

from common.request_class import NAMES, from_name
from gateway.body import Fields
from gateway.errors import invalid
from ignis.v1 import common_pb2, engine_pb2

CLASS_HEADER = "x-ignis-class"
_LOOKUP = {"use_cache": engine_pb2.ReusePolicy.LOOKUP_USE_CACHE, "bypass": engine_pb2.ReusePolicy.LOOKUP_BYPASS}
_COMMIT = {"all": engine_pb2.ReusePolicy.COMMIT_INCLUDING_GENERATED_TOKENS,
           "prefill": engine_pb2.ReusePolicy.COMMIT_PREFILL_STATE_ONLY,
           "none": engine_pb2.ReusePolicy.COMMIT_NONE}


@dataclass(frozen=True, slots=True)
class EngineOptions:
    request_class: common_pb2.RequestClass
    cache_salt: str
    reuse: engine_pb2.ReusePolicy | None
    route_key: str | None  # prompt_cache_key: when set, routing hashes this instead of the prompt head
    speculative: bool | None = None  # ignis.speculative: False turns speculative decoding off for the request

    def apply(self, request: engine_pb2.GenerateRequest) -> None:
        request.request_class = self.request_class
        request.cache_salt = self.cache_salt
        if self.reuse is not None:
            request.reuse.CopyFrom(self.reuse)
        if self.speculative is not None:
            request.speculative = self.speculative


def engine_options(body: Fields, headers: Headers) -> EngineOptions:
    ignis = body.obj("ignis")
    name = ignis.string("class", choices=NAMES) if ignis is not None else None
    if name is None and CLASS_HEADER in headers:
        name = headers[CLASS_HEADER].strip().lower()
        if name not in NAMES:
            raise invalid(f"the X-Ignis-Class header must be one of {', '.join(NAMES)}, got {name!r}",
                          param="X-Ignis-Class")
    reuse = None
    if ignis is not None and (ignis.has("lookup") or ignis.has("commit")):
        lookup = ignis.string("lookup", choices=tuple(_LOOKUP)) or "use_cache"
        commit = ignis.string("commit", choices=tuple(_COMMIT)) or "all"
        reuse = engine_pb2.ReusePolicy(lookup=_LOOKUP[lookup], commit=_COMMIT[commit])
    return EngineOptions(
        request_class=from_name(name or "interactive").pb,
        cache_salt=body.string("cache_salt") or "",
        reuse=reuse,
        route_key=body.string("prompt_cache_key"),
        speculative=ignis.boolean("speculative") if ignis is not None else None,
    )
