"""`python -m bench.bare_relay --engine ADDR`: the floor under the gateway's per-token cost, for bench.gateway.

What any HTTP front of the engine must do for a streamed token, and nothing else: wake
on the engine's session socket, parse the frame, and send one Server-Sent Event to the
client over TCP. One asyncio protocol per side, no framework, no validation, no
metrics; `POST /v1/completions` only (prompt, max_tokens, temperature, ignore_eos,
stream), answered as an OpenAI stream (text chunks, a usage chunk, `[DONE]`) or as one
JSON body. It is a measuring stick, not a server: it trusts its one client.

bench.gateway runs it beside the gateways, in front of the same engine, so the
gateway's CPU per token can be read against what one wakeup and one loopback send
cost on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from pathlib import Path
from typing import cast

import grpc
import orjson

from common.frames import FrameSplitter, frame
from ignis.v1 import engine_pb2, engine_pb2_grpc

_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


class Client(asyncio.Protocol):
    """One client connection: requests one at a time, a stream being its last (it closes after)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.stream = False
        self.tokens = 0
        self.text: list[str] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, body = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        if len(body) < length:
            return
        request = orjson.loads(body[:length])
        self.buffer, self.tokens, self.text = b"", 0, []
        self.stream = bool(request.get("stream"))
        self.relay.start(self, engine_pb2.GenerateRequest(
            model=request.get("model", ""), text=request["prompt"],
            sampling=engine_pb2.SamplingParams(temperature=request.get("temperature", 1.0),
                                               max_tokens=request.get("max_tokens", 16),
                                               ignore_eos=request.get("ignore_eos", False))))
        if self.stream and self.transport is not None:
            self.transport.write(_SSE_HEAD)

    def token(self, response: engine_pb2.GenerateResponse) -> None:
        self.tokens += len(response.token_ids)
        if self.transport is None:
            return
        if self.stream:
            if response.text:
                self.transport.write(b"data: " + orjson.dumps(
                    {"object": "text_completion", "choices": [{"index": 0, "text": response.text}]}) + b"\n\n")
        else:
            self.text.append(response.text)

    def end(self) -> None:
        if self.transport is None:
            return
        usage = {"completion_tokens": self.tokens}
        if self.stream:
            self.transport.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        else:
            body = orjson.dumps({"object": "text_completion", "usage": usage,
                                 "choices": [{"index": 0, "text": "".join(self.text)}]})
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
            return  # the connection stays open for the client's next request
        self.transport.close()


class Relay(asyncio.Protocol):
    """The engine's session socket: calls out, events in, matched by tag."""

    def __init__(self) -> None:
        self.frames = FrameSplitter()
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Client] = {}
        self.tags = itertools.count(1)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def start(self, client: Client, request: engine_pb2.GenerateRequest) -> None:
        tag = next(self.tags)
        self.calls[tag] = client
        assert self.transport is not None
        self.transport.write(frame(engine_pb2.SessionRequest(
            tag=tag, call=engine_pb2.SessionCall(request=request)).SerializeToString()))

    def data_received(self, data: bytes) -> None:
        for payload in self.frames.feed(data):
            for event in engine_pb2.SessionResponse.FromString(payload).events:
                client = self.calls.get(event.tag)
                if client is None:
                    continue
                if event.HasField("response"):
                    client.token(event.response)
                else:
                    del self.calls[event.tag]
                    client.end()


async def serve(engine: str, port_file: Path) -> None:
    async with grpc.aio.insecure_channel(engine) as channel:
        listing = await engine_pb2_grpc.EngineStub(channel).ListModels(engine_pb2.ListModelsRequest())
    if not listing.session_socket:
        raise SystemExit(f"the engine at {engine} serves no session socket")
    loop = asyncio.get_running_loop()
    _, relay = await loop.create_unix_connection(Relay, listing.session_socket)
    server = await loop.create_server(lambda: Client(relay), "127.0.0.1", 0)
    port_file.write_text(str(server.sockets[0].getsockname()[1]))
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="the engine's gRPC address")
    parser.add_argument("--port", type=int, default=0, help="ignored: it listens on a free loopback port")
    parser.add_argument("--port-file", type=Path, required=True, help="where it writes the port it took")
    args = parser.parse_args()
    asyncio.run(serve(args.engine, args.port_file))


if __name__ == "__main__":
    main()
