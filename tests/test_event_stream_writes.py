"""gateway.sse.EventStream's ASGI messages: one body message per event, and a stream's last events (those
ending in [DONE]) carry the end of the body, so the end leaves in the same write instead of one more."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.types import Message

from gateway.sse import DONE, SERVER_SEND, EventStream


def _messages(events: list[bytes]) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def source() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    async def run() -> None:
        await EventStream(source())({"type": "http", SERVER_SEND: send}, receive, send)

    asyncio.run(run())
    return sent


def _bodies(sent: list[Message]) -> list[tuple[bytes, bool]]:
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    return [(m["body"], m["more_body"]) for m in sent[1:]]


def test_the_events_ending_in_done_end_the_body_in_their_own_message() -> None:
    last = b'data: {"choices":[]}\n\n' + DONE
    assert _bodies(_messages([b"data: 1\n\n", b"data: 2\n\n", last])) == [
        (b"data: 1\n\n", True), (b"data: 2\n\n", True), (last, False)]


def test_a_stream_that_is_one_write_ends_with_its_first() -> None:
    only = b"data: 1\n\n" + DONE
    assert _bodies(_messages([only])) == [(only, False)]


def test_a_stream_without_done_ends_with_an_empty_body() -> None:
    # The Responses API's named events have no [DONE].
    events = [b"event: response.created\ndata: {}\n\n", b"event: response.completed\ndata: {}\n\n"]
    assert _bodies(_messages(events)) == [(events[0], True), (events[1], True), (b"", False)]


def test_nothing_is_sent_after_the_end() -> None:
    # Whatever a source yields after [DONE] (none of the routes does) is not written after the body's end.
    assert _bodies(_messages([DONE, b"data: late\n\n"])) == [(DONE, False)]
