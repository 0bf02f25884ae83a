"""Length-prefixed frames read as they land (common.frames.FrameSplitter), and the gateway's
session-socket protocol built on them (gateway.session_socket.SocketStream), on real Unix sockets."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.frames import FrameError, FrameSplitter, frame
from gateway.session_socket import SocketStream
from ignis.v1 import engine_pb2


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.binary(max_size=300), max_size=12), data=st.data())
def test_any_split_of_the_bytes_gives_the_same_frames(payloads: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(frame(p) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    splitter = FrameSplitter()
    got: list[bytes] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        got += splitter.feed(stream[start:end])
    assert got == payloads
    splitter.end()  # every frame was whole


@given(payload=st.binary(min_size=1, max_size=50), keep=st.data())
def test_a_stream_cut_inside_a_frame_is_an_error_at_its_end(payload: bytes, keep: st.DataObject) -> None:
    framed = frame(payload)
    n = keep.draw(st.integers(1, len(framed) - 1))
    splitter = FrameSplitter()
    assert splitter.feed(framed[:n]) == []
    with pytest.raises(FrameError):
        splitter.end()


def test_a_length_over_the_bound_is_refused_before_its_bytes_come() -> None:
    splitter = FrameSplitter(limit=100)
    assert splitter.feed(frame(b"x" * 100)) == [b"x" * 100]
    with pytest.raises(FrameError, match="over the 100-byte bound"):
        splitter.feed(struct.pack("<I", 101))


def _response(tag: int, text: str) -> engine_pb2.SessionResponse:
    return engine_pb2.SessionResponse(events=[engine_pb2.SessionEvent(
        tag=tag, response=engine_pb2.GenerateResponse(text=text))])


async def _no_requests() -> AsyncIterator[engine_pb2.SessionRequest]:
    await asyncio.Event().wait()  # the session has nothing to send
    yield engine_pb2.SessionRequest()


async def _serve(path: Path, sends: bytes) -> asyncio.AbstractServer:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(sends)
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(serve, str(path))


@pytest.mark.parametrize("tail, error", [
    (b"", None),  # a clean end between frames
    (frame(b"\xff\xff not a SessionResponse"), FrameError),
    (frame(_response(3, "cut").SerializeToString())[:-2], FrameError),  # the engine went away mid-frame
])
def test_the_socket_hands_each_response_on_and_says_how_it_ended(tmp_path: Path, tail: bytes,
                                                                 error: type[Exception] | None) -> None:
    sent = [_response(1, "a"), _response(2, "b" * 5000), _response(1, "c")]

    async def main() -> list[engine_pb2.SessionResponse]:
        got: list[engine_pb2.SessionResponse] = []
        server = await _serve(tmp_path / "s.sock", b"".join(frame(m.SerializeToString()) for m in sent) + tail)
        async with server:
            stream = await SocketStream.open(str(tmp_path / "s.sock"), _no_requests(), got.append)
            if error is None:
                await stream.closed()
            else:
                with pytest.raises(error):
                    await stream.closed()
            stream.cancel()
        return got

    assert asyncio.run(main()) == sent  # what came whole before the end is handed on


def test_requests_past_the_sockets_buffer_all_arrive_in_order(tmp_path: Path) -> None:
    """The writer waits while the transport asks it to pause (a server that reads slowly)."""
    requests = [engine_pb2.SessionRequest(tag=i, call=engine_pb2.SessionCall(
        request=engine_pb2.GenerateRequest(text="p" * 50_000))) for i in range(1, 41)]  # 2 MB in all

    async def main() -> list[int]:
        tags: list[int] = []
        done = asyncio.Event()
        opened: list[SocketStream] = []
        buffered: list[int] = []  # the transport's unsent bytes each time the writer takes a request

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            splitter = FrameSplitter()
            while len(tags) < len(requests):
                await asyncio.sleep(0.001)  # slower than the writer
                for payload in splitter.feed(await reader.read(8192)):
                    tags.append(engine_pb2.SessionRequest.FromString(payload).tag)
            done.set()
            writer.close()

        async def outbox() -> AsyncIterator[engine_pb2.SessionRequest]:
            for r in requests:
                if opened:
                    buffered.append(opened[0]._transport.get_write_buffer_size())
                yield r
            await asyncio.Event().wait()

        async with await asyncio.start_unix_server(serve, str(tmp_path / "s.sock")):
            stream = await SocketStream.open(str(tmp_path / "s.sock"), outbox(), lambda _: None)
            opened.append(stream)
            await asyncio.wait_for(done.wait(), 60)
            stream.cancel()
        assert buffered and max(buffered) <= 64 * 1024 + 60_000  # asyncio's high-water mark and one frame
        return tags

    assert asyncio.run(main()) == [r.tag for r in requests]
