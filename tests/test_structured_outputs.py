"""Structured outputs through the real gateway with the OpenAI SDK (ignis-tiny, random weights).

Random weights write noise: every parse below succeeds only because the grammar forces it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Literal

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from engine.text.tokenizer import Tokenizer
from services import RunningService, start_gateway

MODEL = "ignis-tiny"
MESSAGES = [{"role": "user", "content": "Describe the weather as JSON."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 8}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "required": ["a", "b"], "additionalProperties": False,
             "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                            "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}}]


class Weather(BaseModel):
    city: str = Field(max_length=8)
    sunny: bool
    kind: Literal["rain", "snow", "sun"]
    celsius: int = Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
    yield service
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


@pytest.fixture(scope="module")
def client(gateway: RunningService) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(gateway: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as c:
        yield c


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        done = client.chat.completions.parse(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                             response_format=Weather, max_tokens=200, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Weather)


def test_parse_streamed(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                        response_format=Weather, max_tokens=200, seed=9) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Weather)


@pytest.fixture(scope="module")
def closing_bias(tiny_model_dir: Path) -> dict[str, int]:
    """Any JSON object has unbounded keys, and random weights never close a string: nudge the
    closing tokens (the grammar still decides what is valid where)."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    ids = [tokenizer.token_to_id(t) for t in ('"', "}", "]")]
    return {str(i): 30 for i in ids if i is not None}


def test_json_object_is_parseable(client: openai.OpenAI, closing_bias: dict[str, int]) -> None:
    for seed in range(3):
        done = client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                              response_format={"type": "json_object"}, max_tokens=300, seed=seed,
                                              logit_bias=closing_bias)
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


def test_tool_choice_required_always_calls_a_tool(client: openai.OpenAI) -> None:
    for seed in range(4):
        done = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
                                              tool_choice="required", max_tokens=120, seed=seed,
                                              parallel_tool_calls=False)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls or []
        assert call.function.name in ("get_weather", "add")  # type: ignore[union-attr]
        json.loads(call.function.arguments)  # type: ignore[union-attr]


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in range(3):
        done = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120, seed=seed,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "add"}})
        calls = done.choices[0].message.tool_calls or []
        assert calls and all(c.function.name == "add" for c in calls)  # type: ignore[union-attr]
        args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        assert set(args) == {"a", "b"} and all(0 <= v <= 9 for v in args.values())


@pytest.mark.parametrize("parallel", [None, True, False], ids=["parallel-unset", "parallel", "one-call"])
def test_required_tool_calls_are_the_whole_output(client: openai.OpenAI, parallel: bool | None) -> None:
    """tool_choice "required" (langchain's "any") with the OpenAI default, parallel calls allowed: one
    call or more and then the end, every time; no text after the calls (it ran on to max_tokens:
    finish_reason "length")."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    counts = []
    for seed in range(6):
        done = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
                                              tool_choice="required", max_tokens=400, temperature=1.0, seed=seed,
                                              **extra)  # type: ignore[call-overload]
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        calls = choice.message.tool_calls or []
        assert calls and all(c.function.name in ("get_weather", "add") for c in calls)  # type: ignore[union-attr]
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)  # type: ignore[union-attr]
        counts.append(len(calls))
    if parallel is False:
        assert set(counts) == {1}, counts


def test_a_named_function_ends_after_its_call(client: openai.OpenAI) -> None:
    for seed in range(4):
        done = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=400, temperature=1.0,  # type: ignore[arg-type]
            seed=seed, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]


RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}  # type: ignore[index]
                   for t in TOOLS]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "add"}], ids=["required", "named"])
def test_a_forced_responses_call_completes_with_calls_only(client: openai.OpenAI, tool_choice: object) -> None:
    """/v1/responses with the default parallel calls: `completed`, its output only function_call items
    (a trailing message made it `incomplete`, which openai-agents raises as ModelBehaviorError)."""
    for seed in range(4):
        resp = client.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
                                       tool_choice=tool_choice, max_output_tokens=400,  # type: ignore[arg-type]
                                       temperature=1.0, extra_body={"seed": seed})
        assert resp.status == "completed", resp
        assert resp.output and {item.type for item in resp.output} == {"function_call"}, resp.output


def test_streamed_required_tool_call(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,  # type: ignore[arg-type]
        seed=2, stream=True, parallel_tool_calls=False))
    calls = [c for chunk in chunks for ch in chunk.choices for c in (ch.delta.tool_calls or [])]
    assert calls and calls[0].function and calls[0].function.name in ("get_weather", "add")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_text_format_and_tool_choice(client: openai.OpenAI) -> None:
    resp = client.responses.parse(model=MODEL, input="Describe the weather.", text_format=Weather,
                                  max_output_tokens=200)
    assert isinstance(resp.output_parsed, Weather)
    resp2 = client.responses.create(model=MODEL, input="weather?", max_output_tokens=120,
                                    tools=[{"type": "function", "name": "add", "strict": True,  # type: ignore[list-item]
                                            "parameters": TOOLS[1]["function"]["parameters"]}],  # type: ignore[index]
                                    tool_choice={"type": "function", "name": "add"})
    calls = [item for item in resp2.output if item.type == "function_call"]
    assert calls and calls[0].name == "add"  # type: ignore[union-attr]


def test_a_forced_tool_with_a_format_is_a_tool_call(http: httpx.Client) -> None:
    # openai-agents sends both for an agent with an output_type: the call wins, the format has no text.
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 120, "tools": TOOLS, "tool_choice": "required",
        "parallel_tool_calls": False, "seed": 1,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], choice


def test_a_non_strict_schema_gets_only_its_declared_keys(client: openai.OpenAI) -> None:
    """`strict: false` (instructor's JSON_SCHEMA mode) holds the schema as written, as vLLM does: no
    additionalProperties means no other key (xgrammar's loose mode took any, and a random model
    wrote one until max_tokens)."""
    schema = {"type": "object", "required": ["city", "n"], "properties": {
        "city": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"}, "kind": {"enum": ["rain", "sun"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": False}}
    for seed in range(6):
        done = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt,  # type: ignore[arg-type]
                                              max_tokens=300, temperature=1.0, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content or "")
        assert {"city", "n"} <= set(value) <= set(schema["properties"]), value  # type: ignore[arg-type]
        jsonschema.validate(value, schema)


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     None, "invalid json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
])
def test_bad_structured_requests_are_400(http: httpx.Client, body: dict[str, Any], param: str | None,
                                         fragment: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and (param is None or err["param"] == param), err


# -------------------------------------------------------------- random schemas (hypothesis)

def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda vs: {"enum": vs}, st.lists(st.sampled_from(["a", "b c", "d\"e", 1, 2.5, True, None]),
                                                     min_size=1, max_size=4, unique=True)),
    )


def _schema(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.dictionaries(st.sampled_from(["id", "name", "ok", "tags", "x", "y z"]), children, min_size=1,
                              max_size=3).flatmap(lambda props: st.builds(
                                  lambda req: {"type": "object", "properties": props, "required": req,
                                               "additionalProperties": False},
                                  st.lists(st.sampled_from(sorted(props)), unique=True)))
    arrays = st.builds(lambda items, hi: {"type": "array", "items": items, "maxItems": hi}, children,
                       st.integers(0, 3))
    return st.one_of(objects, arrays)


SCHEMAS = st.recursive(_leaf(), _schema, max_leaves=6).filter(lambda s: s.get("type") in ("object", "array"))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_random_schemas_always_parse_and_validate(http: httpx.Client, schema: dict[str, Any], seed: int) -> None:
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 400, "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", (schema, choice)
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


# -------------------------------------------------------------- langchain

@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(gateway: RunningService, method: str, closing_bias: dict[str, int]) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"http://{gateway.address}/v1", api_key="unused",  # type: ignore[arg-type]
                     max_retries=0, timeout=60, max_completion_tokens=200, seed=4,
                     logit_bias=closing_bias if method == "json_mode" else None)
    if method == "json_mode":
        # JSON mode promises a JSON object, not the schema: langchain returns it as a dict.
        out = llm.with_structured_output(Weather.model_json_schema(), method="json_mode").invoke(
            "Describe the weather as JSON.")
        assert isinstance(out, dict)
    else:
        out = llm.with_structured_output(Weather, method=method).invoke("Describe the weather.")  # type: ignore[arg-type]
        assert isinstance(out, Weather)


def test_langchain_tool_choice_any_is_required(gateway: RunningService) -> None:
    """langchain's "any" is sent as "required": every answer is tool calls only, finish_reason tool_calls."""
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    sent: list[dict[str, Any]] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]}, timeout=60)
    for seed in range(3):
        llm = ChatOpenAI(model=MODEL, base_url=f"http://{gateway.address}/v1", api_key="unused",  # type: ignore[arg-type]
                         max_retries=0, http_client=http, max_completion_tokens=400, temperature=1.0, seed=seed)
        out = llm.bind_tools(TOOLS, tool_choice="any").invoke("Weather in Paris?")
        assert isinstance(out, AIMessage) and out.tool_calls and not out.content, out
        assert out.response_metadata["finish_reason"] == "tool_calls", out.response_metadata
    http.close()
    assert [body["tool_choice"] for body in sent] == ["required"] * 3


def test_a_reasoning_request_thinks_first_then_answers_in_the_schema(http: httpx.Client, tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    bias = {str(tokenizer.token_to_id("<think>")): 50, str(tokenizer.token_to_id("</think>")): 100}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema(), "strict": True}}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "seed": 1,
                                                "response_format": fmt, "logit_bias": bias, "reasoning_effort": "low"})
    body = r.json()
    assert r.status_code == 200, body
    Weather.model_validate_json(body["choices"][0]["message"]["content"])
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2  # <think></think>, then the answer
