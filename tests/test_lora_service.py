"""LoRA adapters through the real services: an engine started with --lora behind a gateway with an API
key, driven by the openai SDK and httpx. Adapters are listed with their base, chosen by `model`,
loaded and unloaded while other adapters' streams decode (those finish with their solo outputs), and
a bad adapter is a 400 that disturbs nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from lora_adapters import ATTENTION, GDN, MLP, make_adapter
from services import RunningService, start_engine, start_gateway

KEY = "lora-key"
BASE = "ignis-tiny"
TARGETS = ATTENTION + MLP + GDN


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(tiny_model_dir, root / f"a{i}", rank, TARGETS, seed=30 + i, std=0.08)
            for i, rank in enumerate((8, 16, 4, 8))]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, adapters: list[Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[RunningService]:
    engine = start_engine(tmp_path_factory.mktemp("engine"), str(tiny_model_dir), [
        "--served-model-name", BASE, "--lora", f"a0={adapters[0]}", "--lora", f"a1={adapters[1]}",
        "--set", "lora.max_adapters=3", "--max-queue", "64"])
    gateway = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address], ["--api-key", KEY])
    yield gateway
    assert gateway.stop() == 0, gateway.log()
    assert engine.stop() == 0, engine.log()
    assert "Traceback" not in engine.log(), engine.log()


@pytest.fixture(scope="module")
def client(gateway: RunningService) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=KEY, max_retries=0, timeout=300)


def admin(gateway: RunningService, path: str, body: dict[str, str], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"http://127.0.0.1:{gateway.port}/v1/{path}", json=body, headers=headers, timeout=300)


def complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 24) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_models_lists_adapters_with_their_base(client: openai.OpenAI, adapters: list[Path]) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, "a0", "a1"}
    extra = {name: model.model_extra or {} for name, model in models.items()}
    assert extra["a0"]["parent"] == BASE and extra["a0"]["root"] == str(adapters[0])
    assert extra[BASE]["parent"] is None
    assert (client.models.retrieve("a1").model_extra or {})["parent"] == BASE


def test_the_model_field_chooses_the_adapter(client: openai.OpenAI) -> None:
    prompt = "The adapters each say something of their own about"
    texts = {model: complete(client, model, prompt) for model in (BASE, "a0", "a1")}
    assert len(set(texts.values())) == 3  # each adapter changes the output
    assert complete(client, "a0", prompt) == texts["a0"]
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                          temperature=0)
    assert chat.model == "a1" and chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        complete(client, "a9", prompt)


def test_streams_finish_as_alone_while_adapters_load_and_unload(client: openai.OpenAI, gateway: RunningService,
                                                                adapters: list[Path]) -> None:
    """Eight streams of a0, a1 and the base decode while a2 is loaded and used, a1 unloaded (its streams
    go on with it, and its slot is not given away while they run), and a2 unloaded for a3: each stream's
    text is its solo text."""
    plan = [(["a0", "a1", BASE][i % 3], f"stream {i} tells a long story about the number {i}:") for i in range(8)]
    solo = [complete(client, model, prompt, max_tokens=200) for model, prompt in plan]
    texts: list[str] = [""] * len(plan)
    started = [threading.Event() for _ in plan]
    done = [threading.Event() for _ in plan]

    def stream(i: int) -> None:
        model, prompt = plan[i]
        try:
            for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=200, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                texts[i] += chunk.choices[0].text if chunk.choices else ""
                started[i].set()
        finally:
            started[i].set()
            done[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(plan))]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(300)
    assert admin(gateway, "load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters[2])}).status_code == 200
    assert complete(client, "a2", "a new adapter answers at once")
    assert admin(gateway, "unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "a1", "gone")
    a1_streams = [i for i, (model, _) in enumerate(plan) if model == "a1"]
    running_before = not all(done[i].is_set() for i in a1_streams)
    third = admin(gateway, "load_lora_adapter", {"lora_name": "a3", "lora_path": str(adapters[3])})
    running_after = not all(done[i].is_set() for i in a1_streams)
    # a0, a2, and a1's slot while its streams run: no slot for a3 until they end
    if running_after:
        assert third.status_code == 429, third.text
    elif not running_before:
        assert third.status_code == 200, third.text
    if third.status_code == 429:
        assert admin(gateway, "unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
        assert admin(gateway, "load_lora_adapter", {"lora_name": "a3", "lora_path": str(adapters[3])}
                     ).status_code == 200
    for thread in threads:
        thread.join(300)
    assert texts == solo
    assert complete(client, "a3", "the last adapter loaded answers")
    assert {m.id for m in client.models.list().data} >= {BASE, "a0", "a3"}


def test_bad_adapter_calls_are_clear_errors_and_serving_goes_on(client: openai.OpenAI, gateway: RunningService,
                                                                 adapters: list[Path], tmp_path: Path,
                                                                 tiny_model_dir: Path,
                                                                 checkpoint_dir: Callable[[str], Path]) -> None:
    def refused(path: str, body: dict[str, str], status: int, key: str | None = KEY) -> str:
        reply = admin(gateway, path, body, key)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["message"]
        return str(error["message"])

    assert "no adapter_config.json" in refused("load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, 400)
    big = make_adapter(tiny_model_dir, tmp_path / "big", 32, ["q_proj"], seed=1)
    other = make_adapter(checkpoint_dir("Qwen3ForCausalLM"), tmp_path / "other", 4, ["q_proj"], seed=2)
    assert "another base model" in refused("load_lora_adapter", {"lora_name": "x", "lora_path": str(other)}, 400)
    head = make_adapter(checkpoint_dir("Qwen3ForCausalLM"), tmp_path / "head", 4, ["lm_head"], seed=3)
    assert "'lm_head' is not one ignis adapts" in refused("load_lora_adapter",
                                                          {"lora_name": "x", "lora_path": str(head)}, 400)
    assert "over lora.max_rank=16" in refused("load_lora_adapter", {"lora_name": "x", "lora_path": str(big)}, 400)
    assert "already loaded" in refused("load_lora_adapter", {"lora_name": "a0", "lora_path": str(adapters[0])}, 400)
    assert "base model" in refused("load_lora_adapter", {"lora_name": BASE, "lora_path": str(adapters[0])}, 400)
    refused("load_lora_adapter", {"lora_path": str(adapters[0])}, 400)
    refused("load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters[0])}, 401, key=None)
    assert "no adapter named" in refused("unload_lora_adapter", {"lora_name": "nobody"}, 404)
    assert complete(client, "a0", "still serving")
