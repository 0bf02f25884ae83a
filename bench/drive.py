"""Drive an in-process EngineCore synchronously (benchmarks that measure the engine itself)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import load_model
from engine.model.openmp import on_own_thread
from engine.offline import run_to_completion
from engine.outputs import RequestUpdate, Usage
from engine.request import EngineRequest
from engine.text.tokenizer import Tokenizer


def make_core(path: Path, **config: object) -> EngineCore:
    core = on_own_thread(lambda: EngineCore(  # as the engine service builds it (engine/model/openmp.py)
        load_model(path, onednn_linears=True), Tokenizer.from_dir(path), EngineConfig(**config)))  # type: ignore[arg-type]
    core.start()
    return core


def run(core: EngineCore, *requests: EngineRequest) -> list[tuple[list[int], Usage]]:
    """(generated tokens, usage) of each request, submitted together to a started core."""
    return [_outcome(updates) for updates in run_to_completion(core, *requests)]


def run_stepped(core: EngineCore, *requests: EngineRequest) -> list[tuple[list[int], Usage]]:
    """As `run`, for a core that is not started: its steps run on this thread. A benchmark that compares
    several cores in one process drives them all so, since each step thread would be an OpenMP team of
    its own, and teams outnumbering the CPUs throttle each other's spinning (engine/model/openmp.py)."""
    updates: dict[str, list[RequestUpdate]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.submit(request, updates[request.request_id].append)
    while not all(u and u[-1].done for u in updates.values()):
        core.drain_inbox()
        core.step()
    return [_outcome(updates[r.request_id]) for r in requests]


def _outcome(updates: list[RequestUpdate]) -> tuple[list[int], Usage]:
    final = updates[-1]
    if final.error or final.usage is None:
        raise RuntimeError(f"request failed: {final.error}")
    return [t for u in updates for d in u.deltas for t in d.token_ids], final.usage


def random_prompt(n: int, seed: int, vocab: int = 4000) -> tuple[int, ...]:
    return tuple(torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())
