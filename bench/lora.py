"""LoRA adapters: decode tok/s of a batch whose rows run 1, 4 or 8 distinct adapters against the base
model alone, and an adapter's load time, one run.

    python -m bench.lora [--hidden 1024 --layers 16] [--kinds dense,hybrid] [--rank 16] [--batch 8]

The adapters are random, rank --rank on every linear the model lets an adapter change (q/k/v/o,
gate/up/down, the GDN projections), written in PEFT's format (adapter_config.json and
adapter_model.safetensors under PEFT's tensor names) and cached. The baseline is the same checkpoint in
an engine with LoRA off (no slots, no hooks); "base, LoRA on" is base-model requests in the engine that
serves the adapters (what serving adapters costs the requests that use none). Each configuration
alternates with the baseline in pairs; its ratio is the median over the pairs. "bf16 weights": the
same adapters served with lora.dtype=bfloat16 (rounded once; products in fp32) by a third engine. Decode tok/s: --decode
steps timed once every row has its first token, each step decoding every row (both engines driven
on one thread). Load time: reading the folder and checking it
against the model (engine/lora/adapter.py), then placing it in its slot of every linear.
Target: >= 0.8x the base with 8 adapters of rank 16 at batch 8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.drive import random_prompt
from bench.geometry import ensure_geometry
from bench.table import RESULTS, markdown, save
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.lora.adapter import LinearShape
from engine.lora.registry import ServedAdapter
from engine.model.loader import load_model
from engine.model.openmp import on_own_thread
from engine.outputs import RequestUpdate
from engine.model.tiny import default_cache_dir
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer

PROMPT = 64
SLACK = 16  # tokens past the timed steps: rows start decoding a step or two apart
ADAPTERS = 8


def write_adapter(folder: Path, targets: dict[str, LinearShape], rank: int, seed: int) -> Path:
    """A random rank-`rank` adapter on every target, in PEFT's files (A ~ 1/sqrt(in), B small: a change of
    the outputs of the order of the weights' own)."""
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in targets.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, shape.in_features, generator=g) \
            / shape.in_features ** 0.5
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(shape.out_features, rank, generator=g) * 0.01
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False, "bias": "none",
              "target_modules": sorted({n.rsplit(".", 1)[-1] for n in targets}), "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def requests(batch: int, adapters: list[ServedAdapter | None], tokens: int, tag: str) -> list[EngineRequest]:
    """Row i runs adapters[i % len(adapters)]."""
    return [EngineRequest(f"{tag}-{i}", random_prompt(PROMPT, 2000 + i),
                          SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), lookup=False,
                          adapter=adapters[i % len(adapters)])
            for i in range(batch)]


def decode_rate(core: EngineCore, batch: int, adapters: list[ServedAdapter | None], decode: int, tag: str
                ) -> tuple[float, list[list[int]]]:
    """Decode tok/s of `batch` rows once each has its first token: `decode` steps, each decoding every row,
    timed alone (the core driven on this thread, as bench/profile.py does: both engines' steps on one
    thread, so one OpenMP team, which two step threads would not be). Returns it and each row's tokens."""
    updates: dict[str, list[RequestUpdate]] = {}
    for request in requests(batch, adapters, decode + SLACK, tag):  # none ends inside the timed steps
        updates[request.request_id] = []
        core.submit(request, updates[request.request_id].append)

    def generated(rid: str) -> list[int]:
        if any(u.error for u in updates[rid]):
            raise RuntimeError(f"request {rid} failed: {[u.error for u in updates[rid] if u.error]}")
        return [t for u in updates[rid] for d in u.deltas for t in d.token_ids]

    while any(not generated(rid) for rid in updates):
        core.drain_inbox()
        core.step()
    before = core.totals.generated_tokens
    start = time.perf_counter()
    for _ in range(decode):
        core.step()
    wall = time.perf_counter() - start
    if core.totals.generated_tokens - before != batch * decode:
        raise RuntimeError(f"not every row decoded in each of the {decode} timed steps "
                           f"({core.totals.generated_tokens - before} tokens)")
    outputs = [generated(rid)[:decode] for rid in updates]
    for rid in updates:
        core.abort(rid)
    while core.scheduler.has_work() or any(not u or not u[-1].done for u in updates.values()):
        core.drain_inbox()
        if core.scheduler.has_work():
            core.step()
    return batch * decode / wall, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kinds", default="dense,hybrid")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the checkpoints and adapters are written (default: ignis' cache folder)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    for kind in args.kinds.split(","):
        path = ensure_geometry(kind, args.hidden, args.layers, root=args.cache)
        tokenizer = Tokenizer.from_dir(path)

        def core_for(lora: bool, weights: str = "auto") -> EngineCore:
            # a model each: the LoRA core's hooks go on its model's linears, the baseline's has none
            loaded = on_own_thread(lambda: load_model(path, onednn_linears=True))
            return on_own_thread(lambda: EngineCore(loaded, tokenizer, EngineConfig(
                page_size=16, kv_cache_bytes=1 << 30, max_num_seqs=args.batch, prefill_chunk_tokens=4096,
                step_time_target_ms=float("inf"), reuse_prompt=False, lora_enabled=lora, lora_max_adapters=ADAPTERS,
                lora_max_rank=args.rank, lora_dtype=weights)))

        plain = core_for(False)
        lora = core_for(True)
        half = core_for(True, "bfloat16")
        assert lora.adapters is not None and half.adapters is not None
        targets = lora.adapters.sites.targets
        folder = (args.cache or default_cache_dir()) / "bench-lora" / f"{kind}-h{args.hidden}-l{args.layers}-r{args.rank}"
        served: list[ServedAdapter | None] = []
        served_half: list[ServedAdapter | None] = []
        for i in range(ADAPTERS):
            adapter_path = write_adapter(folder / f"a{i}", targets, args.rank, seed=i)
            # as the engine reads one, on a thread that ends with it (engine/model/openmp.py)
            start = time.perf_counter()
            adapter = on_own_thread(lambda: lora.adapters.sites.read(adapter_path))
            read = time.perf_counter() - start
            served.append(on_own_thread(lambda: lora.load_adapter(f"a{i}", adapter).result()))
            loads.append({"kind": kind, "read_s": read, "total_s": time.perf_counter() - start,
                          "mib": (adapter_path / "adapter_model.safetensors").stat().st_size / 2**20})
            rounded = on_own_thread(lambda: half.adapters.sites.read(adapter_path))
            served_half.append(on_own_thread(lambda: half.load_adapter(f"a{i}", rounded).result()))
        try:
            decode_rate(plain, args.batch, [None], 4, "warm")
            decode_rate(lora, args.batch, served, 4, "warm-l")
            decode_rate(half, args.batch, served_half, 4, "warm-h")
            configs: list[tuple[str, int, list[ServedAdapter | None], EngineCore]] = [
                ("base, LoRA on", args.batch, [None], lora), ("1 adapter", args.batch, served[:1], lora),
                ("4 adapters", args.batch, served[:4], lora), ("8 adapters", args.batch, served[:8], lora),
                ("8 adapters, bf16 weights", args.batch, served_half[:8], half), ("1 adapter", 1, served[:1], lora)]
            for label, batch, adapters, core in configs:
                pairs = []
                for r in range(args.repeats):
                    got, outs = decode_rate(core, batch, adapters, args.decode, f"l{label}{batch}{r}")
                    want, plain_outs = decode_rate(plain, batch, [None], args.decode, f"p{label}{batch}{r}")
                    if adapters == [None] and outs != plain_outs:
                        raise RuntimeError(f"{kind}: base requests with LoRA on differ from LoRA off")
                    pairs.append((got, want))
                row = {"kind": kind, "batch": batch, "adapters": label, "base_tps": statistics.median(w for _, w in pairs),
                       "lora_tps": statistics.median(g for g, _ in pairs),
                       "ratio": statistics.median(g / w for g, w in pairs), "pairs": pairs}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "pairs"}, flush=True)
        finally:
            plain.stop()
            lora.stop()
            half.stop()
    table = markdown(["model", "batch", "rows run", "base decode tok/s (LoRA off)", "decode tok/s",
                      "ratio (median of pairs)"],
                     [[r["kind"], r["batch"], r["adapters"], r["base_tps"], r["lora_tps"], r["ratio"]] for r in rows])
    load_table = markdown(["model", "adapter file MiB", "read and check ms (median)", "read, check and place ms (median)"],
                          [[kind, statistics.median(x["mib"] for x in loads if x["kind"] == kind),
                            1000 * statistics.median(x["read_s"] for x in loads if x["kind"] == kind),
                            1000 * statistics.median(x["total_s"] for x in loads if x["kind"] == kind)]
                           for kind in args.kinds.split(",")])
    title = (f"### LoRA adapters: decode with per-row adapters vs the base model alone (hidden {args.hidden}, "
             f"{args.layers} layers, CPU fp32, rank {args.rank} on every adaptable linear, greedy)")
    notes = (f"Rows run the adapters round-robin ({ADAPTERS} resident, lora.max_rank={args.rank}); the baseline is "
             "an engine with LoRA off on the same checkpoint, alternated in pairs. \"base, LoRA on\": base-model "
             "requests in the engine serving the adapters (their outputs equal LoRA off's: checked). "
             "Target: >= 0.8x the base with 8 adapters of rank 16.")
    text = title + "\n\n" + table + "\n\n" + load_table + "\n\n" + notes
    print(text)
    save("lora", {"rows": rows, "loads": loads, "args": {k: str(v) for k, v in vars(args).items()}}, text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
