"""Decode attention on the CPU, the torch reference against the in-place C kernel (issue 19), in each
engine.kv_dtype; and the model's whole decode forward at batch 1 and B, before (reference kernels,
fp32 KV) and after (the C kernel, each KV dtype).

    python -m bench.decode_attention [--hidden 1024 --layers 16] [--context 2048] [--batch 8]
        [--repeats 5] [--threads 2] [--out DIR]

On the dense geometry of bench/geometry.py (Qwen3, h1024: 8 query heads, 2 KV heads, head dim 128).
Every sequence has `context` tokens of random K/V on shuffled pages of a pool holding all layers, as
the engine's DeviceCache does; no prefill runs (decode cost does not depend on the values), so the
figures are the model's forward pass of one decode step, without the engine's scheduling and
sampling around it (bench.profile has those). (a) attention alone: one call per attention layer,
as a step makes them. (b) the forward: `model(batch, cache)` of B single-token decodes. Variants are
interleaved in each repeat (A, B, C, ... then again), medians reported, load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import table
from bench.geometry import ensure_geometry
from engine.kv.device_cache import KV_DTYPES, CacheGeometry, DeviceCache
from engine.model.batch import ForwardBatch, SequenceChunk
from engine.model.loader import LoadedModel, load_model
from kernels import select
from kernels.paged_attention import paged_decode_attention as reference

PAGE = 16
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def use_kernels(which: str) -> select.Kernels:
    """Switch the CPU's kernels for this process ("native" or "reference"), as IGNIS_CPU_KERNELS does."""
    os.environ["IGNIS_CPU_KERNELS"] = which
    select._cpu.cache_clear()
    return select.kernels_for(torch.device("cpu"))


def make_cache(loaded: LoadedModel, batch: int, context: int, kv_dtype: torch.dtype, seed: int
               ) -> tuple[DeviceCache, list[list[int]]]:
    """A pool of random K/V for `batch` sequences of `context` tokens (+1 for the decode), pages shuffled."""
    per_seq = -(-(context + 1) // PAGE)
    geometry = CacheGeometry(PAGE, batch * per_seq, 1, loaded.model.dtype, kv_dtype)
    cache = DeviceCache(loaded.config.state_shape(), geometry, loaded.model.device)
    g = torch.Generator().manual_seed(seed)
    for i in range(cache.kv.shape[0]):  # page by page: no fp32 copy of the whole pool
        cache.kv[i].copy_(torch.randn(cache.kv.shape[1:], generator=g))
    order = torch.randperm(cache.kv.shape[0], generator=g).tolist()
    return cache, [order[b * per_seq:(b + 1) * per_seq] for b in range(batch)]


def decode_batch(tables: list[list[int]], context: int) -> ForwardBatch:
    chunks = [SequenceChunk([3 + b], context, t, 0) for b, t in enumerate(tables)]
    return ForwardBatch.build(chunks, PAGE, torch.device("cpu"))


def timed(fn: Callable[[], Any], steps: int) -> float:
    """ms per call, over `steps` calls after one untimed."""
    fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) * 1000 / steps


def attention_step(loaded: LoadedModel, cache: DeviceCache, batch: ForwardBatch,
                   kernel: select.PagedDecodeAttention) -> Callable[[], None]:
    """One step's decode attention calls: one per attention layer, over that layer's K/V."""
    cfg = loaded.config
    gather = batch.decode
    assert gather is not None
    q = torch.randn(len(batch.seqs), cfg.num_heads, cfg.head_dim)
    layers = cfg.state_shape().attention_layers
    scale = cfg.head_dim**-0.5

    pages, offsets, valid = gather.positional()

    def run() -> None:
        for layer in layers:
            kernel(q, cache.k_cache(layer), cache.v_cache(layer), pages, offsets, valid, scale)
    return run


def measure(loaded: LoadedModel, batch: int, context: int, repeats: int, steps: int) -> list[dict[str, Any]]:
    """For one batch size: attention ms/step (reference, C) per KV dtype; forward ms/step per variant."""
    caches = {name: make_cache(loaded, batch, context, dtype, seed=batch) for name, dtype in KV_DTYPES.items()}
    attention: dict[tuple[str, str], list[float]] = {}
    forward: dict[tuple[str, str], list[float]] = {}
    variants = [("reference", "float32")] + [("native", name) for name in KV_DTYPES]
    native = use_kernels("native")
    if not native.decode_in_place:
        raise RuntimeError("the C kernel is not built: `make kernels`")
    for _ in range(repeats):
        use_kernels("native")
        for name in KV_DTYPES:  # (a) the two kernels on the same pool and batch, back to back
            cache, tables = caches[name]
            gathered = decode_batch(tables, context)  # built under the native policy: always one call
            for label, kernel in (("reference", reference), ("native", native.paged_decode_attention)):
                run = attention_step(loaded, cache, gathered, kernel)
                attention.setdefault((label, name), []).append(timed(run, steps))
        for which, name in variants:  # (b) the whole forward, kernels switched for the model
            use_kernels(which)
            cache, tables = caches[name]
            fb = decode_batch(tables, context)
            with torch.inference_mode():
                forward.setdefault((which, name), []).append(timed(lambda: loaded.model(fb, cache), steps))
    use_kernels("native")
    rows = []
    for name in KV_DTYPES:
        ref, ours = attention[("reference", name)], attention[("native", name)]
        after, before = forward[("native", name)], forward[("reference", "float32")]
        rows.append({"batch": batch, "kv_dtype": name,
                     "attention_reference_ms": statistics.median(ref), "attention_native_ms": statistics.median(ours),
                     "forward_ms": statistics.median(after), "forward_reference_fp32_ms": statistics.median(before),
                     "min_ms": {"attention_reference": min(ref), "attention_native": min(ours), "forward": min(after),
                                "forward_reference_fp32": min(before)},
                     "attention_samples": [ref, ours], "forward_samples": after, "forward_reference_samples": before})
    return rows


def _cell(median: float, least: float) -> str:
    return f"{median:.3g} ({least:.3g})"


def render(rows: list[dict[str, Any]], setup: dict[str, Any], loads: dict[str, list[float]]) -> str:
    lines = [f"Decode attention on the CPU, {setup['layers']} attention layers of the dense h{setup['hidden']} "
             f"geometry (8 heads, 2 KV heads, head dim 128), {setup['context']}-token contexts, "
             f"{setup['threads']} threads; medians of {setup['repeats']} interleaved repeats of "
             f"{setup['steps']} steps. Load average (1 min) before {loads['before'][0]:.2f}, "
             f"after {loads['after'][0]:.2f}.", ""]
    lines.append(table.markdown(
        ["batch", "KV dtype", "attention ms/step: reference", "C in place", "speed-up",
         "forward ms/step: before (reference, fp32 KV)", "after (C)", "after / before"],
        [[r["batch"], SHORT[r["kv_dtype"]],
          _cell(r["attention_reference_ms"], r["min_ms"]["attention_reference"]),
          _cell(r["attention_native_ms"], r["min_ms"]["attention_native"]),
          f"{r['attention_reference_ms'] / r['attention_native_ms']:.2f}x",
          _cell(r["forward_reference_fp32_ms"], r["min_ms"]["forward_reference_fp32"]),
          _cell(r["forward_ms"], r["min_ms"]["forward"]),
          f"{r['forward_ms'] / r['forward_reference_fp32_ms']:.2f}"] for r in rows]))
    lines += ["", "Cells: median (min) ms; the ratios are of medians. attention: the step's decode attention calls alone (q random, K/V read from the pool). forward: "
              "the model's decode forward pass (projections, MLPs, lm_head included); the engine step around it "
              "(scheduling, sampling) is not in these figures. The attention reference is called once for the "
              "batch (gather into a padded tensor, masked SDPA), as the engine ran it below 512 tokens; past "
              "that the engine ran one gather + SDPA per sequence, which is what forward 'before' measures."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="the larger batch (batch 1 always runs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per sample")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", type=Path, default=None, help="checkpoint cache (default: ignis' own)")
    parser.add_argument("--out", type=Path, default=table.RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(ensure_geometry("dense", args.hidden, args.layers, args.models), onednn_linears=True)
    setup = {"hidden": args.hidden, "layers": args.layers, "context": args.context, "threads": args.threads,
             "repeats": args.repeats, "steps": args.steps}
    loads = {"before": list(os.getloadavg())}
    rows = [r for b in sorted({1, args.batch}) for r in measure(loaded, b, args.context, args.repeats, args.steps)]
    loads["after"] = list(os.getloadavg())
    text = render(rows, setup, loads)
    print(text)
    path = table.save("decode-attention", {"setup": setup, "load_average": loads, "rows": rows}, text, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
