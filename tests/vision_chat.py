"""A tiny Qwen3.5 checkpoint with a vision tower that chats: ignis-tiny's tokenizer with Qwen's vision tokens
appended (ids 4096..4099) and its chat template rendering an image part as Qwen's templates do, so the
gateway's image parts run end to end through the engine (tests/test_images_service.py, bench/media.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.text.tiny_tokenizer import TINY_CHAT_TEMPLATE, TINY_VOCAB_SIZE, write_tiny_tokenizer

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
IMAGE, VIDEO, VISION_START, VISION_END = range(TINY_VOCAB_SIZE, TINY_VOCAB_SIZE + 4)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_TEXT_PART = "{%- if part is mapping and part.type == 'text' -%}\n                {{- part.text -}}\n"
CHAT_TEMPLATE = TINY_CHAT_TEMPLATE.replace(
    _TEXT_PART, _TEXT_PART + "            {%- elif part is mapping and part.type == 'image' -%}\n"
                             f"                {{{{- '{IMAGE_PLACEHOLDER}' -}}}}\n")
assert CHAT_TEMPLATE != TINY_CHAT_TEMPLATE, "ignis-tiny's template changed: render image parts again"


def write_vision_tokenizer(directory: Path) -> None:
    """ignis-tiny's tokenizer files in `directory`, with the vision tokens and the image-rendering template."""
    write_tiny_tokenizer(directory)
    tokenizer = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    assert [tokenizer.token_to_id(t) for t in VISION_TOKENS] == [IMAGE, VIDEO, VISION_START, VISION_END]
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for i, token in enumerate(VISION_TOKENS):
        config["added_tokens_decoder"][str(IMAGE + i)] = {"content": token, "lstrip": False, "normalized": False,
                                                          "rstrip": False, "single_word": False, "special": True}
    config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
