"""POST /v1/chat/completions."""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway import logprobs as lp
from gateway.aliases import JSONObject, SSEBytes
from gateway.body import Fields, read_json
from gateway.cancel import until_disconnect
from gateway.choices import accumulate, finish_reason
from gateway.errors import OpenAIError
from gateway.guided import asks_reasoning, chat_guided
from gateway.image_parts import ImageSource, attach_images
from gateway.json_body import JSONBody, dumps
from gateway.messages import chat_input, parses_tool_calls
from gateway.options import engine_options
from gateway.routing import chat_head, route_key
from gateway.sampling import TokenLimit, sampling_params
from gateway.sse import DONE, EventStream, chunk_frame, data_event
from gateway.state import GatewayState, state_of
from gateway.output_formats import ChoiceParser, Piece, output_formats
from gateway.reasoning import ReasoningDelta
from gateway.tool_calls import ContentDelta
from gateway.unsupported import reject_unsupported
from gateway.upstream import CallSpec, collect, generate
from gateway.usage import Usage, close_stream
from ignis.v1 import engine_pb2

LIMIT = TokenLimit(("max_completion_tokens", "max_tokens"), default=None)


async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    body = Fields(await read_json(request, state.config.max_request_bytes))
    model = body.string("model", required=True) or ""
    images: list[ImageSource] = []
    chat = chat_input(body, images)
    sampling = sampling_params(body, LIMIT, "chat")
    reject_unsupported(body)
    guided = chat_guided(body, chat, state.config.tool_call_parser)
    opts = engine_options(body, request.headers)
    stream = bool(body.boolean("stream"))
    stream_options = body.obj("stream_options")
    include_usage = bool(stream_options.boolean("include_usage")) if stream_options is not None else False
    body.string("user")  # accepted (type-checked) and not used
    await attach_images(chat, images, state.media, opts.cache_salt)  # after the cheap checks: it may fetch

    rid = "chatcmpl-" + uuid.uuid4().hex
    req = engine_pb2.GenerateRequest(request_id=rid, model=model, chat=chat, sampling=sampling)
    if guided is not None:
        req.guided.CopyFrom(guided)
    opts.apply(req)
    key = route_key(model, opts.cache_salt, opts.route_key or chat_head(chat))
    spec = CallSpec("messages", "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens",
                    state.config.request_timeout)
    formats = output_formats(state.pool, model, state.config.tool_call_parser, state.config.reasoning_parser)
    tools = parses_tool_calls(chat)
    if tools and formats.tool_call == "mistral" and not sampling.HasField("skip_special_tokens"):
        req.sampling.skip_special_tokens = False  # [TOOL_CALLS] is a special token: keep it in the text
    if guided is not None and formats.reasoning and asks_reasoning(body):
        req.guided.after_reasoning = True
    upstream = generate(state.pool, req, key, spec)
    n = sampling.n if sampling.HasField("n") else 1
    reply = _Reply(rid, int(time.time()), model, lambda: ChoiceParser.make(formats, chat.tools_json, tools),
                   sampling.logprobs, n, state)
    if stream:
        return EventStream(reply.events(upstream, include_usage), headers={"X-Request-Id": rid})
    messages = await until_disconnect(request, collect(upstream))
    return JSONBody(reply.whole(messages), headers={"X-Request-Id": rid})


class _Reply:
    """Builds one request's answer, whole or as chunks."""

    def __init__(self, rid: str, created: int, model: str, parser: Callable[[], ChoiceParser], logprobs: bool,
                 n: int, state: GatewayState) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.parser, self.logprobs, self.n = parser, logprobs, n
        self.state = state

    def whole(self, messages: list[engine_pb2.GenerateResponse]) -> JSONObject:
        collected = accumulate(messages)
        parsers = {i: self.parser() for i in collected.choices}
        pieces: dict[int, list[Piece]] = {i: [] for i in collected.choices}
        for msg in messages:  # message by message, as a stream is read: reasoning tokens are counted per message
            if msg.index in parsers:
                finished = msg.finish_reason != engine_pb2.FINISH_REASON_NONE
                pieces[msg.index] += parsers[msg.index].feed(msg.text, len(msg.token_ids), finished)
        choices = []
        for c in collected.choices.values():
            parser = parsers[c.index]
            content = "".join(p.text for p in pieces[c.index] if isinstance(p, ContentDelta))
            calls = parser.calls
            message: JSONObject = {"role": "assistant", "content": None if calls and not content else content,
                                   "refusal": None}
            if parser.reasoning is not None:
                message["reasoning_content"] = "".join(p.text for p in pieces[c.index]
                                                       if isinstance(p, ReasoningDelta)) or None
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": {"content": lp.chat_content(c.logprobs)} if self.logprobs else None,
                "finish_reason": finish_reason(c.finish, bool(calls)),
            })
        usage = replace(collected.usage, reasoning_tokens=sum(p.reasoning_tokens for p in parsers.values()))
        self.state.metrics.observe_usage(usage)
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage.openai(), "system_fingerprint": None,
                "ignis": usage.ignis()}

    def _chunk(self, choices: list[JSONObject], include_usage: bool) -> JSONObject:
        out: JSONObject = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                           "model": self.model, "system_fingerprint": None, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    async def events(self, upstream: AsyncIterator[engine_pb2.GenerateResponse], include_usage: bool
                     ) -> AsyncIterator[SSEBytes]:
        parsers = [self.parser() for _ in range(self.n)]
        head, tail = chunk_frame(self._chunk([], include_usage))
        started = False
        last = b""  # the last message's chunks, sent with [DONE] in one write once the call ends
        async with contextlib.aclosing(upstream):  # type: ignore[type-var]
            try:
                async for msg in upstream:
                    # One write a message: its chunks (after the first message, the role's first) joined.
                    events = []
                    if not started:  # after the first message: errors before it are an HTTP status
                        started = True
                        events = [data_event(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                                           "logprobs": None, "finish_reason": None}], include_usage))
                                  for i in range(self.n)]
                    if not msg.HasField("usage"):  # each chunk is its choice in the stream's frame
                        events += [head + dumps(choice) + tail for choice in self._message_choices(msg, parsers)]
                        if events:
                            yield b"".join(events)
                        continue
                    # The last message: its chunks, then usage and the `ignis` report (close_stream).
                    chunks = [self._chunk([c], include_usage) for c in self._message_choices(msg, parsers)]
                    usage = replace(Usage.from_proto(msg.usage), reasoning_tokens=sum(p.reasoning_tokens for p in parsers))
                    self.state.metrics.observe_usage(usage)
                    close_stream(chunks, usage, include_usage, lambda: self._chunk([], False))
                    last = b"".join([*events, *map(data_event, chunks)])
            except OpenAIError as err:
                if not started:
                    raise
                last += data_event(err.body())
        yield last + DONE

    def _message_choices(self, msg: engine_pb2.GenerateResponse, parsers: list[ChoiceParser]) -> list[JSONObject]:
        """The chunk choices one message makes (each goes in a chunk of its own)."""
        i = msg.index
        finished = msg.finish_reason != engine_pb2.FINISH_REASON_NONE
        pieces: list[Piece] = []
        if i < len(parsers):
            pieces = parsers[i].feed(msg.text, len(msg.token_ids), finished)
        elif msg.text:
            pieces = [ContentDelta(msg.text)]
        deltas: list[JSONObject] = []
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                deltas.append({"reasoning_content": piece.text})
            elif isinstance(piece, ContentDelta):
                deltas.append({"content": piece.text})
            else:
                deltas.append({"tool_calls": [piece.call.openai(piece.index)]})
        logprobs = {"content": lp.chat_content(msg.logprobs)} if self.logprobs and msg.logprobs else None
        if logprobs is not None and not deltas:
            deltas.append({"content": ""})
        choices: list[JSONObject] = [{"index": i, "delta": d, "logprobs": logprobs if k == 0 else None, "finish_reason": None}
                   for k, d in enumerate(deltas)]
        if finished:
            calls = bool(parsers[i].calls) if i < len(parsers) else False
            choices.append({"index": i, "delta": {}, "logprobs": None,
                            "finish_reason": finish_reason(msg.finish_reason, calls)})
        return choices
