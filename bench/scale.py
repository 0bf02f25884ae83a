"""`python -m bench.scale`: several engines behind one gateway, by routing rule, then one engine killed.

    python -m bench.scale [--engines 2,3] [--rules round-robin,affinity,bounded] [--agents 8 --turns 5
        --head-tokens 1024 --slots 2 --hidden 512 --layers 6 --threads 1] [--smoke] [--out DIR]

For each engine count and rule it starts that many engines (a small dense
geometry, bench/geometry.py; `--slots` sequences each, fewer than the swarm's
agents) behind one gateway with `--routing RULE`, runs the seeded agent-swarm
trace (bench/workload.py), and reports the reuse ratio, later-turn TTFT p50/p95,
requests per minute and the requests each engine finished (its own
`ignis_requests` counter). Engines are started afresh for every run: no rule
inherits another's caches. `--repeats N` runs every rule N times, interleaved,
and shows each figure's median (the machine's load drifts; one run of a few
seconds is noisy).

Then, with the most engines and the default rule, the trace runs again and one
engine is killed (SIGKILL) in the middle of a round (half of the agents' turns
of the middle round done, the other half in flight): requests that failed
before their first token (the target is 0: the gateway retries those; the
table says how many were in flight on the engine when it died), after
it (a stream cut mid-way is the client's to see), and the time
from the kill until the gateway stops routing to that engine (its
`ignis_gateway_engine_up` falls to 0).

Writes `scale.md` to --out and `scale.json` beside it (in raw/ when --out is bench/results/, bench/table.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.geometry import ensure_geometry
from common.launch import Service, free_port, grpc_serving, launch, launch_gateway
from bench.swarm_stats import summarize
from bench.table import RESULTS, markdown, save
from bench.workload import (Message, RequestRecord, Trace, WorkloadConfig, chat_chunks, chunk_text, make_trace,
                            run_trace)
from engine.text.tokenizer import Tokenizer

MODEL = "bench-model"
RULES = ["round-robin", "affinity", "bounded"]
HEADERS = ["engines", "routing", "reuse ratio", "later-turn TTFT p50 (s)", "later-turn TTFT p95 (s)",
           "requests/min", "requests per engine"]
KILL_HEADERS = ["engines", "routing", "requests", "in flight on it at the kill", "failed before first token",
                "failed after first token",
                "kill -> out of routing (s)", "requests per engine"]


@dataclass(frozen=True, slots=True)
class Stack:
    engines: list[Service]
    gateway: Service

    def stop(self) -> None:
        for s in [self.gateway, *self.engines]:
            s.stop()


def start_stack(checkpoint: Path, count: int, rule: str, args: argparse.Namespace, workdir: Path) -> Stack:
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    engines: list[Service] = []
    try:
        for i in range(count):
            metrics = free_port()
            service = launch(f"engine{i}", "engine",
                             ["--model", str(checkpoint), "--served-model-name", MODEL, "--max-num-seqs",
                              str(args.slots), "--kv-cache-bytes", args.kv_cache, "--metrics-port", str(metrics),
                              "--set", f"reuse.retained_device={args.retained}"],
                             workdir / f"engine{i}", grpc_serving, env=env)
            service.extra["metrics"] = metrics
            engines.append(service)
        gateway = launch_gateway(workdir / "gateway", [e.address for e in engines], ["--routing", rule])
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return Stack(engines, gateway)


def finished_requests(engine: Service) -> int | None:
    """The engine's own count of requests it finished (any reason), from its /metrics; None once it is gone."""
    try:
        text = httpx.get(f"http://127.0.0.1:{engine.extra['metrics']}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return int(sum(float(v) for v in re.findall(r"^ignis_requests_total\{[^}]*\} (\S+)$", text, re.M)))


def in_flight(engine: Service) -> int | None:
    """Requests waiting or running on the engine now (its ignis_requests_waiting + _running gauges)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{engine.extra['metrics']}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return int(sum(float(v) for v in re.findall(r"^ignis_requests_(?:waiting|running)\{[^}]*\} (\S+)$", text, re.M)))


def engine_up(gateway: Service, address: str) -> float | None:
    text = httpx.get(f"http://{gateway.address}/metrics", timeout=5).text
    match = re.search(rf'^ignis_gateway_engine_up\{{engine="{re.escape(address)}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


async def _warm_up(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Warm up, please."}], "max_tokens": 2}
        (await http.post("/chat/completions", json=body)).raise_for_status()


def run_rule(checkpoint: Path, trace: Trace, count: int, rule: str, args: argparse.Namespace, workdir: Path
             ) -> dict[str, Any]:
    stack = start_stack(checkpoint, count, rule, args, workdir)
    try:
        base = f"http://{stack.gateway.address}/v1"
        asyncio.run(_warm_up(base))  # one engine's first-call costs, outside the figures
        before = [finished_requests(e) for e in stack.engines]
        records, wall = asyncio.run(run_trace(base, MODEL, trace, rule, progress=args.progress))
        per_engine = _since(stack.engines, before, len(records))
    finally:
        stack.stop()
    return {"engines": count, "rule": rule, "summary": summarize(records, wall), "per_engine": per_engine,
            "records": [asdict(r) for r in records]}


def _since(engines: list[Service], before: list[int | None], expected: int = 0) -> list[int | None]:
    """Requests each engine finished since `before`; None for one that is gone (the killed one). Read
    again for a few seconds until they add up to `expected` (an engine counts a request just after its
    last message)."""
    deadline = time.monotonic() + 5
    while True:
        now = [finished_requests(e) for e in engines]
        counts = [None if n is None or b is None else n - b for n, b in zip(now, before)]
        if sum(c or 0 for c in counts) >= expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def combine(count: int, rule: str, reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from several runs of a rule: the median of each figure, requests per engine summed."""
    summary: dict[str, Any] = {}
    for key in reps[0]["summary"]:
        values = [r["summary"][key] for r in reps if r["summary"][key] is not None]
        summary[key] = statistics.median(values) if values else None
    per_engine = [sum(r["per_engine"][i] or 0 for r in reps) for i in range(count)]
    return {"engines": count, "rule": rule, "summary": summary, "per_engine": per_engine,
            "repeats": [{k: r[k] for k in ("summary", "per_engine", "records")} for r in reps]}


# ------------------------------------------------------------------ the kill


@dataclass(slots=True)
class KillRun:
    requests: int = 0
    done: int = 0
    failed_before_first: int = 0
    failed_after_first: int = 0
    victim_in_flight: int | None = None  # waiting + running on the engine about to be killed
    killed_at: float | None = None  # time.monotonic() of the SIGKILL
    errors: list[str] = field(default_factory=list)


async def _one(http: httpx.AsyncClient, messages: list[Message], config: WorkloadConfig, run: KillRun) -> str:
    """One streamed request that records, rather than raises, how it failed."""
    body = {"model": MODEL, "messages": messages, "max_tokens": config.max_tokens, "temperature": 0,
            "seed": config.seed, "stream": True}
    text, first = "", False
    run.requests += 1
    try:
        async for chunk in chat_chunks(http, body):
            piece = chunk_text(chunk)
            first = first or bool(piece)
            text += piece
        run.done += 1
    except (RuntimeError, httpx.HTTPError) as err:
        if first:
            run.failed_after_first += 1
        else:
            run.failed_before_first += 1
        run.errors.append(f"{type(err).__name__}: {err}"[:300])
    return text


async def _trace_with_kill(base_url: str, trace: Trace, victim: Service, kill_after: int, run: KillRun) -> float:
    """The trace's rounds (as run_trace), the victim killed once `kill_after` requests are done; the kill time."""
    config = trace.config
    replies: list[list[str]] = [[] for _ in range(config.agents)]
    bursts = {b.after_round: b for b in trace.bursts}
    killed_at = 0.0

    async def watch() -> None:
        nonlocal killed_at
        while run.done + run.failed_before_first + run.failed_after_first < kill_after:
            await asyncio.sleep(0.01)
        run.victim_in_flight = await asyncio.to_thread(in_flight, victim)  # a scrape (ms) before the kill
        victim.process.send_signal(signal.SIGKILL)
        killed_at = run.killed_at = time.monotonic()

    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        killer = asyncio.create_task(watch())

        async def turn(agent: int) -> None:
            replies[agent].append(await _one(http, trace.conversation(agent, replies[agent]), config, run))

        for rnd in range(config.turns):
            await asyncio.gather(*(turn(a) for a in range(config.agents)))
            if rnd in bursts:
                await asyncio.gather(*(_one(http, trace.first_messages(t), config, run) for t in bursts[rnd].tasks))
        await killer  # the kill happens even if the trace ended first (a slow scrape): then nothing was in flight
    return killed_at


def run_kill(checkpoint: Path, trace: Trace, count: int, rule: str, args: argparse.Namespace, workdir: Path
             ) -> dict[str, Any]:
    stack = start_stack(checkpoint, count, rule, args, workdir)
    run = KillRun()
    try:
        base = f"http://{stack.gateway.address}/v1"
        asyncio.run(_warm_up(base))
        before = [finished_requests(e) for e in stack.engines]
        victim = stack.engines[0]
        moved: list[float] = []

        async def main() -> None:
            config = trace.config  # mid-round: half of the middle round's turns done, half in flight
            done_before = config.agents * (config.turns // 2) + sum(
                len(b.tasks) for b in trace.bursts if b.after_round < config.turns // 2)
            kill_after = done_before + max(config.agents // 2, 1)
            trace_task = asyncio.create_task(_trace_with_kill(base, trace, victim, kill_after, run))
            while victim.process.poll() is None:  # the trace kills it, at the latest once it is over
                if trace_task.done() and trace_task.exception() is not None:
                    await trace_task  # raises what went wrong
                await asyncio.sleep(0.005)
            start = run.killed_at or time.monotonic()
            while await asyncio.to_thread(engine_up, stack.gateway, victim.address) != 0.0:
                if time.monotonic() - start > 60:
                    break  # never left routing: the table says "-"
                await asyncio.sleep(0.01)
            else:
                moved.append(time.monotonic() - start)
            await trace_task

        asyncio.run(main())
        per_engine = _since(stack.engines, before)
    finally:
        stack.stop()
    return {"engines": count, "rule": rule, "requests": run.requests, "done": run.done,
            "victim_in_flight": run.victim_in_flight, "failed_before_first_token": run.failed_before_first, "failed_after_first_token": run.failed_after_first,
            "kill_to_out_of_routing_s": moved[0] if moved else None, "per_engine": per_engine,
            "errors": run.errors[:20]}


# ------------------------------------------------------------------ the table


def _per_engine(counts: list[int | None]) -> str:
    return " / ".join("killed" if c is None else str(c) for c in counts)


def table(runs: list[dict[str, Any]], kill: dict[str, Any] | None) -> str:
    rows = [[r["engines"], r["rule"], r["summary"]["reuse_ratio"], r["summary"]["later_turn_ttft_p50_s"],
             r["summary"]["later_turn_ttft_p95_s"], r["summary"]["requests_per_min"], _per_engine(r["per_engine"])]
            for r in runs]
    text = markdown(HEADERS, [["-" if v is None else v for v in row] for row in rows])
    ratios = []
    for count in sorted({r["engines"] for r in runs}):
        by_rule = {r["rule"]: r["summary"] for r in runs if r["engines"] == count}
        if "bounded" in by_rule and "affinity" in by_rule:
            b, a = by_rule["bounded"], by_rule["affinity"]
            reuse = b["reuse_ratio"] / a["reuse_ratio"] if a["reuse_ratio"] else None
            rate = b["requests_per_min"] / a["requests_per_min"] if a["requests_per_min"] else None
            ratios.append(f"{count} engines, bounded / affinity: reuse ratio "
                          f"{'-' if reuse is None else f'{reuse:.3f}'} (target >= 0.95), throughput "
                          f"{'-' if rate is None else f'{rate:.2f}'}x (target >= 1.3x)")
    if ratios:
        text += "\n\n" + "\n".join(f"- {line}" for line in ratios)
    if kill is not None:
        moved = kill["kill_to_out_of_routing_s"]
        text += "\n\nOne engine killed (SIGKILL) in the middle of a round, bounded routing:\n\n" + markdown(
            KILL_HEADERS, [[kill["engines"], kill["rule"], kill["requests"],
                            "-" if kill["victim_in_flight"] is None else kill["victim_in_flight"],
                            kill["failed_before_first_token"],
                            kill["failed_after_first_token"], "-" if moved is None else moved,
                            _per_engine(kill["per_engine"])]])
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="2,3", help="comma-separated engine counts")
    parser.add_argument("--rules", default=",".join(RULES), help="comma-separated: " + ", ".join(RULES))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="per engine")
    parser.add_argument("--slots", type=int, default=2, help="sequences per engine (fewer than the agents)")
    parser.add_argument("--kv-cache", default="64MiB", help="each engine's KV page pool")
    parser.add_argument("--retained", type=int, default=8, help="each engine's reuse.retained_device")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--head-tokens", type=int, default=1024)
    parser.add_argument("--task-tokens", type=int, default=32)
    parser.add_argument("--message-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--burst-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every rule, interleaved; the table shows each figure's median")
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="skip the engine kill")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (2 engines, 3 agents x 2 turns, head 128; for the test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    if args.smoke:
        args.engines, args.agents, args.turns, args.head_tokens, args.burst_size = "2", 3, 2, 128, 2
        args.hidden, args.layers, args.max_tokens, args.progress = 128, 2, 4, False
    counts = [int(c) for c in args.engines.split(",")]
    rules = [r.strip() for r in args.rules.split(",")]
    if any(r not in RULES for r in rules) or not counts or min(counts) < 1 or args.repeats < 1:
        parser.error(f"--rules takes {', '.join(RULES)}; --engines takes counts >= 1; --repeats >= 1")
    config = WorkloadConfig(agents=args.agents, turns=args.turns, head_tokens=args.head_tokens,
                            task_tokens=args.task_tokens, message_tokens=args.message_tokens,
                            max_tokens=args.max_tokens, burst_every=2, burst_size=args.burst_size, seed=args.seed)
    checkpoint = ensure_geometry("dense", args.hidden, args.layers)
    tokenizer = Tokenizer.from_dir(checkpoint)
    trace = make_trace(config, lambda text: len(tokenizer.encode(text)))
    print(f"== scale: {config.agents} agents x {config.turns} turns + {len(trace.bursts)} bursts of "
          f"{config.burst_size} ({trace.request_count()} requests), head {config.head_tokens} tokens, engines "
          f"{counts}, {args.slots} slots and {args.threads} thread(s) each, rules {rules}", flush=True)
    runs: list[dict[str, Any]] = []
    kill: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="ignis-scale-") as scratch:
        # Interleaved (every rule once, then again): a machine whose load drifts weighs on every rule alike.
        repeats: dict[tuple[int, str], list[dict[str, Any]]] = {(c, r): [] for c in counts for r in rules}
        for i in range(args.repeats):
            for count in counts:
                for rule in rules:
                    one = run_rule(checkpoint, trace, count, rule, args, Path(scratch) / f"{count}-{rule}-{i}")
                    repeats[(count, rule)].append(one)
                    s = one["summary"]
                    print(f"{count} engines, {rule} (run {i + 1}/{args.repeats}): reuse {s['reuse_ratio']:.3f}, "
                          f"{s['requests_per_min']:.1f} req/min, per engine {one['per_engine']}", flush=True)
        runs = [combine(count, rule, reps) for (count, rule), reps in repeats.items()]
        if args.kill:
            kill_rule = "bounded" if "bounded" in rules else rules[-1]
            kill = run_kill(checkpoint, trace, max(counts), kill_rule, args, Path(scratch) / "kill")
    title = (f"### Scale-out: {', '.join(map(str, counts))} engines behind one gateway (dense, hidden {args.hidden}, "
             f"{args.layers} layers, CPU fp32, {args.threads} thread(s) and {args.slots} slots per engine): "
             f"{config.agents} agents x {config.turns} turns + {len(trace.bursts)} bursts of {config.burst_size}, "
             f"head {config.head_tokens} tokens, replies of {config.max_tokens} tokens"
             + (f"; median of {args.repeats} interleaved runs" if args.repeats > 1 else "")
             + (", smoke" if args.smoke else ""))
    text = title + "\n\n" + table(runs, kill) + (
        f"\n\nMachine load (1 min) at the end: {os.getloadavg()[0]:.1f}; requests per engine: each engine's own "
        "`ignis_requests` counter.")
    print(text, flush=True)
    payload = {"workload": asdict(config), "counts": counts, "rules": rules, "repeats": args.repeats,
               "threads": args.threads,
               "slots": args.slots, "hidden": args.hidden, "layers": args.layers, "runs": runs, "kill": kill}
    print(f"wrote {save('scale', payload, text, args.out)} (.md in {args.out})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "table", "HEADERS", "KILL_HEADERS", "RULES", "RequestRecord"]
