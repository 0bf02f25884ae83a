"""/v1/responses (the Responses API): create, and the stored responses (retrieve, delete, input items).

``store`` (default true) keeps the response's record in the response store of
an engine (gateway/response_records.py); its id names that engine.
``previous_response_id`` reads that record and renders the stored conversation
followed by the new input, exactly as if the client had resent it all, so the
previous turn's retained state is claimed; the continuation is pinned to that
engine. ``instructions`` are the current request's only (OpenAI: they are not
carried over). The WebSocket mode (gateway/routes/responses_ws.py) runs the
same `Turn`s over one socket.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from gateway import logprobs as lp
from gateway import response_records as records
from gateway.aliases import JSONObject, SSEBytes
from gateway.body import Fields, read_json
from gateway.cancel import until_disconnect
from gateway.choices import accumulate
from gateway.engines import EngineClient
from gateway.errors import OpenAIError, invalid
from gateway.guided import asks_reasoning, responses_guided
from gateway.image_parts import ImageSource, attach_images
from gateway.items import input_items, responses_chat
from gateway.responses_tools import ToolName, responses_tools
from gateway.json_body import JSONBody
from gateway.messages import parses_tool_calls
from gateway.options import engine_options
from gateway.response_output import OutputBuilder
from gateway.routing import chat_head, route_key, route_keys
from gateway.sampling import TokenLimit, sampling_params
from gateway.shutdown import ShuttingDown
from gateway.sse import EventStream, named_event
from gateway.state import GatewayState, state_of
from gateway.output_formats import ChoiceParser, output_formats
from gateway.upstream import CallSpec, collect, generate
from gateway.usage import Usage
from ignis.v1 import engine_pb2

log = logging.getLogger("ignis.gateway")
LIMIT = TokenLimit(("max_output_tokens",), default=None)


@dataclass(slots=True)
class Conversation:
    """A response's id, its conversation (as input items) and the engine keeping it: what a
    WebSocket connection remembers of its latest response, store or not."""

    rid: str
    items: list[JSONObject]
    engine: EngineClient | None


@dataclass(slots=True)
class Turn:
    """One create request, ready to run: the engine call, the reply builder, what to store."""

    state: GatewayState
    rid: str
    request: engine_pb2.GenerateRequest
    key: bytes
    pin: EngineClient | None  # keeps the record: the previous response's engine, else routing's first
    candidates: list[EngineClient]  # the engines to generate on, in order: `pin` first
    store: bool
    scope: str
    reply: _Reply
    own_items: list[JSONObject]  # this request's input items, with ids
    prior: list[JSONObject]  # the previous response's conversation (its inputs and outputs)

    def upstream(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        spec = CallSpec("input", "max_output_tokens", self.state.config.request_timeout)
        return generate(self.state.pool, self.request, self.key, spec, self.candidates)

    def record(self, final: JSONObject) -> records.Record:
        return records.Record(final, [*self.prior, *self.own_items])

    def conversation(self, final: JSONObject) -> Conversation:
        return Conversation(self.rid, self.record(final).conversation, self.pin)

    async def keep(self, final: JSONObject) -> None:
        """Store the record (before the client sees the response end: a GET right after finds it)."""
        if not self.store or self.pin is None or not self.pin.engine_id:
            return
        try:
            await records.save(self.pin, self.rid, self.scope, self.record(final))
        except OpenAIError as err:  # the answer stands; the client learns at its next read
            log.warning("could not store response %s on %s: %s", self.rid, self.pin.address, err.message)


def _check(body: Fields) -> None:
    if body.has("conversation"):
        raise invalid("'conversation' is not supported: continue with 'previous_response_id'", param="conversation")
    if body.boolean("background"):
        raise invalid("background responses are not supported", param="background")


async def prepare(state: GatewayState, body: Fields, headers: Headers, local: Conversation | None = None,
                  prewarm: bool = False) -> Turn:
    """Validate a create body and resolve its previous response (`local` first: the socket's own)."""
    model = body.string("model", required=True) or ""
    _check(body)
    opts = engine_options(body, headers)
    scope = records.scope_of(headers, opts.cache_salt)
    store = body.boolean("store")
    store = True if store is None else store
    previous = body.string("previous_response_id")
    prior: list[JSONObject] = []
    pin: EngineClient | None = None
    if previous:
        if local is not None and local.rid == previous:
            prior, pin = local.items, local.engine
        else:
            record, pin = await records.fetch(state.pool, previous, scope, "previous_response_id")
            prior = record.conversation
    tools = responses_tools(body)
    images: list[ImageSource] = []
    chat = responses_chat(body, images, prior, tools)
    own_items = records.with_ids(input_items(body))
    guided = responses_guided(body, chat, state.config.tool_call_parser, tools.guide_json() if tools.grammars else "")
    sampling = sampling_params(body, LIMIT, "responses")
    if prewarm:
        # Prefill only: the engine retains the state at the prompt's end. Without the assistant
        # opener, that end is a prefix of every later turn (a continuation's next input, or a
        # resend of the same input with the opener), so any of them claims it whole.
        sampling.max_tokens = 0
        chat.add_generation_prompt = False
    truncation = body.string("truncation", choices=("auto", "disabled")) or "disabled"
    chat.truncate = truncation == "auto"  # the engine drops the oldest turns when the context is short
    parallel = body.boolean("parallel_tool_calls")
    metadata = body.obj("metadata")
    await attach_images(chat, images, state.media, opts.cache_salt)  # after the cheap checks: it may fetch

    req = engine_pb2.GenerateRequest(model=model, chat=chat, sampling=sampling)
    if guided is not None:
        req.guided.CopyFrom(guided)
    opts.apply(req)
    key = route_key(model, opts.cache_salt, opts.route_key or chat_head(chat))
    # Ordered once (a round-robin rule moves on at every call): a continuation's engine first, else
    # the engine routing picks keeps the record too.
    candidates = state.pool.candidates(model, route_keys(req, key))
    if pin is not None:
        candidates = [pin, *(e for e in candidates if e is not pin)]
    pin = candidates[0] if candidates else None
    rid = records.new_id(pin.engine_id if store and pin is not None else "")
    req.request_id = rid
    base: JSONObject = {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
        "instructions": body.string("instructions"), "tools": body.raw("tools") or [],
        "tool_choice": body.raw("tool_choice") or "auto",
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": body.raw("temperature"), "top_p": body.raw("top_p"),
        "max_output_tokens": body.raw("max_output_tokens"), "previous_response_id": previous or None,
        "store": store, "text": _text(body), "truncation": truncation, "reasoning": body.raw("reasoning"),
        "metadata": metadata.data if metadata is not None else {}, "user": body.string("user"),
        "error": None, "incomplete_details": None,
    }
    formats = output_formats(state.pool, model, state.config.tool_call_parser, state.config.reasoning_parser)
    parse_calls = parses_tool_calls(chat)
    if parse_calls and formats.tool_call == "mistral" and not sampling.HasField("skip_special_tokens"):
        req.sampling.skip_special_tokens = False  # [TOOL_CALLS] is a special token: keep it in the text
    if guided is not None and formats.reasoning and asks_reasoning(body):
        req.guided.after_reasoning = True
    turn = Turn(state, rid, req, key, pin, candidates, store, scope,
                _Reply(base, lambda: ChoiceParser.make(formats, chat.tools_json, parse_calls), sampling.logprobs, state,
                       prewarm, tools.names),
                own_items, prior)
    turn.reply.keep = turn.keep
    return turn


async def responses(request: Request) -> Response:
    state = state_of(request)
    body = Fields(await read_json(request, state.config.max_request_bytes))
    turn = await prepare(state, body, request.headers)
    headers = {"X-Request-Id": turn.rid}
    if body.boolean("stream"):
        return EventStream(_sse(turn.reply.batches(turn.upstream())), headers=headers)
    messages = await until_disconnect(request, collect(turn.upstream()))
    final = turn.reply.whole(messages)
    await turn.keep(final)
    return JSONBody(final, headers=headers)


async def _sse(batches: AsyncIterator[list[JSONObject]]) -> AsyncIterator[SSEBytes]:
    """An engine message's events as one write."""
    async with contextlib.aclosing(batches):  # type: ignore[type-var]
        async for batch in batches:
            yield b"".join([named_event(event["type"], event) for event in batch])


# ---------------------------------------------------------------- stored responses


async def get_response(request: Request) -> Response:
    state = state_of(request)
    rid = request.path_params["response_id"]
    record, _ = await records.fetch(state.pool, rid, _read_scope(request))
    return JSONBody(record.response)


async def delete_response(request: Request) -> Response:
    state = state_of(request)
    rid = request.path_params["response_id"]
    await records.delete(state.pool, rid, _read_scope(request))
    return JSONBody({"id": rid, "object": "response", "deleted": True})


async def list_input_items(request: Request) -> Response:
    """OpenAI's page: ``limit`` 1..100 (20), ``order`` asc|desc (desc), ``after`` an item id."""
    state = state_of(request)
    q = request.query_params
    limit = _int_param(q.get("limit"), "limit", 20)
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
    record, _ = await records.fetch(state.pool, request.path_params["response_id"], _read_scope(request))
    items = [_listed(item) for item in record.input_items]
    if order == "desc":
        items.reverse()
    if (after := q.get("after")) is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid(f"no input item with id {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONBody({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def _read_scope(request: Request) -> str:
    """Reads scope by the key and by cache_salt (a query parameter, or the header engine_options reads)."""
    salt = request.query_params.get("cache_salt") or request.headers.get("x-ignis-cache-salt", "")
    return records.scope_of(request.headers, salt)


def _int_param(value: str | None, name: str, default: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise invalid(f"'{name}' must be an integer, got {value!r}", param=name) from None
    if not 1 <= number <= 100:
        raise invalid(f"'{name}' must be between 1 and 100, got {number}", param=name)
    return number


def _listed(item: JSONObject) -> JSONObject:
    """An input item as OpenAI lists it: a message's string content as one part (input_text, or
    output_text for an earlier turn's reply)."""
    if item.get("type") == "message" and isinstance(item.get("content"), str):
        if item.get("role") == "assistant":
            part: JSONObject = {"type": "output_text", "text": item["content"], "annotations": []}
        else:
            part = {"type": "input_text", "text": item["content"]}
        return dict(item, content=[part])
    return item


# ---------------------------------------------------------------- the reply


def _text(body: Fields) -> object:
    """`text` echoed as sent, with its format defaulted to plain text."""
    text = body.obj("text")
    if text is None:
        return {"format": {"type": "text"}}
    fmt = text.obj("format")
    return dict(text.data, format=fmt.data if fmt is not None else {"type": "text"})


def _status(finish: int, prewarm: bool) -> tuple[str, JSONObject | None]:
    if prewarm:
        return "completed", None  # nothing was asked for: the length limit of 0 is the point
    if finish == engine_pb2.FINISH_REASON_LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == engine_pb2.FINISH_REASON_ABORT:
        return "incomplete", {"reason": "abort"}
    return "completed", None


class _Reply:
    def __init__(self, base: JSONObject, parser: Callable[[], ChoiceParser], logprobs: bool,
                 state: GatewayState, prewarm: bool = False, names: dict[str, ToolName] | None = None) -> None:
        self.base, self.parser, self.logprobs, self.state, self.prewarm = base, parser, logprobs, state, prewarm
        self.names = names or {}  # the model's tool names -> the client's (namespaces, custom tools)
        self.keep: Callable[[JSONObject], Awaitable[None]] | None = None  # stores the final response
        self.final: JSONObject | None = None

    def _final(self, builder: OutputBuilder, finish: int, usage: Usage, parser: ChoiceParser) -> JSONObject:
        status, incomplete = _status(finish, self.prewarm)
        usage = replace(usage, reasoning_tokens=parser.reasoning_tokens)
        self.state.metrics.observe_usage(usage)
        self.final = dict(self.base, status=status, incomplete_details=incomplete,
                          output=[] if self.prewarm else builder.items, usage=usage.responses(), ignis=usage.ignis())
        return self.final

    def whole(self, messages: list[engine_pb2.GenerateResponse]) -> JSONObject:
        collected = accumulate(messages)
        choice = collected.choices.get(0)
        builder, parser = OutputBuilder(self.names), self.parser()
        for msg in messages:  # message by message, as a stream is read: reasoning tokens are counted per message
            if msg.index == 0:
                logprobs = lp.chat_content(msg.logprobs) if self.logprobs and msg.logprobs else None
                finished = msg.finish_reason != engine_pb2.FINISH_REASON_NONE
                builder.feed(parser.feed(msg.text, len(msg.token_ids), finished), logprobs)
        builder.finish()
        return self._final(builder, choice.finish if choice else engine_pb2.FINISH_REASON_STOP, collected.usage,
                           parser)

    async def events(self, upstream: AsyncIterator[engine_pb2.GenerateResponse]) -> AsyncIterator[JSONObject]:
        """The ``response.*`` events, numbered, one by one (`batches`, flattened)."""
        async with contextlib.aclosing(self.batches(upstream)) as batches:  # type: ignore[type-var]
            async for batch in batches:
                for event in batch:
                    yield event

    async def batches(self, upstream: AsyncIterator[engine_pb2.GenerateResponse]) -> AsyncIterator[list[JSONObject]]:
        """The ``response.*`` events, numbered, in a list per engine message (an SSE stream writes each list
        at once: the end of a response is four or more events); the record is kept before the last one."""
        seq = 0

        def numbered(event: JSONObject) -> JSONObject:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return event

        parser, builder = self.parser(), OutputBuilder(self.names)
        finish = engine_pb2.FINISH_REASON_NONE
        started = False
        batch: list[JSONObject] = []  # this message's events so far (an error ends them)
        async with contextlib.aclosing(upstream):  # type: ignore[type-var]
            try:
                async for msg in upstream:
                    if not started:  # errors before the first message are an HTTP status
                        started = True
                        pending = dict(self.base, status="in_progress", output=[], usage=None)
                        batch += [numbered({"type": "response.created", "response": pending}),
                                  numbered({"type": "response.in_progress", "response": pending})]
                    if msg.index == 0:
                        finished = msg.finish_reason != engine_pb2.FINISH_REASON_NONE
                        if finished:
                            finish = msg.finish_reason
                        logprobs = lp.chat_content(msg.logprobs) if self.logprobs and msg.logprobs else None
                        if not self.prewarm:
                            fed = builder.feed(parser.feed(msg.text, len(msg.token_ids), finished), logprobs)
                            batch += [numbered(event) for event in fed]
                        if msg.HasField("usage"):
                            if not self.prewarm:
                                batch += [numbered(event) for event in builder.finish()]
                            final = self._final(builder, finish, Usage.from_proto(msg.usage), parser)
                            if self.keep is not None:
                                await self.keep(final)
                            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                            batch.append(numbered({"type": kind, "response": final}))
                    if batch:
                        yield batch
                        batch = []
            except ShuttingDown as err:
                if not started:
                    raise
                yield [*batch, numbered({"type": "response.failed", "response": self._failed(builder, err)})]
            except OpenAIError as err:
                if not started:
                    raise
                yield [*batch, numbered({"type": "error", "code": err.code, "message": err.message, "param": err.param})]

    def _failed(self, builder: OutputBuilder, err: OpenAIError) -> JSONObject:
        """The response the server's stop ended: failed, with what it had output (not stored)."""
        error: JSONObject = {"code": "server_error", "message": err.message}  # a code of OpenAI's ResponseError
        return dict(self.base, status="failed", error=error, output=list(builder.items), usage=None)
