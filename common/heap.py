"""The cyclic garbage collector in a long-running service: start-up objects frozen, young passes rarer.

A service allocates container objects per request and per token (dicts, coroutines, futures, protobuf
wrappers); almost all die by reference counting, but each 700 allocations start a young-generation
pass, and every so often a full pass walks every object alive since start-up (modules, grpc, the app,
a model's Python objects). `freeze_startup_heap` moves what start-up left into the permanent
generation, which no pass walks, and runs a young pass every `young` allocations instead.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # allocations between young-generation passes (CPython's default: 700)


def freeze_startup_heap(young: int = YOUNG_THRESHOLD) -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)
