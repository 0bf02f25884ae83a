"""The tool-call parser (gateway/tool_calls.py): whole texts and every way of streaming them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from gateway.tool_calls import ContentDelta, ToolCall, ToolCallDelta, ToolCallStream, parse_block


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the text held only tool calls
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str) -> ParsedOutput:
    """A whole text through the stream parser, as a non-streamed answer is."""
    stream = ToolCallStream()
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return ParsedOutput(None if stream.calls and not content else content, stream.calls)


def block(name: str, args: object, pad: str = "\n") -> str:
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': args})}{pad}</tool_call>"


def calls_of(text: str) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text).tool_calls]


def stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, object]]]:
    """Feed `text` cut at `cuts`; returns (content, calls) as a client would accumulate them."""
    parser = ToolCallStream()
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.call.name, json.loads(e.call.arguments)) for e in events if isinstance(e, ToolCallDelta)]
    assert [e.index for e in events if isinstance(e, ToolCallDelta)] == list(range(len(calls)))
    return content, calls


TEXTS = [
    "plain text, no tools at all\n",
    "  leading and trailing spaces  ",
    block("get_weather", {"city": "Paris"}),
    "Let me check.\n" + block("get_weather", {"city": "Paris"}),
    block("a", {"x": 1}) + "\n" + block("b", {"y": [1, 2]}) + "\n",
    block("lookup", {"q": "caf\u00e9 \u2615"}) + "\nDone.",
    "a <toolbox> is not a tag, nor is <tool_call_x",
    "before <tool_call>{not json}</tool_call> after",
    "cut off: <tool_call>\n{\"name\": \"get_weather\", \"argu",
    "<tool_call>{\"arguments\": {}}</tool_call>",  # no name: not a call
    "ends with a partial tag <tool_ca",
]


def test_plain_text_passes_through_unchanged() -> None:
    for text in ("hello", "  spaced  \n", "a <toolbox> b", "x <tool_ca"):
        parsed = parse_tool_calls(text)
        assert parsed.content == text and parsed.tool_calls == []


def test_single_call_has_no_content() -> None:
    parsed = parse_tool_calls(block("get_weather", {"city": "Paris", "unit": "C"}))
    assert parsed.content is None
    [call] = parsed.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    assert call.id.startswith("call_") and len(call.id) > 10
    assert call.openai(0) == {"index": 0, "id": call.id, "type": "function",
                              "function": {"name": "get_weather", "arguments": call.arguments}}


def test_text_around_calls_and_several_calls() -> None:
    text = "Let me check.\n" + block("a", {"x": 1}) + "\n" + block("b", {"y": [1, 2]}) + "\nDone."
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check.Done."  # whitespace next to a parsed block is template formatting
    assert calls_of(text) == [("a", {"x": 1}), ("b", {"y": [1, 2]})]
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == 2


def test_malformed_and_unclosed_blocks_stay_text() -> None:
    for text in ("before <tool_call>{not json}</tool_call> after",
                 "<tool_call>{\"arguments\": {}}</tool_call>",
                 "<tool_call>[1, 2]</tool_call>",
                 "cut off: <tool_call>\n{\"name\": \"get_weather\", \"argu"):
        parsed = parse_tool_calls(text)
        assert parsed.tool_calls == [] and parsed.content == text


def test_a_bad_block_next_to_a_good_one() -> None:
    text = block("good", {"k": "v"}) + "<tool_call>oops</tool_call>"
    parsed = parse_tool_calls(text)
    assert calls_of(text) == [("good", {"k": "v"})]
    assert parsed.content == "<tool_call>oops</tool_call>"


def test_argument_forms() -> None:
    as_string = parse_block('{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert as_string is not None and as_string.arguments == '{"a": 1}'
    alias = parse_block('{"name": "f", "parameters": {"a": 1}}')
    assert alias is not None and json.loads(alias.arguments) == {"a": 1}
    missing = parse_block('{"name": "f"}')
    assert missing is not None and missing.arguments == "{}"
    unicode = parse_block('{"name": "f", "arguments": {"q": "caf\\u00e9"}}')
    assert unicode is not None and unicode.arguments == '{"q": "café"}'  # not \\u-escaped
    assert parse_block('{"name": "", "arguments": {}}') is None
    assert parse_block('{"name": 3}') is None


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_in_any_pieces_equals_the_whole_parse(text: str) -> None:
    whole = parse_tool_calls(text)
    expected = (whole.content or "", calls_of(text))
    assert stream(text, []) == expected
    assert stream(text, list(range(1, len(text)))) == expected  # one character at a time
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
        assert stream(text, cuts) == expected, cuts


def test_streaming_emits_text_before_the_call_arrives() -> None:
    parser = ToolCallStream()
    assert parser.feed("Checking the weather") == [ContentDelta("Checking the weather")]
    assert parser.feed(" now <tool") == [ContentDelta(" now")]  # the space and the partial tag are held
    assert parser.feed("_call>\n{\"name\": \"get_weather\", ") == []
    events = parser.feed("\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>")
    assert len(events) == 1 and isinstance(events[0], ToolCallDelta)
    assert events[0].call.name == "get_weather" and json.loads(events[0].call.arguments) == {"city": "Oslo"}
    assert parser.finish() == []


def test_streaming_releases_a_false_alarm() -> None:
    parser = ToolCallStream()
    assert parser.feed("a <tool") == [ContentDelta("a")]
    assert parser.feed("box>") == [ContentDelta(" <toolbox>")]
    assert parser.finish() == []
