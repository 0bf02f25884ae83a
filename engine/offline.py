"""Offline generation with one sequence: the simplest correct use of the model.

Used as the reference the served engine is checked against, and by tools that
want tokens without starting a server.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from engine.kv.device_cache import CacheGeometry, DeviceCache
from engine.model.batch import ForwardBatch, LogitsWanted, SequenceChunk
from engine.model.loader import LoadedModel
from engine.outputs import RequestUpdate
from engine.request import EngineRequest


class Submitter(Protocol):
    """What run_to_completion needs of an engine core (engine.core.EngineCore)."""

    def submit(self, request: EngineRequest, sink: Callable[[RequestUpdate], None]) -> None: ...

    def start(self) -> None: ...


@dataclass(frozen=True, slots=True)
class OfflineResult:
    token_ids: list[int]
    logits: list[torch.Tensor]  # next-token logits before each generated token, fp32 [vocab]


def greedy_generate(
    loaded: LoadedModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    page_size: int = 16,
    stop_token_ids: frozenset[int] = frozenset(),
    prefill_chunk: int | None = None,
) -> OfflineResult:
    """Greedy decoding of one prompt; prefill in chunks of `prefill_chunk` tokens if given."""
    if not prompt:
        raise ValueError("prompt must not be empty")
    total = len(prompt) + max_new_tokens
    pages = -(-total // page_size)
    model = loaded.model
    cache = DeviceCache(loaded.config.state_shape(), CacheGeometry(page_size, pages, 1, model.dtype), model.device)
    page_table = list(range(pages))
    step = prefill_chunk or len(prompt)
    logits = torch.empty(0)
    for start in range(0, len(prompt), step):
        chunk = list(prompt[start : start + step])
        batch = ForwardBatch.build(
            [SequenceChunk(chunk, start, page_table, 0, LogitsWanted.LAST)], page_size, model.device
        )
        logits = model(batch, cache)[0]
    out: list[int] = []
    seen: list[torch.Tensor] = []
    position = len(prompt)
    for _ in range(max_new_tokens):
        seen.append(logits)
        token = int(torch.argmax(logits))
        out.append(token)
        if token in stop_token_ids or len(out) == max_new_tokens:
            break
        batch = ForwardBatch.build([SequenceChunk([token], position, page_table, 0)], page_size, model.device)
        logits = model(batch, cache)[0]
        position += 1
    return OfflineResult(token_ids=out, logits=seen)


def run_to_completion(core: Submitter, *requests: EngineRequest, timeout: float = 3600.0,
                      start: bool = False) -> list[list[RequestUpdate]]:
    """Submit `requests` together to a started EngineCore (so they may batch) and block until
    each is done; returns every request's updates, in submission order. `start`: the core is
    not started yet; start it once all are queued, so its first step sees them all."""
    done = threading.Semaphore(0)
    updates: dict[str, list[RequestUpdate]] = {r.request_id: [] for r in requests}

    def sink(update: RequestUpdate) -> None:  # called on the engine thread
        updates[update.request_id].append(update)
        if update.done:
            done.release()

    for request in requests:
        core.submit(request, sink)
    if start:
        core.start()
    for _ in requests:
        if not done.acquire(timeout=timeout):
            raise TimeoutError(f"requests did not finish within {timeout:.0f}s")
    return [updates[r.request_id] for r in requests]
