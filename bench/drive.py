"""Drive an in-process EngineCore synchronously (benchmarks that measure the engine itself)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from engine.core import EngineConfig, EngineCore
from engine.model.loader import load_model
from engine.outputs import RequestUpdate, Usage
from engine.request import EngineRequest
from engine.text.tokenizer import Tokenizer


def make_core(path: Path, **config: object) -> EngineCore:
    core = EngineCore(load_model(path), Tokenizer.from_dir(path), EngineConfig(**config))  # type: ignore[arg-type]
    core.start()
    return core


def run(core: EngineCore, *requests: EngineRequest) -> list[tuple[list[int], Usage]]:
    done = threading.Semaphore(0)
    updates: dict[str, list[RequestUpdate]] = {r.request_id: [] for r in requests}

    def sink(u: RequestUpdate) -> None:
        updates[u.request_id].append(u)
        if u.done:
            done.release()

    for r in requests:
        core.submit(r, sink)
    for _ in requests:
        if not done.acquire(timeout=3600):
            raise TimeoutError("request did not finish")
    out = []
    for r in requests:
        final = updates[r.request_id][-1]
        if final.error or final.usage is None:
            raise RuntimeError(f"request failed: {final.error}")
        tokens = [t for u in updates[r.request_id] for d in u.deltas for t in d.token_ids]
        out.append((tokens, final.usage))
    return out


def random_prompt(n: int, seed: int, vocab: int = 4000) -> tuple[int, ...]:
    return tuple(torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())
