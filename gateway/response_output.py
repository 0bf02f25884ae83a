"""The Responses API's output items, built from text and tool-call events in order.

Used for both answers: streamed, each step returns the ``response.*`` events
to send (without sequence numbers); whole, only `items` is read. Reasoning
opens a ``reasoning`` item (closed by whatever follows it); content opens a
``message`` item; a tool call closes it and adds a ``function_call`` item (with the
``namespace`` it was declared in, if any) or, for a custom tool, a ``custom_tool_call``
item whose ``input`` is the raw text (gateway/responses_tools.py); content after a call
opens a new message item.
"""

from __future__ import annotations

import uuid

from gateway.aliases import JSONObject
from gateway.reasoning import ReasoningDelta
from gateway.responses_tools import ToolName, custom_input
from gateway.tool_calls import ContentDelta, Event, ToolCall


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self, names: dict[str, ToolName] | None = None) -> None:
        self.names = names or {}  # the model's tool names -> the client's
        self.items: list[JSONObject] = []
        self._open: JSONObject | None = None  # the message item being written
        self._text = ""
        self._lps: list[JSONObject] = []  # logprobs of the open message's text
        self._thinking: JSONObject | None = None  # the reasoning item being written
        self._reasoning_text = ""

    def feed(self, events: list[Event | ReasoningDelta], logprobs: list[JSONObject] | None = None
             ) -> list[JSONObject]:
        out: list[JSONObject] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out += self._reasoning(event.text)
                continue
            out += self._close_reasoning()
            if isinstance(event, ContentDelta):
                out += self._content(event.text, logprobs)
                logprobs = None  # a step's logprobs ride on its first delta
            else:
                out += self._close_message()
                out += self._function_call(event.call)
        if logprobs:  # a step that produced no visible text yet
            out += self._content("", logprobs)
        return out

    def finish(self) -> list[JSONObject]:
        """Close what is open; an answer with no items gets one empty message (output_text is "")."""
        out = self._close_reasoning() + self._close_message()
        if not any(item["type"] != "reasoning" for item in self.items):
            out += self._content("", None) + self._close_message()
        return out

    def _content(self, text: str, logprobs: list[JSONObject] | None) -> list[JSONObject]:
        out: list[JSONObject] = []
        if self._open is None:
            self._open = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                          "content": []}
            self._text = ""
            self._lps = []
            self.items.append(self._open)
            out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                        "item": dict(self._open, content=[])})
            out.append({"type": "response.content_part.added", "item_id": self._open["id"],
                        "output_index": len(self.items) - 1, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        self._text += text
        self._lps.extend(logprobs or [])
        if text or logprobs:
            out.append({"type": "response.output_text.delta", "item_id": self._open["id"],
                        "output_index": len(self.items) - 1, "content_index": 0, "delta": text,
                        "logprobs": logprobs or []})
        return out

    def _reasoning(self, text: str) -> list[JSONObject]:
        out: list[JSONObject] = []
        if self._thinking is None:
            out += self._close_message()
            self._thinking = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                              "content": []}
            self._reasoning_text = ""
            self.items.append(self._thinking)
            out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                        "item": dict(self._thinking)})
        self._reasoning_text += text
        out.append({"type": "response.reasoning_text.delta", "item_id": self._thinking["id"],
                    "output_index": len(self.items) - 1, "content_index": 0, "delta": text})
        return out

    def _close_reasoning(self) -> list[JSONObject]:
        item = self._thinking
        if item is None:
            return []
        self._thinking = None
        index = self.items.index(item)
        item["content"] = [{"type": "reasoning_text", "text": self._reasoning_text}]
        item["status"] = "completed"
        return [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "text": self._reasoning_text},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def _close_message(self) -> list[JSONObject]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = self.items.index(item)
        part = {"type": "output_text", "text": self._text, "annotations": [], "logprobs": self._lps}
        item["content"] = [part]
        item["status"] = "completed"
        return [
            {"type": "response.output_text.done", "item_id": item["id"], "output_index": index, "content_index": 0,
             "text": self._text, "logprobs": part["logprobs"]},
            {"type": "response.content_part.done", "item_id": item["id"], "output_index": index, "content_index": 0,
             "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def _function_call(self, call: ToolCall) -> list[JSONObject]:
        named = self.names.get(call.name)
        if named is not None and named.kind == "custom":
            return self._custom_call(call, named)
        item: JSONObject = {"type": "function_call", "id": _id("fc"), "call_id": call.id,
                            "name": named.name if named is not None else call.name,
                            "arguments": call.arguments, "status": "completed"}
        if named is not None and named.namespace:
            item["namespace"] = named.namespace
        return self._call(item, "arguments", "function_call_arguments", {"name": call.name, "arguments": call.arguments})

    def _custom_call(self, call: ToolCall, named: ToolName) -> list[JSONObject]:
        text = custom_input(call.arguments)
        item: JSONObject = {"type": "custom_tool_call", "id": _id("ctc"), "call_id": call.id, "name": named.name,
                            "input": text, "status": "completed"}
        if named.namespace:
            item["namespace"] = named.namespace
        return self._call(item, "input", "custom_tool_call_input", {"input": text})

    def _call(self, item: JSONObject, field: str, event: str, done: JSONObject) -> list[JSONObject]:
        """A call item's events: added in progress, its `field` in one delta, `done`, the item done."""
        self.items.append(item)
        index = len(self.items) - 1
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": dict(item, **{field: "", "status": "in_progress"})},
            {"type": f"response.{event}.delta", "item_id": item["id"], "output_index": index, "delta": item[field]},
            {"type": f"response.{event}.done", "item_id": item["id"], "output_index": index, **done},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]
