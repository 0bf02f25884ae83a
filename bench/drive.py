"""Drive an in-process EngineCore synchronously (benchmarks that measure the engine itself)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import load_model
from engine.model.openmp import on_own_thread
from engine.offline import run_to_completion
from engine.outputs import Usage
from engine.request import EngineRequest
from engine.text.tokenizer import Tokenizer


def make_core(path: Path, **config: object) -> EngineCore:
    core = on_own_thread(lambda: EngineCore(  # as the engine service builds it (engine/model/openmp.py)
        load_model(path, onednn_linears=True), Tokenizer.from_dir(path), EngineConfig(**config)))  # type: ignore[arg-type]
    core.start()
    return core


def run(core: EngineCore, *requests: EngineRequest) -> list[tuple[list[int], Usage]]:
    """(generated tokens, usage) of each request, submitted together."""
    out = []
    for updates in run_to_completion(core, *requests):
        final = updates[-1]
        if final.error or final.usage is None:
            raise RuntimeError(f"request failed: {final.error}")
        out.append(([t for u in updates for d in u.deltas for t in d.token_ids], final.usage))
    return out


def random_prompt(n: int, seed: int, vocab: int = 4000) -> tuple[int, ...]:
    return tuple(torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())
