"""`python -m bench.gateway`: what the gateway adds on top of the engine, in one run.

- Added latency: a 1-token completion (temperature 0) through the gateway
  (HTTP, non-streamed) versus the same request straight to the engine over
  gRPC, alternating the two; p50 and p99 of each and their difference.
- Streaming: per-stream decode rate (tokens after the first, over the time
  from the first to the last token) with 1 and with 32 concurrent streams, as
  Server-Sent Events through the gateway versus the gRPC stream itself.

It starts its own engine and gateway processes (bench/launch.py) on loopback;
all processes (and this client, which parses SSE in Python) share this
machine's cores, as they would on one host. On a small machine the streaming
ratio is mostly that contention; the gateway's own CPU time per request and
per streamed token (from /proc) is reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np

from bench.launch import launch_engine, launch_gateway
from bench.table import markdown, save
from ignis.v1 import engine_pb2, engine_pb2_grpc

PROMPT = "The gateway adds how much latency to a request?"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), to charge work to the gateway alone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean()), "n": len(samples)}


def one_token_latency(engine: str, gateway: str, gateway_pid: int, model: str, n: int, warmup: int
                      ) -> dict[str, Any]:
    request = engine_pb2.GenerateRequest(model=model, text=PROMPT,
                                         sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=1))
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    direct: list[float] = []
    through: list[float] = []
    cpu = 0.0
    with grpc.insecure_channel(engine) as channel, httpx.Client(base_url=f"http://{gateway}", timeout=60) as http:
        stub = engine_pb2_grpc.EngineStub(channel)
        for i in range(warmup + n):  # alternate, so drift (caches, frequency) hits both alike
            t = time.perf_counter()
            for _ in stub.Generate(request, timeout=60):
                pass
            d = time.perf_counter() - t
            c = cpu_seconds(gateway_pid)
            t = time.perf_counter()
            reply = http.post("/v1/completions", json=body)
            g = time.perf_counter() - t
            if i >= warmup:
                cpu += cpu_seconds(gateway_pid) - c
            reply.raise_for_status()
            if i >= warmup:
                direct.append(d)
                through.append(g)
    out: dict[str, Any] = {"direct": _percentiles(direct), "gateway": _percentiles(through)}
    out["added_p50_ms"] = out["gateway"]["p50_ms"] - out["direct"]["p50_ms"]
    out["added_p99_ms"] = out["gateway"]["p99_ms"] - out["direct"]["p99_ms"]
    out["gateway_cpu_ms_per_request"] = cpu / n * 1000.0
    return out


def _rate(tokens: int, first: float, last: float) -> float:
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0


async def _grpc_stream(stub: engine_pb2_grpc.EngineStub, model: str, prompt: str, tokens: int) -> float:
    request = engine_pb2.GenerateRequest(model=model, text=prompt, sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True))
    first = last = 0.0
    count = 0
    async for msg in stub.Generate(request, timeout=600):
        if msg.token_ids:
            last = time.perf_counter()
            first = first or last
            count += len(msg.token_ids)
    return _rate(count, first, last)


async def _sse_stream(http: httpx.AsyncClient, model: str, prompt: str, tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = 0.0
    count = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
    return _rate(count, first, last)


async def stream_rates(engine: str, gateway: str, gateway_pid: int, model: str, streams: int, tokens: int,
                       repeats: int) -> dict[str, Any]:
    """Mean per-stream rate of each round; rounds alternate the paths, the median round is reported
    (the cores are shared with the engine and with anything else running)."""
    prompts = [f"Stream {i} of {streams}: tell me about caches." for i in range(streams)]
    direct: list[float] = []
    through: list[float] = []
    cpu = 0.0
    limits = httpx.Limits(max_connections=streams + 8)
    async with grpc.aio.insecure_channel(engine) as channel, \
            httpx.AsyncClient(base_url=f"http://{gateway}", timeout=600, limits=limits) as http:
        stub = engine_pb2_grpc.EngineStub(channel)
        for _ in range(repeats):
            rates = await asyncio.gather(*(_grpc_stream(stub, model, p, tokens) for p in prompts))
            direct.append(float(np.mean(rates)))
            c = cpu_seconds(gateway_pid)
            rates = await asyncio.gather(*(_sse_stream(http, model, p, tokens) for p in prompts))
            cpu += cpu_seconds(gateway_pid) - c
            through.append(float(np.mean(rates)))
    return {"streams": streams, "tokens": tokens, "repeats": repeats,
            "direct_tokens_per_s": float(np.median(direct)), "gateway_tokens_per_s": float(np.median(through)),
            "direct_rounds": direct, "gateway_rounds": through,
            "gateway_cpu_us_per_token": cpu / (repeats * streams * tokens) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ignis-tiny", help="checkpoint directory or ignis-tiny")
    parser.add_argument("--requests", type=int, default=200, help="1-token completions per path")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream with 1 stream")
    parser.add_argument("--tokens-32", type=int, default=64, help="tokens per stream with 32 streams")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each streaming measurement")
    args = parser.parse_args()
    model = "bench-model"
    with tempfile.TemporaryDirectory(prefix="ignis-bench-gateway-") as scratch:
        engine = launch_engine(Path(scratch), args.model, ["--served-model-name", model, "--max-queue", "256"])
        try:
            gateway = launch_gateway(Path(scratch), [engine.address])
            try:
                pid = gateway.process.pid
                latency = one_token_latency(engine.address, gateway.address, pid, model, args.requests, args.warmup)
                # warm the streaming paths once (first-use costs are not the steady state)
                asyncio.run(stream_rates(engine.address, gateway.address, pid, model, 2, 8, 1))
                rates = [asyncio.run(stream_rates(engine.address, gateway.address, pid, model, n, tokens,
                                                  args.repeats))
                         for n, tokens in ((1, args.tokens), (32, args.tokens_32))]
            finally:
                gateway.stop()
        finally:
            engine.stop()
    d, g = latency["direct"], latency["gateway"]
    rows: list[list[Any]] = [
        ["1-token completion p50 (ms)", d["p50_ms"], g["p50_ms"],
         f"+{latency['added_p50_ms']:.2f} ms ({latency['gateway_cpu_ms_per_request']:.2f} ms gateway CPU/request)"],
        ["1-token completion p99 (ms)", d["p99_ms"], g["p99_ms"], f"+{latency['added_p99_ms']:.2f} ms"],
    ]
    for r in rates:
        ratio = r["gateway_tokens_per_s"] / r["direct_tokens_per_s"] if r["direct_tokens_per_s"] else 0.0
        rows.append([f"tokens/s per stream, {r['streams']} stream{'s' if r['streams'] > 1 else ''}",
                     r["direct_tokens_per_s"], r["gateway_tokens_per_s"],
                     f"x{ratio:.3f} ({r['gateway_cpu_us_per_token']:.0f} us gateway CPU/token)"])
    table = markdown(["measure", "engine over gRPC", "through the gateway", "gateway effect"], rows)
    print(table)
    path = save("gateway", {"model": args.model, "latency": latency, "streams": rates,
                            "args": vars(args)}, table)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
