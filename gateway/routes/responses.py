"""POST /v1/responses (the Responses API), stateless.

Nothing is stored: ``previous_response_id`` and ``conversation`` get a 400
that says to send the whole input, and ``store`` is accepted but answered
``false``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import logprobs as lp
from gateway.aliases import JSONObject, SSEBytes
from gateway.body import Fields, read_json
from gateway.cancel import until_disconnect
from gateway.choices import accumulate
from gateway.errors import OpenAIError, invalid
from gateway.guided import responses_guided
from gateway.items import responses_chat
from gateway.messages import parses_tool_calls
from gateway.options import engine_options
from gateway.response_output import OutputBuilder
from gateway.routing import chat_head, route_key
from gateway.sampling import TokenLimit, sampling_params
from gateway.sse import EventStream, named_event
from gateway.state import GatewayState, state_of
from gateway.output_formats import ChoiceParser, output_formats
from gateway.upstream import CallSpec, collect, generate
from gateway.usage import Usage
from ignis.v1 import engine_pb2

LIMIT = TokenLimit(("max_output_tokens",), default=None)
_STATELESS = "the gateway keeps no state between requests: send the whole conversation in 'input'"


def _check_stateless(body: Fields) -> None:
    for name in ("previous_response_id", "conversation"):
        if body.has(name):
            raise invalid(f"'{name}' is not supported: {_STATELESS}", param=name)
    if body.boolean("background"):
        raise invalid("background responses are not supported: they would need stored state", param="background")


async def responses(request: Request) -> Response:
    state = state_of(request)
    body = Fields(await read_json(request, state.config.max_request_bytes))
    model = body.string("model", required=True) or ""
    _check_stateless(body)
    chat = responses_chat(body)
    guided = responses_guided(body, chat)
    sampling = sampling_params(body, LIMIT, "responses")
    opts = engine_options(body, request.headers)
    stream = bool(body.boolean("stream"))
    metadata = body.obj("metadata")

    rid = "resp_" + uuid.uuid4().hex
    req = engine_pb2.GenerateRequest(request_id=rid, model=model, chat=chat, sampling=sampling)
    if guided is not None:
        req.guided.CopyFrom(guided)
    opts.apply(req)
    key = route_key(model, opts.cache_salt, opts.route_key or chat_head(chat))
    upstream = generate(state.pool, req, key, CallSpec("input", "max_output_tokens", state.config.request_timeout))
    base: JSONObject = {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
        "instructions": body.string("instructions"), "tools": body.raw("tools") or [],
        "tool_choice": body.raw("tool_choice") or "auto", "parallel_tool_calls": True,
        "temperature": body.raw("temperature"), "top_p": body.raw("top_p"),
        "max_output_tokens": body.raw("max_output_tokens"), "previous_response_id": None, "store": False,
        "text": {"format": _text_format(body)}, "truncation": "disabled", "reasoning": None,
        "metadata": metadata.data if metadata is not None else {}, "user": body.string("user"),
        "error": None, "incomplete_details": None,
    }
    formats = output_formats(state.pool, model, state.config.tool_call_parser, state.config.reasoning_parser)
    tools = parses_tool_calls(chat)
    if tools and formats.tool_call == "mistral" and not sampling.HasField("skip_special_tokens"):
        req.sampling.skip_special_tokens = False  # [TOOL_CALLS] is a special token: keep it in the text
    reply = _Reply(base, lambda: ChoiceParser.make(formats, chat.tools_json, tools), sampling.logprobs, state)
    if stream:
        return EventStream(reply.events(upstream), headers={"X-Request-Id": rid})
    messages = await until_disconnect(request, collect(upstream))
    return JSONResponse(reply.whole(messages), headers={"X-Request-Id": rid})


def _text_format(body: Fields) -> object:
    text = body.obj("text")
    fmt = text.obj("format") if text is not None else None
    return fmt.data if fmt is not None else {"type": "text"}


def _status(finish: int) -> tuple[str, JSONObject | None]:
    if finish == engine_pb2.FINISH_REASON_LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == engine_pb2.FINISH_REASON_ABORT:
        return "incomplete", {"reason": "abort"}
    return "completed", None


class _Reply:
    def __init__(self, base: JSONObject, parser: Callable[[], ChoiceParser], logprobs: bool,
                 state: GatewayState) -> None:
        self.base, self.parser, self.logprobs, self.state = base, parser, logprobs, state

    def _final(self, builder: OutputBuilder, finish: int, usage: Usage, parser: ChoiceParser) -> JSONObject:
        status, incomplete = _status(finish)
        usage = replace(usage, reasoning_tokens=parser.reasoning_tokens)
        self.state.metrics.observe_usage(usage)
        return dict(self.base, status=status, incomplete_details=incomplete, output=builder.items,
                    usage=usage.responses(), ignis=usage.ignis())

    def whole(self, messages: list[engine_pb2.GenerateResponse]) -> JSONObject:
        collected = accumulate(messages)
        choice = collected.choices.get(0)
        builder, parser = OutputBuilder(), self.parser()
        for msg in messages:  # message by message, as a stream is read: reasoning tokens are counted per message
            if msg.index == 0:
                logprobs = lp.chat_content(msg.logprobs) if self.logprobs and msg.logprobs else None
                finished = msg.finish_reason != engine_pb2.FINISH_REASON_NONE
                builder.feed(parser.feed(msg.text, len(msg.token_ids), finished), logprobs)
        builder.finish()
        return self._final(builder, choice.finish if choice else engine_pb2.FINISH_REASON_STOP, collected.usage,
                           parser)

    async def events(self, upstream: AsyncIterator[engine_pb2.GenerateResponse]) -> AsyncIterator[SSEBytes]:
        seq = 0

        def sse(event: JSONObject) -> SSEBytes:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return named_event(event["type"], event)

        parser, builder = self.parser(), OutputBuilder()
        finish = engine_pb2.FINISH_REASON_NONE
        started = False
        async with contextlib.aclosing(upstream):  # type: ignore[type-var]
            try:
                async for msg in upstream:
                    if not started:  # errors before the first message are an HTTP status
                        started = True
                        pending = dict(self.base, status="in_progress", output=[], usage=None)
                        yield sse({"type": "response.created", "response": pending})
                        yield sse({"type": "response.in_progress", "response": pending})
                    if msg.index != 0:
                        continue
                    finished = msg.finish_reason != engine_pb2.FINISH_REASON_NONE
                    if finished:
                        finish = msg.finish_reason
                    logprobs = lp.chat_content(msg.logprobs) if self.logprobs and msg.logprobs else None
                    for event in builder.feed(parser.feed(msg.text, len(msg.token_ids), finished), logprobs):
                        yield sse(event)
                    if msg.HasField("usage"):
                        for event in builder.finish():
                            yield sse(event)
                        final = self._final(builder, finish, Usage.from_proto(msg.usage), parser)
                        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                        yield sse({"type": kind, "response": final})
            except OpenAIError as err:
                if not started:
                    raise
                yield sse({"type": "error", "code": err.code, "message": err.message, "param": err.param})
