"""The ignis-tiny tokenizer: deterministic training, loadable by transformers, a prefix-stable template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.text.tiny_tokenizer import (
    TINY_ADDED_TOKENS,
    TINY_VOCAB_SIZE,
    tiny_tokenizer_json,
    write_tiny_tokenizer,
)
from engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ignis-tiny")
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def make_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        },
        {"type": "function", "function": {"name": "get_time", "description": "Time in a zone, e.g. 東京"}},
    ]


def make_conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21°C"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
        {"role": "assistant", "content": "Sunny and 21°C at 14:05.", "reasoning_content": "Both tools answered."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_training_is_deterministic() -> None:
    assert tiny_tokenizer_json() == tiny_tokenizer_json()


def test_written_files_are_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes()


def test_vocab_and_added_tokens(tok: Tokenizer, tiny_dir: Path) -> None:
    assert tok.vocab_size == TINY_VOCAB_SIZE
    for i, (content, _) in enumerate(TINY_ADDED_TOKENS):
        assert tok.token_to_id(content) == i
    # Only the ChatML markers are special; tool and think markers stay in decoded text.
    assert tok.special_token_ids == frozenset({0, 1, 2})
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id is None
    assert tok.pad_token_id == 0
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] is None


def test_loads_with_transformers(tiny_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    assert len(hf) == TINY_VOCAB_SIZE
    assert hf.eos_token_id == 2 and hf.pad_token_id == 0
    text = "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call><|im_end|>"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)


def test_special_tokens_encode_as_one_id(tok: Tokenizer) -> None:
    for i, (content, _) in enumerate(TINY_ADDED_TOKENS):
        assert tok.encode(f"a{content}b") == [*tok.encode("a"), i, *tok.encode("b")]


@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_system_and_tools_head_is_a_prefix(tok: Tokenizer, with_system: bool, with_tools: bool) -> None:
    conversation = make_conversation() if with_system else make_conversation()[1:]
    tools = make_tools() if with_tools else None
    head_messages = conversation[:1] if with_system else []
    head = tok.apply_chat_template(head_messages, tools=tools, add_generation_prompt=False)
    for gen in (True, False):
        full = tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=gen)
        assert full.startswith(head)
        # The engine compares token ids, so the prefix must hold after tokenization too.
        head_ids = tok.encode(head)
        assert tok.encode(full)[: len(head_ids)] == head_ids
    if with_system or with_tools:
        assert head.endswith("<|im_end|>\n")
    else:
        assert head == ""


def test_each_turn_extends_the_previous_prompt(tok: Tokenizer) -> None:
    # The prompt checkpoint (state at the generation opener) is reusable by the next turn.
    conversation = make_conversation()
    tools = make_tools()
    for k in range(1, len(conversation)):
        if conversation[k]["role"] != "assistant":
            continue
        prompt = tok.render_chat(conversation[:k], tools=tools, add_generation_prompt=True)[1]
        later = tok.render_chat(conversation[: k + 1], tools=tools, add_generation_prompt=False)[1]
        assert later[: len(prompt)] == prompt


def test_template_renders_tool_calls_and_responses(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(make_conversation(), tools=make_tools(), add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' in text
    responses = "<tool_response>\nsunny, 21°C\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
    assert f"<|im_start|>user\n{responses}<|im_end|>\n" in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in text
    assert "<think>\nBoth tools answered.\n</think>\n\nSunny" in text
    assert '"description": "Time in a zone, e.g. 東京"' in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_role_is_a_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="Unknown message role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])
