"""Custom (freeform) tools' grammars: Lark and regex -> EBNF (engine/guided/lark.py), held in the
tool-call grammar (engine/guided/tool_grammar.py). Lark itself is the oracle: what the converted
grammar lets through parses under the Lark grammar, and what Lark parses the converted grammar takes."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.guided.lark import lark_to_ebnf, regex_to_ebnf
from engine.guided.tool_grammar import tool_call_tag

lark = pytest.importorskip("lark", reason="lark (a test extra) is the oracle")
APPLY_PATCH = (Path(__file__).parent / "data" / "codex" / "tool_apply_patch.lark").read_text()
PATCHES = [
    "*** Begin Patch\n*** Add File: hello.txt\n+Hello world\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: src/app.py\n*** Move to: src/main.py\n@@ def greet():\n"
    "-print(\"Hi\")\n+print(\"Hello, world!\")\n context \\ \t\n*** End of File\n*** Delete File: obsolete.txt\n"
    "*** End Patch",
    "*** Begin Patch\n*** Update File: a\n@@\n+x\n*** End Patch\n",
]
NOT_PATCHES = [
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Begin Patch\n*** Add File: a\n*** End Patch\n",  # an added file needs a line
    "*** Begin Patch\n*** Add File: a\nb\n+c\n*** End Patch\n",  # a line without its +
    "*** Begin Patch\n*** Delete File: \n*** End Patch\n",  # an empty filename
    "*** Begin Patch\n*** Add File: a\n+x\n*** End Patch\n\n",  # past the end
]
# Lark's Earley parser refuses a terminal that can match nothing; `/(.+)/?` is the same language as `/(.*)/`.
ORACLE = lark.Lark(APPLY_PATCH.replace("/(.*)/", "/(.+)/?"), start="start")
BYTES = xgr.TokenizerInfo([bytes([i]) for i in range(256)], xgr.VocabType.RAW, vocab_size=256)


def compiled(ebnf: str, root: str = "root") -> xgr.CompiledGrammar:
    return xgr.GrammarCompiler(BYTES).compile_grammar(xgr.Grammar.from_ebnf(ebnf, root_rule_name=root))


def accepts(grammar: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.is_completed()


def walk(grammar: xgr.CompiledGrammar, rng: random.Random, end_bias: float = 0.2, limit: int = 400) -> bytes | None:
    """A random text the grammar takes, byte by byte (printable bytes and newline only), or None."""
    matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    mask = xgr.allocate_token_bitmask(1, 256)
    out = bytearray()
    for _ in range(limit):
        if matcher.is_completed() and (rng.random() < end_bias or matcher.is_terminated()):
            return bytes(out)
        matcher.fill_next_token_bitmask(mask)
        allowed = [b for b in [*range(32, 127), 10, 9] if (int(mask[0, b // 32]) >> (b % 32)) & 1]
        if not allowed:
            return bytes(out) if matcher.is_completed() else None
        # Prefer what closes structure (newline, '*') so walks end: the point is what the grammar allows.
        closing = [x for x in allowed if x in b"\n*+-@ "]
        b = rng.choice(closing or allowed) if rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.accept_token(b)
        out.append(b)
    return None


def test_apply_patch_grammar_agrees_with_lark() -> None:
    parser = ORACLE
    grammar = compiled(lark_to_ebnf(APPLY_PATCH))
    for text in PATCHES:
        parser.parse(text)
        assert accepts(grammar, text), text
    for text in NOT_PATCHES:
        with pytest.raises(lark.exceptions.LarkError):
            parser.parse(text)
        assert not accepts(grammar, text), text
    rng = random.Random(7)
    walked = [t for t in (walk(grammar, rng) for _ in range(60)) if t is not None]
    assert len(walked) >= 20
    for text in walked:
        parser.parse(text.decode())  # the oracle: every text the grammar let through is a patch


def test_a_filename_stays_on_its_line() -> None:
    """xgrammar's own regex reading of `.` takes a newline; Lark's does not."""
    grammar = compiled(lark_to_ebnf(APPLY_PATCH))
    assert not accepts(grammar, "*** Begin Patch\n*** Delete File: a\nb\n*** End Patch\n".replace("a\nb", "a\n\nb"))
    assert accepts(grammar, "*** Begin Patch\n*** Delete File: a b\n*** End Patch\n")


def test_json_string_form_is_the_escaped_language() -> None:
    grammar = compiled(lark_to_ebnf(APPLY_PATCH, json_string=True, prefix="p_"), root="p_root")
    for text in PATCHES:
        assert accepts(grammar, json.dumps(text)[1:-1]), text
    assert not accepts(grammar, PATCHES[0])  # a raw newline is not JSON
    for text in NOT_PATCHES:
        assert not accepts(grammar, json.dumps(text)[1:-1])


@pytest.mark.parametrize("pattern,good,bad", [
    (r"[a-z]{1,4}(-\d+)?", ["ab", "abcd-12"], ["", "abcde", "ab-"]),
    (r"(?:yes|no)\.?", ["yes", "no."], ["maybe", "yes.."]),
    (r"[^\n\"]+", ['a b\\c'], ["a\nb", 'a"b']),
    (r"\w+\s\W", ["ab !"], ["ab a"]),
])
def test_regex_matches_python(pattern: str, good: list[str], bad: list[str]) -> None:
    for json_string in (False, True):
        grammar = compiled(regex_to_ebnf(pattern, json_string=json_string))
        for text in good + bad:
            expected = re.fullmatch(pattern, text) is not None
            assert expected == (text in good)
            shown = json.dumps(text)[1:-1] if json_string else text
            assert accepts(grammar, shown) == expected, (pattern, text, json_string)


@pytest.mark.parametrize("definition,why", [
    ('start: "a"\n%declare B', "%declare"),
    ('start: x{"a"}\nx: "b"', "template"),
    ('start: /a(?=b)/', "lookaround"),
    ('start: /^a/', "anchor"),
    ('start: "a"i', "case-insensitive"),
    ('start: b', "not defined"),
    ('s: "a"', "no 'start'"),
    ('start: "a"\n%import common.NOPE', "common.NOPE"),
])
def test_unsupported_lark_is_named(definition: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        lark_to_ebnf(definition)


def test_common_imports_and_ignore() -> None:
    definition = 'start: WORD ("," WORD)*\n%import common.WORD\n%import common.WS\n%ignore WS'
    grammar = compiled(lark_to_ebnf(definition))
    assert accepts(grammar, "ab,cd")
    assert not accepts(grammar, "ab,,cd")


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "apply_patch"])
def test_the_call_holds_the_input_to_the_grammar(fmt: str, choice: str) -> None:
    tools = [{"type": "function", "function": {"name": "apply_patch", "parameters": {
                  "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}},
              "grammar": {"syntax": "lark", "definition": APPLY_PATCH}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    grammar = xgr.GrammarCompiler(BYTES).compile_grammar(
        xgr.Grammar.from_structural_tag(tool_call_tag(json.dumps(tools), choice, fmt, False)))

    def call(text: str) -> str:
        if fmt == "qwen3_coder":
            return ("<tool_call>\n<function=apply_patch>\n<parameter=input>\n"
                    f"{text}\n</parameter>\n</function>\n</tool_call>")
        args = json.dumps({"input": text})
        if fmt == "llama3_json":
            return '{"name": "apply_patch", "parameters": ' + args + "}"
        return '<tool_call>\n{"name": "apply_patch", "arguments": ' + args + "}\n</tool_call>"

    assert accepts(grammar, call(PATCHES[1]))
    assert not accepts(grammar, call(NOT_PATCHES[2]))
