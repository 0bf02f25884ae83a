"""The Responses API's `tools` -> what the model is shown, what the grammar holds, and how the
client names each tool back.

- ``function``: as chat's function tool.
- ``namespace`` (``{"name", "description", "tools": [function | custom, ...]}``, Codex's MCP
  servers and its ``multi_agent_v1`` collaboration tools): each member is shown to the model as a
  function named ``<namespace>__<name>`` (`flat_name`), and its calls come back named as the
  client declared them: ``{"type": "function_call", "namespace": ..., "name": ...}`` (Codex
  dispatches on the pair).
- ``custom`` (freeform; Codex's ``apply_patch``): shown as a function of one string parameter,
  ``input`` (its description carries the grammar); a call comes back as a ``custom_tool_call``
  whose ``input`` is that string, raw. A ``{"type": "grammar", "syntax": "lark" | "regex"}``
  format rides to the engine (`guide_json`), which holds the input to it when `tool_choice` forces
  calls (engine/guided/tool_grammar.py); under ``auto`` the model's text is free, as for functions.
- hosted tools the server cannot run (`HOSTED`: web search, file search, code interpreter, image
  generation, remote MCP, ...): accepted, echoed in the response's ``tools``, and left out of the
  prompt, so the model never calls them; a WARNING line names them. vLLM's Responses server
  likewise serves a request whose built-in tools it has no server for without them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.body import Fields
from gateway.errors import invalid

log = logging.getLogger("ignis.gateway")
HOSTED = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
          "file_search", "code_interpreter", "image_generation", "computer_use_preview", "computer",
          "mcp", "local_shell", "shell", "tool_search")
_INPUT_NOTE = "The tool's whole input as raw text (not JSON)"


@dataclass(frozen=True, slots=True)
class ToolName:
    """How the client names a tool the model knows by its flat name."""

    kind: str  # "function" | "custom"
    name: str
    namespace: str | None = None


@dataclass(slots=True)
class ResponsesTools:
    chat: list[dict[str, Any]] = field(default_factory=list)  # chat's function tools, for the template
    grammars: dict[str, dict[str, Any]] = field(default_factory=dict)  # flat name -> custom tool's grammar
    names: dict[str, ToolName] = field(default_factory=dict)  # flat name -> the client's name for it
    skipped: list[str] = field(default_factory=list)  # hosted tool types left out

    @property
    def chat_json(self) -> str:
        return json.dumps(self.chat, ensure_ascii=False) if self.chat else ""

    def guide_json(self) -> str:
        """The tools for the engine's tool-call grammar: chat's, each custom one with its grammar."""
        return json.dumps([dict(t, grammar=self.grammars[t["function"]["name"]])
                           if t["function"]["name"] in self.grammars else t for t in self.chat], ensure_ascii=False)


def flat_name(namespace: str | None, name: str) -> str:
    """The one name the model sees for a namespace's member (MCP's ``mcp__server__tool`` style)."""
    return f"{namespace.rstrip('_')}__{name}" if namespace else name


def responses_tools(body: Fields) -> ResponsesTools:
    out = ResponsesTools()
    for i, tool in enumerate(body.array("tools") or []):
        _tool(tool, f"tools[{i}]", None, out)
    if out.skipped:
        log.warning("hosted tools the server cannot run were left out of the prompt: %s", ", ".join(out.skipped))
    return out


def _tool(tool: Any, path: str, namespace: str | None, out: ResponsesTools) -> None:
    if not isinstance(tool, dict):
        raise invalid(f"'{path}' must be an object", param=path)
    f = Fields(tool, path)
    kind = f.string("type", required=True)
    if kind == "function":
        if "function" in tool and namespace is None:  # already in the chat shape
            nested = f.obj("function")
            given = nested.string("name", required=True) if nested is not None else None
            _add(out, dict(tool), given or "", ToolName("function", given or ""))
            return
        name = f.string("name", required=True) or ""
        fn: dict[str, Any] = {"name": flat_name(namespace, name)}
        for key in ("description", "parameters", "strict"):
            if key in tool:
                fn[key] = tool[key]
        _add(out, {"type": "function", "function": fn}, fn["name"], ToolName("function", name, namespace))
    elif kind == "custom":
        _custom(f, namespace, out, path)
    elif kind == "namespace" and namespace is None:
        ns = f.string("name", required=True) or ""
        for j, member in enumerate(f.array("tools", required=True) or []):
            _tool(member, f"{path}.tools[{j}]", ns, out)
    elif kind in HOSTED and namespace is None:
        out.skipped.append(kind)
    else:
        raise invalid(f"'{path}.type' {kind!r} is not supported: function, custom and namespace tools are, "
                      f"and hosted tools ({', '.join(HOSTED[:4])}, ...) are left out", param=f"{path}.type")


def _custom(f: Fields, namespace: str | None, out: ResponsesTools, path: str) -> None:
    name = f.string("name", required=True) or ""
    flat = flat_name(namespace, name)
    described = f.string("description") or ""
    note = _INPUT_NOTE
    fmt = f.obj("format")
    if fmt is not None:
        kind = fmt.string("type", required=True, choices=("text", "grammar"))
        if kind == "grammar":
            syntax = fmt.string("syntax", required=True, choices=("lark", "regex"))
            definition = fmt.string("definition", required=True) or ""
            out.grammars[flat] = {"syntax": syntax, "definition": definition}
            note += f", in this {syntax} grammar:\n{definition}"
    fn = {"name": flat, "description": described,
          "parameters": {"type": "object", "properties": {"input": {"type": "string", "description": note}},
                         "required": ["input"], "additionalProperties": False}}
    _add(out, {"type": "function", "function": fn}, flat, ToolName("custom", name, namespace))


def _add(out: ResponsesTools, chat_tool: dict[str, Any], flat: str, name: ToolName) -> None:
    out.names.setdefault(flat, name)
    out.chat.append(chat_tool)


def custom_input(arguments: str) -> str:
    """A custom tool's raw input from the call's JSON arguments ({"input": "..."}); the arguments
    themselves when the model wrote something else."""
    try:
        data = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(data, dict) and isinstance(data.get("input"), str):
        return str(data["input"])
    return arguments
