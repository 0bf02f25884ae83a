"""OpenAI chat messages, tools and tool_choice -> `engine_pb2.ChatInput`.

The engine renders the chat template; the gateway only checks shapes (so a
400 names the field) and carries the fields across. Image parts are noted
here and read before the engine call (gateway/image_parts.py).
"""

from __future__ import annotations

import json
from typing import Any

from common.template_kwargs import RESERVED_TEMPLATE_KWARGS
from gateway.body import Fields
from gateway.errors import invalid
from gateway.image_parts import IMAGE_PART_TYPES, ImageSource, image_part
from ignis.v1 import engine_pb2

ROLES = ("system", "developer", "user", "assistant", "tool")
# "input_text"/"output_text" are the Responses API spellings of a text part.
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def chat_input(body: Fields, images: list[ImageSource]) -> engine_pb2.ChatInput:
    """The chat; its image parts' sources are appended to `images`, for `attach_images`."""
    raw = body.array("messages", required=True)
    assert raw is not None
    if not raw:
        raise invalid("'messages' must not be empty", param="messages")
    chat = engine_pb2.ChatInput()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise invalid(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        chat.messages.append(chat_message(Fields(item, f"messages[{i}]"), images))
    tools = tools_json(body)
    if tools:
        chat.tools_json = tools
    chat.tool_choice = tool_choice(body)
    kwargs = body.obj("chat_template_kwargs")
    if kwargs is not None:
        for key in RESERVED_TEMPLATE_KWARGS:
            if key in kwargs.data:
                raise invalid(f"'chat_template_kwargs' may not set '{key}': the request's own field does",
                              param=f"chat_template_kwargs.{key}")
        chat.chat_template_kwargs_json = json.dumps(kwargs.data)
    if (add := body.boolean("add_generation_prompt")) is not None:
        chat.add_generation_prompt = add
    if body.boolean("continue_final_message"):
        chat.continue_final_message = True
    return chat


def chat_message(m: Fields, images: list[ImageSource]) -> engine_pb2.ChatMessage:
    role = m.string("role", required=True, choices=ROLES)
    msg = engine_pb2.ChatMessage(role=role)
    content = m.raw("content")
    if isinstance(content, str):
        msg.content = content
    elif isinstance(content, list):
        msg.content_parts.extend(content_parts(content, m.path("content"), images))
    elif content is not None:
        raise invalid(f"'{m.path('content')}' must be a string, an array of parts or null", param=m.path("content"))
    elif role in ("system", "developer", "user", "tool"):
        raise invalid(f"'{m.path('content')}' is required for a {role} message", param=m.path("content"))
    if (name := m.string("name")) is not None:
        msg.name = name
    if (call_id := m.string("tool_call_id")) is not None:
        msg.tool_call_id = call_id
    reasoning = m.string("reasoning_content") or m.string("reasoning")
    if reasoning is not None:
        msg.reasoning_content = reasoning
    calls = m.array("tool_calls")
    if calls:
        if role != "assistant":
            raise invalid(f"'{m.path('tool_calls')}' is only allowed on assistant messages", param=m.path("tool_calls"))
        for j, call in enumerate(calls):
            path = f"{m.path('tool_calls')}[{j}]"
            if not isinstance(call, dict):
                raise invalid(f"'{path}' must be an object", param=path)
            msg.tool_calls.append(tool_call(Fields(call, path)))
    return msg


def content_parts(parts: list[Any], path: str, images: list[ImageSource]) -> list[engine_pb2.ContentPart]:
    """Text and image parts, in order; each image's source is appended to `images`."""
    out = []
    for j, part in enumerate(parts):
        p = f"{path}[{j}]"
        if isinstance(part, str):  # lenient: a bare string part
            out.append(engine_pb2.ContentPart(type="text", text=part))
            continue
        if not isinstance(part, dict):
            raise invalid(f"'{p}' must be an object", param=p)
        f = Fields(part, p)
        kind = f.string("type", required=True)
        if kind in IMAGE_PART_TYPES:
            out.append(image_part(f, kind, images))
            continue
        if kind not in TEXT_PART_TYPES:
            raise invalid(f"'{p}.type' {kind!r} is not supported: only text and image parts are",
                          param=f"{p}.type")
        out.append(engine_pb2.ContentPart(type="text", text=f.string("text", required=True) or ""))
    return out


def tool_call(f: Fields) -> engine_pb2.ToolCall:
    kind = f.string("type") or "function"
    if kind != "function":
        raise invalid(f"'{f.path('type')}' must be 'function', got {kind!r}", param=f.path("type"))
    fn = f.obj("function")
    if fn is None:
        raise invalid(f"'{f.path('function')}' is required", param=f.path("function"))
    name = fn.string("name", required=True) or ""
    args = fn.raw("arguments")
    if args is None:
        args = "{}"
    elif not isinstance(args, str):  # lenient: an object instead of its JSON encoding
        args = json.dumps(args, ensure_ascii=False)
    return engine_pb2.ToolCall(id=f.string("id") or "", type="function",
                               function=engine_pb2.ToolCallFunction(name=name, arguments=args))


def tools_json(body: Fields) -> str:
    """OpenAI chat tools ([{"type": "function", "function": {...}}]) as the engine's JSON string."""
    tools = body.array("tools")
    if not tools:
        return ""
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"'{path}' must be an object", param=path)
        f = Fields(tool, path)
        if (f.string("type") or "function") != "function":
            raise invalid(f"'{path}.type' must be 'function'", param=f"{path}.type")
        fn = f.obj("function")
        if fn is None:
            raise invalid(f"'{path}.function' is required", param=f"{path}.function")
        fn.string("name", required=True)
    return json.dumps(tools, ensure_ascii=False)


def tool_choice(body: Fields) -> str:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name": ...}} as a string."""
    choice = body.raw("tool_choice")
    if choice is None:
        return ""
    if isinstance(choice, str):
        body.string("tool_choice", choices=("auto", "none", "required"))
        return choice
    if isinstance(choice, dict):
        return json.dumps(choice, ensure_ascii=False)
    raise invalid("'tool_choice' must be a string or an object", param="tool_choice")


def parses_tool_calls(chat: engine_pb2.ChatInput) -> bool:
    """Whether the model's `<tool_call>` blocks become `tool_calls` (tools given and not turned off)."""
    return bool(chat.tools_json) and chat.tool_choice != "none"
