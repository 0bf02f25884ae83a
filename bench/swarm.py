"""`python -m bench.swarm`: an agent swarm on ignis and on llama.cpp's llama-server, same model, same machine.

    python -m bench.swarm --peer llama.cpp|none [--kind dense,hybrid] [--agents 8 --turns 8
        --head-tokens 2048 --hidden 1024 --layers 16 --threads N] [--out DIR]

For each model kind it writes the benchmark checkpoint (bench/geometry.py), starts
ignis (engine + gateway, optionally a tierstore) and runs the trace of
bench/workload.py, stops it; then starts llama-server on the GGUF of the same
checkpoint (converted by llama.cpp's own converter at the same precision) and
runs the same trace, stops it. Both get the same thread count and the same
number of slots (the trace's concurrency); llama-server's per-slot context is
sized to hold the longest conversation, and its prompt cache (`--cache-ram`)
is on. Where the peer cannot be built, ignis runs alone and the table says so.

Writes `swarm-<kind>.md` and `.png` (TTFT per turn) to --out and `swarm-<kind>.json` beside them (in raw/
when --out is bench/results/, bench/table.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.geometry import ensure_geometry
from common.launch import Service, grpc_serving, launch, launch_gateway
from bench.swarm_stats import plot, ratios, summarize, table
from bench.table import RESULTS, save
from bench.workload import RequestRecord, Trace, WorkloadConfig, make_trace, run_trace, stream_chat
from engine.model.config import parse_config
from engine.text.tokenizer import Tokenizer

MODEL = "bench-model"
PAGE = 16
PEER = "llama.cpp"


@dataclass(frozen=True, slots=True)
class Setup:
    """What both servers are given: threads, slots, and the context a slot must hold."""
    threads: int
    slots: int
    slot_tokens: int  # the longest conversation of the trace plus its reply, with a margin
    tierstore: bool


def slot_tokens(trace: Trace, tokenizer: Tokenizer) -> int:
    """Tokens of the longest agent conversation (replies taken as max_tokens one-token words), +10% and a page."""
    config = trace.config
    reply = " ".join(["word"] * config.max_tokens)
    longest = max(len(tokenizer.render_chat(trace.conversation(a, [reply] * (config.turns - 1)))[1])
                  for a in range(config.agents))
    return math.ceil((longest + config.max_tokens) * 1.1 / 256) * 256


async def _warm_up(base_url: str, config: WorkloadConfig) -> None:
    """One short unrelated request: first-call costs (allocation, kernels) stay out of the trace's figures."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as http:
        await stream_chat(http, MODEL, [{"role": "user", "content": "Warm up, please."}],
                          WorkloadConfig(max_tokens=2, seed=config.seed))


def _run_on(base_url: str, trace: Trace, server: str, progress: bool
            ) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    """Warm up, run the trace; with the machine's load around it (the servers share its cores with
    whatever else runs: a busy machine shows in the figures, llama.cpp's spinning threads most)."""
    asyncio.run(_warm_up(base_url, trace.config))
    before = os.getloadavg()[0]
    records, wall = asyncio.run(run_trace(base_url, MODEL, trace, server, progress=progress))
    return records, wall, {"loadavg_1m_before": before, "loadavg_1m_after": os.getloadavg()[0]}


def run_ignis(checkpoint: Path, trace: Trace, setup: Setup, workdir: Path, progress: bool
              ) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    config = trace.config
    model_config = parse_config(json.loads((checkpoint / "config.json").read_text()))
    # Room for every slot's live conversation and as much again for retained states (a fair
    # operator sizes the pool to the swarm, as llama-server's context is sized to its slots).
    pages = 2 * setup.slots * math.ceil(setup.slot_tokens / PAGE) + 64
    kv_bytes = pages * model_config.state_shape().kv_bytes_per_page(PAGE, torch.float32)
    # Two checkpoints per conversation (agents and the latest burst's subagents), the head, spares.
    retained = 2 * (config.agents + config.burst_size) + 2
    args = ["--served-model-name", MODEL, "--max-num-seqs", str(setup.slots), "--page-size", str(PAGE),
            "--kv-cache-bytes", str(kv_bytes), "--set", f"reuse.retained_device={retained}"]
    env = {"OMP_NUM_THREADS": str(setup.threads), "MKL_NUM_THREADS": str(setup.threads)}
    services: list[Service] = []
    try:
        if setup.tierstore:
            store = launch("tierstore", "tierstore", ["--host", "127.0.0.1", "--kv-host-pool-bytes", "4GiB",
                                                      "--kv-disk-path", str(workdir / "kv-disk"),
                                                      "--kv-disk-bytes", "8GiB"], workdir, grpc_serving)
            services.append(store)
            args += ["--tierstore", store.address]
        engine = launch("engine", "engine", ["--model", str(checkpoint), *args], workdir, grpc_serving, env=env)
        services.append(engine)
        gateway = launch_gateway(workdir, [engine.address])
        services.append(gateway)
        records, wall, load = _run_on(f"http://{gateway.address}/v1", trace, "ignis", progress)
    finally:
        for service in reversed(services):
            service.stop()
    return records, wall, {"engine_args": args, "env": env, "kv_cache_bytes": kv_bytes, **load}


def run_peer(checkpoint: Path, trace: Trace, setup: Setup, workdir: Path, progress: bool
             ) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    from bench.peers import llama_cpp  # imported here: --peer none needs none of it

    llama_cpp.ensure_built()
    gguf = llama_cpp.convert_to_gguf(checkpoint, "f32")
    ctx = setup.slots * setup.slot_tokens
    # The prompt cache in host RAM: room for every slot's conversation several times over.
    cache_ram_mib = 4096
    server = llama_cpp.launch_llama_server(workdir, gguf, threads=setup.threads, parallel=setup.slots,
                                           ctx_size=ctx, cache_ram_mib=cache_ram_mib)
    try:
        records, wall, load = _run_on(f"http://127.0.0.1:{server.port}/v1", trace, PEER, progress)
    finally:
        server.stop()
    return records, wall, {"gguf": str(gguf), "threads": setup.threads, "parallel": setup.slots,
                           "ctx_size": ctx, "cache_ram_mib": cache_ram_mib, **load}


def settings_note(settings: dict[str, Any]) -> str:
    """What each server was given, and the machine's load while it ran (shared cores skew figures)."""
    lines = []
    if "ignis" in settings:
        i = settings["ignis"]
        lines.append(f"ignis: `{' '.join(i['engine_args'][2:])}`, OMP_NUM_THREADS={i['env']['OMP_NUM_THREADS']}, "
                     f"load {i['loadavg_1m_before']:.1f} -> {i['loadavg_1m_after']:.1f}")
    if PEER in settings:
        p = settings[PEER]
        lines.append(f"{PEER}: `--threads {p['threads']} --parallel {p['parallel']} --ctx-size {p['ctx_size']} "
                     f"--kv-unified --cache-ram {p['cache_ram_mib']}`, load {p['loadavg_1m_before']:.1f} -> "
                     f"{p['loadavg_1m_after']:.1f}")
    return "Settings (load: the 1-minute load average before -> after the trace):\n\n" + "\n".join(
        f"- {line}" for line in lines)


def peer_unavailable(err: BaseException) -> str | None:
    """Why the peer cannot run here (its module missing, or its PeerUnavailable), else None."""
    if isinstance(err, ModuleNotFoundError) and (err.name or "").startswith("bench.peers"):
        return f"not run: {err.name} is missing"
    if type(err).__name__ == "PeerUnavailable":
        return f"not run: {err}"
    return None


def bench_kind(kind: str, args: argparse.Namespace, config: WorkloadConfig, out: Path) -> bool:
    """Run one model kind on both servers; writes the results; False if a server failed."""
    checkpoint = ensure_geometry(kind, args.hidden, args.layers)
    tokenizer = Tokenizer.from_dir(checkpoint)
    trace = make_trace(config, lambda text: len(tokenizer.encode(text)))
    setup = Setup(args.threads, config.concurrency, slot_tokens(trace, tokenizer), args.tierstore)
    head = len(tokenizer.render_chat(trace.first_messages("")[:1], add_generation_prompt=False)[1])
    print(f"\n== swarm, {kind} (hidden {args.hidden}, {args.layers} layers): {config.agents} agents x "
          f"{config.turns} turns, {len(trace.bursts)} bursts of {config.burst_size}, head {head} tokens, "
          f"{setup.threads} threads, {setup.slots} slots of {setup.slot_tokens} tokens", flush=True)
    series: dict[str, list[RequestRecord]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    settings: dict[str, Any] = {}
    note: str | None = None
    ok = True
    with tempfile.TemporaryDirectory(prefix=f"ignis-swarm-{kind}-") as scratch:
        records, wall, settings["ignis"] = run_ignis(checkpoint, trace, setup, Path(scratch) / "ignis",
                                                     args.progress)
        series["ignis"], summaries["ignis"] = records, summarize(records, wall)
        if args.peer == "none":
            note = "not run (--peer none)"
        else:
            try:
                records, wall, settings[PEER] = run_peer(checkpoint, trace, setup, Path(scratch) / "peer",
                                                         args.progress)
                series[PEER], summaries[PEER] = records, summarize(records, wall)
            except Exception as err:  # the peer's failure must not lose ignis' run
                note = peer_unavailable(err)
                if note is None:
                    traceback.print_exc()
                    note, ok = f"failed: {type(err).__name__}: {err}", False
    title = (f"### Agent swarm, {kind} (hidden {args.hidden}, {args.layers} layers, CPU fp32, {setup.threads} "
             f"threads): {config.agents} agents x {config.turns} turns + {len(trace.bursts)} bursts of "
             f"{config.burst_size}, head {head} tokens, replies of {config.max_tokens} tokens")
    text = title + "\n\n" + table(summaries, PEER, note) + "\n\n" + settings_note(settings)
    print(text)
    payload = {"kind": kind, "hidden": args.hidden, "layers": args.layers,
               "workload": asdict(config), "head_tokens": head, "setup": asdict(setup), "settings": settings,
               "peer": PEER, "peer_note": note, "summaries": summaries,
               "ratios": ratios(summaries["ignis"], summaries[PEER]) if PEER in summaries else None,
               "records": {s: [asdict(r) for r in rs] for s, rs in series.items()}}
    path = save(f"swarm-{kind}", payload, text, out)
    plot(out / f"swarm-{kind}.png", f"TTFT per turn, {kind} (hidden {args.hidden}, {args.layers} layers)",
         series, trace)
    print(f"wrote {path} (.md, .png in {out})", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=[PEER, "none"], default=PEER)
    parser.add_argument("--kind", default="dense,hybrid", help="comma-separated: dense, hybrid")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="for each server")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--head-tokens", type=int, default=2048)
    parser.add_argument("--task-tokens", type=int, default=48)
    parser.add_argument("--message-tokens", type=int, default=96, help="each tool result or user message")
    parser.add_argument("--max-tokens", type=int, default=32, help="per reply")
    parser.add_argument("--burst-every", type=int, default=2, help="rounds between subagent bursts (0: none)")
    parser.add_argument("--burst-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tierstore", action="store_true", help="give ignis a tierstore (KV-RAM + disk)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args()
    config = WorkloadConfig(agents=args.agents, turns=args.turns, head_tokens=args.head_tokens,
                            task_tokens=args.task_tokens, message_tokens=args.message_tokens,
                            max_tokens=args.max_tokens, burst_every=args.burst_every,
                            burst_size=args.burst_size, seed=args.seed)
    ok = True
    for kind in args.kind.split(","):
        ok &= bench_kind(kind.strip(), args, config, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
