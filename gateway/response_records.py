"""Stored responses, seen from the gateway: ids, scopes, the record, and the engine calls.

The gateway keeps nothing: a record lives in the response store of the engine
named in its id (``resp_<engine_id>_<hex>``; engines report their id in
ListModels), so any gateway in front of that engine resolves it, before and
after a restart of either.

A record is one JSON object: the response as returned and every input item
that produced it (earlier turns' inputs and outputs, then its own request's;
each with an id), which is what ``/input_items`` lists, as OpenAI's does. The
conversation a continuation renders is those items plus the response's output:
one read. The scope is a digest of the key the client presented and its
cache_salt: the raw key never leaves the gateway, and a read with another
scope is the engine's NOT_FOUND, as an unknown id is.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from starlette.datastructures import Headers

from gateway.aliases import JSONObject
from gateway.engines import EngineClient, EnginePool
from gateway.errors import OpenAIError, from_grpc, unavailable
from ignis.v1 import engine_pb2

RPC_TIMEOUT = 10.0  # seconds for one record call (an LMDB read or write)
_ID = re.compile(r"^resp_([0-9a-f]{1,32})_[0-9a-f]{8,64}$")


def scope_of(headers: Headers, cache_salt: str) -> str:
    """hex(sha256(key + "\\0" + cache_salt)); the key is the bearer token presented ("" for none)."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else ""
    return hashlib.sha256(f"{key}\0{cache_salt}".encode()).hexdigest()


def new_id(engine_id: str) -> str:
    return f"resp_{engine_id}_{uuid.uuid4().hex}" if engine_id else f"resp_{uuid.uuid4().hex}"


def engine_id_of(rid: str) -> str | None:
    match = _ID.match(rid)
    return match.group(1) if match else None


def not_found(rid: str, param: str | None) -> OpenAIError:
    if param == "previous_response_id":
        return OpenAIError(404, f"Previous response with id '{rid}' not found.", param=param,
                           code="previous_response_not_found")
    return OpenAIError(404, f"Response with id '{rid}' not found.", param=param, code="response_not_found")


@dataclass(slots=True)
class Record:
    response: JSONObject
    input_items: list[JSONObject] = field(default_factory=list)  # all that produced it, earlier turns first

    @property
    def conversation(self) -> list[JSONObject]:
        """Everything so far as input items: what a continuation renders before its new input."""
        return [*self.input_items, *as_input(self.response.get("output", []))]

    def encode(self) -> bytes:
        return json.dumps({"response": self.response, "input_items": self.input_items}, ensure_ascii=False,
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Record:
        obj = json.loads(data)
        return cls(obj["response"], obj.get("input_items", []))


def as_input(output: list[JSONObject]) -> list[JSONObject]:
    """A response's output items as the input items a client would resend: what renders the same.

    A message becomes its text as one string (a chat client's assistant turn); reasoning items
    are kept (the renderer drops them, as it does the client's).
    """
    items: list[JSONObject] = []
    for item in output:
        kind = item.get("type")
        if kind == "message":
            text = "".join(p.get("text", "") for p in item.get("content", []) if isinstance(p, dict))
            items.append({"type": "message", "role": "assistant", "content": text, "id": item.get("id")})
        elif kind == "function_call":
            call = {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                    "arguments": item["arguments"], "id": item.get("id")}
            if item.get("namespace"):
                call["namespace"] = item["namespace"]
            items.append(call)
        else:
            items.append(item)
    return items


def with_ids(items: list[Any]) -> list[JSONObject]:
    """The request's input items as stored: each an object with an id (a string input is one user message)."""
    out: list[JSONObject] = []
    for item in items:
        item = dict(item)
        kind = item.get("type") or "message"
        if "id" not in item or not isinstance(item["id"], str):
            prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
            item["id"] = f"{prefix}_{uuid.uuid4().hex}"
        item.setdefault("type", kind)
        out.append(item)
    return out


def _owner(pool: EnginePool, rid: str, param: str | None) -> EngineClient:
    engine_id = engine_id_of(rid)
    engine = pool.by_engine_id(engine_id) if engine_id else None
    if engine is None:
        # An id of no engine this gateway knows (or not an id of ours): it cannot exist here.
        raise not_found(rid, param)
    return engine


def _error(exc: grpc.aio.AioRpcError, rid: str, param: str | None) -> OpenAIError:
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return not_found(rid, param)
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return unavailable(f"the engine holding response '{rid}' is unavailable: {exc.details()}")
    return from_grpc(exc)


async def fetch(pool: EnginePool, rid: str, scope: str, param: str | None = None
                ) -> tuple[Record, EngineClient]:
    """The record under `rid` for `scope` and the engine keeping it; 404 when there is none."""
    engine = _owner(pool, rid, param)
    try:
        reply = await engine.stub.GetResponse(engine_pb2.GetResponseRequest(id=rid, scope=scope),
                                              timeout=RPC_TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        raise _error(exc, rid, param) from None
    return Record.decode(reply.record), engine


async def save(engine: EngineClient, rid: str, scope: str, record: Record) -> None:
    try:
        await engine.stub.PutResponse(engine_pb2.PutResponseRequest(id=rid, scope=scope, record=record.encode()),
                                      timeout=RPC_TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        raise _error(exc, rid, None) from None


async def delete(pool: EnginePool, rid: str, scope: str) -> None:
    engine = _owner(pool, rid, None)
    try:
        await engine.stub.DeleteResponse(engine_pb2.DeleteResponseRequest(id=rid, scope=scope), timeout=RPC_TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        raise _error(exc, rid, None) from None
