"""POST /v1/completions (the legacy text completions API)."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from gateway import logprobs as lp
from gateway.aliases import JSONObject, SSEBytes
from gateway.body import Fields, read_json
from gateway.cancel import until_disconnect
from gateway.choices import accumulate, finish_reason
from gateway.errors import OpenAIError, invalid
from gateway.json_body import JSONBody, dumps
from gateway.options import engine_options
from gateway.prompts import Prompt, parse_prompts
from gateway.routing import route_key
from gateway.sampling import COMPLETIONS_DEFAULT_MAX_TOKENS, TokenLimit, sampling_params
from gateway.sse import DONE, EventStream, chunk_frame, data_event
from gateway.state import GatewayState, state_of
from gateway.upstream import CallSpec, collect_all, generate, merge
from gateway.usage import Usage, close_stream
from ignis.v1 import engine_pb2

# max_tokens 0 is allowed with echo: score the prompt only.
LIMIT = TokenLimit(("max_tokens",), default=COMPLETIONS_DEFAULT_MAX_TOKENS, minimum=0)


async def completions(request: Request) -> Response:
    state = state_of(request)
    body = Fields(await read_json(request, state.config.max_request_bytes))
    model = body.string("model", required=True) or ""
    prompts = parse_prompts(body.raw("prompt"))
    echo = bool(body.boolean("echo"))
    sampling = sampling_params(body, LIMIT, "completions")
    if sampling.max_tokens == 0 and not echo:
        raise invalid("'max_tokens' must be >= 1 (0 is allowed only with echo)", param="max_tokens")
    n = sampling.n if sampling.HasField("n") else 1
    best_of = body.integer("best_of", lo=1)
    if best_of is not None and best_of != n:
        raise invalid("best_of other than n is not supported", param="best_of")
    if body.string("suffix"):
        raise invalid("'suffix' is not supported", param="suffix")
    opts = engine_options(body, request.headers)
    stream = bool(body.boolean("stream"))
    stream_options = body.obj("stream_options")
    include_usage = bool(stream_options.boolean("include_usage")) if stream_options is not None else False
    body.string("user")

    rid = "cmpl-" + uuid.uuid4().hex
    spec = CallSpec("prompt", "max_tokens", state.config.request_timeout)
    calls = []
    for i, prompt in enumerate(prompts):
        req = engine_pb2.GenerateRequest(request_id=f"{rid}-{i}", model=model, sampling=sampling, echo=echo)
        prompt.apply(req)
        opts.apply(req)
        if echo and prompt.text is None:
            # The gateway has no tokenizer: a token-id prompt's text comes from its echoed tokens' bytes.
            req.sampling.logprobs = True
        key = route_key(model, opts.cache_salt, opts.route_key or prompt.head)
        calls.append(generate(state.pool, req, key, spec))
    reply = _Reply(rid, int(time.time()), model, prompts, n, echo, sampling.logprobs, state)
    if stream:
        return EventStream(reply.events(calls, include_usage), headers={"X-Request-Id": rid})
    results = await until_disconnect(request, collect_all(calls))
    return JSONBody(reply.whole(results), headers={"X-Request-Id": rid})


class _Reply:
    def __init__(self, rid: str, created: int, model: str, prompts: list[Prompt], n: int, echo: bool,
                 logprobs: bool, state: GatewayState) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.prompts, self.n, self.echo, self.logprobs = prompts, n, echo, logprobs
        self.state = state

    def _prompt_text(self, p: int, prompt_logprobs: list[engine_pb2.TokenLogprob]) -> str:
        text = self.prompts[p].text
        return text if text is not None else lp.prompt_text(prompt_logprobs)

    def _prompt_logprobs(self, builder: lp.CompletionLogprobs, p: int,
                         items: list[engine_pb2.TokenLogprob]) -> JSONObject:
        text = self.prompts[p].text
        first = lp.prompt_first_token(text, items) if text is not None else None
        return builder.add(items, first_has_no_logprob=True, first_text=first)

    def whole(self, results: list[list[engine_pb2.GenerateResponse]]) -> JSONObject:
        choices = []
        usages = []
        for p, messages in enumerate(results):
            collected = accumulate(messages)
            usages.append(collected.usage)
            prefix = self._prompt_text(p, collected.prompt_logprobs) if self.echo else ""
            for c in collected.choices.values():
                logprobs = None
                if self.logprobs:
                    builder = lp.CompletionLogprobs()
                    parts = [self._prompt_logprobs(builder, p, collected.prompt_logprobs)] if self.echo else []
                    parts.append(builder.add(c.logprobs))
                    logprobs = lp.merge_completion(parts)
                choices.append({"index": p * self.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": finish_reason(c.finish)})
        usage = Usage.total(usages)
        self.state.metrics.observe_usage(usage)
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage.openai(), "system_fingerprint": None, "ignis": usage.ignis()}

    def _chunk(self, choices: list[JSONObject], include_usage: bool) -> JSONObject:
        out: JSONObject = {"id": self.rid, "object": "text_completion", "created": self.created,
                           "model": self.model, "system_fingerprint": None, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    async def events(self, calls: list[AsyncIterator[engine_pb2.GenerateResponse]], include_usage: bool
                     ) -> AsyncIterator[SSEBytes]:
        started = False
        prompt_lps: dict[int, list[engine_pb2.TokenLogprob]] = {}
        builders: dict[int, lp.CompletionLogprobs] = {}  # per global choice index: text offsets so far
        usages: dict[int, Usage] = {}
        head, tail = chunk_frame(self._chunk([], include_usage))
        last = b""  # the last call's last chunks, sent with [DONE] in one write once the calls end
        async with contextlib.aclosing(merge(calls)) as merged:  # type: ignore[type-var]
            try:
                async for p, msg in merged:
                    started = True
                    if msg.prompt_token_ids:
                        prompt_lps[p] = list(msg.prompt_logprobs)
                    choice = self._message_choice(p, msg, prompt_lps, builders)
                    if not msg.HasField("usage"):  # its chunk is the choice in the stream's frame
                        if choice is not None:
                            yield head + dumps(choice) + tail
                        continue
                    chunks = [self._chunk([choice], include_usage)] if choice is not None else []
                    usages[p] = Usage.from_proto(msg.usage)
                    if len(usages) == len(calls):  # the last call ended: the final chunk
                        usage = Usage.total(usages[i] for i in sorted(usages))
                        self.state.metrics.observe_usage(usage)
                        close_stream(chunks, usage, include_usage, lambda: self._chunk([], False))
                        last = b"".join(map(data_event, chunks))
                        continue
                    for chunk in chunks:
                        yield data_event(chunk)
            except OpenAIError as err:
                if not started:
                    raise
                last += data_event(err.body())
        yield last + DONE

    def _message_choice(self, p: int, msg: engine_pb2.GenerateResponse,
                        prompt_lps: dict[int, list[engine_pb2.TokenLogprob]],
                        builders: dict[int, lp.CompletionLogprobs]) -> JSONObject | None:
        """The chunk choice one message makes, or None (e.g. the usage-only last message)."""
        g = p * self.n + msg.index
        text = msg.text
        logprobs = None
        if self.echo or self.logprobs:  # text offsets so far, and whether this is the choice's first chunk
            first = g not in builders
            builder = builders[g] = lp.CompletionLogprobs() if first else builders[g]
            parts = []
            if first and self.echo:  # each choice starts with the prompt
                text = self._prompt_text(p, prompt_lps.get(p, [])) + text
                if self.logprobs:
                    parts.append(self._prompt_logprobs(builder, p, prompt_lps.get(p, [])))
            if self.logprobs:
                parts.append(builder.add(msg.logprobs))
                logprobs = lp.merge_completion(parts)
        finish = finish_reason(msg.finish_reason)
        if not text and finish is None and not (logprobs and logprobs["tokens"]):
            return None
        return {"index": g, "text": text, "logprobs": logprobs, "finish_reason": finish}

