"""Chat template rendering, configured the way Hugging Face `transformers` does it.

Chat templates ship with checkpoints and are untrusted code, so they run in
Jinja2's immutable sandbox. The environment (trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape) mirrors `transformers.utils.chat_template_utils`, so a template
renders to the same string here as in `transformers`, which tests use as the
oracle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning arrives under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; templates expect neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag to build assistant-token masks for training;
    serving only needs templates that contain it to compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses dunder/underscore attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages the way transformers does before rendering.

    Keys whose value is None are dropped (OpenAI clients send `content: null`
    next to tool calls, and templates test `is defined`), and reasoning under
    an older name is aliased to `reasoning_content` (and `thinking`).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"chat messages must be objects, got {message!r}")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One checkpoint's chat template(s), compiled once.

    `templates` maps names to sources; a single template is named "default".
    With tools, a template named "tool_use" wins when present.
    """

    def __init__(self, templates: dict[str, str]) -> None:
        if not templates:
            raise ValueError("a chat template needs at least one template source")
        self._sources = dict(templates)
        self._env = make_environment()
        self._compiled: dict[str, jinja2.Template] = {}

    def source(self, name: str) -> str:
        return self._sources[name]

    def _pick(self, has_tools: bool) -> str:
        if has_tools and "tool_use" in self._sources:
            return "tool_use"
        if "default" in self._sources:
            return "default"
        if len(self._sources) == 1:
            return next(iter(self._sources))
        raise ValueError(
            f"the checkpoint has several chat templates {sorted(self._sources)} and none named 'default'"
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        variables: dict[str, Any],
    ) -> str:
        name = self._pick(tools is not None)
        template = self._compiled.get(name)
        if template is None:
            try:
                template = self._env.from_string(self._sources[name])
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"the chat template {name!r} does not compile: {e}") from e
            self._compiled[name] = template
        context = {"documents": None, **variables}
        try:
            # One dict, not keyword arguments: a variable may be named anything ("self" included).
            return template.render({**context, "messages": normalize_messages(messages), "tools": tools,
                                    "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as e:
            # Templates reject bad conversations with raise_exception: a caller mistake.
            raise ValueError(f"the chat template rejected the request: {e}") from e
        except RecursionError:
            raise ValueError("the request's messages or tools are nested too deeply to render") from None
