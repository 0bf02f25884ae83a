"""Speculative decoding through the real services (issue 44): `speculative.method=ngram` set on the
engine's command line, a chat request through the gateway with the `openai` SDK, the response's
`ignis.speculative` report, and `ignis: {"speculative": false}` turning it off for one request.

The checkpoint is the dense random one whose greedy output falls into a loop, which prompt lookup
drafts (tests/test_speculative.py has the oracle tests; this one checks the wiring)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services import RunningService, start_engine, start_gateway


@pytest.fixture(scope="module")
def gateway(dense_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    engine = start_engine(tmp_path_factory.mktemp("engine"), str(dense_chat_model_dir),
                          ["--served-model-name", "dense", "--set", "speculative.method=ngram",
                           "--set", "speculative.num_tokens=3"])
    try:
        service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
        yield service
        assert service.stop() == 0, service.log()
    finally:
        assert engine.stop() == 0, engine.log()
    assert "Traceback" not in engine.log(), engine.log()


def chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="dense", messages=[{"role": "user", "content": "Tell me about loops and loops and loops."}],
        temperature=0, max_tokens=160, extra_body=extra or None)


def test_drafts_are_reported_and_a_request_may_turn_them_off(gateway: RunningService) -> None:
    with openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        drafted = chat(client)
        plain = chat(client, ignis={"speculative": False})
    report = drafted.model_extra["ignis"]["speculative"]
    assert report["draft_tokens"] > 0 and 0 < report["accepted_tokens"] <= report["draft_tokens"]
    assert "speculative" not in plain.model_extra["ignis"]  # nothing drafted for it
    assert drafted.choices[0].message.content == plain.choices[0].message.content  # greedy: the same text
    assert drafted.usage.completion_tokens == plain.usage.completion_tokens


def test_a_bad_speculative_option_is_a_400_naming_it(gateway: RunningService) -> None:
    response = httpx.post(f"http://{gateway.address}/v1/chat/completions", timeout=60, json={
        "model": "dense", "messages": [{"role": "user", "content": "hi"}], "ignis": {"speculative": "no"}})
    assert response.status_code == 400
    assert "speculative" in response.json()["error"]["message"]
