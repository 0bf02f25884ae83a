"""Each model family's tool-call and reasoning syntax: the engine reads it off the chat template
(family templates in tests/data/chat_templates), the gateway parses it, whole and streamed.

The gateway is a real process; the engine is scripted (tests/test_gateway_scripted.py), since
a random model cannot be made to write a family's syntax."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import grpc
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from engine.guided import infer_formats
from engine.text.chat_template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from gateway.output_formats import ChoiceParser, OutputFormats
from gateway.reasoning import ReasoningDelta
from gateway.tool_calls import ContentDelta, ToolCallDelta
from ignis.v1 import engine_pb2
from services import RunningService, start_gateway
from test_gateway_scripted import MODEL, ScriptedEngine, say

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
PARIS = {"city": "Paris", "days": 3}

# (parser, model text, expected content, expected calls)
FAMILIES: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me look.", [("get_weather", PARIS)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}', None,
     [("a", {}), ("b", {"x": [1]})]),
    ("llama3_json", "It is sunny in Paris {not a call}", "It is sunny in Paris {not a call}", []),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "b", "arguments": {}}]', "Checking.", [("get_weather", PARIS), ("b", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', None, [("get_weather", PARIS)]),
    ("mistral", "[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Sure.", [("get_weather", PARIS)]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n"
                    "</tool_call>", None, [("get_weather", {"city": "42"})]),  # typed by the schema: a string
]


def run(parser: ChoiceParser, pieces: list[str]) -> tuple[str | None, str | None, list[tuple[str, Any]]]:
    """(reasoning, content, calls) as a client accumulates them from the stream."""
    out = []
    for i, piece in enumerate(pieces):
        out += parser.feed(piece, 1, finished=i == len(pieces) - 1)
    reasoning = "".join(p.text for p in out if isinstance(p, ReasoningDelta)) or None
    content = "".join(p.text for p in out if isinstance(p, ContentDelta))
    calls = [(p.call.name, json.loads(p.call.arguments)) for p in out if isinstance(p, ToolCallDelta)]
    return reasoning, (None if calls and not content else content), calls


@pytest.mark.parametrize("name, text, content, calls", FAMILIES)
def test_each_family_whole(name: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    parser = ChoiceParser.make(OutputFormats(name), json.dumps(TOOLS), True)
    assert run(parser, [text]) == (None, content, calls)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(FAMILIES), data=st.data())
def test_streamed_in_any_pieces_equals_whole(case: tuple[str, str, str | None, list[tuple[str, Any]]],
                                             data: st.DataObject) -> None:
    name, text, content, calls = case
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parser = ChoiceParser.make(OutputFormats(name), json.dumps(TOOLS), True)
    assert run(parser, pieces) == (None, content, calls)


@pytest.mark.parametrize("reasoning, pieces, expected", [
    ("qwen3", ["<think>\nthe user", " wants x\n</think>\n\n", "Answer."], ("\nthe user wants x\n", "Answer.")),
    ("qwen3", ["No", " thinking here."], (None, "No thinking here.")),
    ("qwen3", ["<thi", "nk>a</th", "ink>b"], ("a", "b")),
    ("deepseek_r1", ["the user wants x", "</think>\n\nAnswer."], ("the user wants x", "Answer.")),
    ("deepseek_r1", ["cut off while thinking"], ("cut off while thinking", "")),
])
def test_reasoning_split(reasoning: str, pieces: list[str], expected: tuple[str | None, str]) -> None:
    parser = ChoiceParser.make(OutputFormats("hermes", reasoning), "", False)
    got = run(parser, pieces)
    assert (got[0], got[1]) == expected


def test_reasoning_then_a_call_and_the_reasoning_tokens() -> None:
    parser = ChoiceParser.make(OutputFormats("hermes", "qwen3"), json.dumps(TOOLS), True)
    pieces = ["<think>", "plan", "</think>", "\n\n", '<tool_call>\n{"name": "get_weather", "arguments": {}}',
              "\n</tool_call>"]
    assert run(parser, pieces) == ("plan", None, [("get_weather", {})])
    assert parser.reasoning_tokens == 3  # <think>, plan, </think>


# -------------------------------------------------------------- the engine reads the family off the template

@pytest.mark.parametrize("template, tool_call, reasoning", [
    ("llama3.jinja", "llama3_json", ""), ("mistral.jinja", "mistral", ""), ("qwen3.jinja", "hermes", "qwen3"),
    ("qwen3_coder.jinja", "qwen3_coder", ""), ("deepseek_r1.jinja", "", "deepseek_r1"),
])
def test_formats_from_each_familys_template(tiny_model_dir: Path, template: str, tool_call: str,
                                            reasoning: str) -> None:
    backend = HFTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>"}  # the templates read them, as real checkpoints have them
    tokenizer = Tokenizer(backend, specials, chat_template=ChatTemplate({"default": (TEMPLATES / template).read_text()}))
    formats = infer_formats(tokenizer)
    assert (formats.tool_call, formats.reasoning) == (tool_call, reasoning)


# -------------------------------------------------------------- through the real gateway

class FamilyEngine(ScriptedEngine):
    """A scripted engine whose ModelCard names the family, as the real engine's does."""

    tool_call_parser = "llama3_json"
    reasoning_parser = "qwen3"

    def ListModels(self, request: engine_pb2.ListModelsRequest, context: grpc.ServicerContext
                   ) -> engine_pb2.ListModelsResponse:
        return engine_pb2.ListModelsResponse(models=[engine_pb2.ModelCard(
            id=MODEL, max_model_len=4096, owned_by="ignis", created=1,
            tool_call_parser=self.tool_call_parser, reasoning_parser=self.reasoning_parser)])


@pytest.fixture(scope="module")
def family_engine() -> Iterator[FamilyEngine]:
    e = FamilyEngine("family")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def gateway(family_engine: FamilyEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [family_engine.address])
    yield service
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


@pytest.fixture(scope="module")
def client(gateway: RunningService) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


LLAMA_REPLY = ["<think>I should", " call it</think>\n\n", '{"name": "get_weather", ', '"parameters": {"city": "Paris"}}']


def test_the_cards_parsers_are_used_whole_and_streamed(client: openai.OpenAI, family_engine: FamilyEngine) -> None:
    family_engine.script = say(LLAMA_REPLY)
    messages: Any = [{"role": "user", "content": "weather?"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    msg = done.choices[0].message
    assert msg.model_extra and msg.model_extra["reasoning_content"] == "I should call it"
    assert msg.content is None and done.choices[0].finish_reason == "tool_calls"
    [call] = msg.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert done.usage and done.usage.completion_tokens_details
    assert done.usage.completion_tokens_details.reasoning_tokens == 2

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert reasoning == "I should call it" and [t.function.name for t in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens_details
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 2


def test_responses_get_reasoning_and_function_call_items(client: openai.OpenAI, family_engine: FamilyEngine) -> None:
    family_engine.script = say(LLAMA_REPLY)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]  # type: ignore[index]
    resp = client.responses.create(model=MODEL, input="weather?", tools=tools)
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert resp.output[0].content and resp.output[0].content[0].text == "I should call it"  # type: ignore[union-attr]
    assert resp.usage and resp.usage.output_tokens_details.reasoning_tokens == 2
    with client.responses.stream(model=MODEL, input="weather?", tools=tools) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "I should call it"
    assert [item.type for item in final.output] == ["reasoning", "function_call"]


def test_flags_override_the_card(family_engine: FamilyEngine, tmp_path: Path) -> None:
    family_engine.script = say(["<think>x</think>", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'])
    service = start_gateway(tmp_path, [family_engine.address], ["--tool-call-parser", "hermes",
                                                                 "--reasoning-parser", "none"])
    try:
        with openai.OpenAI(base_url=f"http://{service.address}/v1", api_key="unused", max_retries=0) as c:
            done = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             tools=TOOLS)  # type: ignore[arg-type]
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,  # type: ignore[arg-type]
                                      tool_choice="required")
    finally:
        assert service.stop() == 0, service.log()
    # The grammar writes what the gateway parses: the flag's syntax, not the card's.
    forced = family_engine.requests[-1].guided.tool_calls
    assert (forced.tool_choice, forced.format) == ("required", "hermes")
    assert json.loads(forced.tools_json) == TOOLS
    msg = done.choices[0].message
    assert msg.content == "<think>x</think>" and "reasoning_content" not in (msg.model_extra or {})
    assert [c.function.name for c in msg.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
