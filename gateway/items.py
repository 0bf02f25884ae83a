"""The Responses API's `input` and `instructions` and `tools` -> `engine_pb2.ChatInput`.

`input` is a string (one user message) or an array of items: messages
(``{"role", "content"}``, with or without ``"type": "message"``), the
assistant's ``function_call`` (a namespace's member by its flat name,
gateway/responses_tools.py) and ``custom_tool_call`` items (as a call of the
function the model saw: ``{"input": ...}``), and the client's
``function_call_output`` and ``custom_tool_call_output`` items. Consecutive
calls become one assistant message with several tool calls, as the chat
template expects. Reasoning items are dropped (the chat templates drop earlier
turns' reasoning too; an ``encrypted_content`` is ours to read, and there is
none), and so are the calls of hosted tools the server never runs.

With ``previous_response_id`` the stored conversation (``prior``: items in the
same shapes) comes between the instructions and the new input, so the prompt
is the one a client resending everything would render.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.body import Fields
from gateway.errors import invalid
from gateway.image_parts import ImageSource
from gateway.messages import ROLES, content_parts
from gateway.responses_tools import ResponsesTools, flat_name, responses_tools
from ignis.v1 import engine_pb2

# Output items of hosted tools (a client resends what OpenAI's server wrote): no turn of ours.
_HOSTED_CALLS = ("web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call",
                 "computer_call", "computer_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                 "mcp_approval_response", "local_shell_call", "local_shell_call_output", "tool_search_call",
                 "tool_search_output")


def input_items(body: Fields) -> list[Any]:
    """`input` as a list of items (a string is one user message)."""
    raw = body.raw("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if isinstance(raw, list):
        return raw
    raise invalid("'input' must be a string or an array of input items", param="input")


def responses_chat(body: Fields, images: list[ImageSource], prior: list[Any] | None = None,
                   tools: ResponsesTools | None = None) -> engine_pb2.ChatInput:
    """The chat; its image parts' sources (the stored conversation's too) are appended to `images`."""
    chat = engine_pb2.ChatInput()
    instructions = body.string("instructions")
    if instructions:
        chat.messages.append(engine_pb2.ChatMessage(role="system", content=instructions))
    if prior:
        _items(prior, chat, images, "previous_response_id")
    _items(input_items(body), chat, images)
    if not any(m.role != "system" for m in chat.messages):
        raise invalid("'input' must not be empty", param="input")
    tools = tools if tools is not None else responses_tools(body)
    chat.tools_json = tools.chat_json
    choice = body.raw("tool_choice")
    if isinstance(choice, str):
        chat.tool_choice = body.string("tool_choice", choices=("auto", "none", "required")) or ""
    elif isinstance(choice, dict):
        # Responses spells a forced tool {"type": "function" | "custom", "name": ..., "namespace"?}; chat
        # nests a function, by the name the model sees.
        f = Fields(choice, "tool_choice")
        name = f.string("name")
        if name and f.string("type") in ("function", "custom"):
            name = flat_name(f.string("namespace"), name)
            chat.tool_choice = json.dumps({"type": "function", "function": {"name": name}})
        else:
            chat.tool_choice = json.dumps(choice)
    elif choice is not None:
        raise invalid("'tool_choice' must be a string or an object", param="tool_choice")
    return chat


def _items(items: list[Any], chat: engine_pb2.ChatInput, images: list[ImageSource], where: str = "input") -> None:
    for i, item in enumerate(items):
        path = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{path}' must be an object", param=path)
        f = Fields(item, path)
        kind = f.string("type") or "message"
        if kind == "message":
            role = f.string("role", required=True, choices=ROLES[:4])
            msg = engine_pb2.ChatMessage(role=role)
            content = f.raw("content")
            if isinstance(content, str):
                msg.content = content
            elif isinstance(content, list):
                msg.content_parts.extend(content_parts(content, f.path("content"), images))
            else:
                raise invalid(f"'{f.path('content')}' must be a string or an array of parts", param=f.path("content"))
            chat.messages.append(msg)
        elif kind in ("function_call", "custom_tool_call"):
            last = chat.messages[-1] if chat.messages else None
            if last is None or last.role != "assistant" or not last.tool_calls:
                last = engine_pb2.ChatMessage(role="assistant")
                chat.messages.append(last)
                last = chat.messages[-1]
            if kind == "function_call":
                arguments = f.string("arguments") or "{}"
            else:
                arguments = json.dumps({"input": f.string("input", required=True)}, ensure_ascii=False)
            name = flat_name(f.string("namespace"), f.string("name", required=True) or "")
            last.tool_calls.append(engine_pb2.ToolCall(
                id=f.string("call_id", required=True) or "", type="function",
                function=engine_pb2.ToolCallFunction(name=name, arguments=arguments)))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = f.raw("output")
            if not isinstance(output, str):
                output = json.dumps(output, ensure_ascii=False)
            chat.messages.append(engine_pb2.ChatMessage(role="tool", content=output,
                                                        tool_call_id=f.string("call_id", required=True) or ""))
        elif kind == "reasoning" or kind in _HOSTED_CALLS:
            continue
        elif kind == "item_reference":
            raise invalid(f"'{path}': item references are not supported; send the items themselves, "
                          "or continue with 'previous_response_id'", param=path)
        else:
            raise invalid(f"'{path}.type' {kind!r} is not supported", param=f"{path}.type")
