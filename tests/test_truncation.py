"""Truncation "auto" (the Responses API): the oldest whole turns after the system messages are
dropped until the prompt and max_output_tokens fit the context.

The render itself on the ignis-tiny tokenizer (every cut that fits, the latest turn kept, tool
calls never parted from their outputs), then end to end: an engine with a short context behind
a gateway, a `previous_response_id` chain that outgrows it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.prompt import render_chat
from engine.text.tiny_tokenizer import write_tiny_tokenizer
from engine.text.tokenizer import Tokenizer
from ignis.v1 import engine_pb2
from services import RunningService, start_engine, start_gateway

MODEL = "ignis-tiny"
CONTEXT = 256


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("ignis-tiny")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_dir(folder)


def conversation(turns: int, truncate: bool = True) -> engine_pb2.ChatInput:
    """A system message, then `turns` turns of user / assistant tool call / tool output / answer."""
    chat = engine_pb2.ChatInput(truncate=truncate)
    chat.messages.add(role="system", content="You are a terse assistant.")
    for t in range(turns):
        chat.messages.add(role="user", content=f"Question {t}: what is the weather in city {t}?")
        call = chat.messages.add(role="assistant").tool_calls.add(id=f"c{t}", type="function")
        call.function.name, call.function.arguments = "weather", f'{{"city": "city {t}"}}'
        chat.messages.add(role="tool", tool_call_id=f"c{t}", content=f"sunny in city {t}")
        chat.messages.add(role="assistant", content=f"City {t} is sunny.")
    chat.messages.add(role="user", content="And the last one?")
    return chat


def roles(chat: engine_pb2.ChatInput, keep_from: int) -> engine_pb2.ChatInput:
    """The chat with messages[1:keep_from] dropped (the system message stays)."""
    kept = engine_pb2.ChatInput()
    kept.CopyFrom(chat)
    del kept.messages[1:keep_from]
    kept.truncate = False
    return kept


def test_a_prompt_that_fits_is_untouched(tok: Tokenizer) -> None:
    chat = conversation(3)
    whole = render_chat(tok, chat, budget=None)
    assert render_chat(tok, chat, budget=len(whole.token_ids)) == whole
    # Without truncate, a budget changes nothing: the engine's length check refuses it later.
    assert render_chat(tok, conversation(3, truncate=False), budget=10).token_ids == whole.token_ids


@pytest.mark.parametrize("turns", [2, 5, 9])
def test_the_oldest_whole_turns_go_first(tok: Tokenizer, turns: int) -> None:
    chat = conversation(turns)
    # What each cut (before the k-th turn's user message) renders to, cut 0 being no cut.
    cuts = [1 + 4 * k for k in range(turns + 1)]
    lengths = [len(render_chat(tok, roles(chat, c)).token_ids) for c in cuts]
    assert lengths == sorted(lengths, reverse=True)
    for budget in range(lengths[-1], lengths[0] + 1, 7):
        got = render_chat(tok, chat, budget=budget)
        # The earliest cut that fits: the most context the budget allows.
        want = next(c for c, n in zip(cuts, lengths) if n <= budget)
        assert got.token_ids == render_chat(tok, roles(chat, want)).token_ids, (budget, want)
        assert len(got.token_ids) <= budget


def test_the_latest_turn_is_always_kept(tok: Tokenizer) -> None:
    chat = conversation(4)
    alone = render_chat(tok, roles(chat, 1 + 4 * 4))
    with pytest.raises(ValueError, match="does not fit this model's context even with truncation"):
        render_chat(tok, chat, budget=len(alone.token_ids) - 1)


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    work = tmp_path_factory.mktemp("truncation")
    engine = start_engine(work / "engine", str(tiny_model_dir),
                          ["--served-model-name", MODEL, "--set", f"responses.path={work / 'store'}",
                           "--set", f"engine.max_model_len={CONTEXT}"])
    gateway = start_gateway(work / "gateway", [engine.address])
    yield gateway
    assert gateway.stop() == 0, gateway.log()
    assert engine.stop() == 0, engine.log()


def test_a_chain_that_outgrows_the_context(gateway: RunningService) -> None:
    question = "Tell me, in a few words, about the weather where you are today."
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=120) as client:
        def create(**body: object) -> httpx.Response:
            return client.post("/v1/responses", json={"model": MODEL, "input": question, "temperature": 0,
                                                      "max_output_tokens": 24, "instructions": "Be brief.", **body})

        previous, prompts = None, []
        for _ in range(12):
            reply = create(truncation="auto", previous_response_id=previous)
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert body["truncation"] == "auto"
            prompts.append(body["usage"]["input_tokens"])
            assert prompts[-1] + 24 <= CONTEXT
            previous = body["id"]
        # The chain kept growing until the context held it no more; then turns were dropped.
        assert max(prompts) > prompts[0]
        assert any(later < earlier for earlier, later in zip(prompts, prompts[1:])), prompts

        refused = create(truncation="disabled", previous_response_id=previous)
        assert refused.status_code == 400, refused.text
        assert "context" in refused.json()["error"]["message"]
        # Each context error in OpenAI's words, which clients (litellm) match to tell it from other 400s.
        opening = f"This model's maximum context length is {CONTEXT} tokens. However, "
        assert refused.json()["error"]["message"].startswith(opening)
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        too_long_turn = create(truncation="auto", previous_response_id=previous, input="weather " * CONTEXT)
        assert too_long_turn.status_code == 400, too_long_turn.text
        error = too_long_turn.json()["error"]
        assert error["message"].startswith(opening) and "even with truncation" in error["message"], error
        assert error["code"] == "context_length_exceeded"
        too_many_chars = create(input="x" * (CONTEXT * 256 + 1))
        assert too_many_chars.status_code == 400, too_many_chars.text
        error = too_many_chars.json()["error"]
        assert error["message"].startswith(opening) and "characters" in error["message"], error
        assert error["code"] == "context_length_exceeded"
