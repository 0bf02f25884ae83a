"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's shape: `{"lora_name", "lora_path"}`
and `{"lora_name"}`, answered with a line of text. Behind the API key like every /v1 route.

Each healthy engine is asked (a pool of replicas serves the adapter on every one of them); the
call succeeds when at least one engine serves it (loads) or served it (unloads), and its model
list is updated at once, so a request naming the adapter right after routes to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.body import Fields, read_json
from gateway.engines import EngineClient
from gateway.errors import OpenAIError, from_grpc, invalid, unavailable
from gateway.state import state_of
from ignis.v1 import engine_pb2

log = logging.getLogger("ignis.gateway")
CALL_TIMEOUT = 120.0  # seconds: an adapter's files are read and placed between two steps


async def load_lora_adapter(request: Request) -> Response:
    state = state_of(request)
    body = Fields(await read_json(request, state.config.max_request_bytes))
    name = body.string("lora_name", required=True) or ""
    path = body.string("lora_path", required=True) or ""
    if not name:
        raise invalid("lora_name must not be empty", param="lora_name")
    if not path:
        raise invalid("lora_path must not be empty", param="lora_path")
    call = engine_pb2.LoadAdapterRequest(name=name, path=path)
    replies = await _ask_all(_healthy(request), lambda e: e.stub.LoadAdapter(call, timeout=CALL_TIMEOUT))
    loaded = [(engine, reply) for engine, reply in replies if isinstance(reply, engine_pb2.LoadAdapterResponse)]
    if not loaded:
        raise _first_error(replies, "lora_path")
    for engine, reply in loaded:
        engine.models[reply.card.id] = reply.card
    _log_refusals(replies, f"load LoRA adapter {name!r}")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = state_of(request)
    body = Fields(await read_json(request, state.config.max_request_bytes))
    name = body.string("lora_name", required=True) or ""
    call = engine_pb2.UnloadAdapterRequest(name=name)
    replies = await _ask_all(_healthy(request), lambda e: e.stub.UnloadAdapter(call, timeout=CALL_TIMEOUT))
    unloaded = [engine for engine, reply in replies if isinstance(reply, engine_pb2.UnloadAdapterResponse)]
    if not unloaded:
        raise _first_error(replies, "lora_name")
    for engine in unloaded:
        engine.models.pop(name, None)
    _log_refusals(replies, f"unload LoRA adapter {name!r}")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _healthy(request: Request) -> list[EngineClient]:
    engines = [e for e in state_of(request).pool.engines if e.healthy]
    if not engines:
        raise unavailable("no engine is available")
    return engines


async def _ask_all(engines: list[EngineClient], call: Callable[[EngineClient], Awaitable[object]]
                   ) -> list[tuple[EngineClient, object]]:
    """Every engine's answer, or its error."""
    answers = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
    return list(zip(engines, answers))


def _log_refusals(replies: list[tuple[EngineClient, object]], what: str) -> None:
    """The engines that did not follow where others did: the pool now differs between them."""
    for engine, reply in replies:
        if isinstance(reply, grpc.aio.AioRpcError):
            log.warning("engine %s did not %s: %s: %s", engine.address, what, reply.code().name, reply.details())


def _first_error(replies: list[tuple[EngineClient, object]], param: str) -> OpenAIError:
    """The answer when no engine did it: the most telling engine's refusal as an OpenAI error."""
    errors = [reply for _, reply in replies if isinstance(reply, grpc.aio.AioRpcError)]
    for reply in replies:
        if isinstance(reply[1], BaseException) and not isinstance(reply[1], grpc.aio.AioRpcError):
            log.error("an adapter call to engine %s failed: %r", reply[0].address, reply[1])
    # a refusal that names the adapter's fault beats an engine that serves no adapters at all
    order = [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION]
    errors.sort(key=lambda e: order.index(e.code()) if e.code() in order else len(order))
    if not errors:
        return OpenAIError(500, "no engine answered the adapter call", code="engine_error")
    err = errors[0]
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        return OpenAIError(404, details, param="lora_name", code="lora_not_found")
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # no engine serves adapters: no field is at fault
        return invalid(details)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
        return invalid(details, param="lora_name" if code == grpc.StatusCode.ALREADY_EXISTS else param)
    return from_grpc(err)
