"""Stream chunks framed once per stream (`sse.chunk_frame`, used by the completions and chat routes) are
the bytes the general path gives: the same JSON as `data_event` of the whole chunk, for every model name."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.connection_faults import ConnectionFaults
from gateway.metrics import GatewayMetrics
from gateway.prompts import parse_prompts
from gateway.output_formats import ChoiceParser, OutputFormats
from gateway.routes.chat import _Reply as ChatReply
from gateway.routes.completions import _Reply
from gateway.json_body import dumps
from gateway.sse import chunk_frame, data_event
from gateway.state import GatewayState
from ignis.v1 import engine_pb2


async def _messages(items: list[engine_pb2.GenerateResponse]) -> AsyncIterator[engine_pb2.GenerateResponse]:
    for item in items:
        yield item


def unserved_state() -> GatewayState:
    """A gateway's state for building replies without serving (its engine is never called)."""
    metrics = GatewayMetrics()
    return GatewayState(GatewayConfig(engines=["127.0.0.1:1"]), metrics, ConnectionFaults(metrics, 10.0))


def _events(model: str, texts: list[str], include_usage: bool) -> list[bytes]:
    state = unserved_state()
    reply = _Reply("cmpl-x", 1700000000, model, parse_prompts("p"), 1, False, False, state)
    msgs = [engine_pb2.GenerateResponse(index=0, token_ids=[i + 1], text=t) for i, t in enumerate(texts)]
    msgs.append(engine_pb2.GenerateResponse(index=0, finish_reason=engine_pb2.FINISH_REASON_LENGTH, usage=engine_pb2.Usage(
        prompt_tokens=1, completion_tokens=len(texts))))

    async def run() -> list[bytes]:
        return [e async for e in reply.events([_messages(msgs)], include_usage)]
    return asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(model=st.text(min_size=1, max_size=30), texts=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=5),
       include_usage=st.booleans())
def test_token_chunks_are_the_bytes_of_the_whole_chunk(model: str, texts: list[str], include_usage: bool) -> None:
    events = _events(model, texts, include_usage)
    for text, event in zip(texts, events):
        chunk = {"id": "cmpl-x", "object": "text_completion", "created": 1700000000, "model": model,
                 "system_fingerprint": None,
                 "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
        if include_usage:
            chunk["usage"] = None
        assert event == data_event(chunk)
        assert json.loads(event[len(b"data: "):]) == chunk
    # The last write: the final chunk (its finish reason), the usage chunk when asked for, then [DONE].
    *final, done = [e + b"\n\n" for e in events[-1].split(b"\n\n") if e]
    assert len(events) == len(texts) + 1 and done == b"data: [DONE]\n\n"
    last = json.loads(final[0][len(b"data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    assert len(final) == (2 if include_usage else 1)
    if include_usage:
        assert json.loads(final[1][len(b"data: "):])["usage"]["completion_tokens"] == len(texts)


@settings(max_examples=60, deadline=None)
@given(model=st.text(max_size=30), rid=st.text(max_size=12), include_usage=st.booleans(),
       choice=st.fixed_dictionaries({"index": st.integers(0, 8), "delta": st.dictionaries(
           st.sampled_from(["content", "reasoning_content"]), st.text(max_size=10)),
           "logprobs": st.none(), "finish_reason": st.sampled_from([None, "stop", "length", "tool_calls"])}))
def test_a_chunk_frame_around_a_choice_is_the_whole_chunk(model: str, rid: str, include_usage: bool,
                                                         choice: dict[str, object]) -> None:
    chunk: dict[str, object] = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": model,
                                "system_fingerprint": None, "choices": []}
    if include_usage:
        chunk["usage"] = None
    head, tail = chunk_frame(chunk)
    assert head + dumps(choice) + tail == data_event({**chunk, "choices": [choice]})


def _chat_writes(texts: list[str], include_usage: bool) -> list[bytes]:
    state = unserved_state()
    reply = ChatReply("chatcmpl-x", 1700000000, "m", lambda: ChoiceParser.make(OutputFormats(), "", False),
                      False, 1, state)
    msgs = [engine_pb2.GenerateResponse(index=0, token_ids=[i + 1], text=t) for i, t in enumerate(texts)]
    msgs.append(engine_pb2.GenerateResponse(index=0, finish_reason=engine_pb2.FINISH_REASON_STOP, usage=engine_pb2.Usage(
        prompt_tokens=1, completion_tokens=len(texts))))

    async def run() -> list[bytes]:
        return [e async for e in reply.events(_messages(msgs), include_usage)]
    return asyncio.run(run())


def _events_of(write: bytes) -> list[dict[str, object] | str]:
    """The SSE events in one write: each chunk's JSON, or "[DONE]"."""
    out: list[dict[str, object] | str] = []
    for event in write.split(b"\n\n"):
        if event:
            data = event[len(b"data: "):]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


@settings(max_examples=30, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=8), min_size=0, max_size=4), include_usage=st.booleans())
def test_a_chat_stream_writes_once_a_message(texts: list[str], include_usage: bool) -> None:
    """The role chunk goes with the first message's tokens, each later message is one write, and the last
    message's chunks go with [DONE]: the same events, in order, as a chunk per write gave."""
    writes = _chat_writes(texts, include_usage)
    assert len(writes) == len(texts) + 1  # a write a message (the last carries no text here)
    events = [_events_of(w) for w in writes]
    flat = [e for write in events for e in write]
    assert flat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
    contents = [e["choices"][0]["delta"].get("content") for e in flat[1:-1] if isinstance(e, dict) and e["choices"]]
    assert "".join(c for c in contents if c) == "".join(texts)
    assert flat[-1] == "[DONE]" and events[-1][-1] == "[DONE]"
    if texts:
        assert len(events[0]) == 2  # the role chunk and the first token's
    finals = [e for e in flat if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0] in events[-1]
