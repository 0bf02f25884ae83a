"""A checkpoint's tokenizer: `tokenizer.json` plus what the config files say about it.

Wraps a `tokenizers.Tokenizer` (the Rust library `transformers` uses too, so
ids and decoded text agree with it) and adds what serving needs: the eos ids
that end generation, the chat template, and `token_bytes`, the raw bytes each
token stands for, which lets the streaming detokenizer work per token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.text.chat_template import ChatTemplate

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_UNSET = object()  # a token text not looked up yet (None is an answer: not whole characters)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Invert GPT-2's byte-to-unicode alphabet (printable chars stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in table.items()}


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as "x" or {"content": "x", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _decoder_kinds(spec: Any) -> set[str]:
    """Types of the decoder and of every decoder inside a Sequence."""
    if not isinstance(spec, dict):
        return set()
    kinds = {str(spec.get("type"))}
    for inner in spec.get("decoders") or []:
        kinds |= _decoder_kinds(inner)
    return kinds


def _load_chat_template(directory: Path, config: dict[str, Any]) -> ChatTemplate | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():  # the newer layout; it wins over the config entry
        return ChatTemplate({"default": jinja_file.read_text(encoding="utf-8")})
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return ChatTemplate({"default": raw})
    if isinstance(raw, list) and raw:
        named = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t and "template" in t}
        return ChatTemplate(named) if named else None
    return None


class Tokenizer:
    """Encode, decode, per-token bytes and chat templating for one checkpoint."""

    def __init__(
        self,
        backend: HFTokenizer,
        config: dict[str, Any],
        generation_eos_ids: Iterable[int] = (),
        chat_template: ChatTemplate | None = None,
    ) -> None:
        # A tokenizer.json may carry padding/truncation settings; serving wants neither.
        backend.no_padding()
        backend.no_truncation()
        self._tk = backend
        self._chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.bos_token_id: int | None = self._id_of(self.special_tokens.get("bos_token"))
        self.pad_token_id: int | None = self._id_of(self.special_tokens.get("pad_token"))
        self.add_bos_token: bool = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None

        eos = {i for i in generation_eos_ids if 0 <= i < self.vocab_size}
        eos_id = self._id_of(self.special_tokens.get("eos_token"))
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        # What `decode(skip_special_tokens=True)` drops: the tokenizers library's
        # own `special` flag, so streaming and full decoding skip the same ids.
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

        # The decoder's own JSON (its pickle state), not the whole tokenizer's.
        decoder = backend.decoder
        kinds = _decoder_kinds(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._metaspace = bool(kinds & {"Metaspace", "Replace"})
        self._bytes_cache: list[bytes | None] = [None] * self.vocab_size
        self._text_cache: list[str | None | object] = [_UNSET] * self.vocab_size

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint directory (tokenizer.json, tokenizer_config.json, ...)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer: {tokenizer_file} does not exist (ignis needs a fast-tokenizer file)")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust library raises plain Exception
            raise ValueError(f"cannot load {tokenizer_file}: {e}") from e
        config = _read_json(directory / "tokenizer_config.json")
        # generate() reads eos from generation_config.json, falling back to config.json.
        generation = _read_json(directory / "generation_config.json")
        if "eos_token_id" not in generation:
            generation = _read_json(directory / "config.json")
        return cls(
            backend,
            config,
            generation_eos_ids=_as_id_list(generation.get("eos_token_id")),
            chat_template=_load_chat_template(directory, config),
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tk.token_to_id(token)

    # --- ids <-> text ---------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        # Some checkpoints ask for BOS in tokenizer_config.json rather than in
        # tokenizer.json's post-processor; add it once either way.
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, i: int) -> str | None:
        token: str | None = self._tk.id_to_token(i)
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._id_of(token)

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` stands for; b"" for ids outside the vocabulary.

        Concatenating token_bytes over a sequence and decoding it as UTF-8 gives
        decode() for byte-level BPE. Why b"" for unknown ids: a model's
        embedding is often padded past the tokenizer's vocabulary, and
        decode() ignores such ids too.
        """
        if not 0 <= i < self.vocab_size:
            return b""
        cached = self._bytes_cache[i]
        if cached is None:
            cached = self._compute_token_bytes(i)
            self._bytes_cache[i] = cached
        return cached

    def text_table(self) -> list[object]:
        """The list token_text fills: entry i is token i's text (a str) once looked up; None where its
        bytes are not whole characters, a sentinel where not looked up yet (the detokenizer reads it)."""
        return self._text_cache

    def token_text(self, i: int) -> str | None:
        """token_bytes(i) as text when those bytes are whole UTF-8 characters on their own; None when
        they end inside a character or are not UTF-8 (then only the bytes around them say what they
        are). What the detokenizer takes when it holds no unfinished character: most tokens."""
        if not 0 <= i < self.vocab_size:
            return ""
        cached = self._text_cache[i]
        if cached is _UNSET:
            try:
                cached = self.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                cached = None
            self._text_cache[i] = cached
        return cached  # type: ignore[return-value]

    def _compute_token_bytes(self, i: int) -> bytes:
        token = self._tk.id_to_token(i)
        if token is None:
            return b""
        if self._byte_level:
            # Like the ByteLevel decoder: map each char back to its byte, or,
            # if any char is outside the alphabet (an added token such as
            # "a b"), take the token's UTF-8 as is.
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in token)
            except KeyError:
                return token.encode("utf-8")
        if self._byte_fallback:
            m = _BYTE_FALLBACK.fullmatch(token)
            if m is not None:
                return bytes([int(m.group(1), 16)])
        if self._metaspace:
            # SentencePiece style: "▁" is a space. Unlike decode(), the leading
            # space of a sequence is kept: generated text continues a prompt.
            return token.replace("\u2581", " ").encode("utf-8")
        return self._tk.decode([i], skip_special_tokens=False).encode("utf-8")

    # --- chat -----------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation to the prompt text, as transformers would.

        Unlike transformers, an empty `messages` list is allowed: the engine
        renders the tools alone to find the shared system+tools head.
        """
        if self._chat_template is None:
            raise ValueError(
                "this checkpoint has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); use the completions API with a raw prompt instead"
            )
        # Template variables: special tokens (bos_token, eos_token, ...) first,
        # then the caller's, which win, as in transformers.
        # A dict, not **kwargs: a client's variable may be named anything ("self" included).
        variables = {**self.special_tokens, **(template_kwargs or {})}
        return self._chat_template.render(messages, tools, add_generation_prompt, variables)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt's text (apply_chat_template) and its ids, encoded without adding special tokens
        (the template has them)."""
        text = self.apply_chat_template(messages, tools, add_generation_prompt, template_kwargs)
        return text, self.encode(text, add_special_tokens=False)
