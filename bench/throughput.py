"""Decode and prefill throughput of the engine against transformers' generate, same checkpoint, same run.

    python -m bench.throughput [--kind dense|hybrid] [--hidden 1024 --layers 16] [--batches 1,8,32]

Prefill tok/s: B prompts of --prompt tokens, one output token each. Decode tok/s:
B sequences generating --decode tokens; the rate excludes the prefill (t(N) - t(1)).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.drive import make_core, random_prompt, run
from bench.geometry import ensure_geometry
from bench.table import markdown, save
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams


def ignis_time(core: Any, batch: int, prompt_len: int, new_tokens: int, tag: str) -> float:
    reqs = [EngineRequest(f"{tag}-{i}", random_prompt(prompt_len, 1000 * batch + i),
                          SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), lookup=False)
            for i in range(batch)]
    start = time.perf_counter()
    run(core, *reqs)
    return time.perf_counter() - start


def hf_time(model: Any, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor([random_prompt(prompt_len, 1000 * batch + i) for i in range(batch)])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", default="dense", choices=["dense", "hybrid"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args()
    path = ensure_geometry(args.kind, args.hidden, args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    core = make_core(path, page_size=16, kv_cache_bytes=2 << 30, max_num_seqs=max(batches),
                     prefill_chunk_tokens=4096, reuse_prompt=False)
    hf = None
    if not args.no_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    try:
        ignis_time(core, 1, 16, 2, "warm")
        for b in batches:
            p_i = ignis_time(core, b, args.prompt, 1, f"p{b}")
            d_i = ignis_time(core, b, 16, args.decode, f"d{b}") - ignis_time(core, b, 16, 1, f"d1-{b}")
            row: dict[str, Any] = {"batch": b, "ignis_prefill_tps": b * args.prompt / p_i,
                                   "ignis_decode_tps": b * (args.decode - 1) / d_i}
            if hf is not None:
                p_h = hf_time(hf, b, args.prompt, 1)
                d_h = hf_time(hf, b, 16, args.decode) - hf_time(hf, b, 16, 1)
                row |= {"hf_prefill_tps": b * args.prompt / p_h, "hf_decode_tps": b * (args.decode - 1) / d_h}
            rows.append(row)
            print(row, flush=True)
    finally:
        core.stop()
    headers = ["batch", "ignis prefill tok/s", "transformers prefill tok/s", "ignis decode tok/s",
               "transformers decode tok/s", "decode ignis/hf"]
    table = markdown(headers, [[r["batch"], r["ignis_prefill_tps"], r.get("hf_prefill_tps", "-"), r["ignis_decode_tps"],
                                r.get("hf_decode_tps", "-"),
                                r["ignis_decode_tps"] / r["hf_decode_tps"] if "hf_decode_tps" in r else "-"]
                               for r in rows])
    title = f"### Throughput, {args.kind} (hidden {args.hidden}, {args.layers} layers, CPU fp32, prompt {args.prompt})"
    print(title + "\n\n" + table)
    save(f"throughput-{args.kind}", {"rows": rows, "args": vars(args)}, title + "\n\n" + table)


if __name__ == "__main__":
    main()
