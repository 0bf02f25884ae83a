"""The engine's gRPC calls about adapters, each failure its status (engine/server.py's servicer
calls these): which adapter a request's `model` names, loading and unloading by name."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import grpc

from engine.call_status import Abort
from engine.core import EngineCore
from engine.lora.adapter import AdapterError
from engine.lora.registry import AdapterExists, NoAdapterSlot, ServedAdapter
from engine.model.openmp import on_own_thread

MAX_NAME = 256  # characters in an adapter's name (a model id)


def named_adapter(core: EngineCore, base: str, model: str) -> ServedAdapter | None:
    """The adapter `model` names; None for the base model (or no name); NOT_FOUND for anything else."""
    if not model or model == base:
        return None
    adapter = core.adapters.get(model) if core.adapters is not None else None
    if adapter is None:
        served = ", ".join(repr(name) for name in [base, *served_names(core)])
        raise Abort(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here; this engine serves {served}")
    return adapter


def served_names(core: EngineCore) -> list[str]:
    return [] if core.adapters is None else [a.name for a in core.adapters.served()]


async def load(core: EngineCore, base: str, name: str, path: str, reader: Executor) -> ServedAdapter:
    """Read the adapter on `reader` (not the event loop), then serve it from a slot (on the step thread)."""
    registry = core.adapters
    if registry is None:
        raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                    "this engine serves no LoRA adapters: start it with --lora NAME=PATH or lora.enabled=true")
    if not name or len(name) > MAX_NAME or name == base:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"an adapter needs a name of 1 to {MAX_NAME} characters other than the base model's ({base!r})")
    if not path:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "an adapter needs the path of its folder")
    if registry.get(name) is not None:  # answered before reading the files
        raise Abort(grpc.StatusCode.ALREADY_EXISTS, f"an adapter named {name!r} is already loaded")
    loop = asyncio.get_running_loop()
    try:
        # On a thread that ends with it (engine/model/openmp.py): reading runs torch ops, and a pooled thread
        # would keep an OpenMP team that slows every parallel region of the step thread from then on.
        adapter = await loop.run_in_executor(reader, on_own_thread, lambda: registry.sites.read(path),
                                             "ignis-adapter-read")
        return await asyncio.wrap_future(core.load_adapter(name, adapter))
    except AdapterExists as exc:
        raise Abort(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
    except AdapterError as exc:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    except NoAdapterSlot as exc:
        raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None


async def unload(core: EngineCore, name: str) -> ServedAdapter:
    if core.adapters is None or core.adapters.get(name) is None:
        raise Abort(grpc.StatusCode.NOT_FOUND, f"no adapter named {name!r} is loaded")
    try:
        return await asyncio.wrap_future(core.unload_adapter(name))
    except KeyError:  # unloaded by another call meanwhile
        raise Abort(grpc.StatusCode.NOT_FOUND, f"no adapter named {name!r} is loaded") from None
