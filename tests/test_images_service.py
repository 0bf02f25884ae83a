"""Images end to end: the openai SDK sends image_url parts to the real gateway, the real engine serves a tiny
Qwen3.5 checkpoint with a vision tower; the answers equal transformers' on the same rendered prompt, and the
next turn, re-sending its screenshots, claims the state of the last with its images."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from engine.prompt import render_chat
from engine.text.tiny_tokenizer import VISION_TOKEN_IDS, write_tiny_vision_tokenizer
from engine.text.tokenizer import Tokenizer
from engine.vision.media import VisionInput
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService, start_engine, start_gateway
from test_vision_tower import make_tiny_vlm

IMAGE, VIDEO, VISION_START, VISION_END = VISION_TOKEN_IDS
MAX_TOKENS = 6


def write_processor(directory: Path) -> None:
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 1024, "longest_edge": 10240}, "patch_size": 8, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessor"}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("vlm_chat")
    tiny = make_tiny_vlm(directory, text={"vocab_size": VISION_END + 1}, special=(IMAGE, VIDEO, VISION_START, VISION_END))
    write_processor(directory)
    write_tiny_vision_tokenizer(directory)
    return directory, tiny.model


@pytest.fixture(scope="module")
def stack(checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningService, RunningService]]:
    directory, _ = checkpoint
    work = tmp_path_factory.mktemp("vlm_services")
    engine = start_engine(work / "engine", str(directory), ["--set", "engine.page_size=16"])
    try:
        gateway = start_gateway(work / "gateway", [engine.address], ["--allow-unauthenticated"])
        try:
            yield engine, gateway
        finally:
            gateway.stop()
    finally:
        engine.stop()


def screenshot(seed: int, size: tuple[int, int] = (96, 64)) -> str:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def user(text: str, *images: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": url}} for url in images)]}


def oracle(checkpoint: Any, messages: list[dict[str, Any]]) -> str:
    """transformers' greedy answer (its text) to the prompt the engine renders from `messages`."""
    directory, model = checkpoint
    chat = engine_pb2.ChatInput()
    images: list[bytes] = []
    for m in messages:
        msg = chat.messages.add(role=m["role"])
        if isinstance(m["content"], str):
            msg.content = m["content"]
            continue
        for part in m["content"]:
            if part["type"] == "text":
                msg.content_parts.add(type="text", text=part["text"])
            else:
                data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                msg.content_parts.add(type="image", image_data=data)
                images.append(data)
    vision = VisionInput.of_checkpoint(directory, json.loads((directory / "config.json").read_text()))
    tokenizer = Tokenizer.from_dir(directory)
    prompt = render_chat(tokenizer, chat, vision=vision)
    assert prompt.media is not None
    tokens = prompt.media.model_ids(prompt.token_ids)
    pixels = torch.cat([span.image.pixel_values for span in prompt.media.spans])
    grids = torch.tensor([span.image.grid_thw for span in prompt.media.spans])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids = torch.tensor([tokens + out])
            logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                           mm_token_type_ids=(ids == IMAGE).int()).logits[0, -1]
            out.append(int(logits.argmax()))
    return tokenizer.decode(out)


def served(gateway: RunningService) -> str:
    return str(httpx.get(f"http://{gateway.address}/v1/models", timeout=60).json()["data"][0]["id"])


def ask(gateway: RunningService, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(f"http://{gateway.address}/v1/chat/completions", timeout=120, json={
        "model": served(gateway), "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_conversation_with_screenshots_equals_transformers_and_turn_two_reuses_turn_one(
        checkpoint: Any, stack: tuple[RunningService, RunningService]) -> None:
    _, gateway = stack
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0)
    first = [{"role": "system", "content": "You look at screens."}, user("What is on these two?", screenshot(1),
                                                                          screenshot(2, (56, 84)))]
    turn1 = client.chat.completions.create(model=served(gateway), messages=first, max_tokens=MAX_TOKENS,  # type: ignore
                                           temperature=0, extra_body={"ignore_eos": True})
    assert turn1.choices[0].message.content is not None
    body = ask(gateway, first)
    assert body["choices"][0]["message"]["content"] == oracle(checkpoint, first)
    assert body["ignis"]["images"] == {"count": 2, "reused": 2}  # the SDK's turn ran them: state reused
    second = first + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                      user("And now?", screenshot(1), screenshot(2, (56, 84)), screenshot(3))]
    body2 = ask(gateway, second)
    assert body2["choices"][0]["message"]["content"] == oracle(checkpoint, second)
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert body2["ignis"]["images"]["count"] == 5


def test_an_image_the_model_cannot_read_is_a_400_and_the_engine_keeps_serving(
        stack: tuple[RunningService, RunningService]) -> None:
    _, gateway = stack
    png = base64.b64decode(screenshot(4).split(",", 1)[1])
    truncated = "data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode()
    r = httpx.post(f"http://{gateway.address}/v1/chat/completions", timeout=60, json={
        "model": served(gateway), "messages": [user("look", truncated)], "max_tokens": 2})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    assert ask(gateway, [user("and this one?", screenshot(5))])["choices"][0]["finish_reason"] == "length"


def test_a_system_prompt_with_a_reference_image_is_published_for_a_burst_of_subagents(
        stack: tuple[RunningService, RunningService]) -> None:
    _, gateway = stack
    system = {"role": "system", "content": [{"type": "text", "text": "Match the design in this mockup."},
                                            {"type": "image_url", "image_url": {"url": screenshot(7)}}]}
    first = ask(gateway, [system, {"role": "user", "content": "Subagent 1: build the header."}])
    second = ask(gateway, [system, {"role": "user", "content": "Subagent 2: build the footer, then the menu."}])
    assert first["ignis"]["images"] == {"count": 1, "reused": 0}
    assert second["ignis"]["images"] == {"count": 1, "reused": 1}  # the head, image and all, was claimed
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["ignis"]["kind"] == "prefix"


def test_the_responses_api_takes_an_input_image_and_the_next_turn_reuses_it(
        stack: tuple[RunningService, RunningService]) -> None:
    _, gateway = stack
    image = {"type": "input_image", "image_url": screenshot(9), "detail": "auto"}

    def respond(text: str, previous: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": served(gateway), "max_output_tokens": 4, "temperature": 0,
                                "input": [{"role": "user", "content": [{"type": "input_text", "text": text}, image]}]}
        if previous is not None:
            body["previous_response_id"] = previous
        r = httpx.post(f"http://{gateway.address}/v1/responses", timeout=120, json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    first = respond("What does this screen show?")
    assert first["status"] == "incomplete"  # max_output_tokens reached
    assert first["ignis"]["images"] == {"count": 1, "reused": 0}
    second = respond("And after the click?", first["id"])  # the stored turn re-sends its image
    assert second["ignis"]["images"]["count"] == 2 and second["ignis"]["images"]["reused"] >= 1
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_echo_of_a_prompt_with_images_is_refused_and_the_engine_keeps_serving(
        stack: tuple[RunningService, RunningService]) -> None:
    """A prompt's key ids have no logprobs to echo: the engine refuses the pair (a caller that is not the
    gateway could ask it) before anything is queued."""
    engine, gateway = stack
    request = engine_pb2.GenerateRequest(model=served(gateway), echo=True)
    request.sampling.max_tokens = 2
    message = request.chat.messages.add(role="user")
    message.content_parts.add(type="image", image_data=base64.b64decode(screenshot(10).split(",", 1)[1]))
    with grpc.insecure_channel(engine.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "echo" in str(caught.value.details())
    assert ask(gateway, [user("still there?", screenshot(10))])["choices"][0]["finish_reason"] == "length"
