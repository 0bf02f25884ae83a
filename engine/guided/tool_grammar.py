"""The grammar `tool_choice` implies: the checkpoint's own tool-call syntax, with each function's
arguments held to its parameter schema, and nothing else in the output.

"required" is one or more calls (exactly one with `parallel_tool_calls: false`), then only the end
(EOS or a stop token); a named function is one call to it, then the end. The output therefore
always finishes `tool_calls` (`completed` on /v1/responses), never runs on in text to `max_tokens`.

xgrammar ships each family's call tag (`get_model_structural_tag`), but its "required" lets free
text follow a call (a `triggered_tags` format, meant for `auto`): its tags are kept and put in a
`tags_with_separator`, calls joined by the family's own separator and nothing else. Mistral's
`[TOOL_CALLS][{...}]` is built here as one JSON array after the marker.

A custom (freeform) tool reaches the model as a function of one string parameter, ``input``
(gateway/responses_tools.py); its tool entry carries ``grammar`` (``{"syntax": "lark" | "regex",
"definition"}``), and that call's content is the grammar's language (engine/guided/lark.py): as a
JSON string in the JSON families, as the raw parameter text in Qwen3-Coder's XML. Mistral's array
holds it to a string only.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import TagsWithSeparatorFormat, TriggeredTagsFormat

from engine.guided.lark import lark_to_ebnf, regex_to_ebnf

# Ours (the gateway's parser names) -> xgrammar's template names.
_XGRAMMAR_MODEL = {"hermes": "qwen_3", "qwen3_coder": "qwen_3_coder", "llama3_json": "llama"}
MAX_WHITESPACE = 2  # inside arguments: a model may not stall the call on endless whitespace
# Between two calls, as each family's template and our parser write them (gateway/tool_parsers.py).
_SEPARATOR = {"qwen_3": "\n", "qwen_3_coder": "\n", "llama": "; "}


def tool_call_tag(tools_json: str, tool_choice: str, tool_format: str, parallel: bool) -> xgr.StructuralTag:
    """`tool_choice`: "required" (any listed function) or the name of one listed function."""
    tools = _tools(tools_json)
    names = [t["function"]["name"] for t in tools]
    if tool_choice != "required" and tool_choice not in names:
        raise ValueError(f"tool_choice names function {tool_choice!r}, which is not among the tools ({', '.join(names)})")
    choice: Any = "required" if tool_choice == "required" else {"type": "function", "function": {"name": tool_choice}}
    fmt = tool_format or "hermes"
    if fmt == "mistral":
        return _mistral(tools if tool_choice == "required" else [t for t in tools if t["function"]["name"] == tool_choice],
                        parallel)
    model = _XGRAMMAR_MODEL.get(fmt)
    if model is None:
        raise ValueError(f"tool-call format {fmt!r} is not one of hermes, llama3_json, mistral, qwen3_coder")
    tag = xgr.get_model_structural_tag(model, tools=list[Any](tools), tool_choice=choice, reasoning="disabled",
                                       max_whitespace_cnt=MAX_WHITESPACE, parallel_tool_calls=parallel)
    tag = _with_custom_grammars(tag, tools, xml=model == "qwen_3_coder")
    if not isinstance(tag.format, TriggeredTagsFormat):
        return tag  # a named function: its one tag is the whole output
    return xgr.StructuralTag(format=TagsWithSeparatorFormat(
        tags=tag.format.tags, separator=_SEPARATOR[model], at_least_one=True, stop_after_first=not parallel))


def _with_custom_grammars(tag: xgr.StructuralTag, tools: list[dict[str, Any]], xml: bool) -> xgr.StructuralTag:
    """Each custom tool's call tag with its content held to the tool's grammar."""
    grammars = {t["function"]["name"]: t["grammar"] for t in tools if isinstance(t.get("grammar"), dict)}
    if not grammars:
        return tag
    data = tag.model_dump(mode="json")
    fmt = data["format"]
    for i, one in enumerate(fmt["tags"] if "tags" in fmt else [fmt]):
        name = next((n for n in grammars if f'"name": {json.dumps(n)}' in one["begin"]
                     or f"<function={n}>" in one["begin"]), None)
        if name is not None:
            one["content"] = {"type": "grammar", "grammar": _input_grammar(grammars[name], f"c{i}_", xml)}
    return xgr.StructuralTag.model_validate(data)


def _input_grammar(grammar: dict[str, Any], prefix: str, xml: bool) -> str:
    """The arguments of a custom tool's call: {"input": "<the grammar's language, JSON-escaped>"}, or
    Qwen3-Coder's one parameter with the raw text."""
    syntax, definition = grammar.get("syntax"), grammar.get("definition")
    if not isinstance(definition, str) or not definition:
        raise ValueError("a custom tool's grammar needs a definition")
    if syntax == "lark":
        rules = lark_to_ebnf(definition, json_string=not xml, prefix=prefix)
    elif syntax == "regex":
        rules = regex_to_ebnf(definition, json_string=not xml, name=f"{prefix}root")
    else:
        raise ValueError(f"a custom tool's grammar syntax must be 'lark' or 'regex', got {syntax!r}")
    if xml:
        return f'root ::= "<parameter=input>\\n" {prefix}root "\\n</parameter>"\n{rules}'
    return f'root ::= "{{\\"input\\": \\"" {prefix}root "\\"}}"\n{rules}'



def _tools(tools_json: str) -> list[dict[str, Any]]:
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the tools are not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not tools:
        raise ValueError("tool_choice needs a non-empty list of tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] is not a function tool with a name")
    return tools


def _mistral(tools: list[dict[str, Any]], parallel: bool) -> xgr.StructuralTag:
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return xgr.StructuralTag.from_json({"type": "structural_tag", "format": {
        "type": "tag", "begin": "[TOOL_CALLS]", "end": "",
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}}})
