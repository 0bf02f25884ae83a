"""Reuse vs cold: TTFT of a repeated prompt (a greedy retry, a seeded regenerate, an n=4 request)
or an extended one against its cold prefill, the cost of the state clone against a raw copy of the
same bytes, the hash chain's cost, and the reuse tax.

    python -m bench.reuse [--sizes 1024,4096,16384] [--hidden 1024 --layers 16] [--kinds dense,hybrid]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.drive import make_core, random_prompt, run
from bench.geometry import ensure_geometry, geometry_config
from engine.model.config import parse_config
from bench.table import markdown, save
from engine.kv.chain_hash import Namespace, page_hashes, python_page_hashes, token_bytes
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams

P = 16


def request(rid: str, prompt: tuple[int, ...], publish: int = 0, n: int = 1, seed: int | None = None
            ) -> EngineRequest:
    """One token of `prompt`: greedy, or sampled with `seed` (a regenerate); `n` choices."""
    params = SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, n=n, max_tokens=1, ignore_eos=True)
    return EngineRequest(rid, prompt, params, head_tokens=publish)


def ttft(core: Any, req: EngineRequest) -> tuple[float, int]:
    (_, usage), = run(core, req)
    return usage.time_to_first_token_ms, usage.cached_tokens


def timed(fn: Any, repeat: int = 20) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1000


def bench_kind(kind: str, sizes: list[int], hidden: int, layers: int) -> dict[str, Any]:
    path = ensure_geometry(kind, hidden, layers)
    config = parse_config(geometry_config(kind, hidden, layers))
    # Room for the live prompt, its turn-2 extension and the retained copies, fp32.
    pages_needed = 4 * (max(sizes) + 128) // P + 64
    kv_bytes = pages_needed * config.state_shape().kv_bytes_per_page(P, torch.float32)
    # A slot for every state the run retains (the warm-up's end; each size's head, end and turn-2 end;
    # the reuse tax's three heads and ends): all are interactive and inside their TTL, so a full set of
    # slots would skip the next capture by design (docs/architecture.md, "a consequence to size for")
    # and a row would measure that instead.
    on = make_core(path, page_size=P, kv_cache_bytes=kv_bytes, max_num_seqs=4, prefill_chunk_tokens=2048,
                   retained_device=1 + 3 * len(sizes) + 6)
    off = make_core(path, page_size=P, kv_cache_bytes=kv_bytes, max_num_seqs=4, prefill_chunk_tokens=2048,
                    reuse_prompt=False)
    rows = []
    try:
        run(on, request("warm", random_prompt(64, 0)))  # first-call overheads out of the figures
        run(off, request("warm", random_prompt(64, 0)))
        for i, n in enumerate(sizes):
            prompt = random_prompt(n, 100 + i)
            publish = (n // 2) // P * P  # a chat-shaped prompt: half of it is the shared head
            cold, _ = ttft(on, request(f"cold{n}", prompt, publish))
            retry, retry_cached = ttft(on, request(f"retry{n}", prompt, publish))
            regenerate, _ = ttft(on, request(f"regenerate{n}", prompt, publish, seed=7))
            fork, fork_cached = ttft(on, request(f"n4-{n}", prompt, publish, n=4, seed=7))
            turn2 = prompt + random_prompt(64, 200 + i)
            extend, extend_cached = ttft(on, request(f"turn2-{n}", turn2, publish))
            rows.append({"tokens": n, "cold_ms": cold, "retry_ms": retry, "retry_cached": retry_cached,
                         "regenerate_ms": regenerate, "n4_ms": fork, "n4_cached": fork_cached,
                         "turn2_ms": extend, "turn2_cached": extend_cached,
                         "speedup_retry": cold / max(retry, 1e-6), "speedup_turn2": cold / max(extend, 1e-6)})
        # The reuse tax at 1k tokens: cold TTFT with reuse on (cut at the publish point, capture) vs off.
        tax_on, tax_off = [], []
        for r in range(3):
            prompt = random_prompt(1024, 900 + r)
            tax_on.append(ttft(on, request(f"tax-on{r}", prompt, 512))[0])
            tax_off.append(ttft(off, request(f"tax-off{r}", prompt + (1,), 512))[0])
        tax = {"on_ms": statistics.median(tax_on), "off_ms": statistics.median(tax_off)}
        tax["tax_pct"] = 100 * (tax["on_ms"] / tax["off_ms"] - 1)
    finally:
        on.stop()
        off.stop()
    # After the step threads end: a claim's copies run on the step thread, the only one with an
    # OpenMP team in the engine; copies on this thread beside live step threads would pay
    # libgomp's throttled wake-ups (engine/model/openmp.py) that no claim pays.
    clone = clone_cost(on, n=4096)
    return {"kind": kind, "rows": rows, "tax": tax, "clone": clone}


def clone_cost(core: Any, n: int, repeat: int = 41) -> dict[str, float]:
    """What a claim copies (the recurrent slot and the partial last page; full pages are shared),
    through the cache's own copy_slot / copy_page, against a raw memcpy (ctypes.memmove) of the
    same bytes: the same source and destination addresses, slot row 0 -> 1 and page 0 -> 1. Also
    torch copying as many bytes between two fresh buffers, this bench's baseline before: on these
    VMs where the bytes live moves a copy's speed by up to a third, so only the same addresses
    compare the clone's code with a copy. Interleaved call by call (a loaded machine
    moves all alike); before each call the last-level cache is flushed (`_evict`), so each copies
    from memory as a claim of a retained state does. Medians, and the median of the per-call ratios.

    Two cases, interleaved. "all cold": the flush leaves nothing cached, the copy's code and tensor
    metadata included; a 512 KiB page copy then spends ~50 us of its ~180 in misses on the torch
    calls around it (`kv[i]` alone: 1.4 us when warm), and memmove's ctypes call pays the same way.
    "warm code, cold bytes": after the flush each call first runs once on other rows (the pool's last
    two), so its code and metadata are cached and its bytes are not. That is a claim on the step
    thread between decode steps, which make those torch calls every step."""
    cache = core.cache
    pages, slots = cache.kv.shape[0], cache.recurrent.shape[0]
    has_slots = slots > 0
    if pages < 4 or has_slots and slots < 4:
        raise ValueError(f"the clone bench needs 4 pages and 4 slots or none, got {pages} and {slots}")
    # The same copies on rows far from 0 and 1 (no cache line or huge page shared with them).
    near, far_page, far_slot = (0, 1), (pages - 2, pages - 1), (slots - 2, slots - 1)

    def spans(page: tuple[int, int], slot: tuple[int, int]) -> list[tuple[int, int, int]]:
        """(dst, src, bytes) of the claim's copies."""
        out = [(cache.kv[page[1]].data_ptr(), cache.kv[page[0]].data_ptr(), cache.kv[0].numel() * cache.kv.element_size())]
        if has_slots:
            row = cache.state_rows
            out.append((row[slot[1]].data_ptr(), row[slot[0]].data_ptr(), row[0].numel() * row.element_size()))
        return out

    near_spans, far_spans = spans(near, near), spans(far_page, far_slot)
    total = sum(nbytes for _, _, nbytes in near_spans)

    def claim(page: tuple[int, int], slot: tuple[int, int]) -> None:
        if has_slots:
            cache.copy_slot(*slot)
        cache.copy_page(*page)

    def memcpy(spans: list[tuple[int, int, int]]) -> None:
        for dst_ptr, src_ptr, nbytes in spans:
            ctypes.memmove(dst_ptr, src_ptr, nbytes)

    # Written, not just allocated: never-written memory reads as the kernel's one zero page, always
    # cached, and a copy from it costs only its writes.
    src, dst, src2, dst2 = (torch.rand(total // 4, dtype=torch.float32) for _ in range(4))
    evict = torch.ones(_last_level_cache_bytes() * 3 // 4, dtype=torch.float32)
    calls = {"clone": (lambda: claim(near, near), lambda: claim(far_page, far_slot)),
             "memcpy": (lambda: memcpy(near_spans), lambda: memcpy(far_spans)),
             "fresh": (lambda: dst.copy_(src), lambda: dst2.copy_(src2))}
    runs: dict[str, list[float]] = {f"{name}{case}": [] for name in calls for case in ("", "_warm")}
    for fn, twin in calls.values():
        fn()  # warm-up: every destination resident
        twin()
    order = list(calls.items())
    for i in range(repeat):
        for case in ("", "_warm"):
            for name, (fn, twin) in order[i % 3:] + order[:i % 3]:  # each in each place: no order favours one
                evict.add_(1.0)  # read and write 3x the L3: no copy finds its bytes in a cache
                if case:
                    twin()
                t = time.perf_counter()
                fn()
                runs[name + case].append(time.perf_counter() - t)
    out = {"bytes": float(total), "reprefill_note": float(n)}
    for case in ("", "_warm"):
        clone, memcpy_runs, fresh = runs["clone" + case], runs["memcpy" + case], runs["fresh" + case]
        out |= {f"clone_ms{case}": statistics.median(clone) * 1000,
                f"raw_copy_ms{case}": statistics.median(memcpy_runs) * 1000,
                f"fresh_copy_ms{case}": statistics.median(fresh) * 1000,
                f"clone_speed{case}": statistics.median(m / c for c, m in zip(clone, memcpy_runs)),
                f"clone_speed_vs_fresh{case}": statistics.median(f / c for c, f in zip(clone, fresh))}
    return out


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), or 32 MiB when it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * unit)
    return max(sizes, default=32 << 20)


def hash_cost(n: int = 100_000) -> dict[str, float]:
    """The chain over a prompt of `n` ids as the engine holds them (a tuple of ints): page_hashes
    as shipped (the C chain, kernels/cpu/chain_hash.c), against the Python loop it replaced and the
    ids' conversion to little-endian uint32 alone, each a median of interleaved calls."""
    tokens = random_prompt(n, 5)
    seed = Namespace(b"\0" * 16, "float32", P).digest()
    calls = {"ms": lambda: page_hashes(seed, tokens, P),
             "python_ms": lambda: python_page_hashes(seed, token_bytes(tokens), P),
             "convert_ms": lambda: token_bytes(tokens)}
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(15):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t)
    out = {name: statistics.median(samples) * 1000 for name, samples in runs.items()}
    return {"tokens": float(n), **out, "ns_per_token": out["ms"] * 1e6 / n,
            "python_ns_per_token": out["python_ms"] * 1e6 / n, "convert_ns_per_token": out["convert_ms"] * 1e6 / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1024,4096,16384")
    parser.add_argument("--kinds", default="dense,hybrid")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = [bench_kind(k, sizes, args.hidden, args.layers) for k in args.kinds.split(",")]
    hashing = hash_cost()
    ttft_rows = [[r["kind"], row["tokens"], row["cold_ms"], row["retry_ms"], row["retry_cached"], row["speedup_retry"],
                  row["regenerate_ms"], row["n4_ms"], row["n4_cached"],
                  row["turn2_ms"], row["turn2_cached"], row["speedup_turn2"]] for r in results for row in r["rows"]]
    parts = [
        f"### Reuse vs cold TTFT (hidden {args.hidden}, {args.layers} layers, CPU fp32, page {P})",
        markdown(["model", "prompt tokens", "cold TTFT ms", "retry TTFT ms", "retry cached", "cold/retry",
                  "regenerate (seeded) TTFT ms", "n=4 TTFT ms", "n=4 cached", "turn-2 (+64) TTFT ms", "turn-2 cached", "cold/turn-2"], ttft_rows),
        "### State clone vs raw copy of the same bytes",
        markdown(["model", "case", "bytes copied", "clone ms", "raw memcpy, same bytes ms", "clone speed / memcpy",
                  "torch copy, fresh buffers ms", "clone speed / fresh copy"],
                 [[r["kind"], label, int(r["clone"]["bytes"]), r["clone"][f"clone_ms{case}"],
                   r["clone"][f"raw_copy_ms{case}"], r["clone"][f"clone_speed{case}"],
                   r["clone"][f"fresh_copy_ms{case}"], r["clone"][f"clone_speed_vs_fresh{case}"]]
                  for r in results for case, label in (("", "all cold"), ("_warm", "warm code, cold bytes"))]),
        "### Reuse tax at 1k tokens (cold TTFT, reuse on vs off)",
        markdown(["model", "reuse on ms", "reuse off ms", "tax %"],
                 [[r["kind"], r["tax"]["on_ms"], r["tax"]["off_ms"], r["tax"]["tax_pct"]] for r in results]),
        "### Hash chain",
        markdown(["tokens", "what", "ms", "ns/token"],
                 [[int(hashing["tokens"]), "page_hashes (shipped: one C call)", hashing["ms"], hashing["ns_per_token"]],
                  [int(hashing["tokens"]), "the Python loop it replaced", hashing["python_ms"],
                   hashing["python_ns_per_token"]],
                  [int(hashing["tokens"]), "of which: ids -> little-endian uint32 (included in both)",
                   hashing["convert_ms"], hashing["convert_ns_per_token"]]]),
    ]
    table = "\n\n".join(parts)
    print(table)
    save("reuse", {"results": results, "hash": hashing, "args": vars(args)}, table)


if __name__ == "__main__":
    main()
