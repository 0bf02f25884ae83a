"""The Responses stream's events in a list per engine message (`_Reply.batches`), each list one SSE write:
the same events and numbers as one at a time (`_Reply.events`, the WebSocket's), the closing ones together,
and an error after output began going after what was already numbered."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from gateway.errors import OpenAIError
from gateway.output_formats import ChoiceParser, OutputFormats
from gateway.routes.responses import _Reply
from ignis.v1 import engine_pb2
from tests.test_completion_chunks import unserved_state


def _reply() -> _Reply:
    base = {"id": "resp_x", "object": "response", "created_at": 1, "model": "m"}
    return _Reply(base, lambda: ChoiceParser.make(OutputFormats(), "", False), False, unserved_state())


def _messages(texts: list[str], fail: bool = False) -> list[engine_pb2.GenerateResponse]:
    msgs = [engine_pb2.GenerateResponse(index=0, token_ids=[i + 1], text=t) for i, t in enumerate(texts)]
    if not fail:
        msgs.append(engine_pb2.GenerateResponse(index=0, finish_reason=engine_pb2.FINISH_REASON_STOP,
                                                usage=engine_pb2.Usage(prompt_tokens=1, completion_tokens=len(texts))))
    return msgs


async def _upstream(msgs: list[engine_pb2.GenerateResponse], fail: bool) -> AsyncIterator[engine_pb2.GenerateResponse]:
    for msg in msgs:
        yield msg
    if fail:
        raise OpenAIError(500, "the engine went away", code="internal_error")


def _batches(texts: list[str], fail: bool = False) -> list[list[dict[str, Any]]]:
    async def run() -> list[list[dict[str, Any]]]:
        return [b async for b in _reply().batches(_upstream(_messages(texts, fail), fail))]
    return asyncio.run(run())


def _events(texts: list[str], fail: bool = False) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [e async for e in _reply().events(_upstream(_messages(texts, fail), fail))]
    return asyncio.run(run())


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_a_batch_a_message_with_the_closing_events_together() -> None:
    batches = _batches(["Hel", "lo"])
    assert len(batches) == 3  # two messages of text, then the last one
    assert _types(batches[0])[:2] == ["response.created", "response.in_progress"]
    last = _types(batches[-1])
    assert last[-1] == "response.completed" and "response.output_text.done" in last
    assert "response.output_item.done" in last and "response.content_part.done" in last
    flat = [e for b in batches for e in b]
    assert [e["sequence_number"] for e in flat] == list(range(len(flat)))
    assert "".join(e["delta"] for e in flat if e["type"] == "response.output_text.delta") == "Hello"


def test_one_at_a_time_gives_the_same_events() -> None:
    def shape(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:  # item ids are random per reply
        return [(e["type"], e["sequence_number"], e.get("delta"), e.get("text")) for e in events]
    assert shape(_events(["a", "b", "c"])) == shape([e for b in _batches(["a", "b", "c"]) for e in b])


def test_an_error_after_output_began_follows_every_numbered_event() -> None:
    batches = _batches(["Hel", "lo"], fail=True)
    flat = [e for b in batches for e in b]
    assert flat[-1]["type"] == "error" and flat[-1]["code"] == "internal_error"
    assert [e["sequence_number"] for e in flat] == list(range(len(flat)))


def test_an_error_while_a_message_is_handled_follows_its_numbered_events() -> None:
    """Storing the final response fails after the closing events were numbered: they go out, then the error,
    with no gap in the sequence numbers."""
    reply = _reply()

    async def keep(final: dict[str, Any]) -> None:
        raise OpenAIError(500, "the store is down", code="internal_error")
    reply.keep = keep

    async def run() -> list[list[dict[str, Any]]]:
        return [b async for b in reply.batches(_upstream(_messages(["Hi"]), False))]
    batches = asyncio.run(run())
    flat = [e for b in batches for e in b]
    assert [e["sequence_number"] for e in flat] == list(range(len(flat)))
    assert flat[-1]["type"] == "error" and "response.output_text.done" in _types(batches[-1])
