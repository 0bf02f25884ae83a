"""Tokenizer: agrees with transformers on ids, text and chat templates; reads the config files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engine.text.tiny_tokenizer import write_tiny_tokenizer
from engine.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world, how are you?",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "café naïve résumé — 21°C ± 2",
    "日本語のテキスト and 中文 mixed",
    "emoji 😀🚀🦀 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ignis-tiny")
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


def make_checkpoint(tiny_dir: Path, dest: Path, **config_changes: Any) -> Path:
    """A copy of the tiny tokenizer with tokenizer_config.json entries replaced (None deletes)."""
    shutil.copy(tiny_dir / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def make_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": "search_web",
                "description": "Search the web — returns snippets",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
            },
        }
    ]


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city in 日本."}],
    [
        {"role": "system", "content": [{"type": "text", "text": "You search."}]},
        {"role": "user", "content": "Find café prices"},
        {
            "role": "assistant",
            "content": "Searching.",
            "tool_calls": [{"type": "function", "function": {"name": "search_web", "arguments": {"query": "café"}}}],
        },
        {"role": "tool", "content": '{"price": "3€"}'},
        {"role": "assistant", "content": "About 3€.", "reasoning": "The tool said so."},
        {"role": "user", "content": "Thanks 😀"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf: Any, text: str) -> None:
    for add_special in (False, True):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special)
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_token_bytes_agree_with_decode(tok: Tokenizer) -> None:
    split_chars = 0
    for i in range(tok.vocab_size):
        single = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in single:
            split_chars += 1  # a piece of a multi-byte character
            assert tok.token_bytes(i).decode("utf-8", errors="replace") == single
        else:
            assert tok.token_bytes(i) == single.encode("utf-8")
    assert split_chars > 0
    ids = tok.encode(TEXTS[4])
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == TEXTS[4]


def test_token_bytes_outside_vocab_is_empty(tok: Tokenizer) -> None:
    assert tok.token_bytes(tok.vocab_size) == b""
    assert tok.token_bytes(-1) == b""
    assert tok.id_to_token(tok.vocab_size) is None


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "tools-multiturn"])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf: Any, conversation: list[dict[str, Any]], with_tools: bool, add_generation_prompt: bool
) -> None:
    tools = make_tools() if with_tools else None
    text = tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    ids = tok.render_chat(conversation, tools=tools, add_generation_prompt=add_generation_prompt)[1]
    expected_ids = hf.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids == list(expected_ids)


def test_eos_ids_from_generation_config(tiny_dir: Path, tmp_path: Path) -> None:
    d = make_checkpoint(tiny_dir, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(d).eos_token_ids == frozenset({0, 2})
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(d).eos_token_ids == frozenset({0, 2})


def test_eos_ids_fall_back_to_config_json(tiny_dir: Path, tmp_path: Path) -> None:
    d = make_checkpoint(tiny_dir, tmp_path)
    (d / "config.json").write_text(json.dumps({"eos_token_id": [0]}))
    assert Tokenizer.from_dir(d).eos_token_ids == frozenset({0, 2})


def test_special_tokens_as_dicts_and_bos(tiny_dir: Path, tmp_path: Path) -> None:
    d = make_checkpoint(
        tiny_dir,
        tmp_path,
        bos_token={"content": "<|endoftext|>", "special": True},
        eos_token={"content": "<|im_end|>"},
        add_bos_token=True,
    )
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id == 0 and tok.eos_token_ids == frozenset({2})
    assert tok.encode("hi", add_special_tokens=True) == [0, *tok.encode("hi")]
    # The template sees bos_token as a string.
    assert tok.special_tokens["bos_token"] == "<|endoftext|>"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_missing_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_checkpoint(tiny_dir, tmp_path, chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(tiny_dir: Path, tmp_path: Path) -> None:
    d = make_checkpoint(tiny_dir, tmp_path)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_named_templates_pick_tool_use(tiny_dir: Path, tmp_path: Path) -> None:
    templates = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools={{ tools|length }}"}]
    tok = Tokenizer.from_dir(make_checkpoint(tiny_dir, tmp_path, chat_template=templates))
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "plain"
    assert tok.apply_chat_template(messages, tools=make_tools()) == "tools=1"


def test_template_environment_like_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content | tojson }}|{{ {'b': 1, 'a': 2} | tojson(indent=1) }}"
        "|{{ strftime_now('%Y') | length }}|{{ flavour }}|{% for i in range(5) %}{% if i > 1 %}{% break %}{% endif %}"
        "{{ i }}{% endfor %}{% generation %}G{% endgeneration %}"
    )
    d = make_checkpoint(tiny_dir, tmp_path, chat_template=source, bos_token="<|endoftext|>")
    tok = Tokenizer.from_dir(d)
    messages = [{"role": "user", "content": "日本 <b>"}]
    text = tok.apply_chat_template(messages, template_kwargs={"flavour": "vanilla"})
    assert text == '<|endoftext|>|<|im_end|>|"日本 <b>"|{\n "b": 1,\n "a": 2\n}|4|vanilla|01G'
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert hf.apply_chat_template(messages, tokenize=False, flavour="vanilla") == text


def test_raise_exception_is_a_value_error(tiny_dir: Path, tmp_path: Path) -> None:
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    tok = Tokenizer.from_dir(make_checkpoint(tiny_dir, tmp_path, chat_template=source))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_unsafe_access(tiny_dir: Path, tmp_path: Path) -> None:
    source = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_dir(make_checkpoint(tiny_dir, tmp_path, chat_template=source))
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_sentencepiece_style_token_bytes(tmp_path: Path) -> None:
    # A Llama-2-style tokenizer: "▁" for spaces, <0xNN> byte-fallback pieces.
    vocab = {"<unk>": 0, "<0xE6>": 1, "<0x97>": 2, "<0xA5>": 3, "▁": 4, "h": 5, "i": 6, "▁hi": 7, "hi": 8}
    spec: dict[str, Any] = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False},
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True,
                  "vocab": vocab, "merges": [["h", "i"], ["▁", "hi"]]},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("hi 日")
    assert ids == [7, 4, 1, 2, 3]
    assert [tok.token_bytes(i) for i in ids] == [b" hi", b" ", b"\xe6", b"\x97", b"\xa5"]
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == tok.decode(ids) == " hi 日"
