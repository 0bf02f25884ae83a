"""Request guides -> compiled grammars, against the engine's vocabulary, cached by content.

Compiling runs on the servicer's prompt workers before a request is queued (never on the
step thread): a request waits in the queue, not in the step, while its grammar compiles.
The cache is a bounded LRU keyed by the `GuidedSpec` itself (its whole content).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

import xgrammar as xgr

from engine.guided.matcher import CompiledGuide, ReasoningTokens
from engine.guided.schema_support import unenforced_construct
from engine.guided.spec import GuideKind, GuidedSpec
from engine.guided.tool_grammar import tool_call_tag
from engine.text.tokenizer import Tokenizer

CACHE_ENTRIES = 256
COMPILE_THREADS = 2
# xgrammar's C++ errors start "[10:26:46] /project/cpp/regex_converter.cc:94: "; the rest is the reason.
_LOG_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")
# xgrammar 0.2.9 writes a length-limited JSON string's character as [^"\\\r\n]: control characters
# pass (invalid JSON) and escapes do not. Its other strings' character, [^\0-\x1f"\\\r\n], takes
# the UTF-16 surrogates U+D800-DFFF as if they were characters: their 3-byte forms (ED A0-BF xx) are
# not UTF-8, so the text decodes to three U+FFFD and breaks maxLength (a seeded request wrote
# "}}th" + ED B7 BA against maxLength 5). Both are replaced by JSON's own rule for an unescaped
# character, without the surrogates (xgrammar already refuses overlong forms and past U+10FFFF).
_XGRAMMAR_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


class GuidedError(ValueError):
    """The request's schema, regex, grammar or tool choice is not valid (INVALID_ARGUMENT)."""


class GuidedCompiler:
    """One per engine: the vocabulary xgrammar masks over and the compiled-grammar cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_entries: int = CACHE_ENTRIES) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        # Raw token bytes; special tokens (and ids past the tokenizer, a padded embedding) are
        # empty, which xgrammar never allows inside a grammar, only as a stop token.
        vocab = [b"" if i in tokenizer.special_token_ids else tokenizer.token_bytes(i)
                 for i in range(min(tokenizer.vocab_size, vocab_size))]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=list(self.eos_token_ids))
        self._xgr = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self._cache: OrderedDict[GuidedSpec, xgr.CompiledGrammar] = OrderedDict()
        self._limit = cache_entries
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, spec: GuidedSpec, stop_token_ids: Iterable[int] = (),
                reasoning: ReasoningTokens | None = None) -> CompiledGuide:
        """GuidedError naming what is wrong; `stop_token_ids` also end a completed output; with
        `reasoning`, the grammar holds after the model's reasoning block."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
        if grammar is None:
            grammar = self._compile(spec)
            _check_some_output(grammar, spec)
            with self._lock:
                self.misses += 1
                self._cache[spec] = grammar
                while len(self._cache) > self._limit:
                    self._cache.popitem(last=False)
        stops = tuple(sorted({*self.eos_token_ids, *stop_token_ids}))
        return CompiledGuide(grammar, stops, spec.kind.value, reasoning)

    def _compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        what = spec.kind.value
        try:
            if spec.kind is GuideKind.JSON_OBJECT:
                # Compact JSON: a model must not be able to stall the output on endless whitespace.
                return self._xgr.compile_grammar(_json_grammar('{"type": "object"}'))
            if spec.kind is GuideKind.JSON_SCHEMA:
                _check_json(spec.source, "json_schema")
                why = unenforced_construct(json.loads(spec.source))
                if why is not None:
                    raise GuidedError(f"invalid json_schema: {why}")
                return self._xgr.compile_grammar(_json_grammar(spec.source))
            if spec.kind is GuideKind.REGEX:
                return self._xgr.compile_regex(spec.source)
            if spec.kind is GuideKind.CHOICE:
                what = "choice"
                return self._xgr.compile_grammar("root ::= " + " | ".join(_ebnf_string(c) for c in spec.choices))
            if spec.kind is GuideKind.GRAMMAR:
                return self._xgr.compile_grammar(spec.source)
            if spec.kind is GuideKind.STRUCTURAL_TAG:
                _check_json(spec.source, "structural_tag")
                return self._xgr.compile_grammar(_mended(xgr.Grammar.from_structural_tag(spec.source)))
            what = "tool_choice"
            tag = tool_call_tag(spec.source, spec.tool_choice, spec.tool_format, spec.parallel_tool_calls)
            # The arguments' schemas are JSON schemas inside the tag: the same string rule is mended.
            return self._xgr.compile_grammar(_mended(xgr.Grammar.from_structural_tag(tag)))
        except GuidedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request's input: xgrammar raises RuntimeError from C++,
            # and its builders assert (a tool whose `parameters` is not an object): every one is the input's fault
            raise GuidedError(f"invalid {what}: {_reason(exc)}") from None


def _check_some_output(grammar: xgr.CompiledGrammar, spec: GuidedSpec) -> None:
    """GuidedError when no first token is allowed: the grammar's language is empty (`root ::= root "a"`),
    and the request would fail at its first sampled token."""
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()) and not matcher.is_completed():
        raise GuidedError(f"invalid {spec.kind.value}: it accepts no output (no derivation of its root ends; "
                          "is a rule only ever defined through itself?)")


def _json_grammar(schema: str) -> xgr.Grammar:
    """The schema as written, whatever the request's `strict` (vLLM leaves xgrammar's strict_mode on too):
    properties and items beyond those declared only where the schema allows them
    (`additionalProperties`, `items`); a bare `{"type": "object"}` is any object. xgrammar's loose
    mode would add any key to every object, and a random model writes one until max_tokens.
    Compact JSON (no free whitespace): a model must not be able to stall the output on it."""
    return _mended(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))


def _mended(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with xgrammar's JSON string characters replaced by JSON's own (see above)."""
    text = original = str(grammar)
    for chars in _XGRAMMAR_STRING_CHARS:
        text = text.replace(chars, _JSON_STRING_CHAR)
    return grammar if text == original else xgr.Grammar.from_ebnf(text)


def _check_json(source: str, what: str) -> None:
    try:
        json.loads(source)
    except json.JSONDecodeError as exc:
        raise GuidedError(f"invalid {what}: not valid JSON ({exc})") from None


def _ebnf_string(text: str) -> str:
    if not text:
        raise GuidedError("invalid choice: a choice may not be empty")
    return json.dumps(text, ensure_ascii=False)  # EBNF string literals take JSON's escapes


def _reason(exc: Exception) -> str:
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__
