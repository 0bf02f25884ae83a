"""`python -m bench.long_prefill`: do short requests keep moving while a long prompt prefills?

A probe is a short streamed completion (`--probe-tokens` prompt tokens, `--probe-max-tokens` out).
For each variant (an engine with its own flags, started fresh, with a gateway in front):

- alone: probes one after another on an idle engine: their time to first token (TTFT) and total;
- the long prompt alone (`--long-tokens`, one token out): its TTFT;
- beside: another long prompt of the same length, and while it prefills, probes one after another
  (a short random pause between them, so they land anywhere in a step): their TTFT and total, and
  the long prompt's own TTFT with them beside it.

Every prompt is distinct (random token ids), so nothing is reused: each is a cold prefill. The
table gives the probes' TTFT beside over alone (the target: at most 2x) and what the long prompt
pays for it. By default the variants are the engine as shipped (`engine.step_time_target_ms`
bounds each step's time) and the same engine with only the token budget per step (the target off),
measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.drive import random_prompt
from bench.table import markdown, save
from bench.workload import sse_chunks
from common.launch import launch_engine, launch_gateway
from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE

DEFAULT_VARIANTS = ["shipped=", "token budget only=--set engine.step_time_target_ms=off"]


@dataclass
class Timing:
    ttft: float
    total: float
    tokens: int


@dataclass
class VariantResult:
    name: str
    flags: str
    probes_alone: list[Timing] = field(default_factory=list)
    probes_beside: list[Timing] = field(default_factory=list)
    long_alone: float = 0.0
    long_beside: float = 0.0


class Prompts:
    """Distinct random token-id prompts (nothing one request computed is reusable by another)."""

    def __init__(self, seed: int) -> None:
        self.seeds = itertools.count(seed)

    def make(self, n: int) -> list[int]:
        return list(random_prompt(n, next(self.seeds), vocab=TINY_VOCAB_SIZE))


async def completion(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Timing:
    """One streamed /v1/completions (greedy, no early end): seconds to its first chunk of output and to
    its end, and its tokens as the usage counts them (a chunk's text can be empty, or hold several
    tokens, where a token ends inside a character: counting chunks would miscount)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for chunk in sse_chunks(client, "/v1/completions", body):
        if first is None and chunk.get("choices"):
            first = time.perf_counter() - started
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return Timing(first, time.perf_counter() - started, tokens)


async def measure(base_url: str, model: str, args: argparse.Namespace, prompts: Prompts, result: VariantResult
                  ) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0)) as client:
        for _ in range(2):  # warm the paths (first-call allocations) before anything is timed
            await completion(client, model, prompts.make(args.probe_tokens), args.probe_max_tokens)
        for _ in range(args.probes):
            result.probes_alone.append(await completion(client, model, prompts.make(args.probe_tokens),
                                                        args.probe_max_tokens))
        result.long_alone = (await completion(client, model, prompts.make(args.long_tokens), 1)).ttft
        long_task = asyncio.create_task(completion(client, model, prompts.make(args.long_tokens), 1))
        await asyncio.sleep(0.3)  # the long prompt is admitted and prefilling
        pauses = random.Random(args.seed)
        while not long_task.done():
            probe = await completion(client, model, prompts.make(args.probe_tokens), args.probe_max_tokens)
            if long_task.done():
                break  # it ended while this probe ran: this one was not wholly beside it
            result.probes_beside.append(probe)
            await asyncio.sleep(pauses.uniform(0.0, 0.2))
        result.long_beside = (await long_task).ttft


def run_variant(name: str, flags: str, args: argparse.Namespace, seed: int) -> VariantResult:
    result = VariantResult(name, flags)
    with tempfile.TemporaryDirectory(prefix="ignis-long-prefill-") as tmp:
        workdir = Path(tmp)
        engine = launch_engine(workdir, args.model, [*shlex.split(flags)])
        try:
            gateway = launch_gateway(workdir, [engine.address])
            try:
                models = httpx.get(f"http://127.0.0.1:{gateway.port}/v1/models", timeout=30).json()
                model = models["data"][0]["id"]
                asyncio.run(measure(f"http://127.0.0.1:{gateway.port}", model, args, Prompts(seed), result))
            finally:
                gateway.stop()
        finally:
            engine.stop()
    return result


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def row(r: VariantResult) -> list[Any]:
    alone = [t.ttft for t in r.probes_alone]
    beside = [t.ttft for t in r.probes_beside]
    p50_alone, p50_beside = statistics.median(alone), statistics.median(beside) if beside else float("nan")
    return [r.name, len(beside), f"{p50_alone * 1e3:.0f}", f"{quantile(alone, 0.9) * 1e3:.0f}",
            f"{p50_beside * 1e3:.0f}", f"{quantile(beside, 0.9) * 1e3:.0f}", f"{p50_beside / p50_alone:.2f}",
            f"{statistics.median(t.total for t in r.probes_alone) * 1e3:.0f}",
            f"{statistics.median(t.total for t in r.probes_beside) * 1e3:.0f}" if beside else "-",
            f"{r.long_alone:.2f}", f"{r.long_beside:.2f}", f"{r.long_beside / r.long_alone:.2f}"]


HEADERS = ["variant", "probes beside", "probe TTFT alone p50 ms", "alone p90", "probe TTFT beside p50 ms",
           "beside p90", "beside / alone (p50; target <= 2)", "probe total alone p50 ms", "probe total beside p50 ms",
           "long TTFT alone s", "long TTFT beside s", "long beside / alone"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ignis-tiny")
    parser.add_argument("--long-tokens", type=int, default=24000)
    parser.add_argument("--probe-tokens", type=int, default=16)
    parser.add_argument("--probe-max-tokens", type=int, default=4)
    parser.add_argument("--probes", type=int, default=12, help="probes timed alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME=ENGINE FLAGS (repeatable; default: as shipped, and the step time target off)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    args = parser.parse_args()
    results = []
    for i, spec in enumerate(args.variant or DEFAULT_VARIANTS):
        name, _, flags = spec.partition("=")
        print(f"variant {name!r}: engine flags {flags!r}", flush=True)
        results.append(run_variant(name, flags, args, seed=args.seed + 1000 * i))
        print(markdown(HEADERS, [row(results[-1])]), flush=True)
    table = (f"Probes ({args.probe_tokens} prompt tokens, {args.probe_max_tokens} out) beside a "
             f"{args.long_tokens}-token prefill, model {args.model}, through the gateway; every prompt cold.\n\n"
             + markdown(HEADERS, [row(r) for r in results]))
    print(table)
    payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "variants": [{"name": r.name, "flags": r.flags, "long_alone_s": r.long_alone,
                             "long_beside_s": r.long_beside,
                             "probes_alone": [vars(t) for t in r.probes_alone],
                             "probes_beside": [vars(t) for t in r.probes_beside]} for r in results]}
    kwargs = {"out": args.out} if args.out is not None else {}
    print(f"wrote {save('long-prefill', payload, table, **kwargs)}")


if __name__ == "__main__":
    main()
