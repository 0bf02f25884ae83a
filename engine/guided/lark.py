"""Lark grammars (and Python regexes) -> xgrammar EBNF, for custom (freeform) tools.

OpenAI's custom tools give their input's syntax as a Lark grammar or a regex (Codex's
``apply_patch`` is a Lark grammar). xgrammar reads EBNF, and its own regex converter reads
``.`` as any character, newline included, where Python and Lark exclude it: a filename
``/(.+)/`` would run over lines. So both are converted here, for the subset tool grammars use:

- rules and terminals (``name: ...``, ``NAME: ...``, ``?name``/``!name``, ``.priority``
  ignored), alternatives (``|``, continued on lines that start with ``|``), ``-> alias``
  (dropped), ``( )``, ``[ ]`` (optional), ``? * +``, ``~ n`` and ``~ n..m``, ``"a".."z"``;
- strings with Python escapes; regexes ``/.../`` (flag ``s`` only): literals, escapes, ``.``,
  classes, groups (plain, ``?:``, named), alternation, ``* + ? {n} {n,} {n,m}`` (lazy marks
  change nothing in a language);
- ``%import common.NAME`` for the common terminals below; ``%ignore`` is dropped (the output
  then simply has none of the ignored text: still in the language); ``//`` and ``#`` comments.

Anything else (templates, ``%declare``, lookarounds, backreferences, anchors, flags other than
``s``) is a ValueError naming it. `json_string` renders the language as the inside of a JSON
string (each character in its JSON escape where it needs one): a call's input inside JSON arguments.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

MAX_CODE = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
_JSON_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # what a JSON string writes escaped

# Lark's common.lark, the terminals tool grammars import (in Lark syntax, converted like the rest).
COMMON = {
    "LF": r'"\n"', "CR": r'"\r"', "NEWLINE": r"(CR? LF)+", "WS_INLINE": r'(" "|/\t/)+',
    "WS": r"/[ \t\f\r\n]/+", "DIGIT": r'"0".."9"', "HEXDIGIT": r'"a".."f"|"A".."F"|DIGIT',
    "INT": "DIGIT+", "SIGNED_INT": r'["+"|"-"] INT', "LCASE_LETTER": r'"a".."z"',
    "UCASE_LETTER": r'"A".."Z"', "LETTER": "UCASE_LETTER | LCASE_LETTER",
    "WORD": "LETTER+", "CNAME": r'("_"|LETTER) ("_"|LETTER|DIGIT)*',
    "DECIMAL": r'INT "." INT? | "." INT', "_EXP": r'("e"|"E") SIGNED_INT',
    "FLOAT": "INT _EXP | DECIMAL _EXP?", "SIGNED_FLOAT": r'["+"|"-"] FLOAT',
    "NUMBER": "FLOAT | INT", "SIGNED_NUMBER": r'["+"|"-"] NUMBER',
    "ESCAPED_STRING": r'"\"" _STRING_ESC_INNER "\""', "_STRING_ESC_INNER": r'/([^"\\]|\\.)*/',
}
# Lark's own token rules (lark/load_grammar.py), in the order tried.
_TOKEN = re.compile(r"""
    (?P<ws>[ \t\f\r\n]+)
  | (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?!/)(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<arrow>->)
  | (?P<dots>\.\.)
  | (?P<number>\d+)
  | (?P<name>[_?!]?[A-Za-z_][A-Za-z_0-9]*)
  | (?P<op>[:|()\[\]?*+~.{},])
""", re.VERBOSE)


@dataclass(frozen=True, slots=True)
class CharSet:
    """A set of code points: `ranges` (inclusive), or all but them when `negated`."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def has(self, code: int) -> bool:
        return any(lo <= code <= hi for lo, hi in self.ranges) != self.negated

    def positive(self, without: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
        """The set minus `without` as ranges; None when negated (too wide to list: see `render`)."""
        if self.negated:
            return None
        out = list(self.ranges)
        for cut_lo, cut_hi in without:
            kept: list[tuple[int, int]] = []
            for lo, hi in out:
                if hi < cut_lo or lo > cut_hi:
                    kept.append((lo, hi))
                    continue
                if lo < cut_lo:
                    kept.append((lo, cut_lo - 1))
                if hi > cut_hi:
                    kept.append((cut_hi + 1, hi))
            out = kept
        return out


def _class_text(ranges: list[tuple[int, int]], negated: bool) -> str:
    def char(code: int) -> str:
        if chr(code).isascii() and chr(code).isalnum():
            return chr(code)
        return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    body = "".join(char(lo) if lo == hi else f"{char(lo)}-{char(hi)}" for lo, hi in ranges)
    return f"[{'^' if negated else ''}{body}]"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # xgrammar's EBNF strings take JSON's escapes


class _Renderer:
    """Characters and strings as EBNF, raw or as the inside of a JSON string."""

    def __init__(self, json_string: bool) -> None:
        self.json_string = json_string

    def string(self, text: str) -> str:
        if not text:
            return '""'
        if self.json_string:
            text = json.dumps(text, ensure_ascii=False)[1:-1]
        return _literal(text)

    def chars(self, chars: CharSet) -> str:
        cut = [SURROGATES, *(_JSON_ESCAPED if self.json_string else [])]
        plain = chars.positive(cut)
        if plain is None:
            parts = [_class_text(sorted([*chars.ranges, *cut]), negated=True)]
        else:
            parts = [_class_text(plain, negated=False)] if plain else []
        if self.json_string:  # the characters JSON escapes, each in its escape
            parts += [_literal(json.dumps(chr(code))[1:-1]) for lo, hi in _JSON_ESCAPED
                      for code in range(lo, hi + 1) if chars.has(code)]
        if not parts:
            raise ValueError("a character class matches no character")
        return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"


# ---------------------------------------------------------------- regex


_CLASS_ESCAPES = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
                  "s": [(0x09, 0x0D), (0x20, 0x20)]}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}


class _Regex:
    """A Python regex (the subset above) -> an EBNF expression."""

    def __init__(self, pattern: str, dotall: bool, out: _Renderer) -> None:
        self.p, self.i, self.dotall, self.out = pattern, 0, dotall, out

    def convert(self) -> str:
        expr = self._alt()
        if self.i != len(self.p):
            raise self._bad("an unbalanced ')'")
        return expr

    def _bad(self, what: str) -> ValueError:
        return ValueError(f"regex /{self.p}/: {what} (at {self.i}) is not supported")

    def _peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def _alt(self) -> str:
        seqs = [self._seq()]
        while self._peek() == "|":
            self.i += 1
            seqs.append(self._seq())
        return seqs[0] if len(seqs) == 1 else "(" + " | ".join(seqs) + ")"

    def _seq(self) -> str:
        parts: list[str] = []
        while self._peek() not in ("", "|", ")"):
            atom = self._atom()
            parts.append(self._quantified(atom))
        return " ".join(parts) if parts else '""'

    def _quantified(self, atom: str) -> str:
        c = self._peek()
        if c in ("*", "+", "?"):
            self.i += 1
            quant = c
        elif c == "{" and (m := re.compile(r"\{(\d+)(,(\d*))?\}").match(self.p, self.i)):
            self.i = m.end()
            lo, comma, hi = m.group(1), m.group(2), m.group(3)
            quant = "{" + lo + ("," + (hi or "") if comma else "") + "}"
            if comma and not hi:
                quant = "{" + lo + ",}"
        else:
            return atom
        if self._peek() in ("?", "+"):  # lazy or possessive: the same language
            self.i += 1
        if self._peek() in ("*", "+", "?", "{"):
            raise self._bad("a repeated quantifier")
        return f"({atom}){quant}"

    def _atom(self) -> str:
        c = self._peek()
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i):
                self.i = self.p.index(">", self.i) + 1
            elif self._peek() == "?":
                raise self._bad("a group flag or lookaround")
            inner = self._alt()
            if self._peek() != ")":
                raise self._bad("an unclosed '('")
            self.i += 1
            return f"({inner})"
        if c == "[":
            return self.out.chars(self._class())
        if c == ".":
            return self.out.chars(CharSet(((0, MAX_CODE),)) if self.dotall else CharSet(((10, 10),), negated=True))
        if c == "\\":
            found = self._escape()
            return self.out.chars(found) if isinstance(found, CharSet) else self.out.string(found)
        if c in ("^", "$"):
            raise self._bad(f"the anchor {c!r}")
        if c in ("*", "+", "?", "{") and c != "{":
            raise self._bad(f"a quantifier {c!r} with nothing before it")
        return self.out.string(c)

    def _escape(self) -> str | CharSet:
        c = self._peek()
        if not c:
            raise self._bad("a trailing backslash")
        self.i += 1
        if c.lower() in _CLASS_ESCAPES:
            return CharSet(tuple(_CLASS_ESCAPES[c.lower()]), negated=c.isupper())
        if c in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[c]
        if c in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self._bad(f"a malformed \\{c} escape")
            self.i += width
            return chr(int(digits, 16))
        if c.isalnum():
            raise self._bad(f"the escape \\{c}")
        return c

    def _class(self) -> CharSet:
        negated = self._peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self._peek()
            if not c:
                raise self._bad("an unclosed '['")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self._class_char()
            if isinstance(lo, CharSet):
                if lo.negated:
                    raise self._bad("a negated class escape inside a class")
                ranges += lo.ranges
                continue
            if self._peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._class_char()
                if isinstance(hi, CharSet) or ord(hi) < ord(lo):
                    raise self._bad("a bad range in a class")
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        return CharSet(tuple(sorted(ranges)), negated)

    def _class_char(self) -> str | CharSet:
        c = self._peek()
        self.i += 1
        if c != "\\":
            return c
        if self._peek() == "b":
            self.i += 1
            return "\b"
        return self._escape()


def regex_to_ebnf(pattern: str, json_string: bool = False, flags: str = "", name: str = "root") -> str:
    """A grammar whose rule `name` is the regex's language (`json_string`: as the inside of a JSON string)."""
    if set(flags) - {"s"}:
        raise ValueError(f"regex /{pattern}/{flags}: only the flag 's' is supported")
    return f"{name} ::= {_Regex(pattern, 's' in flags, _Renderer(json_string)).convert()}\n"


# ---------------------------------------------------------------- lark


@dataclass(slots=True)
class _Tok:
    kind: str
    text: str


def _tokens(line: str) -> list[_Tok]:
    out: list[_Tok] = []
    i = 0
    while i < len(line):
        m = _TOKEN.match(line, i)
        if m is None:
            raise ValueError(f"cannot read the grammar at {line[i:i + 20]!r}")
        i = m.end()
        kind = m.lastgroup or ""
        if kind not in ("ws", "comment"):
            out.append(_Tok(kind, m.group()))
    return out


class _Lark:
    def __init__(self, definition: str, json_string: bool, prefix: str) -> None:
        self.out = _Renderer(json_string)
        self.prefix = prefix
        self.defs: dict[str, list[_Tok]] = {}
        self._read(definition)
        self.rules: dict[str, str] = {}
        self._pending: list[str] = []

    def _read(self, definition: str) -> None:
        lines: list[list[_Tok]] = []
        for raw in definition.splitlines():
            toks = _tokens(raw)
            if not toks:
                continue
            if toks[0].text == "|" and lines:
                lines[-1] += toks
            else:
                lines.append(toks)
        for toks in lines:
            head = toks[0].text
            if toks[0].kind != "name":
                raise ValueError(f"a definition must start with a name, got {head!r}")
            i = 1
            if len(toks) > 2 and toks[1].text == "." and toks[2].kind == "number":
                i = 3  # a priority: no part of the language
            if i >= len(toks) or toks[i].text != ":":
                if toks[i - 1].text == "{" or (i < len(toks) and toks[i].text == "{"):
                    raise ValueError(f"rule templates ({head}{{...}}) are not supported")
                raise ValueError(f"expected ':' after {head!r}")
            self.defs[head.lstrip("?!")] = toks[i + 1:]

    def convert(self) -> str:
        if "start" not in self.defs:
            raise ValueError("the grammar has no 'start' rule")
        self._pending = ["start"]
        while self._pending:
            name = self._pending.pop()
            if name in self.rules:
                continue
            toks = self.defs[name]
            expr, end = self._alternatives(toks, 0, name)
            if end != len(toks):
                raise ValueError(f"in {name!r}: unexpected {toks[end].text!r}")
            self.rules[name] = expr
        body = "".join(f"{self.prefix}{name} ::= {expr}\n" for name, expr in self.rules.items())
        return f"{self.prefix}root ::= {self.prefix}start\n{body}" if self.prefix else f"root ::= start\n{body}"

    def _ref(self, name: str, where: str) -> str:
        if name not in self.defs:
            raise ValueError(f"in {where!r}: {name!r} is not defined")
        self._pending.append(name)
        return self.prefix + name

    def _alternatives(self, toks: list[_Tok], i: int, where: str) -> tuple[str, int]:
        alts: list[str] = []
        while True:
            seq, i = self._sequence(toks, i, where)
            if i < len(toks) and toks[i].kind == "arrow":
                i += 2  # an alias names the tree node: no part of the language
            alts.append(seq)
            if i < len(toks) and toks[i].text == "|":
                i += 1
                continue
            break
        return (alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"), i

    def _sequence(self, toks: list[_Tok], i: int, where: str) -> tuple[str, int]:
        parts: list[str] = []
        while i < len(toks) and toks[i].text not in ("|", ")", "]") and toks[i].kind != "arrow":
            atom, i = self._atom(toks, i, where)
            parts.append(atom)
        return (" ".join(parts) if parts else '""'), i

    def _atom(self, toks: list[_Tok], i: int, where: str) -> tuple[str, int]:
        tok = toks[i]
        if tok.text in ("(", "["):
            close = ")" if tok.text == "(" else "]"
            inner, i = self._alternatives(toks, i + 1, where)
            if i >= len(toks) or toks[i].text != close:
                raise ValueError(f"in {where!r}: an unclosed {tok.text!r}")
            i += 1
            atom = f"({inner})" if close == ")" else f"({inner})?"
        elif tok.kind == "string":
            text = _string(tok.text)
            i += 1
            if i + 1 < len(toks) and toks[i].kind == "dots" and toks[i + 1].kind == "string":
                hi = _string(toks[i + 1].text)
                if len(text) != 1 or len(hi) != 1 or ord(hi) < ord(text):
                    raise ValueError(f"in {where!r}: a bad range {tok.text}..{toks[i + 1].text}")
                atom = self.out.chars(CharSet(((ord(text), ord(hi)),)))
                i += 2
            else:
                atom = self.out.string(text)
        elif tok.kind == "regex":
            body, _, flags = tok.text[1:].rpartition("/")
            atom = "(" + regex_to_ebnf(body, self.out.json_string, flags, "x").split(" ::= ", 1)[1].strip() + ")"
            i += 1
        elif tok.kind == "name":
            atom = self._ref(tok.text.lstrip("?!"), where)
            i += 1
            if i < len(toks) and toks[i].text == "{":
                raise ValueError(f"in {where!r}: rule templates are not supported")
        else:
            raise ValueError(f"in {where!r}: unexpected {tok.text!r}")
        if i < len(toks) and toks[i].text in ("?", "*", "+"):
            atom = f"({atom}){toks[i].text}"
            i += 1
        elif i < len(toks) and toks[i].text == "~":
            if i + 1 >= len(toks) or toks[i + 1].kind != "number":
                raise ValueError(f"in {where!r}: '~' needs a count")
            lo = toks[i + 1].text
            i += 2
            if i + 1 < len(toks) and toks[i].kind == "dots" and toks[i + 1].kind == "number":
                atom = f"({atom}){{{lo},{toks[i + 1].text}}}"
                i += 2
            else:
                atom = f"({atom}){{{lo}}}"
        return atom, i


def _string(token: str) -> str:
    if token.endswith("i"):
        raise ValueError(f"case-insensitive strings ({token}) are not supported")
    value = ast.literal_eval(token)  # Lark reads its strings with Python's escapes too
    if not isinstance(value, str):
        raise ValueError(f"bad string {token}")
    return value


_DIRECTIVE = re.compile(r"^\s*%(\w+)\s*(.*?)\s*(?://.*|#.*)?$")
_COMMON_IMPORT = re.compile(r"^common\.(\w+)(?:\s*->\s*(\w+))?$|^common\s*\(([\w\s,]+)\)$")


def lark_to_ebnf(definition: str, json_string: bool = False, prefix: str = "") -> str:
    """An EBNF grammar for the Lark grammar's language from its `start` rule; the root rule is
    `{prefix}root`, every rule is named with `prefix` (so several grammars can share one)."""
    imports: dict[str, str] = {}
    kept: list[str] = []
    for line in definition.splitlines():
        m = _DIRECTIVE.match(line)
        if m is None:
            kept.append(line)
            continue
        kind, arg = m.group(1), m.group(2)
        if kind == "ignore":
            continue
        if kind != "import":
            raise ValueError(f"the directive %{kind} is not supported")
        im = _COMMON_IMPORT.match(arg)
        if im is None:
            raise ValueError(f"%import {arg}: only Lark's common terminals can be imported")
        names = [(im.group(1), im.group(2) or im.group(1))] if im.group(1) else [
            (n.strip(), n.strip()) for n in im.group(3).split(",") if n.strip()]
        for source, alias in names:
            if source not in COMMON:
                raise ValueError(f"%import common.{source}: not one of {', '.join(sorted(COMMON))}")
            imports[alias] = source
    for alias, source in imports.items():
        kept.append(f"{alias}: {source}" if alias != source else "")
    lark = _Lark("\n".join(kept), json_string, prefix)
    _add_common(lark, set(imports.values()))
    return lark.convert()


def _add_common(lark: _Lark, names: set[str]) -> None:
    """The imported common terminals, and those they use, as definitions."""
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in lark.defs:
            continue
        toks = _tokens(COMMON[name])
        lark.defs[name] = toks
        todo += [t.text for t in toks if t.kind == "name" and t.text in COMMON]
