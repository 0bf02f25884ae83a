"""Decode throughput with a JSON-schema grammar against the same requests unconstrained, one run.

    python -m bench.structured [--hidden 1024 --layers 16] [--batches 1,8] [--decode 64]

Each guided request writes a JSON array of objects ({"name": string of at most 8 characters,
"n": integer 0..999}), more of them than --decode tokens hold, so every request of both kinds
decodes exactly --decode tokens and the batch stays full to the end (the same tokens to
decode, the same occupancy). Decode tok/s excludes the prefill (t(N) - t(1), as
bench/throughput.py). Guided and unconstrained runs alternate in pairs; the ratio is the median
over the pairs (a noisy neighbour slows both of a pair alike). The grammar's own cost per step
(the batch's bitmask filled and applied, `apply_guides`) is timed apart, beside the step time. The grammar is compiled once before timing (the engine
compiles on its prompt workers, off the step); the compile time is reported apart.
Target: guided / unconstrained >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from bench.drive import make_core, random_prompt, run
from bench.geometry import ensure_geometry
from bench.table import markdown, save
from engine.guided import CompiledGuide, GuidedCompiler, GuideKind, GuidedSpec
from engine.request import EngineRequest
from engine.sampling.guide import apply_guides
from engine.sampling.params import SamplingParams

PROMPT = 16


def schema(items: int) -> dict[str, Any]:
    item = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
            "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 999}}}
    return {"type": "array", "minItems": items, "maxItems": items, "items": item}


def timed(core: Any, batch: int, max_tokens: int, guide: CompiledGuide | None, tag: str) -> tuple[float, int]:
    """(seconds, tokens generated) for `batch` requests submitted together."""
    reqs = [EngineRequest(f"{tag}-{i}", random_prompt(PROMPT, 100 * batch + i),
                          SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True),
                          lookup=False, guided=guide) for i in range(batch)]
    start = time.perf_counter()
    out = run(core, *reqs)
    return time.perf_counter() - start, sum(len(tokens) for tokens, _ in out)


def decode_rate(core: Any, batch: int, decode: int, guide: CompiledGuide | None, tag: str) -> float:
    t_n, tokens = timed(core, batch, decode, guide, tag)
    if tokens != batch * decode:
        raise RuntimeError(f"expected {batch * decode} tokens, got {tokens}: the grammar ended early")
    t_1, _ = timed(core, batch, 1, guide, f"{tag}-first")
    return (tokens - batch) / max(t_n - t_1, 1e-9)


def mask_ms(guide: CompiledGuide, batch: int, vocab: int, steps: int = 200) -> float:
    """The grammar's cost in one step of `batch` guided rows: fill the bitmask, apply it, accept."""
    guides = [guide.new_guide() for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    rows = list(range(batch))
    start = time.perf_counter()
    for _ in range(steps):
        x = logits.clone()
        apply_guides(x, rows, guides)
    return (time.perf_counter() - start) * 1000 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = ensure_geometry("dense", args.hidden, args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    core = make_core(path, page_size=16, kv_cache_bytes=2 << 30, max_num_seqs=max(batches),
                     prefill_chunk_tokens=4096, reuse_prompt=False)
    rows: list[dict[str, Any]] = []
    try:
        start = time.perf_counter()
        compiler = GuidedCompiler(core.tokenizer, core.loaded.config.vocab_size, core.eos_ids)
        setup_s = time.perf_counter() - start
        items = args.decode  # each object takes more than one token: the array outlasts --decode
        spec = GuidedSpec(GuideKind.JSON_SCHEMA, source=json.dumps(schema(items)), strict=True)
        start = time.perf_counter()
        guide = compiler.compile(spec)
        compile_ms = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        compiler.compile(spec)
        cached_ms = (time.perf_counter() - start) * 1000
        timed(core, 1, 8, guide, "warm")
        timed(core, 1, 8, None, "warm-plain")
        for b in batches:
            pairs = []
            for r in range(args.repeats):
                pairs.append((decode_rate(core, b, args.decode, guide, f"g{b}-{r}"),
                              decode_rate(core, b, args.decode, None, f"u{b}-{r}")))
            guided_tps = statistics.median(g for g, _ in pairs)
            plain_tps = statistics.median(u for _, u in pairs)
            step_ms = 1000 * b / plain_tps  # one decode step of the whole batch
            row = {"batch": b, "tokens_per_request": args.decode, "unconstrained_tps": plain_tps,
                   "guided_tps": guided_tps, "ratio": statistics.median(g / u for g, u in pairs),
                   "pairs": pairs, "mask_ms_per_step": mask_ms(guide, b, core.loaded.config.vocab_size),
                   "step_ms": step_ms}
            rows.append(row)
            print(row, flush=True)
    finally:
        core.stop()
    headers = ["batch", "tokens / request", "unconstrained decode tok/s", "json_schema decode tok/s",
               "guided / unconstrained (median of pairs)", "grammar ms / step", "step ms"]
    table = markdown(headers, [[r["batch"], r["tokens_per_request"], r["unconstrained_tps"], r["guided_tps"],
                                r["ratio"], r["mask_ms_per_step"], r["step_ms"]] for r in rows])
    title = (f"### Structured outputs: decode with a json_schema grammar vs unconstrained "
             f"(dense, hidden {args.hidden}, {args.layers} layers, CPU fp32, vocab 4096, temperature 1)")
    notes = (f"Grammar: a JSON array of {items} objects (xgrammar), cut at {args.decode} tokens. Vocabulary read once: {setup_s * 1000:.0f} ms; "
             f"compile {compile_ms:.1f} ms, cached {cached_ms:.3f} ms. Target ratio >= 0.9.")
    print(title + "\n\n" + table + "\n\n" + notes)
    save("structured", {"rows": rows, "args": vars(args), "vocab_ms": setup_s * 1000, "compile_ms": compile_ms,
                        "cached_compile_ms": cached_ms}, title + "\n\n" + table + "\n\n" + notes)


if __name__ == "__main__":
    main()
