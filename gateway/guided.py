"""`response_format`, `text.format` and `tool_choice` -> the engine's `GuidedDecoding`.

The engine compiles and enforces the grammar (a bad schema comes back as its 400); the
gateway checks the shapes, and that a forced function is one of the `tools`.
`tool_choice` "required" or a named function is enforced by the tool-call grammar;
"auto" and "none" leave the output free (the prompt says what the tools are either way).
A forced tool call and a text format may come together (openai-agents sends both for an agent
with an `output_type`): the output must then be a tool call, so the tool-call grammar holds and
the format, which only shapes message text, has nothing to shape.
"""

from __future__ import annotations

import json

from gateway.body import Fields
from gateway.errors import invalid
from ignis.v1 import engine_pb2


def chat_guided(body: Fields, chat: engine_pb2.ChatInput, tool_format: str = "") -> engine_pb2.GuidedDecoding | None:
    """Chat Completions: `response_format` ({type: text | json_object | json_schema}) and `tool_choice`.
    `tool_format`: the call syntax the gateway parses (--tool-call-parser); "": the engine's own."""
    fmt = body.obj("response_format")
    guided = None
    if fmt is not None:
        kind = fmt.string("type", required=True, choices=("text", "json_object", "json_schema"))
        if kind == "json_object":
            guided = engine_pb2.GuidedDecoding(json_object=True)
        elif kind == "json_schema":
            spec = fmt.obj("json_schema")
            if spec is None:
                raise invalid("'response_format.json_schema' is required when its type is 'json_schema'",
                              param="response_format")
            guided = _schema(spec)
    return _with_tools(guided, body, chat, tool_format)


def responses_guided(body: Fields, chat: engine_pb2.ChatInput, tool_format: str = "", guide_tools_json: str = ""
                     ) -> engine_pb2.GuidedDecoding | None:
    """Responses: `text.format` ({type: text | json_object | json_schema, name, schema, strict}) and `tool_choice`.
    `guide_tools_json`: the tools as the grammar reads them (custom tools with their grammars), when
    they differ from the prompt's."""
    text = body.obj("text")
    fmt = text.obj("format") if text is not None else None
    guided = None
    if fmt is not None:
        kind = fmt.string("type", required=True, choices=("text", "json_object", "json_schema"))
        if kind == "json_object":
            guided = engine_pb2.GuidedDecoding(json_object=True)
        elif kind == "json_schema":
            guided = _schema(fmt)
    return _with_tools(guided, body, chat, tool_format, guide_tools_json)


def _schema(spec: Fields) -> engine_pb2.GuidedDecoding:
    """{name, schema, strict}: the schema object as JSON text; no schema is any JSON object. `strict`
    is checked but changes nothing: the engine holds every schema as written, as vLLM does (extra
    properties only where the schema allows them), so instructor's non-strict JSON_SCHEMA ends too."""
    spec.string("name")
    spec.boolean("strict")
    schema = spec.obj("schema")
    if schema is None:
        return engine_pb2.GuidedDecoding(json_object=True)
    return engine_pb2.GuidedDecoding(json_schema=json.dumps(schema.data, ensure_ascii=False))


def _with_tools(guided: engine_pb2.GuidedDecoding | None, body: Fields, chat: engine_pb2.ChatInput,
                tool_format: str, tools_json: str = "") -> engine_pb2.GuidedDecoding | None:
    forced = forced_tool(chat)
    if forced is None:
        return guided
    # The grammar writes the syntax the gateway will parse: the flag's when given, else the engine's.
    calls = engine_pb2.GuidedToolCalls(tools_json=tools_json or chat.tools_json, tool_choice=forced,
                                       format=tool_format)
    parallel = body.boolean("parallel_tool_calls")
    if parallel is not None:
        calls.parallel_tool_calls = parallel
    return engine_pb2.GuidedDecoding(tool_calls=calls)


def forced_tool(chat: engine_pb2.ChatInput) -> str | None:
    """"required", the forced function's name, or None (auto / none / unset). A 400 when a forced
    call has no tools or names a function that is not among them."""
    choice = chat.tool_choice
    if choice in ("", "auto", "none"):
        return None
    tools = json.loads(chat.tools_json) if chat.tools_json else []
    names = [t["function"]["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if choice == "required":
        if not names:
            raise invalid("tool_choice 'required' needs at least one tool in 'tools'", param="tool_choice")
        return "required"
    data = json.loads(choice)
    f = Fields(data, "tool_choice")
    if (f.string("type") or "function") != "function":
        raise invalid("'tool_choice.type' must be 'function'", param="tool_choice.type")
    fn = f.obj("function")
    name = fn.string("name", required=True) if fn is not None else None
    if not name:
        raise invalid("'tool_choice.function.name' is required", param="tool_choice.function.name")
    if name not in names:
        listed = ", ".join(repr(n) for n in names) or "none"
        raise invalid(f"tool_choice names function {name!r}, which is not in 'tools' (listed: {listed})",
                      param="tool_choice")
    return name


def asks_reasoning(body: Fields) -> bool:
    """Whether the request asks the model to reason first: `reasoning_effort` (chat) or
    `reasoning.effort` (responses) other than none/minimal, or `chat_template_kwargs.enable_thinking`.
    A guided request that does gets its grammar after the reasoning block (`after_reasoning`);
    one that does not is held to the grammar from its first token."""
    effort = body.string("reasoning_effort")
    reasoning = body.obj("reasoning")
    if reasoning is not None:
        effort = reasoning.string("effort") or effort
    kwargs = body.obj("chat_template_kwargs")
    thinking = kwargs.raw("enable_thinking") if kwargs is not None else None
    return (effort is not None and effort not in ("none", "minimal")) or thinking is True
