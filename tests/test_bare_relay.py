"""bench/bare_relay.py, the floor bench.gateway measures the gateway against, relays what the engine
streams: the same text as a Generate call, token for token, streamed and not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import httpx
import pytest

from bench.gateway import Stream, _sse_stream, listening
from common.launch import launch
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService

PROMPT = "The floor under a gateway"


@pytest.fixture(scope="module")
def relay(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = launch("bare-relay", "bench.bare_relay", ["--engine", engine.address],
                     tmp_path_factory.mktemp("relay"), listening, timeout=60)
    yield service
    service.stop()


def _direct(engine: RunningService, tokens: int) -> tuple[str, int]:
    request = engine_pb2.GenerateRequest(model="ignis-tiny", text=PROMPT, sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True))
    with grpc.insecure_channel(engine.address) as channel:
        messages = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
    return "".join(m.text for m in messages), sum(len(m.token_ids) for m in messages)


def test_it_answers_a_completion_as_the_engine_does(engine: RunningService, relay: RunningService) -> None:
    text, count = _direct(engine, 12)
    with httpx.Client(base_url=f"http://{relay.address}", timeout=60) as client:
        for _ in range(2):  # the connection is kept for the next request
            body = client.post("/v1/completions", json={"model": "ignis-tiny", "prompt": PROMPT, "max_tokens": 12,
                                                        "temperature": 0, "ignore_eos": True}).json()
            assert body["choices"][0]["text"] == text
            assert body["usage"]["completion_tokens"] == count == 12


def test_it_streams_every_token_and_the_end(engine: RunningService, relay: RunningService) -> None:
    async def stream() -> Stream:
        async with aiohttp.ClientSession(base_url=f"http://{relay.address}") as http:
            return await _sse_stream(http, "ignis-tiny", PROMPT, 20)

    got = asyncio.run(stream())
    assert got.error == "" and got.tokens == 20
