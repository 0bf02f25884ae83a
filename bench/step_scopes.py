"""`ignis.*` profiler scopes over the engine step and the model's parts, and the breakdown they give.

The scopes are put in place by patching the classes' methods (and the CPU kernel table the model
reaches through kernels.select) for the duration of a `with scopes(model):` block, and undone after:
nothing in the product carries profiling code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.profiler import profile, record_function

import engine.step_sampling
import kernels.select
from engine.core import EngineCore
from engine.model.attention import Attention
from engine.model.batch import ForwardBatch
from engine.model.decoder import CausalLM
from engine.model.gated_deltanet import GatedDeltaNet
from engine.model.layers import MLP, Experts, GatedRMSNorm, RMSNorm, SparseMoE
from engine.scheduler import Scheduler


def _wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)
    return scoped


def _patch(owner: Any, name: str, label: str, undo: list[Callable[[], None]]) -> None:
    if isinstance(owner, nn.Module):  # one instance: an attribute of its own shadows the class's forward
        setattr(owner, name, _wrap(getattr(owner, name), label))
        undo.append(functools.partial(delattr, owner, name))
        return
    original = vars(owner)[name]  # a class's own attribute or a module's global, as stored
    if isinstance(original, classmethod):
        setattr(owner, name, classmethod(_wrap(original.__func__, label)))
    else:
        setattr(owner, name, _wrap(original, label))
    undo.append(functools.partial(setattr, owner, name, original))


# (owner, attribute, scope). Functions the model modules imported by name are patched where they
# are looked up (engine.step_sampling.sample_rows, not engine.sampling.sampler.sample_rows).
CLASS_SCOPES: list[tuple[Any, str, str]] = [
    (EngineCore, "step", "ignis.step"),
    (Scheduler, "schedule", "ignis.scheduler"),
    (ForwardBatch, "build", "ignis.batch_build"),
    (engine.step_sampling, "sample_rows", "ignis.sampling"),
    (CausalLM, "forward", "ignis.forward"),
    (Attention, "forward", "ignis.attention"),
    (GatedDeltaNet, "forward", "ignis.gdn"),
    (GatedDeltaNet, "_project", "ignis.gdn.in_proj"),
    (GatedDeltaNet, "_prefill", "ignis.gdn.state"),
    (GatedDeltaNet, "_decode", "ignis.gdn.state"),
    (GatedRMSNorm, "forward", "ignis.gdn.norm"),
    (MLP, "forward", "ignis.mlp"),
    (SparseMoE, "forward", "ignis.moe"),
    (Experts, "forward", "ignis.moe.experts"),
    (RMSNorm, "forward", "ignis.norm"),
]


# Kernels the model reaches through kernels.select (the table of the device's kernels): field -> scope.
# On the CPU the fused GDN decode step (C: conv taps and delta rule in one call) counts as the
# decode kernel; its conv is inside it.
KERNEL_SCOPES: dict[str, str] = {
    "paged_attention": "ignis.attention.kernel",
    "paged_decode_attention": "ignis.attention.kernel",
    "paged_decode_from_table": "ignis.attention.kernel",  # the decode-only batch's form (was uncounted: in "rest")
    "causal_conv1d": "ignis.gdn.conv",
    "chunk_gated_delta_rule": "ignis.gdn.chunked",
    "gated_delta_decode_step_": "ignis.gdn.recurrent",
    "gdn_decode_fused": "ignis.gdn.recurrent",
}


def _patch_kernels(undo: list[Callable[[], None]]) -> None:
    """The CPU's kernel tables (the references, and the C kernels' table), each kernel in its scope."""
    for table_fn in ("_references", "_cpu"):
        original = vars(kernels.select)[table_fn]
        table = original()
        scoped = dataclasses.replace(table, **{f: _wrap(getattr(table, f), label) for f, label in KERNEL_SCOPES.items()
                                               if getattr(table, f) is not None})
        setattr(kernels.select, table_fn, functools.partial(lambda t: t, scoped))
        undo.append(functools.partial(setattr, kernels.select, table_fn, original))


@contextmanager
def scopes(model: CausalLM) -> Iterator[None]:
    """Wrap the engine's and the model's parts in `ignis.*` profiler scopes; all undone on exit."""
    undo: list[Callable[[], None]] = []
    try:
        for owner, name, label in CLASS_SCOPES:
            _patch(owner, name, label, undo)
        _patch_kernels(undo)
        _patch(model.lm_head, "forward", "ignis.lm_head", undo)
        for module in model.modules():
            if isinstance(module, Attention):
                projections = (module.q_proj, module.k_proj, module.v_proj, module.o_proj, module.fused_qkv)
                for proj in projections:
                    if isinstance(proj, nn.Module):  # fused_qkv: None where q, k and v run as three calls
                        _patch(proj, "forward", "ignis.attention.proj", undo)
            elif isinstance(module, GatedDeltaNet):
                _patch(module.out_proj, "forward", "ignis.gdn.out_proj", undo)
        yield
    finally:
        for restore in reversed(undo):
            restore()


def scope_times(prof: profile) -> tuple[dict[str, float], dict[str, float]]:
    """ms of each ignis.* scope: inclusive, and exclusive of the ignis.* scopes nested in it."""
    incl: dict[str, float] = defaultdict(float)
    excl: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if not event.name.startswith("ignis."):
            continue
        ms = event.cpu_time_total / 1000
        incl[event.name] += ms
        excl[event.name] += ms
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("ignis."):
            parent = parent.cpu_parent
        if parent is not None:
            excl[parent.name] -= ms
    return incl, excl


# (label, scope whose exclusive time it is); rows of scopes that never ran are left out.
FORWARD_PARTS = [
    ("attention: q/k/v/o projections", "ignis.attention.proj"),
    ("attention: paged attention kernel", "ignis.attention.kernel"),
    ("attention: rest (rope, KV-cache writes)", "ignis.attention"),
    ("GDN: input projections (qkv, z, b, a)", "ignis.gdn.in_proj"),
    ("GDN: causal conv", "ignis.gdn.conv"),
    ("GDN: chunked delta rule (prefill kernel)", "ignis.gdn.chunked"),
    ("GDN: recurrent delta rule (decode kernel)", "ignis.gdn.recurrent"),
    ("GDN: state slots in/out, head split", "ignis.gdn.state"),
    ("GDN: gated RMSNorm", "ignis.gdn.norm"),
    ("GDN: output projection", "ignis.gdn.out_proj"),
    ("GDN: rest (gates, decay, buffers)", "ignis.gdn"),
    ("MLP", "ignis.mlp"),  # an MoE's shared expert too
    ("MoE: routed experts (sort by expert, grouped GEMMs, scatter-add)", "ignis.moe.experts"),
    ("MoE: router (gate, softmax, top-k), rest of the block", "ignis.moe"),
    ("RMSNorm (layers, final, q/k)", "ignis.norm"),
    ("LM head (logits)", "ignis.lm_head"),
    ("forward rest (embedding, rotary tables, residuals)", "ignis.forward"),
]
ENGINE_PARTS = [
    ("scheduler (Scheduler.schedule)", "ignis.scheduler"),
    ("batch building (ForwardBatch.build)", "ignis.batch_build"),
    ("sampling (sample_rows)", "ignis.sampling"),
    ("rest of the step (runner, bookkeeping, detokenize, sinks)", "ignis.step"),
]


def breakdown(prof: profile, wall_ms: float) -> list[dict[str, Any]]:
    """Rows (category, ms, % of the profiled wall, leaf); the leaves partition the wall."""
    incl, excl = scope_times(prof)
    step, forward = incl.get("ignis.step", 0.0), incl.get("ignis.forward", 0.0)

    def row(name: str, ms: float, leaf: bool) -> dict[str, Any]:
        return {"category": name, "ms": ms, "pct": 100 * ms / wall_ms if wall_ms else 0.0, "leaf": leaf}

    rows = [row("engine step (EngineCore.step)", step, False),
            row("— model forward (CausalLM.forward)", forward, False)]
    rows += [row(f"—— {name}", excl[key], True) for name, key in FORWARD_PARTS if key in incl]
    rows.append(row("— engine Python outside the model (step − forward)", step - forward, False))
    rows += [row(f"—— {name}", excl[key], True) for name, key in ENGINE_PARTS if key in incl]
    outside = excl.get("ignis.window", wall_ms - step)
    rows.append(row("outside the step (driver loop, inbox, submit)", outside, True))
    return rows


def top_ops(prof: profile, wall_ms: float, n: int = 15) -> list[dict[str, Any]]:
    ops = sorted((a for a in prof.key_averages() if a.key.startswith("aten::")),
                 key=lambda a: a.self_cpu_time_total, reverse=True)[:n]
    return [{"op": a.key, "calls": a.count, "self_ms": a.self_cpu_time_total / 1000,
             "pct": 100 * a.self_cpu_time_total / 1000 / wall_ms if wall_ms else 0.0} for a in ops]
