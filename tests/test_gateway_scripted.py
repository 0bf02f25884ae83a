"""The gateway against scripted engines: in-process gRPC servers that answer with chosen text.

A random model cannot be made to call a tool, fail mid-stream or run on several hosts, so
these tests script the engine side (through the generated stubs, like the real engine) and
drive a real gateway process with the `openai` SDK: tool calls out (whole and streamed),
tool results in, the request translation, routing and failover, and upstream errors.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ignis.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services import RunningService, start_gateway

MODEL = "scripted"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_TEXT = ["Let me look.\n", "<tool_call>\n{\"name\": \"get_weather\", ",
             "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"]

Script = Callable[["ScriptedEngine", engine_pb2.GenerateRequest, grpc.ServicerContext],
                  Iterator[engine_pb2.GenerateResponse]]


def say(pieces: list[str], finish: int = engine_pb2.FINISH_REASON_STOP) -> Script:
    """A script that streams `pieces` as one choice, then finishes with usage."""
    def script(engine: ScriptedEngine, request: engine_pb2.GenerateRequest, context: grpc.ServicerContext
               ) -> Iterator[engine_pb2.GenerateResponse]:
        for i, piece in enumerate(pieces):
            msg = engine_pb2.GenerateResponse(index=0, token_ids=[100 + i], text=piece)
            if i == len(pieces) - 1:
                msg.finish_reason = finish
                msg.usage.CopyFrom(engine_pb2.Usage(
                    prompt_tokens=40, completion_tokens=len(pieces), cached_tokens=32,
                    reuse=engine_pb2.ReuseInfo(tier=common_pb2.REUSE_TIER_RAM, kind=common_pb2.REUSE_KIND_PREFIX,
                                               reused_tokens=32), time_to_first_token_ms=1.5))
            yield msg
    return script


def my_name(engine: ScriptedEngine, request: engine_pb2.GenerateRequest, context: grpc.ServicerContext
            ) -> Iterator[engine_pb2.GenerateResponse]:
    yield from say([engine.name])(engine, request, context)


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, name: str) -> None:
        self.name = name
        self.script: Script = my_name
        self.requests: list[engine_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        engine_pb2_grpc.add_EngineServicer_to_server(self, self.server)
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[engine_pb2.GenerateResponse]:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        yield from self.script(self, request, context)

    def ListModels(self, request: engine_pb2.ListModelsRequest, context: grpc.ServicerContext
                   ) -> engine_pb2.ListModelsResponse:
        return engine_pb2.ListModelsResponse(models=[engine_pb2.ModelCard(id=MODEL, max_model_len=4096,
                                                                          owned_by="ignis", created=1)])

    def stop(self) -> None:
        self.server.stop(0).wait()


@pytest.fixture(scope="module")
def engine() -> Iterator[ScriptedEngine]:
    e = ScriptedEngine("solo")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def gateway(engine: ScriptedEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
    yield service
    assert service.stop() == 0, service.log()


@pytest.fixture(autouse=True)
def fresh_script(request: pytest.FixtureRequest) -> None:
    if "engine" in request.fixturenames:
        e: ScriptedEngine = request.getfixturevalue("engine")
        e.script, e.requests = my_name, []


@pytest.fixture(scope="module")
def client(gateway: RunningService) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------ tool calls

def test_tool_calls_whole(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.script = say(TOOL_TEXT)
    reply = client.chat.completions.create(model=MODEL, messages=user("Weather in Paris?"), tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    sent = engine.requests[-1].chat
    assert json.loads(sent.tools_json) == TOOLS and sent.tool_choice == ""
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 32
    assert reply.model_extra["ignis"] == {"tier": "ram", "kind": "prefix", "reused_tokens": 32,
                                          "time_to_first_token_ms": 1.5}


def test_tool_calls_streamed(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.script = say(TOOL_TEXT)
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("Weather in Paris?"), tools=TOOLS,
                                                 tool_choice="auto", stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me look."
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id and calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments or "") == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # The text before the call streams before the call completes.
    first_content = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert first_content < first_call
    assert chunks[-1].model_extra["ignis"]["reused_tokens"] == 32


def test_two_calls_streamed_one_piece_per_character(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    text = ("<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>")
    engine.script = say(list(text))
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("two"), tools=TOOLS, stream=True))
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
        (0, "a", '{"x": 1}'), (1, "b", "{}")]
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_the_tool_result_goes_back_in_the_next_turn(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.script = say(TOOL_TEXT)
    first = client.chat.completions.create(model=MODEL, messages=user("Weather in Paris?"), tools=TOOLS)
    call = (first.choices[0].message.tool_calls or [])[0]
    engine.script = say(["It is ", "21 C."])
    messages = user("Weather in Paris?") + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "{\"celsius\": 21}"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is 21 C." and second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls
    sent = engine.requests[-1].chat.messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert sent[1].content == "Let me look." and len(sent[1].tool_calls) == 1
    assert sent[1].tool_calls[0].id == call.id and sent[1].tool_calls[0].function.name == "get_weather"
    assert json.loads(sent[1].tool_calls[0].function.arguments) == {"city": "Paris"}
    assert sent[2].tool_call_id == call.id and sent[2].content == "{\"celsius\": 21}"


def test_tool_text_stays_text_without_tools_or_with_tool_choice_none(client: openai.OpenAI,
                                                                     engine: ScriptedEngine) -> None:
    engine.script = say(TOOL_TEXT)
    plain = client.chat.completions.create(model=MODEL, messages=user("x"))
    off = client.chat.completions.create(model=MODEL, messages=user("x"), tools=TOOLS, tool_choice="none")
    for reply in (plain, off):
        assert reply.choices[0].message.content == "".join(TOOL_TEXT) and not reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "stop"
    assert engine.requests[-1].chat.tool_choice == "none"


def test_responses_function_calls(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.script = say(TOOL_TEXT)
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather for a city.",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    reply = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    assert [item.type for item in reply.output] == ["message", "function_call"]
    assert reply.output_text == "Let me look."
    call = reply.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert json.loads(engine.requests[-1].chat.tools_json) == TOOLS  # flattened tools -> the chat shape
    assert reply.usage is not None and reply.usage.input_tokens_details.cached_tokens == 32

    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.done")

    engine.script = say(["Sunny."])
    follow = client.responses.create(model=MODEL, tools=tools, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "{\"celsius\": 21}"},
    ])
    assert follow.output_text == "Sunny." and follow.status == "completed"
    sent = engine.requests[-1].chat.messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert sent[1].tool_calls[0].id == call.call_id and sent[2].tool_call_id == call.call_id


# ------------------------------------------------------------------ translation

def test_chat_fields_reach_the_engine(gateway: RunningService, engine: ScriptedEngine) -> None:
    body = {"model": MODEL, "messages": [{"role": "developer", "content": "sys"}, {"role": "user", "content": "u"}],
            "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": "END", "max_completion_tokens": 33,
            "max_tokens": 99, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": True,
            "top_logprobs": 3, "logit_bias": {"12": -100}, "cache_salt": "tenant-a", "user": "u-1",
            "top_k": 5, "min_p": 0.1, "ignore_eos": True, "ignis": {"class": "agent", "lookup": "bypass"},
            "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(f"http://{gateway.address}/v1/chat/completions", json=body).status_code == 200
    r = engine.requests[-1]
    s = r.sampling
    assert r.request_id.startswith("chatcmpl-") and r.model == MODEL and r.cache_salt == "tenant-a"
    assert r.request_class == common_pb2.REQUEST_CLASS_AGENT
    assert r.reuse.lookup == engine_pb2.ReusePolicy.LOOKUP_BYPASS
    assert [m.role for m in r.chat.messages] == ["developer", "user"]
    assert json.loads(r.chat.chat_template_kwargs_json) == {"enable_thinking": False}
    assert (s.temperature, round(s.top_p, 5), s.seed, list(s.stop), s.max_tokens) == (0.5, 0.9, 7, ["END"], 33)
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, s.top_logprobs) == (0.5, -0.5, True, 3)
    assert dict(s.logit_bias) == {12: -100.0} and (s.top_k, round(s.min_p, 5), s.ignore_eos) == (5, 0.1, True)


def test_defaults_and_the_class_header(gateway: RunningService, engine: ScriptedEngine) -> None:
    url = f"http://{gateway.address}/v1"
    chat = {"model": MODEL, "messages": user("u")}
    httpx.post(url + "/chat/completions", json=chat, headers={"X-Ignis-Class": "agent"})
    r = engine.requests[-1]
    assert r.request_class == common_pb2.REQUEST_CLASS_AGENT and not r.HasField("reuse")
    assert not r.sampling.HasField("max_tokens")  # chat: up to the end of the context
    assert not r.sampling.HasField("temperature") and not r.sampling.HasField("n")
    httpx.post(url + "/chat/completions", json={**chat, "ignis": {"class": "interactive"}},
               headers={"X-Ignis-Class": "agent"})
    assert engine.requests[-1].request_class == common_pb2.REQUEST_CLASS_INTERACTIVE  # the body wins
    httpx.post(url + "/completions", json={"model": MODEL, "prompt": "p"})
    r = engine.requests[-1]
    assert r.text == "p" and r.sampling.max_tokens == 16 and r.request_class == common_pb2.REQUEST_CLASS_INTERACTIVE
    httpx.post(url + "/responses", json={"model": MODEL, "input": "i", "instructions": "be brief",
                                         "max_output_tokens": 5, "temperature": 0})
    r = engine.requests[-1]
    assert [(m.role, m.content) for m in r.chat.messages] == [("system", "be brief"), ("user", "i")]
    assert r.sampling.max_tokens == 5 and r.sampling.temperature == 0 and r.sampling.HasField("temperature")


# ------------------------------------------------------------------ upstream errors

def test_engine_failures_are_mapped_and_never_leak_a_trace(client: openai.OpenAI, gateway: RunningService,
                                                           engine: ScriptedEngine) -> None:
    def fail_at_once(e: ScriptedEngine, r: engine_pb2.GenerateRequest, context: grpc.ServicerContext
                     ) -> Iterator[engine_pb2.GenerateResponse]:
        context.abort(grpc.StatusCode.INTERNAL, "Traceback (most recent call last): secret engine internals")
        yield engine_pb2.GenerateResponse()

    def fail_midway(e: ScriptedEngine, r: engine_pb2.GenerateRequest, context: grpc.ServicerContext
                    ) -> Iterator[engine_pb2.GenerateResponse]:
        yield engine_pb2.GenerateResponse(index=0, token_ids=[1], text="partial")
        context.abort(grpc.StatusCode.INTERNAL, "Traceback (most recent call last): secret engine internals")

    def full(e: ScriptedEngine, r: engine_pb2.GenerateRequest, context: grpc.ServicerContext
             ) -> Iterator[engine_pb2.GenerateResponse]:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the engine queue is full (1 requests)")
        yield engine_pb2.GenerateResponse()

    url = f"http://{gateway.address}/v1/chat/completions"
    body = {"model": MODEL, "messages": user("x")}
    engine.script = fail_at_once
    response = httpx.post(url, json=body)
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert "secret" not in response.text and "Traceback" not in response.text
    engine.script = fail_midway
    with httpx.stream("POST", url, json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "partial"
    assert json.loads(events[-2])["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
    assert "secret" not in "".join(events)
    engine.script = full
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=user("x"))
    engine.script = my_name
    assert client.chat.completions.create(model=MODEL, messages=user("x")).choices[0].message.content == "solo"


def test_request_timeout_is_504(engine: ScriptedEngine, tmp_path: Path) -> None:
    def slow(e: ScriptedEngine, r: engine_pb2.GenerateRequest, context: grpc.ServicerContext
             ) -> Iterator[engine_pb2.GenerateResponse]:
        while context.is_active():
            time.sleep(0.02)
        yield engine_pb2.GenerateResponse()

    engine.script = slow
    gw = start_gateway(tmp_path, [engine.address], ["--request-timeout", "0.3"])
    try:
        response = httpx.post(f"http://{gw.address}/v1/chat/completions", json={"model": MODEL, "messages": user("x")})
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout_error"
    finally:
        assert gw.stop() == 0, gw.log()


def test_trace_context_reaches_the_engine(engine: ScriptedEngine, tmp_path: Path) -> None:
    """With an OTLP endpoint set (none listens: export fails quietly), the gateway continues the
    caller's trace and hands its span's context to the engine in gRPC metadata."""
    gw = start_gateway(tmp_path, [engine.address], env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                                        "OTEL_EXPORTER_OTLP_TIMEOUT": "0.2"})
    try:
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        response = httpx.post(f"http://{gw.address}/v1/chat/completions", json={"model": MODEL, "messages": user("x")},
                              headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        assert response.status_code == 200
        traceparent = engine.metadata[-1]["traceparent"]
        assert traceparent.split("-")[1] == trace_id and traceparent.split("-")[2] != "00f067aa0ba902b7"
    finally:
        assert gw.stop() == 0, gw.log()


# ------------------------------------------------------------------ several engines

def test_routing_keeps_a_head_on_one_engine_and_skips_a_dead_one(tmp_path: Path) -> None:
    engines = [ScriptedEngine(f"e{i}") for i in range(3)]
    # The affinity rule (the bounded default spreads a burst by conversation: test_gateway_routing.py).
    gw = start_gateway(tmp_path, [e.address for e in engines], ["--probe-interval", "0.2", "--routing", "affinity"])
    client = openai.OpenAI(base_url=f"http://{gw.address}/v1", api_key="unused", max_retries=0, timeout=30)
    try:

        def served_by(system: str, task: str, **extra: Any) -> str:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
            reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **extra)
            return reply.choices[0].message.content or ""

        # A burst of subagents: one system prompt and tools, different tasks -> one engine.
        home = {served_by("You are subagent type A.", f"task {i}") for i in range(8)}
        assert len(home) == 1
        # Different heads spread over the engines.
        assert len({served_by(f"You are agent {i}.", "task") for i in range(24)}) >= 2
        # prompt_cache_key replaces the head: different system prompts, one key -> one engine.
        assert len({served_by(f"system {i}", "t", extra_body={"prompt_cache_key": "k1"}) for i in range(6)}) == 1
        # The home engine dies: the same burst is served elsewhere, all on one engine again.
        dead = next(e for e in engines if e.name in home)
        dead.stop()
        moved = {served_by("You are subagent type A.", f"task {i}") for i in range(6)}
        assert len(moved) == 1 and moved != home
        health = httpx.get(f"http://{gw.address}/health").json()
        assert [e["healthy"] for e in health["engines"]] == [e is not dead for e in engines]
    finally:
        client.close()
        assert gw.stop() == 0, gw.log()
        for e in engines:
            e.stop()


def test_unavailable_before_any_output_fails_over(tmp_path: Path) -> None:
    def unavailable(e: ScriptedEngine, r: engine_pb2.GenerateRequest, context: grpc.ServicerContext
                    ) -> Iterator[engine_pb2.GenerateResponse]:
        context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        yield engine_pb2.GenerateResponse()

    engines = [ScriptedEngine(f"e{i}") for i in range(3)]
    for e in engines[:2]:
        e.script = unavailable
    gw = start_gateway(tmp_path, [e.address for e in engines])
    client = openai.OpenAI(base_url=f"http://{gw.address}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        for i in range(6):
            reply = client.chat.completions.create(model=MODEL, messages=user(f"task {i}"))
            assert reply.choices[0].message.content == "e2"
        for e in engines:
            e.script = unavailable
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model=MODEL, messages=user("x"))
        assert err.value.status_code == 503
    finally:
        client.close()
        assert gw.stop() == 0, gw.log()
        for e in engines:
            e.stop()


def test_unavailable_after_output_began_is_the_clients_error_and_no_other_engine_is_called(
        tmp_path: Path) -> None:
    """One chunk, then UNAVAILABLE (its engine died mid-stream), beside a healthy engine: what was sent
    stands, so the client sees that chunk, then the error, and the other engine gets no call (it would
    start the answer again behind the chunk already sent)."""
    calls: list[str] = []
    lock = threading.Lock()

    def dies_after_one_chunk_once(e: ScriptedEngine, r: engine_pb2.GenerateRequest, context: grpc.ServicerContext
                                  ) -> Iterator[engine_pb2.GenerateResponse]:
        with lock:
            calls.append(e.name)
            first = len(calls) == 1
        if not first:  # whichever engine a retry reaches answers whole
            yield from my_name(e, r, context)
            return
        yield engine_pb2.GenerateResponse(index=0, token_ids=[100], text="partial")
        context.abort(grpc.StatusCode.UNAVAILABLE, "the engine lost its device")

    engines = [ScriptedEngine(f"e{i}") for i in range(2)]
    for e in engines:
        e.script = dies_after_one_chunk_once
    gw = start_gateway(tmp_path, [e.address for e in engines])
    try:
        body = {"model": MODEL, "messages": user("x"), "stream": True}
        with httpx.stream("POST", f"http://{gw.address}/v1/chat/completions", json=body, timeout=60) as streamed:
            assert streamed.status_code == 200
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                          for e in events[:-1] if "choices" in json.loads(e) and json.loads(e)["choices"])
        assert content == "partial", events
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_failed" and "failed after output began" in error["message"], error
        assert events[-1] == "[DONE]"
        assert calls == [calls[0]] and sum(len(e.requests) for e in engines) == 1  # no second engine was called
    finally:
        assert gw.stop() == 0, gw.log()
        for e in engines:
            e.stop()


def test_an_engine_marked_down_is_still_tried_last(tmp_path: Path) -> None:
    """Down is the gateway's guess (a probe that timed out under load, an engine that says NOT_SERVING
    and still answers): such an engine stays a candidate, after every healthy one, so a request whose
    healthy engine fails before any output is still served there."""
    import asyncio

    from gateway.engines import EnginePool
    from gateway.routing import RouteKeys
    from gateway.upstream import CallSpec, generate

    def unavailable(e: ScriptedEngine, r: engine_pb2.GenerateRequest, context: grpc.ServicerContext
                    ) -> Iterator[engine_pb2.GenerateResponse]:
        context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        yield engine_pb2.GenerateResponse()

    healthy, marked_down = ScriptedEngine("healthy"), ScriptedEngine("marked down")
    healthy.script = unavailable
    marked_down.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # it answers Generate all the same

    async def main() -> None:
        pool = EnginePool([healthy.address, marked_down.address], interval=3600.0, sessions=False)
        await pool.start()
        try:
            first, second = pool.engines
            deadline = time.monotonic() + 60
            while not (first.healthy and not second.healthy):
                assert time.monotonic() < deadline, "the pool never saw one engine up and one down"
                await asyncio.sleep(0.02)
            keys = RouteKeys(b"head", b"conversation")
            assert pool.candidates(MODEL, keys) == [first, second]  # the down one last, not left out
            request = engine_pb2.GenerateRequest(request_id="r", model=MODEL)
            got = [m async for m in generate(pool, request, b"head", CallSpec("messages", "max_tokens"))]
            assert [m.text for m in got] == ["marked down"]
            assert (len(healthy.requests), len(marked_down.requests)) == (1, 1)
        finally:
            await pool.close()

    try:
        asyncio.run(main())
    finally:
        healthy.stop()
        marked_down.stop()
