"""llama.cpp's llama-server, the benchmark peer, serves the same model as ignis after GGUF conversion.

Skipped unless `python -m bench.peers.llama_cpp build` already ran: `make test` never builds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from bench.geometry import ensure_geometry
from common.launch import Service
from bench.peers.llama_cpp import convert_to_gguf, is_built, launch_llama_server, server_binary
from engine.model.loader import load_model
from engine.offline import greedy_generate

if not is_built():
    pytest.skip(f"llama-server is not built ({server_binary()} missing): run python -m bench.peers.llama_cpp build",
                allow_module_level=True)

# Fixed ids from the tiny tokenizer's ordinary range (0..8 are the chat specials).
PROMPT = [(17 + 389 * i) % 4087 + 9 for i in range(40)]
N_PREDICT = 16


# dense: Qwen3ForCausalLM; moe: Qwen3MoeForCausalLM with its experts stored per expert, as published
# (the converter stacks them into ffn_{gate,up,down}_exps).
GEOMETRIES = {"dense": 4, "moe": 2}


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return ensure_geometry(request.param, hidden=256, layers=GEOMETRIES[request.param])


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = launch_llama_server(tmp_path_factory.mktemp("llama"), convert_to_gguf(checkpoint), threads=2,
                                  parallel=1, ctx_size=512, extra=["--no-warmup"])
    yield service
    service.stop()


def peer_greedy(service: Service, prompt: list[int]) -> list[int]:
    reply = httpx.post(f"http://{service.address}/completion", timeout=120, json={
        "prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": False,
        "ignore_eos": True, "return_tokens": True})
    reply.raise_for_status()
    return [int(t) for t in reply.json()["tokens"]]


def test_peer_greedy_continuation_matches_ignis(checkpoint: Path, server: Service) -> None:
    ours = greedy_generate(load_model(checkpoint), PROMPT, N_PREDICT)
    theirs = peer_greedy(server, PROMPT)
    assert len(theirs) == N_PREDICT
    agree = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs)) if a != b), N_PREDICT)
    if agree < N_PREDICT:
        # fp32 summation order may flip an argmax only where the top two logits nearly tie.
        logits = ours.logits[agree]
        gap = float(logits[ours.token_ids[agree]] - logits[theirs[agree]])
        assert gap < 1e-3 * float(torch.max(torch.abs(logits))), (agree, gap, ours.token_ids, theirs)
    assert agree >= 8, (ours.token_ids, theirs)
