"""The gateway as a client sees it: a real engine process and a real gateway process on loopback,
driven with the official `openai` SDK and `httpx`.

Outputs of the random-weight ignis-tiny model are gibberish but deterministic at temperature 0,
so the gateway's answers are compared with the engine's own answers over gRPC.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import httpx
import openai
import pytest

from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService, start_engine, start_gateway

MODEL = "ignis-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# Forces a short, *stopped* answer from a random model: EOS (<|im_end|>, id 2) is banned for
# three tokens by min_tokens, then its +100 bias makes it the next token.
STOP_AFTER_3 = {"min_tokens": 3, "logit_bias": {"2": 100}}


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
    yield service
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


@pytest.fixture(scope="module")
def stub(engine: RunningService) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


@pytest.fixture(scope="module")
def client(gateway: RunningService) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(gateway: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as c:
        yield c


# ------------------------------------------------------------------ helpers

def engine_text(stub: engine_pb2_grpc.EngineStub, max_tokens: int, **input_: Any) -> str:
    """What the engine itself generates greedily for this input (chat=, text= or token_ids=)."""
    request = engine_pb2.GenerateRequest(model=MODEL, sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens), **input_)
    return "".join(m.text for m in stub.Generate(request, timeout=60))


def chat_input(messages: list[dict[str, str]]) -> engine_pb2.ChatInput:
    return engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role=m["role"], content=m["content"])
                                          for m in messages])


def stats(stub: engine_pb2_grpc.EngineStub) -> engine_pb2.GetStatsResponse:
    return stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)


def wait_until(condition: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ models, chat

def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "ignis" and models.data[0].model_extra["max_model_len"] == 32768
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    assert models.data[0].model_extra["parent"] is None  # a base model (a LoRA adapter names its base)


def test_adapter_loads_on_an_engine_without_lora_are_clear_400s(gateway: RunningService) -> None:
    url = f"http://127.0.0.1:{gateway.port}/v1"
    error = assert_error(httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}), 400)
    assert "serves no LoRA adapters" in error["message"] and error["param"] is None
    assert_error(httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "x"}), 404, param="lora_name")


def test_chat_greedy_equals_the_engine_and_reports_usage(client: openai.OpenAI,
                                                        stub: engine_pb2_grpc.EngineStub) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == engine_text(stub, 12, chat=chat_input(messages))
    rendered = stub.Tokenize(engine_pb2.TokenizeRequest(model=MODEL, chat=chat_input(messages)))
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (rendered.count, 12)
    assert reply.usage.total_tokens == rendered.count + 12
    ignis = reply.model_extra["ignis"]
    assert ignis["tier"] in ("none", "device", "ram", "disk") and ignis["kind"] in ("none", "checkpoint", "prefix",
                                                                                      "pages")
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == ignis["reused_tokens"] <= rendered.count
    assert ignis["time_to_first_token_ms"] > 0
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == last.model_extra["ignis"]["reused_tokens"]
    assert all("ignis" not in c.model_extra for c in chunks[:-1])


def test_chat_stream_without_usage_puts_ignis_on_the_last_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length" and "kind" in chunks[-1].model_extra["ignis"]


def test_chat_stop_n_logprobs_and_content_parts(client: openai.OpenAI, stub: engine_pb2_grpc.EngineStub) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": " parts"}]}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                           temperature=0, n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content == reply.choices[1].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    content = reply.choices[0].logprobs.content
    assert content is not None and len(content) == 6
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    text = reply.choices[0].message.content or ""
    stop = text[3:6]
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                             stop=[stop])
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_request_class_header_and_body(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body, headers={"X-Ignis-Class": "agent"}).status_code == 200
    assert http.post("/v1/chat/completions", json={**body, "ignis": {"class": "interactive"}}).status_code == 200
    assert_error(http.post("/v1/chat/completions", json=body, headers={"X-Ignis-Class": "robot"}), 400,
                 param="X-Ignis-Class")
    assert_error(http.post("/v1/chat/completions", json={**body, "ignis": {"class": "robot"}}), 400,
                 param="ignis.class")


def test_second_identical_chat_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a cache. " * 20}, {"role": "user", "content": "Again?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.model_extra["ignis"]["reused_tokens"] == second.usage.prompt_tokens_details.cached_tokens
    assert (second.model_extra["ignis"]["tier"], second.model_extra["ignis"]["kind"]) == ("device", "checkpoint")
    assert second.choices[0].message.content == first.choices[0].message.content


# ------------------------------------------------------------------ tools

def test_tools_and_a_tool_result_reach_the_template(client: openai.OpenAI, stub: engine_pb2_grpc.EngineStub) -> None:
    """The model is random, so it cannot be made to call a tool; test_gateway_scripted.py covers tool_calls
    out. Here: tools, an assistant tool call and the tool's result go in, and the engine renders them."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"celsius\": 21}"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto",
                                           max_tokens=4, temperature=0)
    chat = engine_pb2.ChatInput(messages=[
        engine_pb2.ChatMessage(role="user", content="Weather in Paris?"),
        engine_pb2.ChatMessage(role="assistant", tool_calls=[engine_pb2.ToolCall(
            id="call_1", type="function",
            function=engine_pb2.ToolCallFunction(name="get_weather", arguments="{\"city\": \"Paris\"}"))]),
        engine_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="{\"celsius\": 21}"),
    ], tools_json=json.dumps(TOOLS))
    rendered = stub.Tokenize(engine_pb2.TokenizeRequest(model=MODEL, chat=chat))
    assert '"name": "get_weather"' in rendered.prompt and "Current weather for a city." in rendered.prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered.prompt
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in rendered.prompt
    assert reply.usage is not None and reply.usage.prompt_tokens == rendered.count  # the same prompt
    assert reply.choices[0].message.content == engine_text(stub, 4, chat=chat)


# ------------------------------------------------------------------ completions

def test_completions_every_prompt_form(client: openai.OpenAI, stub: engine_pb2_grpc.EngineStub) -> None:
    a, b = "The cache", "A second prompt"
    ids_a = list(stub.Tokenize(engine_pb2.TokenizeRequest(model=MODEL, text=a)).token_ids)
    expect_a, expect_b = engine_text(stub, 5, text=a), engine_text(stub, 5, text=b)
    expect_ids = engine_text(stub, 5, token_ids=engine_pb2.TokenIds(ids=[7, 300, 42]))

    def texts(prompt: Any) -> list[str]:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
        return [c.text for c in reply.choices]

    assert texts(a) == [expect_a]
    assert texts([a, b]) == [expect_a, expect_b]
    assert texts(ids_a) == [expect_a]
    assert texts([ids_a, [7, 300, 42]]) == [expect_a, expect_ids]
    two = client.completions.create(model=MODEL, prompt=[a, b], max_tokens=5, temperature=0, n=2)
    assert [c.text for c in two.choices] == [expect_a, expect_a, expect_b, expect_b]
    assert two.usage is not None and two.usage.completion_tokens == 20


def test_completions_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Once", temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 16


def test_completions_echo_and_logprobs(client: openai.OpenAI, stub: engine_pb2_grpc.EngineStub) -> None:
    # Prompts used nowhere else, and echoed before anything else sends them: the engine computes
    # prompt logprobs only for the tokens it prefills, and a reused prompt has none to prefill.
    prompt, scored_prompt = "Hello echoed caching world", "Only score this prompt"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    scored = client.completions.create(model=MODEL, prompt=scored_prompt, max_tokens=0, echo=True, logprobs=0)
    n_prompt = stub.Tokenize(engine_pb2.TokenizeRequest(model=MODEL, text=prompt)).count
    generated = engine_text(stub, 4, text=prompt)
    choice = reply.choices[0]
    assert choice.text == prompt + generated
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores the first token
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(t is not None and len(t) <= 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert scored.choices[0].text == scored_prompt
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    scored_lp = scored.choices[0].logprobs
    assert scored_lp is not None and scored_lp.tokens is not None and scored_lp.token_logprobs is not None
    assert "".join(scored_lp.tokens) == scored_prompt and len(scored_lp.tokens) == scored.usage.prompt_tokens
    assert scored_lp.token_logprobs[0] is None and all(v is not None for v in scored_lp.token_logprobs[1:])
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    assert plain.choices[0].text == generated and len(plain.choices[0].logprobs.tokens) == 4
    ids = client.completions.create(model=MODEL, prompt=[7, 300, 42], max_tokens=3, temperature=0, echo=True)
    assert ids.choices[0].text.endswith(engine_text(stub, 3, token_ids=engine_pb2.TokenIds(ids=[7, 300, 42])))
    assert ids.choices[0].logprobs is None


def test_completions_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=["x y z", "a b c"], max_tokens=6, temperature=0, echo=True)
    chunks = list(client.completions.create(model=MODEL, prompt=["x y z", "a b c"], max_tokens=6, temperature=0,
                                            echo=True, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].model_extra["ignis"]["reused_tokens"]


# ------------------------------------------------------------------ responses

def test_responses_non_stream(client: openai.OpenAI, stub: engine_pb2_grpc.EngineStub) -> None:
    reply = client.responses.create(model=MODEL, instructions="Be brief.", input="What is a cache?",
                                    max_output_tokens=8, temperature=0)
    expected = engine_text(stub, 8, chat=chat_input([{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "What is a cache?"}]))
    assert reply.output_text == expected
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and reply.usage.output_tokens == 8
    assert reply.usage.input_tokens_details.cached_tokens == reply.model_extra["ignis"]["reused_tokens"]
    items = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is a cache?"}]}])
    assert items.output_text == expected


def test_responses_stream_event_sequence(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Say something.", max_output_tokens=10, temperature=0,
                                    extra_body=STOP_AFTER_3)
    assert whole.status == "completed" and whole.usage is not None and whole.usage.output_tokens == 4
    events = list(client.responses.create(model=MODEL, input="Say something.", max_output_tokens=10,
                                          temperature=0, stream=True, extra_body=STOP_AFTER_3))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = events[-1].response
    assert done.output_text == text and done.usage is not None
    assert done.usage.input_tokens_details.cached_tokens == done.model_extra["ignis"]["reused_tokens"]


def test_responses_unknown_previous_response_is_404(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "previous_response_id": "resp_123"}
    error = assert_error(http.post("/v1/responses", json=body), 404, param="previous_response_id")
    assert error["code"] == "previous_response_not_found"  # stored responses: tests/test_responses_state.py


# ------------------------------------------------------------------ errors

def test_every_client_error_has_its_status_and_body(http: httpx.Client) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    post = lambda body, path="/v1/chat/completions": http.post(path, json=body)  # noqa: E731
    as_json = {"content-type": "application/json"}
    assert_error(http.post("/v1/chat/completions", content=b"{not json", headers=as_json), 400)
    assert_error(http.post("/v1/chat/completions", content=b"[1, 2]", headers=as_json), 400)
    assert_error(post({**chat, "temperature": "hot"}), 400, param="temperature")
    assert_error(post({**chat, "temperature": 3}), 400, param="temperature")
    assert_error(post({**chat, "top_p": 0}), 400, param="top_p")  # the engine's check, mapped to the field
    assert_error(post({**chat, "n": True}), 400, param="n")
    assert_error(post({k: v for k, v in chat.items() if k != "model"}), 400, param="model")
    assert_error(post({**chat, "messages": []}), 400, param="messages")
    assert_error(post({**chat, "messages": [{"role": "wizard", "content": "x"}]}), 400, param="messages[0].role")
    assert_error(post({**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400,
                 param="messages[0].content[0].image_url")
    assert_error(post({**chat, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}), 400,
                 param="messages[0].content[0].type")
    assert_error(post({**chat, "response_format": {"type": "json_schema"}}), 400, param="response_format")
    assert_error(post({"model": MODEL, "prompt": [1, "a"]}, "/v1/completions"), 400, param="prompt")
    assert_error(post({"model": MODEL, "prompt": "x", "max_tokens": 0}, "/v1/completions"), 400, param="max_tokens")
    assert_error(post({**chat, "model": "gpt-17"}), 404, param="model", code="model_not_found")
    # Beyond the 32k context: as token ids (fast: nothing to tokenize), and by max_tokens. In OpenAI's
    # words, which clients match (litellm raises ContextWindowExceededError on them, else BadRequestError).
    context = http.post("/tokenize", json={"model": MODEL, "prompt": "x"}).json()["max_model_len"]
    long_prompt = assert_error(post({"model": MODEL, "prompt": [5] * 33000}, "/v1/completions"), 400,
                               param="prompt", code="context_length_exceeded")
    limit, asked, prompt, completion = context_error(long_prompt["message"])
    assert (limit, prompt) == (context, 33000) and asked == prompt + completion
    long_answer = assert_error(post({**chat, "max_tokens": 40000}), 400, param="max_tokens",
                               code="context_length_exceeded")
    limit, asked, prompt, completion = context_error(long_answer["message"])
    assert (limit, completion) == (context, 40000) and asked == prompt + completion and 0 < prompt < context
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)
    ok = post(chat)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def context_error(message: str) -> tuple[int, ...]:
    """The numbers of OpenAI's context-length message (the whole message must be in its words)."""
    match = re.fullmatch(r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) "
                         r"tokens \((\d+) in the messages, (\d+) in the completion\)\. Please reduce the "
                         r"length of the messages or completion\.", message)
    assert match is not None, message
    return tuple(int(n) for n in match.groups())


def test_sdk_raises_the_matching_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=40000)
    assert bad.value.code == "context_length_exceeded"
    assert "This model's maximum context length is" in str(bad.value)  # what litellm looks for


def test_api_key(engine: RunningService, tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, [engine.address], ["--api-key", "sekret"])
    try:
        url = f"http://{gw.address}"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert_error(httpx.post(url + "/v1/chat/completions", json=body), 401, code="invalid_api_key")
        wrong = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, code="invalid_api_key")
        assert_error(httpx.get(url + "/v1/models"), 401)
        assert httpx.get(url + "/health").status_code == 200  # probes and scrapes need no key
        with openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0) as good:
            assert good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2).choices
    finally:
        assert gw.stop() == 0, gw.log()


def test_no_engine_is_503_and_the_gateway_keeps_serving(tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, [f"127.0.0.1:{free_port()}"])
    try:
        url = f"http://{gw.address}"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        for stream in (False, True):
            response = httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream})
            assert_error(response, 503, code="service_unavailable")
            assert response.headers["retry-after"] == "1"
        assert_error(httpx.get(url + "/v1/models"), 503)
        assert httpx.get(url + "/metrics").status_code == 200
    finally:
        assert gw.stop() == 0, gw.log()


def test_full_engine_queue_is_429(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = start_engine(tmp_path / "engine", str(tiny_model_dir), ["--served-model-name", MODEL, "--max-queue", "1"])
    gw = start_gateway(tmp_path / "gateway", [engine.address])
    try:
        url = f"http://{gw.address}/v1/completions"
        long = {"model": MODEL, "prompt": "stream on", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", url, json=long) as first:
            assert first.status_code == 200
            data = sse_data(first.iter_lines())  # held: dropping the iterator would close the connection
            next(data)  # admitted and streaming
            for stream in (False, True):
                busy = http.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": stream})
                assert_error(busy, 429, code="rate_limit_exceeded")
                assert busy.headers["retry-after"] == "1"
        # The first stream is closed (cancelled): the engine takes work again.
        assert wait_until(lambda: httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                                             timeout=60).status_code == 200)
    finally:
        assert gw.stop() == 0, gw.log()
        assert engine.stop() == 0, engine.log()


# ------------------------------------------------------------------ cancellation, concurrency, metrics

def test_disconnect_mid_stream_cancels_the_engine_work(gateway: RunningService,
                                                      stub: engine_pb2_grpc.EngineStub) -> None:
    before = stats(stub).counters.requests_cancelled
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"http://{gateway.address}/v1/chat/completions", json=body) as response:
            data = sse_data(response.iter_lines())
            for _ in range(4):
                next(data)
            assert stats(stub).page_pool.used_pages > 0
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: stats(stub).counters.requests_cancelled == before + 1)
    s = stats(stub)
    assert wait_until(lambda: stats(stub).page_pool.used_pages == 0), s
    assert s.running.interactive == 0 and s.state_slots.used == 0


def test_disconnect_while_waiting_for_a_whole_answer_cancels_too(gateway: RunningService,
                                                                 stub: engine_pb2_grpc.EngineStub) -> None:
    before = stats(stub).counters.requests_cancelled
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://{gateway.address}/v1/completions", json=body, timeout=1.0)
    assert wait_until(lambda: stats(stub).counters.requests_cancelled == before + 1)
    assert wait_until(lambda: stats(stub).page_pool.used_pages == 0)


async def test_32_concurrent_streams_all_complete_correctly(gateway: RunningService) -> None:
    prompts = [f"Stream number {i}: {'abc ' * (i % 7)}" for i in range(32)]
    async with openai.AsyncOpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        async def solo(prompt: str) -> str:
            reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                         max_tokens=8, temperature=0)
            return reply.choices[0].message.content or ""

        async def streamed(prompt: str) -> tuple[str, str | None, int]:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0,
                stream=True, stream_options={"include_usage": True})
            text, finish, tokens = "", None, 0
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return text, finish, tokens

        expected = [await solo(p) for p in prompts[:8]] + [None] * 24  # a sample, solo, to bound the runtime
        results = await asyncio.gather(*(streamed(p) for p in prompts))
        for i, (text, finish, tokens) in enumerate(results):
            assert (finish, tokens) == ("length", 8), i
            if expected[i] is not None:
                assert text == expected[i], i
        # Prompts that share a solo run's text give the same text under load.
        again = await asyncio.gather(*(streamed(p) for p in prompts[:8] * 4))
        assert [t for t, _, _ in again] == [expected[i % 8] for i in range(32)]


def test_metrics(http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "m"}],
                                            "max_tokens": 2})
    text = http.get("/metrics").text
    assert 'ignis_gateway_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert 'ignis_gateway_requests_total{method="POST",route="/v1/chat/completions",status="400"}' in text
    assert "ignis_gateway_request_duration_seconds_bucket" in text
    assert "ignis_gateway_time_to_first_byte_seconds_count" in text
    assert 'ignis_gateway_tokens_total{kind="completion"}' in text
    assert 'ignis_gateway_engine_up{engine="' in text
