"""The engine's own Python around the model (issue 18): where a decode step's time goes at 64 and
256 sequences on a tiny checkpoint, where the model is cheap and the engine's share is largest; with
the same sequences decoding (the steady state) and under churn (requests ending and replaced).

Each decode step is cut into the scheduler's plan, building the forward batch, the model's
forward pass, sampling, and the rest of the step (token handling, stop strings, emitting), each
timed with perf_counter around the engine's own methods on this one EngineCore (patched on the
instance, or the module, for the run; the product carries no timers). The engine's share is everything but the
model's forward pass and the sampler's torch work.

    python -m bench.overhead [--hidden 128 --layers 4] [--batches 64,256] [--steps 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine.runner
import engine.step_sampling
from bench import table
from bench.drive import random_prompt
from bench.geometry import ensure_geometry
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import load_model
from engine.outputs import RequestUpdate
from engine.request import EngineRequest
from engine.scheduler import StepPlan
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer

PARTS = ["schedule", "build batch", "model forward", "sample", "rest of the step"]


class Timed:
    """Wall time per part of the current step, summed over the measured steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started
        return timed


def measure(path: Path, batch: int, steps: int, prompt: int = 16, churn: bool = False) -> dict[str, Any]:
    """`churn`: requests of 8 to 40 tokens, each replaced by a new one as it ends, so the batch changes
    every step or two (a prefill joins it, a sequence leaves) instead of decoding the same sequences."""
    loaded, tokenizer = load_model(path, onednn_linears=True), Tokenizer.from_dir(path)  # as the engine service
    longest = 40 if churn else steps + 8
    pages = (batch + 1) * -(-(prompt + longest) // 16) + 16
    page_bytes = loaded.config.state_shape().kv_bytes_per_page(16, loaded.model.dtype) or 1
    core = EngineCore(loaded, tokenizer, EngineConfig(
        page_size=16, kv_cache_bytes=pages * page_bytes, max_num_seqs=batch, max_queue=batch + 1,
        prefill_chunk_tokens=max(2048, batch * prompt), reuse_prompt=False))
    submitted = [0]
    ended = [0]  # requests over since the driver last replaced them (churn)

    def submit() -> None:
        i = submitted[0]
        submitted[0] += 1
        max_tokens = 8 + (i * 13) % 33 if churn else longest
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        core.submit(EngineRequest(f"r{i}", random_prompt(prompt, i), params), sink_for(f"r{i}"))

    def sink_for(rid: str) -> Callable[[RequestUpdate], None]:
        def sink(update: RequestUpdate) -> None:
            if update.error:
                raise RuntimeError(f"{rid} failed: {update.error}")
            if update.done and churn:
                ended[0] += 1  # replaced between steps, as a client's next request arrives on the server's thread
        return sink

    def replace_ended() -> None:
        for _ in range(ended[0]):
            submit()
        ended[0] = 0

    for _ in range(batch):
        submit()
    core.drain_inbox()
    with torch.no_grad():
        for _ in range(4 if not churn else 48):  # prefill, then decode steps (churn: till lengths mix) out of the figures
            replace_ended()
            core.drain_inbox()
            core.step()
        if not churn and len(core.scheduler.running) != batch:
            raise RuntimeError(f"{len(core.scheduler.running)} of {batch} sequences are decoding")
        timed = Timed()
        schedule = core.scheduler.schedule
        steady: list[bool] = []

        def noting() -> StepPlan:
            plan = schedule()
            steady.append(plan.steady)
            return plan
        core.scheduler.schedule = timed.wrap("schedule", noting)  # type: ignore[method-assign]
        model = core.runner.model  # nn.Module.__call__ finds an instance attribute `forward` first
        model.forward = timed.wrap("model forward", model.forward)  # type: ignore[method-assign]
        # The leaves of building a batch: the decode road's (built from the sequences, or the kept one moved
        # on), a step with prefills' (its decodes as the decode road lists them) and the general one's.
        builders = [(engine.runner.KeptDecodes, "build"), (engine.runner.KeptDecodes, "advance"),
                    (engine.runner.ForwardBatch, "_any"), (engine.runner.ForwardBatch, "mixed")]
        originals = [vars(owner)[name] for owner, name in builders]
        for (owner, name), build in zip(builders, originals):
            wrapped = timed.wrap("build batch", build.__func__ if isinstance(build, classmethod) else build)
            setattr(owner, name, classmethod(wrapped) if isinstance(build, classmethod) else wrapped)
        # The sampler's own call only: what StepSampling.sample does with its tokens (appending them, the
        # detokenizer, stop checks) is the engine's Python, in the rest of the step.
        sampler = engine.step_sampling.sample_rows
        engine.step_sampling.sample_rows = timed.wrap("sample", sampler)
        step_times = []
        try:
            for _ in range(steps):
                replace_ended()  # submit's own checks are the caller's thread's, not the step's
                started = time.perf_counter()
                core.drain_inbox()
                core.step()
                step_times.append(time.perf_counter() - started)
        finally:
            for (owner, name), build in zip(builders, originals):
                setattr(owner, name, build)
            engine.step_sampling.sample_rows = sampler
            del model.forward
    core.stop()
    total = sum(step_times)
    parts = {k: timed.seconds[k] for k in PARTS[:-1]}
    parts["rest of the step"] = total - sum(parts.values())
    return {"batch": batch, "traffic": "churn" if churn else "steady", "steps": steps,
            "step_ms_p50": statistics.median(step_times) * 1000, "steady_steps": sum(steady),
            "ms_per_step": {k: v / steps * 1000 for k, v in parts.items()}, "total_ms_per_step": total / steps * 1000}


def rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    out = []
    for r in results:
        ms, total = r["ms_per_step"], r["total_ms_per_step"]
        engine_ms = ms["schedule"] + ms["build batch"] + ms["rest of the step"]
        out.append([r["kind"], r["batch"], r.get("traffic", "steady"), f"{100 * r.get('steady_steps', 0) / r['steps']:.0f}",
                    f"{total:.2f}", *(f"{ms[k]:.3f}" for k in PARTS),
                    f"{100 * engine_ms / total:.1f}", f"{100 * (engine_ms + ms['sample']) / total:.1f}"])
    return out


HEADERS = ["model", "sequences", "traffic", "steady steps %", "step ms", *(f"{p} ms" for p in PARTS), "engine Python % (no sampler)",
           "outside the forward %"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=table.RESULTS)
    parser.add_argument("--models", type=Path, default=None, help="checkpoint cache (default: ignis' own)")
    a = parser.parse_args(argv)
    load = os.getloadavg()[0]
    results = []
    for kind in ("dense", "hybrid"):
        path = ensure_geometry(kind, a.hidden, a.layers, root=a.models)
        for batch in (int(b) for b in a.batches.split(",")):
            for churn in (False, True):
                print(f"overhead: {kind}, {batch} sequences{', churn' if churn else ''}", flush=True)
                results.append({"kind": kind, **measure(path, batch, a.steps, churn=churn)})
    text = "\n\n".join([
        f"### The engine's Python around the model (issue 18): h{a.hidden}, {a.layers} layers, CPU fp32, "
        f"{torch.get_num_threads()} threads",
        table.markdown(HEADERS, rows(results)),
        f"{a.steps} steps measured, greedy, 16-token prompts, reuse off. *Steady* traffic: the same sequences "
        "decoding, after their prefill and 3 warm steps (the steady state, engine/steady_decodes.py, from the second "
        "decode on). *Churn*: requests of 8 to 40 tokens, each replaced as it ends (after 48 warm steps), so sequences "
        "leave and prefills join every step or two; *steady steps*: the share planned as the steady state. *Engine Python*: the scheduler's plan, building the forward batch and the rest of the step "
        "(appending each sampled token, the detokenizer, stop checks, emitting updates) as a share of the step; "
        "*outside the forward* adds the sampler's call (one batched torch call). A tiny model makes the forward cheap, so these shares are the "
        f"largest the engine's Python ever is. 1-minute load average {load:.2f} → {os.getloadavg()[0]:.2f}.",
    ])
    print(text, flush=True)
    path = table.save("overhead", {"results": results, "args": {k: str(v) for k, v in vars(a).items()}}, text, a.out)
    print(f"\nwrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
