"""Where ignis' time goes on the slow side, against llama.cpp (issue 8): per-token rates of both servers
on one checkpoint and thread count, and a torch.profiler breakdown of ignis' engine step.

    python -m bench.profile [--kind dense,hybrid,moe] [--hidden 1024 --layers 16] [--threads 2]
        [--prompt 2048] [--decode 32] [--batch 8] [--peer llama.cpp|none] [--kv-dtype auto|float32|bfloat16|float16]
        [--weight-dtype auto|bfloat16] [--out DIR]

ignis runs in this process, stepped synchronously on the main thread (no engine thread), so the
profiler sees every op. Three measurements per server: (a) prefill of one prompt, (b) decode at
batch 1, (c) decode at batch B with every sequence decoding, each ROUNDS times with the two servers
alternating (llama-server stays up throughout), the median round reported. (a) and (c) run once more
under torch.profiler, with the model's parts wrapped in `ignis.*` scopes for the breakdown.

Kinds (bench/geometry.py): dense is Qwen3, hybrid Qwen3.5 (Gated DeltaNet), moe Qwen3-MoE (issue 42:
128 experts, top-8, every layer routed); --kind defaults to dense,hybrid.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench import table
from bench.drive import random_prompt
from bench.geometry import KINDS, ensure_geometry
from bench.step_scopes import breakdown, scope_times, scopes, top_ops
from engine import cpu_host
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.device_cache import resolve_kv_dtype
from engine.model.config import load_config
from engine.model.loader import load_model
from engine.outputs import RequestUpdate
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from kernels.select import kernels_for

PAGE = 16
PEER = "llama.cpp"
Around = Callable[[], AbstractContextManager[Any]]


@dataclass(frozen=True, slots=True)
class Setup:
    kind: str
    hidden: int
    layers: int
    threads: int
    prompt: int
    decode: int
    batch: int
    kv_dtype: str = "auto"  # engine.kv_dtype of ignis' cache (llama.cpp keeps its default f16 KV)
    weight_dtype: str = "auto"  # engine.weight_dtype of ignis' linears; bfloat16: llama.cpp gets a bf16 GGUF

    @property
    def gguf_type(self) -> str:
        return "bf16" if self.weight_dtype == "bfloat16" else "f32"

    @property
    def name(self) -> str:
        """profile-<kind>[-kv-<dtype>][-w-<dtype>]: the results' file name."""
        kv = "" if self.kv_dtype == "auto" else f"-kv-{self.kv_dtype}"
        weights = "" if self.weight_dtype == "auto" else f"-w-{self.weight_dtype}"
        return f"profile-{self.kind}{kv}{weights}"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.prompt < 1 or self.decode < 2 or self.batch < 1 or self.threads < 1:
            raise ValueError(f"need prompt >= 1, decode >= 2, batch >= 1, threads >= 1: {self}")
        if self.kind == "moe" and self.weight_dtype != "auto":
            # engine.weight_dtype converts nn.Linear layers; the stacked experts, nearly all of the
            # weights, stay fp32 while llama.cpp would get all of them in bf16: not the same model.
            raise ValueError("--weight-dtype bfloat16 leaves ignis' MoE experts in fp32; "
                             "profile the moe kind with --weight-dtype auto")

    @property
    def slack(self) -> int:
        """Extra tokens a batch-B request may generate while the others still prefill: each step
        finishes about one prompt, so the first sequence is ~B tokens ahead when the last starts."""
        return 2 * self.batch + 4

    def prompts(self) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
        """The one prompt of (a) and (b), and the B prompts of (c): same ids on both servers."""
        return random_prompt(self.prompt, 1), [random_prompt(self.prompt, 100 + i) for i in range(self.batch)]


@dataclass(frozen=True, slots=True)
class Timed:
    wall_s: float
    tokens: int  # prompt tokens for a prefill, generated tokens for a decode
    steps: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ms_step(self) -> float:
        return self.wall_s * 1000 / self.steps if self.steps else 0.0


# --- ignis, driven synchronously -------------------------------------------------------------

class Driver:
    """An EngineCore that is never started: this thread drains its inbox and runs its steps."""

    def __init__(self, checkpoint: Path, setup: Setup) -> None:
        self.setup = setup
        loaded = load_model(checkpoint, onednn_linears=True,  # as the engine service loads it
                            weight_dtype=setup.weight_dtype)
        kv_dtype = resolve_kv_dtype(setup.kv_dtype, loaded.model.dtype)
        page_bytes = loaded.config.state_shape().kv_bytes_per_page(PAGE, kv_dtype)
        if not page_bytes:
            raise ValueError("the model has no full-attention layer (a hybrid needs --layers >= 4)")
        pages = setup.batch * -(-(setup.prompt + setup.decode + setup.slack) // PAGE) + 4
        # Pacing off (the token budget alone): (a) is the whole prompt in one step, and (c)'s slack
        # assumes each step finishes about one prompt; paced chunks (engine/step_pacing.py) broke both.
        config = EngineConfig(page_size=PAGE, kv_dtype=setup.kv_dtype, kv_cache_bytes=pages * page_bytes,
                              max_num_seqs=setup.batch, prefill_chunk_tokens=setup.prompt, reuse_prompt=False,
                              step_time_target_ms=math.inf)
        self.core = EngineCore(loaded, Tokenizer.from_dir(checkpoint), config)
        self.updates: dict[str, list[RequestUpdate]] = {}
        self._next = 0

    def submit(self, prompts: list[tuple[int, ...]], max_tokens: int) -> list[str]:
        rids = []
        for prompt in prompts:
            self._next += 1
            rid = f"profile-{self._next}"
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            self.updates[rid] = []
            self.core.submit(EngineRequest(rid, prompt, params, lookup=False), self.updates[rid].append)
            rids.append(rid)
        return rids

    def generated(self, rid: str) -> int:
        return sum(len(d.token_ids) for u in self.updates[rid] for d in u.deltas)

    def done(self, rid: str) -> bool:
        for u in self.updates[rid]:
            if u.error:
                raise RuntimeError(f"request {rid} failed: {u.error}")
        return any(u.done for u in self.updates[rid])

    def run_until(self, cond: Callable[[], bool]) -> int:
        """Steps until `cond()`; returns how many ran."""
        steps = 0
        while not cond():
            self.core.drain_inbox()
            if not self.core.scheduler.has_work():
                raise RuntimeError("requests are unfinished but the engine has no work: this is a bug")
            self.core.step()
            steps += 1
        return steps

    def warm_up(self) -> None:
        """Short requests through prefill and batched decode, so first-call costs stay out of the figures."""
        rids = self.submit([random_prompt(32, i) for i in range(min(self.setup.batch, 2))], 4)
        self.run_until(lambda: all(self.done(r) for r in rids))

    def prefill(self, prompt: tuple[int, ...], around: Around = nullcontext) -> Timed:
        """(a) one request of the whole prompt and max_tokens=1: submit to done."""
        with around():
            start = time.perf_counter()
            [rid] = self.submit([prompt], 1)
            steps = self.run_until(lambda: self.done(rid))
            wall = time.perf_counter() - start
        return Timed(wall, len(prompt), steps)

    def decode_one(self, prompt: tuple[int, ...]) -> Timed:
        """(b) one request; only the steps after its first token are timed."""
        [rid] = self.submit([prompt], self.setup.decode)
        self.run_until(lambda: self.generated(rid) >= 1)
        before = self.generated(rid)
        start = time.perf_counter()
        steps = self.run_until(lambda: self.done(rid))
        return Timed(time.perf_counter() - start, self.generated(rid) - before, steps)

    def decode_batch(self, prompts: list[tuple[int, ...]], around: Around = nullcontext) -> Timed:
        """(c) B requests; once all have their first token, decode-1 steps with all B decoding are timed.

        Each asks for decode + slack tokens so none finishes inside the window; what is left is aborted.
        """
        rids = self.submit(prompts, self.setup.decode + self.setup.slack)
        self.run_until(lambda: all(self.generated(r) >= 1 for r in rids))
        totals = self.core.totals
        before, steps = totals.generated_tokens, self.setup.decode - 1
        with around():
            start = time.perf_counter()
            for _ in range(steps):
                self.core.step()
            wall = time.perf_counter() - start
        tokens = totals.generated_tokens - before
        if tokens != len(rids) * steps or any(self.done(r) for r in rids):
            raise RuntimeError(f"{tokens} tokens in {steps} steps of {len(rids)} sequences: not all decoded "
                               "every step (a sequence finished early: raise the slack)")
        for rid in rids:
            self.core.abort(rid)
        self.core.drain_inbox()
        self.core.check_integrity()
        return Timed(wall, tokens, steps)


def profiled(driver: Driver, run: Callable[[Around], Timed], unprofiled: Timed) -> dict[str, Any]:
    """Run again under the profiler with the scopes in place: breakdown, top ops, profiler overhead."""
    prof = profile(activities=[ProfilerActivity.CPU])

    @contextmanager
    def window() -> Iterator[None]:
        # The window's own scope: shares are taken on the profiler's clock, which runs ~0.5% apart
        # from time.perf_counter's, so its scopes would not add up to a perf_counter wall.
        with prof, record_function("ignis.window"):
            yield

    with scopes(driver.core.loaded.model):
        timed = run(window)
    wall_ms = scope_times(prof)[0]["ignis.window"]
    return {"wall_ms": wall_ms, "wall_ms_perf_counter": timed.wall_s * 1000,
            "unprofiled_wall_ms": unprofiled.wall_s * 1000,
            "overhead_pct": 100 * (timed.wall_s / unprofiled.wall_s - 1) if unprofiled.wall_s else 0.0,
            "breakdown": breakdown(prof, wall_ms), "top_ops": top_ops(prof, wall_ms)}


ROUNDS = 3  # each measurement, ignis and llama.cpp alternating: a load spike hits one round, not one side
PHASES = ("prefill", "decode_1", "decode_b")


def _median(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round whose `key` is the median (an odd count: a real round, not an average), with every
    round's `key` beside it."""
    ordered = sorted(results, key=lambda r: r[key])
    return {**ordered[len(ordered) // 2], "rounds": [r[key] for r in results]}


def run_both(checkpoint: Path, setup: Setup, peer: Peer | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """ROUNDS of (a), (b), (c) on each side in turn (the first side alternating by round), the
    median round of each; then ignis' (a) and (c) again under torch.profiler."""
    one, many = setup.prompts()
    threads = torch.get_num_threads()
    torch.set_num_threads(setup.threads)
    ours: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
    theirs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
    try:
        with torch.set_grad_enabled(False):
            driver = Driver(checkpoint, setup)
            driver.warm_up()
            mine: dict[str, Callable[[], Timed]] = {
                "prefill": lambda: driver.prefill(one), "decode_1": lambda: driver.decode_one(one),
                "decode_b": lambda: driver.decode_batch(many)}
            peers: dict[str, Callable[[], dict[str, Any]]] = {} if peer is None else {
                "prefill": lambda: peer.prefill(one), "decode_1": lambda: peer.decode_one(one),
                "decode_b": lambda: peer.decode_batch(many)}
            for r in range(ROUNDS):
                print(f"  round {r + 1}/{ROUNDS}: (a) prefill, (b) decode batch 1, (c) decode batch {setup.batch}"
                      f"{'' if peer is None else f', ignis and {PEER}'}", flush=True)
                for phase in PHASES:
                    sides = [functools.partial(lambda p: ours[p].append(_timed(mine[p]())), phase)]
                    if peer is not None:
                        sides.append(functools.partial(lambda p: theirs[p].append(peers[p]()), phase))
                    for side in sides if r % 2 == 0 else reversed(sides):
                        side()
            ignis = {phase: _median(ours[phase], "wall_s") for phase in PHASES}
            print("  ignis: (a) and (c) under torch.profiler", flush=True)
            prefill, decode_b = (Timed(ignis[k]["wall_s"], ignis[k]["tokens"], ignis[k]["steps"])
                                 for k in ("prefill", "decode_b"))
            ignis["profile_prefill"] = profiled(driver, lambda around: driver.prefill(one, around), prefill)
            ignis["profile_decode_b"] = profiled(driver, lambda around: driver.decode_batch(many, around), decode_b)
            ignis["host"] = host_facts(driver)  # right after a decode: the OpenMP team is where it ran
    finally:
        torch.set_num_threads(threads)
    if peer is None:
        return ignis, None
    keys = {"prefill": "prefill_ms", "decode_1": "ms_step", "decode_b": "ms_step"}  # lower is the median's order
    return ignis, {**peer.about, **{phase: _median(theirs[phase], keys[phase]) for phase in PHASES}}


def host_facts(driver: Driver) -> dict[str, Any]:
    """What ran where: the CPU, the OpenMP runtime and where this process's threads last ran, which
    path runs the linears at each row count, and which kernels the CPU's table holds (C or reference)."""
    host = cpu_host.describe()
    table = kernels_for(torch.device("cpu"))
    plan = driver.core.loaded.linear_plan
    return {"cpu": asdict(host), "summary": host.summary(),
            "threads": [asdict(t) for t in cpu_host.thread_placement()],
            "linear_plan": plan.summary() if plan is not None else "not packed: torch's F.linear (MKL)",
            "kernels": {"table": table.name,
                        "c": sorted(f.name for f in dataclasses.fields(table)
                                    if f.name != "name" and callable(getattr(table, f.name))
                                    and getattr(getattr(table, f.name), "func", None) is not None)}}


def streaming_read(nbytes: int, threads: int, repeats: int = 5) -> dict[str, float]:
    """The machine's limit for a decode step: a plain streaming read (a sum) of as many bytes as the
    model's weights, on the same threads; every decode step must read each weight once."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        buf.sum()  # faulted in, warm
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return {"bytes": float(nbytes), "gb_s": nbytes / best / 1e9, "floor_ms": best * 1000}


def _timed(t: Timed) -> dict[str, Any]:
    return {**asdict(t), "tok_s": t.tok_s, "ms_step": t.ms_step}


# --- llama.cpp ------------------------------------------------------------------------------

def _body(prompt: tuple[int, ...], n_predict: int) -> dict[str, Any]:
    # Greedy (top-k 1, no other sampler), no prompt cache, always n_predict tokens.
    return {"prompt": list(prompt), "n_predict": n_predict, "cache_prompt": False, "temperature": 0,
            "ignore_eos": True, "samplers": ["top_k"], "top_k": 1}


def _complete(http: httpx.Client, prompt: tuple[int, ...], n_predict: int) -> dict[str, Any]:
    reply = http.post("/completion", json=_body(prompt, n_predict))
    reply.raise_for_status()
    timings: dict[str, Any] = reply.json()["timings"]
    return timings


def _stream(http: httpx.Client, prompt: tuple[int, ...], n_predict: int
            ) -> tuple[list[tuple[float, int]], dict[str, Any]]:
    """(arrival time, tokens decoded so far) of each streamed chunk, and the final timings."""
    series: list[tuple[float, int]] = []
    timings: dict[str, Any] = {}
    with http.stream("POST", "/completion", json={**_body(prompt, n_predict), "stream": True}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: "):])
            series.append((time.perf_counter(), int(chunk.get("tokens_predicted", 0))))
            if chunk.get("stop"):
                timings = chunk.get("timings", {})
    return series, timings


def all_decoding_window(series: list[list[tuple[float, int]]]) -> tuple[float, int]:
    """(seconds, tokens) from the last slot's first token to the first slot's last: all B decoding."""
    start = max(next(t for t, n in s if n >= 1) for s in series)
    end = min(s[-1][0] for s in series)

    def decoded_at(s: list[tuple[float, int]], when: float) -> int:
        return max((n for t, n in s if t <= when), default=0)

    return end - start, sum(decoded_at(s, end) - decoded_at(s, start) for s in series)


class Peer:
    """A llama-server on the same GGUF, threads and batch, kept up for every round."""

    def __init__(self, setup: Setup, gguf: Path) -> None:
        from bench.peers import llama_cpp

        self.setup = setup
        self.n_predict_b = setup.decode + setup.slack
        ctx_size = setup.batch * (setup.prompt + setup.decode + max(64, setup.slack))
        workdir = llama_cpp.BUILD / f"profile-{setup.kind}"  # its log, beside the build (git-ignored)
        self.server = llama_cpp.launch_llama_server(workdir, gguf, threads=setup.threads, parallel=setup.batch,
                                                    ctx_size=ctx_size, cache_ram_mib=0)
        # A connection per request: llama-server drops a connection after a streamed reply although its
        # headers say keep-alive, and a request sent on it right after failed 13 times in 15 ("Server
        # disconnected without sending a response": (a) of round 2 follows (c) of round 1 on this side).
        self.http = httpx.Client(base_url=f"http://{self.server.address}", timeout=3600,
                                 limits=httpx.Limits(max_keepalive_connections=0))
        self.about = {"gguf": str(gguf), "threads": setup.threads, "parallel": setup.batch, "ctx_size": ctx_size}
        _complete(self.http, random_prompt(32, 0), 4)  # warm-up

    @classmethod
    def start(cls, checkpoint: Path, setup: Setup) -> Peer | str:
        """The running peer, or why there is none."""
        from bench.peers import llama_cpp  # imported here: --peer none needs none of it

        if not llama_cpp.is_built():  # building takes ~20 minutes: not this benchmark's job
            return "peer not built (python -m bench.peers.llama_cpp build)"
        try:
            llama_cpp.ensure_built()
            return cls(setup, llama_cpp.convert_to_gguf(checkpoint, setup.gguf_type))
        except llama_cpp.PeerUnavailable as e:
            return f"peer unavailable: {e}"

    def prefill(self, prompt: tuple[int, ...]) -> dict[str, Any]:
        t = _complete(self.http, prompt, 1)
        return {"tok_s": t["prompt_per_second"], "prefill_ms": t["prompt_ms"], "timings": t}

    def decode_one(self, prompt: tuple[int, ...]) -> dict[str, Any]:
        t = _complete(self.http, prompt, self.setup.decode)
        return {"tok_s": t["predicted_per_second"], "ms_step": t["predicted_per_token_ms"], "timings": t}

    def decode_batch(self, prompts: list[tuple[int, ...]]) -> dict[str, Any]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            streamed = list(pool.map(lambda p: _stream(self.http, p, self.n_predict_b), prompts))
        window_s, window_tokens = all_decoding_window([s for s, _ in streamed])
        timings = [t for _, t in streamed]
        # The brief's figure from the timings: it counts decode steps that overlap other slots' prefill.
        n, ms = sum(t["predicted_n"] for t in timings), max(t["predicted_ms"] for t in timings)
        steps = window_tokens / len(prompts)
        return {"tok_s": window_tokens / window_s if window_s > 0 else 0.0,
                "ms_step": window_s * 1000 / steps if steps else 0.0,
                "window_s": window_s, "window_tokens": window_tokens, "n_predict": self.n_predict_b,
                "timings_tok_s": n / ms * 1000 if ms else 0.0, "timings": timings}

    def close(self) -> None:
        self.http.close()
        self.server.stop()


# --- report -----------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "—"


def _num(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"  # no 9.28e+03 for a rate


def machine_section(host: dict[str, Any] | None) -> list[str]:
    """The CPU, OpenMP runtime, thread placement, linear path and C kernels of ignis' side (issue 50:
    two machines' reports are only comparable with these)."""
    if host is None:
        return []
    places = ", ".join(f"{t['name']} on CPU {t['cpu']}" for t in host["threads"])
    return ["## Machine", "", f"- {host['summary']}", f"- threads after a decode step: {places}",
            f"- {host['linear_plan']}",
            f"- C kernels loaded (kernels/cpu/, `make kernels`; the line above says whether linear_rows runs): "
            f"{', '.join(host['kernels']['c']) or 'none'}; the rest are the torch references", ""]


def render(setup: Setup, ignis: dict[str, Any], peer: dict[str, Any], loads: dict[str, list[float]]) -> str:
    b = setup.batch
    have_peer = "unavailable" not in peer
    p = peer if have_peer else {"prefill": {}, "decode_1": {}, "decode_b": {}}

    def cells(label: str, phase: str, key: str) -> list[Any]:
        mine, theirs = ignis[phase][key], p[phase].get(key)
        return [label, _num(mine), _num(theirs), _ratio(mine, theirs)]

    load_line = ", ".join(f"{side} {v[0]:.2f} → {v[1]:.2f}" for side, v in loads.items())
    spread = ", ".join(f"{phase} {_num(min(ignis[phase]['rounds']) * 1000)}–{_num(max(ignis[phase]['rounds']) * 1000)} ms"
                       for phase in PHASES if "rounds" in ignis[phase])
    out = [f"# Profile, {setup.kind}: hidden {setup.hidden}, {setup.layers} layers, {setup.threads} threads, "
           f"prompt {setup.prompt}, decode {setup.decode}, batch {b}, ignis KV dtype {setup.kv_dtype}, "
           f"weights {setup.weight_dtype} ({PEER}: a {setup.gguf_type} GGUF, f16 KV)",
           "", f"1-minute load average before → after: {load_line}", "", *machine_section(ignis.get("host")),
           "## Rates", "",
           f"Each figure is the median of {ROUNDS} rounds, ignis and {PEER} alternating (which goes first "
           f"alternates by round), so a load spike lands in one round rather than on one side. ignis' "
           f"rounds, wall: {spread}.", "",
           table.markdown(["", "ignis", PEER, f"ignis/{PEER}"], [
               cells(f"prefill tok/s (1 seq, {setup.prompt} tokens)", "prefill", "tok_s"),
               cells("decode tok/s, batch 1", "decode_1", "tok_s"),
               cells("decode ms/step, batch 1", "decode_1", "ms_step"),
               cells(f"decode tok/s, batch {b} (aggregate)", "decode_b", "tok_s"),
               cells(f"decode ms/step, batch {b}", "decode_b", "ms_step")]), ""]
    bw = ignis.get("bandwidth")
    if bw is not None:
        floors = [bw["floor_ms"], bw.get("floor_ms_b", bw["floor_ms"])]
        theirs = [p[k].get("ms_step") for k in ("decode_1", "decode_b")]
        if setup.kind == "moe":
            lead = (f"Memory bandwidth: a streaming read runs at {bw['gb_s']:.1f} GB/s ({setup.threads} threads). "
                    f"An MoE decode step reads all weights but the experts, and of those only the ones its tokens "
                    f"are routed to (uniform routing assumed): {bw['bytes'] / 2**20:.0f} MiB at batch 1, "
                    f"{bw['bytes_b'] / 2**20:.0f} MiB at batch {b}, which take {floors[0]:.1f} and "
                    f"{floors[1]:.1f} ms, the least those steps can take. Each side's step against its floor "
                    "(floor / ms per step):")
        else:
            lead = (f"Memory bandwidth: a streaming read of the weights' {bw['bytes'] / 2**20:.0f} MiB takes "
                    f"{floors[0]:.1f} ms ({bw['gb_s']:.1f} GB/s, {setup.threads} threads), the least any decode "
                    "step can take. Each side's step against that floor (floor / ms per step):")
        out += [lead, "", table.markdown(["", "ignis", PEER], [
            ["batch 1", _num(floors[0] / ignis["decode_1"]["ms_step"]),
             _num(floors[0] / theirs[0] if theirs[0] else None)],
            [f"batch {b}", _num(floors[1] / ignis["decode_b"]["ms_step"]),
             _num(floors[1] / theirs[1] if theirs[1] else None)]]), ""]
    if have_peer:
        d = peer["decode_b"]
        out.append(
            f"tok/s: higher is better (ratio > 1: ignis faster); ms/step: lower is better (ratio > 1: ignis "
            f"slower). Decode excludes the first token (it comes from the prefill) on both sides. ignis batch "
            f"{b}: {setup.decode - 1} steps with all {b} sequences decoding. {PEER} prefill: its timings' "
            f"prompt_per_second; batch 1: predicted_per_second ((predicted_n − 1) / predicted_ms in this "
            f"version). {PEER} batch {b}: {b} concurrent streamed requests of n_predict {d['n_predict']}; "
            f"tokens decoded from the last slot's first token to the first slot's last ({d['window_tokens']} "
            f"tokens in {d['window_s'] * 1000:.0f} ms), ms/step = window / (tokens / {b}). Its timings give "
            f"sum(predicted_n) / max(predicted_ms) = {d['timings_tok_s']:.3g} tok/s, which also counts steps "
            f"that overlap other slots' prefill.")
    else:
        out.append(f"**{PEER}: {peer['unavailable']}**")
    for name, key in ((f"prefill (1 × {setup.prompt} tokens)", "profile_prefill"),
                      (f"decode batch {b} ({setup.decode - 1} steps)", "profile_decode_b")):
        prof = ignis[key]
        out += ["", f"## ignis breakdown: {name}", "",
                f"Profiled wall {prof['wall_ms']:.1f} ms on the profiler's clock ({prof['wall_ms_perf_counter']:.1f} "
                f"ms by perf_counter); unprofiled {prof['unprofiled_wall_ms']:.1f} ms (profiler overhead "
                f"{prof['overhead_pct']:+.0f}%). Leaf rows (——, and the last) partition "
                f"the profiled wall; each scope's time excludes the scopes nested in it.", "",
                table.markdown(["category", "ms", "% of profiled wall"],
                               [[r["category"], r["ms"], r["pct"]] for r in prof["breakdown"]])]
    for name, key in (("prefill", "profile_prefill"), (f"decode batch {b}", "profile_decode_b")):
        out += ["", f"## top aten ops by self CPU time: {name}", "",
                table.markdown(["op", "calls", "self ms", "% of profiled wall"],
                               [[o["op"], o["calls"], o["self_ms"], o["pct"]] for o in ignis[key]["top_ops"]])]
    return "\n".join(out)


def weight_bytes(checkpoint: Path) -> int:
    """The checkpoint's weights as stored (fp32 here)."""
    return sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))


def step_bytes(checkpoint: Path, setup: Setup) -> tuple[int, int]:
    """Bytes of weights a decode step at batch 1 and at batch B streams. A dense step reads every
    weight (bf16 linears: about half the fp32 file, they are nearly all of it); an MoE step reads all
    but the experts, and of those the ones its tokens are routed to: with top-k of E and uniform
    routing, a share 1 - (1 - k/E)^n of them for n tokens."""
    stored = weight_bytes(checkpoint)
    if setup.kind != "moe":
        whole = stored // 2 if setup.weight_dtype == "bfloat16" else stored
        return whole, whole
    config = load_config(checkpoint)
    per_layer = 3 * config.num_experts * config.hidden_size * config.moe_intermediate_size * 4  # fp32
    experts = per_layer * sum(config.is_moe_layer(i) for i in range(config.num_layers))

    def reads(n: int) -> int:
        return stored - experts + round(experts * (1 - (1 - config.num_experts_per_tok / config.num_experts) ** n))

    return reads(1), reads(setup.batch)


def profile_kind(setup: Setup, peer: str, out: Path, models: Path | None) -> Path:
    checkpoint = ensure_geometry(setup.kind, setup.hidden, setup.layers, root=models)
    print(f"\n== profile, {setup.kind}: {checkpoint}", flush=True)
    before = os.getloadavg()[0]
    started = Peer.start(checkpoint, setup) if peer == PEER else "not run (--peer none)"
    try:
        ignis, measured = run_both(checkpoint, setup, started if isinstance(started, Peer) else None)
    finally:
        if isinstance(started, Peer):
            started.close()
    one, many = step_bytes(checkpoint, setup)
    bandwidth = streaming_read(one, setup.threads)
    ignis["bandwidth"] = {**bandwidth, "bytes_b": float(many), "floor_ms_b": many / bandwidth["gb_s"] / 1e6}
    loads = {"both sides": [before, os.getloadavg()[0]]}
    peer_result = measured if measured is not None else {"unavailable": started}
    text = render(setup, ignis, peer_result, loads)
    print(text, flush=True)
    payload = {"setup": asdict(setup), "checkpoint": str(checkpoint), "ignis": ignis, "peer": peer_result,
               "loadavg_1m": loads}
    return table.save(setup.name, payload, text, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="dense,hybrid", help=f"comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--peer", choices=[PEER, "none"], default=PEER)
    parser.add_argument("--kv-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="engine.kv_dtype of ignis' cache (results: profile-<kind>-kv-<dtype> unless auto)")
    parser.add_argument("--weight-dtype", choices=["auto", "bfloat16"], default="auto",
                        help="engine.weight_dtype of ignis' linears; bfloat16 also gives llama.cpp a bf16 GGUF "
                             "(results: ...-w-bfloat16)")
    parser.add_argument("--out", type=Path, default=table.RESULTS,
                        help="where profile-<kind>.{json,md} go (bench/results/: the .json in raw/)")
    parser.add_argument("--models", type=Path, default=None, help="checkpoint cache (default: ignis' own)")
    a = parser.parse_args(argv)
    for kind in a.kind.split(","):
        setup = Setup(kind.strip(), a.hidden, a.layers, a.threads, a.prompt, a.decode, a.batch, a.kv_dtype,
                      a.weight_dtype)
        print(f"wrote {profile_kind(setup, a.peer, a.out, a.models)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
