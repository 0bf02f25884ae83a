"""GPU benchmarks, each beside its baseline in the same run (issue 20):

1. state clone: a retained-state claim (slot + partial page) by the selected kernels' copy_rows_,
   against torch copying the same rows (DeviceCache.copy_slot + a page copy_) and against the
   card's own copy bandwidth (one large contiguous copy);
2. paged decode attention (pages read in place) against SDPA on a contiguous cache;
3. Gated DeltaNet chunked prefill (and the fused decode step) against the torch reference;
4. reused vs cold TTFT on the mid hybrid geometry in bf16 (4k / 16k / ~64k tokens);
5. a host-slot claim (one host-to-device copy) against a device claim.

    python -m bench.gpu [--out DIR] [--sizes 4096,16384,65000] [--hidden 1024 --layers 16]
    python -m bench.gpu --tiny --out DIR      # every section at a tiny size, CPU or GPU (tests)

Without CUDA only --tiny runs (the CPU's kernels are the torch references, so the kernel rows
then compare the reference with itself); a full run refuses. GB/s counts bytes copied or
read once. Writes DIR/gpu.md and DIR/gpu.json (default bench/results/, its JSON in raw/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench.geometry import ensure_geometry, geometry_config
from bench.table import RESULTS, markdown, save
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.device_cache import CacheGeometry, DeviceCache
from engine.model.config import parse_config
from engine.model.loader import LoadedModel, load_model
from engine.model.openmp import on_own_thread
from engine.offline import run_to_completion
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from kernels import gated_delta
from kernels.select import Kernels, kernels_for

P = 16
GB = 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], device: torch.device, repeat: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn in ms, synchronised around each call (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


# --- 1. state clone --------------------------------------------------------------------------------

def state_clone(ops: Kernels, device: torch.device, hidden: int, layers: int, dtype: torch.dtype,
                card_bytes: int) -> dict[str, Any]:
    shape = parse_config(geometry_config("hybrid", hidden, layers)).state_shape()
    cache = DeviceCache(shape, CacheGeometry(P, 64, 32, dtype), device)
    page_bytes = cache.kv[0].numel() * cache.kv.element_size()
    slot_bytes = cache.recurrent[0].numel() * 4 + cache.conv[0].numel() * cache.conv.element_size()
    rows = []
    for claims in (1, 8):
        src_slots = torch.arange(claims, device=device)
        dst_slots = src_slots + 16
        src_pages = torch.arange(claims, device=device)
        dst_pages = src_pages + 32

        def kernel() -> None:
            ops.copy_rows_(cache.recurrent, src_slots, dst_slots)
            ops.copy_rows_(cache.conv, src_slots, dst_slots)
            ops.copy_rows_(cache.kv, src_pages, dst_pages)

        def torch_rows() -> None:
            for i in range(claims):
                cache.copy_slot(i, 16 + i)
                cache.kv[32 + i].copy_(cache.kv[i])

        nbytes = claims * (slot_bytes + page_bytes)
        k_ms, t_ms = timed_ms(kernel, device), timed_ms(torch_rows, device)
        rows.append({"claims": claims, "bytes": nbytes, "kernel_ms": k_ms, "torch_ms": t_ms,
                     "kernel_gbs": nbytes / GB / (k_ms / 1000), "torch_gbs": nbytes / GB / (t_ms / 1000)})
    src = torch.empty(card_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    card_ms = timed_ms(lambda: dst.copy_(src), device, repeat=10)
    return {"slot_bytes": slot_bytes, "page_bytes": page_bytes, "rows": rows,
            "card_bytes": card_bytes, "card_ms": card_ms, "card_gbs": card_bytes / GB / (card_ms / 1000)}


# --- 2. paged decode attention ------------------------------------------------------------------------

def decode_attention(ops: Kernels, device: torch.device, cases: list[tuple[int, int]], heads: int, kv_heads: int,
                     dim: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    rows = []
    for batch, context in cases:
        n_pages = batch * (context // P)
        k_cache = torch.randn(n_pages, P, kv_heads, dim, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(n_pages, device=device).view(batch, context // P)  # scattered pages
        positions = torch.arange(context, device=device)
        pages = table[:, positions // P]
        offsets = (positions % P).expand(batch, -1)
        valid = torch.ones(batch, context, dtype=torch.bool, device=device)
        q = torch.randn(batch, heads, dim, device=device, dtype=dtype)
        scale = dim**-0.5
        # the same keys, contiguous: [B, Hkv, L, D]
        k_flat = k_cache[table].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
        v_flat = v_cache[table].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
        paged_ms = timed_ms(lambda: ops.paged_decode_attention(q, k_cache, v_cache, pages, offsets, valid, scale),
                            device)
        grouped = q.view(batch, kv_heads, heads // kv_heads, dim)  # the heads sharing a KV head as its query rows
        sdpa_ms = timed_ms(lambda: F.scaled_dot_product_attention(grouped, k_flat, v_flat, scale=scale), device)
        kv_bytes = 2 * batch * context * kv_heads * dim * k_cache.element_size()
        rows.append({"batch": batch, "context": context, "paged_ms": paged_ms, "sdpa_ms": sdpa_ms,
                     "paged_gbs": kv_bytes / GB / (paged_ms / 1000), "sdpa_gbs": kv_bytes / GB / (sdpa_ms / 1000)})
        del k_cache, v_cache, k_flat, v_flat
    return rows


# --- 3. Gated DeltaNet ---------------------------------------------------------------------------------

def gdn(ops: Kernels, device: torch.device, lengths: list[int], hk: int, hv: int, dim: int, dtype: torch.dtype,
        decode_batch: int) -> dict[str, Any]:
    prefill = []
    for t in lengths:
        q, k = (torch.randn(1, t, hk, dim, device=device, dtype=dtype) for _ in range(2))
        v = torch.randn(1, t, hv, dim, device=device, dtype=dtype)
        g = -torch.rand(1, t, hv, device=device) * 0.5
        beta = torch.rand(1, t, hv, device=device, dtype=dtype)
        state = torch.randn(1, hv, dim, dim, device=device)
        k_ms = timed_ms(lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, state), device, repeat=5)
        r_ms = timed_ms(lambda: gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, state), device, repeat=3,
                        warmup=1)
        prefill.append({"tokens": t, "kernel_ms": k_ms, "torch_ms": r_ms,
                        "kernel_tok_s": t / (k_ms / 1000), "torch_tok_s": t / (r_ms / 1000)})
    b = decode_batch
    q, k = (torch.randn(b, 1, hk, dim, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(b, 1, hv, dim, device=device, dtype=dtype)
    g = -torch.rand(b, 1, hv, device=device) * 0.5
    beta = torch.rand(b, 1, hv, device=device, dtype=dtype)
    pool = torch.randn(b + 1, 2, hv, dim, dim, device=device)
    states = [pool[i + 1, 1] for i in range(b)]
    step_ms = timed_ms(lambda: ops.gated_delta_decode_step_(q, k, v, g, beta, states), device)
    ref_ms = timed_ms(lambda: gated_delta.gated_delta_decode_step_(q, k, v, g, beta, states), device)
    return {"prefill": prefill, "decode": {"batch": b, "kernel_ms": step_ms, "torch_ms": ref_ms}}


# --- 4 and 5. TTFT through the engine ------------------------------------------------------------------

def prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def first_token(core: EngineCore, rid: str, ids: tuple[int, ...], publish: int) -> tuple[float, int, str]:
    req = EngineRequest(rid, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), head_tokens=publish)
    final = run_to_completion(core, req)[0][-1]
    if final.error or final.usage is None:
        raise RuntimeError(f"request {rid} failed: {final.error}")
    return final.usage.time_to_first_token_ms, final.usage.cached_tokens, final.usage.reuse.tier.value


def make_core(loaded: LoadedModel, tokenizer: Tokenizer, sizes: list[int], **config: Any) -> EngineCore:
    kv_page = loaded.config.state_shape().kv_bytes_per_page(P, loaded.model.dtype)
    pages = 4 * (max(sizes) + 128) // P + 64  # the live prompt, its turn-2 extension, retained copies
    core = on_own_thread(lambda: EngineCore(loaded, tokenizer, EngineConfig(
        page_size=P, kv_cache_bytes=pages * kv_page, max_num_seqs=4, prefill_chunk_tokens=2048, **config)))
    core.start()
    return core


def ttft(loaded: LoadedModel, tokenizer: Tokenizer, sizes: list[int]) -> list[dict[str, Any]]:
    core = make_core(loaded, tokenizer, sizes, retained_device=8)
    rows = []
    try:
        first_token(core, "warm", prompt(64, 0), 0)  # compiles and first-call overheads out of the figures
        for i, n in enumerate(sizes):
            ids = prompt(n, 100 + i)
            publish = (n // 2) // P * P  # chat-shaped: half of the prompt is the shared head
            cold, _, _ = first_token(core, f"cold{n}", ids, publish)
            retry, retry_cached, retry_tier = first_token(core, f"retry{n}", ids, publish)
            turn2, turn2_cached, _ = first_token(core, f"turn2-{n}", ids + prompt(64, 200 + i), publish)
            rows.append({"tokens": n, "cold_ms": cold, "retry_ms": retry, "retry_cached": retry_cached,
                         "retry_tier": retry_tier, "turn2_ms": turn2, "turn2_cached": turn2_cached})
    finally:
        core.stop()
    return rows


def host_vs_device(loaded: LoadedModel, tokenizer: Tokenizer, sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    host = {"retained_device": 0, "retained_host": 4, "retained_host_tokens": max(sizes) + 64}
    for where, config in (("device", {"retained_device": 4}), ("host", host)):
        core = make_core(loaded, tokenizer, sizes, **config)
        try:
            first_token(core, "warm", prompt(64, 0), 0)
            for i, n in enumerate(sizes):
                ids = prompt(n, 300 + i)
                first_token(core, f"capture{n}", ids, 0)  # the opener checkpoint lands in a slot
                ms, cached, tier = first_token(core, f"claim{n}", ids, 0)
                rows.append({"slots": where, "tokens": n, "claim_ttft_ms": ms, "cached": cached, "tier": tier})
        finally:
            core.stop()
    return rows


# --- the run ---------------------------------------------------------------------------------------

def render(device: str, args: argparse.Namespace, res: dict[str, Any]) -> str:
    clone, dec, g, tt, hd = res["clone"], res["decode"], res["gdn"], res["ttft"], res["host"]
    kern = res["kernels"]
    parts = [
        f"### GPU benchmarks ({device}; kernels: {kern}; hidden {args.hidden}, {args.layers} layers, page {P})",
        f"#### 1. State clone: a claim's slot ({clone['slot_bytes']} B) + partial page ({clone['page_bytes']} B)",
        markdown(["claims", "bytes", f"{kern} copy_rows_ ms", "GB/s", "torch copy_ ms", "GB/s",
                  "card copy GB/s"],
                 [[r["claims"], r["bytes"], r["kernel_ms"], r["kernel_gbs"], r["torch_ms"], r["torch_gbs"],
                   clone["card_gbs"]] for r in clone["rows"]]),
        f"Card copy: one contiguous {clone['card_bytes'] / 2**20:.0f} MiB copy_ ({clone['card_ms']:.3f} ms).",
        "#### 2. Decode attention: paged (in place) vs SDPA on a contiguous cache "
        f"({res['attn_geometry']})",
        markdown(["batch", "context", f"{kern} paged ms", "KV GB/s", "SDPA contiguous ms", "KV GB/s"],
                 [[r["batch"], r["context"], r["paged_ms"], r["paged_gbs"], r["sdpa_ms"], r["sdpa_gbs"]]
                  for r in dec]),
        f"#### 3. Gated DeltaNet ({res['gdn_geometry']}) vs the torch reference on the same device",
        markdown(["prefill tokens", f"{kern} ms", "tok/s", "torch ms", "tok/s", "speed-up"],
                 [[r["tokens"], r["kernel_ms"], r["kernel_tok_s"], r["torch_ms"], r["torch_tok_s"],
                   r["torch_ms"] / max(r["kernel_ms"], 1e-9)] for r in g["prefill"]]),
        markdown(["decode step, batch", f"{kern} ms", "torch ms"],
                 [[g["decode"]["batch"], g["decode"]["kernel_ms"], g["decode"]["torch_ms"]]]),
        f"#### 4. Reused vs cold TTFT (hybrid, {res['dtype']})",
        markdown(["prompt tokens", "cold ms", "retry ms", "retry cached", "tier", "cold/retry", "turn-2 (+64) ms",
                  "turn-2 cached", "cold/turn-2"],
                 [[r["tokens"], r["cold_ms"], r["retry_ms"], r["retry_cached"], r["retry_tier"],
                   r["cold_ms"] / max(r["retry_ms"], 1e-9), r["turn2_ms"], r["turn2_cached"],
                   r["cold_ms"] / max(r["turn2_ms"], 1e-9)] for r in tt]),
        "#### 5. Claim of a retained state: host slot (one host-to-device copy) vs device slot",
        markdown(["slots", "prompt tokens", "claim TTFT ms", "cached", "tier"],
                 [[r["slots"], r["tokens"], r["claim_ttft_ms"], r["cached"], r["tier"]] for r in hd]),
    ]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tiny", action="store_true", help="every section at a tiny size (CPU smoke run, tests)")
    parser.add_argument("--sizes", default="4096,16384,65000", help="TTFT prompt lengths (65000: ~64k in context)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--models", type=Path, default=None, help="where the benchmark checkpoints are written")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench.gpu: no CUDA device here; a full run needs an NVIDIA GPU (use --tiny for a CPU smoke run)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        args.hidden, args.layers = 256, 4
        sizes = [96, 160]
    else:
        sizes = [int(s) for s in args.sizes.split(",")]
    ops = kernels_for(device)
    config = parse_config(geometry_config("hybrid", args.hidden, args.layers))
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    res: dict[str, Any] = {"kernels": ops.name, "dtype": str(dtype).removeprefix("torch."), "sizes": sizes,
                           "attn_geometry": f"{heads} heads, {kv_heads} KV heads, dim {dim}, {dtype}",
                           "gdn_geometry": f"{hk} key / {hv} value heads, dim {config.linear_key_head_dim}, {dtype}"}
    began = time.perf_counter()
    decode_cases = [(2, 128), (4, 256)] if args.tiny else [(1, 16384), (16, 4096), (16, 16384), (64, 4096)]

    def kernel_timings() -> None:
        res["clone"] = state_clone(ops, device, args.hidden, args.layers, dtype,
                                   (1 << 20) * (8 if args.tiny else 1024))
        res["decode"] = decode_attention(ops, device, decode_cases, heads, kv_heads, dim, dtype)
        res["gdn"] = gdn(ops, device, [64] if args.tiny else [2048, 8192], hk, hv, config.linear_key_head_dim,
                         dtype, decode_batch=2 if args.tiny else 64)

    # Torch's CPU work on threads that end, as the engine service does (engine/model/openmp.py): a
    # thread left with an OpenMP team beside the core's step thread would slow its steps (CPU fallback).
    on_own_thread(kernel_timings, "ignis-bench-kernels")
    path = ensure_geometry("hybrid", args.hidden, args.layers, root=args.models)
    loaded = on_own_thread(lambda: load_model(path, dtype="bfloat16" if cuda else "float32", device=device))
    tokenizer = Tokenizer.from_dir(path)
    res["ttft"] = ttft(loaded, tokenizer, sizes)
    res["host"] = host_vs_device(loaded, tokenizer, sizes[:2])
    res["seconds"] = time.perf_counter() - began
    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    table = render(name, args, res)
    print(table)
    save("gpu", {"results": res, "args": vars(args)}, table, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
