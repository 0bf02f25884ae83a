"""`python -m bench.gateway`: what the gateway adds on top of the engine, in one run.

- Added latency: a 1-token completion (temperature 0) through the gateway
  (HTTP, non-streamed) versus the same request straight to the engine over
  gRPC, interleaved; p50 and p99 of each and their difference, and the
  gateway's CPU time per request.
- Streaming: per-stream decode rate (tokens after the first, over the time
  from the first to the last token) and the round's throughput (every
  stream's tokens over the round's wall time, first token included) with 1,
  32 and 256 concurrent streams, as Server-Sent Events through the gateway
  versus the gRPC stream itself; the
  gateway's CPU time per streamed token, and each client's (this process's)
  CPU time per token; streams that failed (an error, a short stream) at each
  width. After each round the same width of 1-token streams splits the
  gateway's CPU into a fixed cost per request and a cost per token after a
  stream's first: the blended figure divides the fixed cost by however many
  tokens a stream carries (16 at 256 streams, to keep the run short).
- The floor: bench/bare_relay.py in front of the same engine, measured in the same
  rounds as a gateway: one wakeup on the session socket, one frame parse and one
  loopback send per token, no framework (`--no-bare-relay` leaves it out). What a
  gateway costs per token above it is what its own code costs; the rest is this
  host's price of a wakeup and a loopback send (in a VM, a large one).
- Variants: one gateway per variant (`--variant NAME=FLAGS`; by default the
  gateway as shipped and the gateway on asyncio's own event loop), all in
  front of the same engine, each phase interleaving direct / variant 1 /
  variant 2 ..., so a library's effect is measured side by side.

It starts its own engine and gateway processes (common/launch.py) on loopback;
all processes (and this client) share this machine's cores, as they would on
one host. On a small machine the streaming ratio is mostly that contention, so
the streams' client is as lean as the gRPC one: aiohttp (its HTTP parser in C;
httpx cost ~4.5x its CPU per token, ~2.5x grpc.aio's, and on 2 cores that CPU
was taken from the engine) with orjson per event, and the table shows each
client's CPU per token beside the gateway's. The gateway's own CPU time is read
from /proc (every thread's schedstat, in nanoseconds) around each request or
round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import httpx
import numpy as np
import orjson

from common.launch import Service, launch, launch_engine, launch_gateway
from bench.table import markdown, save
from ignis.v1 import engine_pb2, engine_pb2_grpc

PROMPT = "The gateway adds how much latency to a request?"
BARE_RELAY = "bare relay"  # the column of bench/bare_relay.py
DEFAULT_VARIANTS = ["shipped=", "grpc session=--upstream grpc-session", "calls=--upstream calls",
                    "uvloop=--loop uvloop"]  # the session on its socket, over gRPC, a call per request; each loop


def cpu_seconds(pid: int) -> float:
    """CPU time of all of a process's threads so far (Linux schedstat: ns, not 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended between the listing and the read
    return total / 1e9


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean()), "n": len(samples)}


@dataclass
class Gateway:
    name: str
    flags: list[str]
    service: Service

    @property
    def pid(self) -> int:
        return self.service.process.pid


def one_token_latency(engine: str, gateways: list[Gateway], model: str, n: int, warmup: int) -> dict[str, Any]:
    request = engine_pb2.GenerateRequest(model=model, text=PROMPT,
                                         sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=1))
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    direct: list[float] = []
    through: dict[str, list[float]] = {g.name: [] for g in gateways}
    cpu = {g.name: 0.0 for g in gateways}
    clients = {g.name: httpx.Client(base_url=f"http://{g.service.address}", timeout=60) for g in gateways}
    try:
        with grpc.insecure_channel(engine) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for i in range(warmup + n):  # interleaved, so drift (caches, frequency, load) hits every path alike
                t = time.perf_counter()
                for _ in stub.Generate(request, timeout=60):
                    pass
                if i >= warmup:
                    direct.append(time.perf_counter() - t)
                for g in gateways:
                    c = cpu_seconds(g.pid)
                    t = time.perf_counter()
                    reply = clients[g.name].post("/v1/completions", json=body)
                    elapsed = time.perf_counter() - t
                    used = cpu_seconds(g.pid) - c
                    reply.raise_for_status()
                    if i >= warmup:
                        through[g.name].append(elapsed)
                        cpu[g.name] += used
    finally:
        for client in clients.values():
            client.close()
    out: dict[str, Any] = {"direct": _percentiles(direct), "gateways": {}}
    for g in gateways:
        p = _percentiles(through[g.name])
        out["gateways"][g.name] = {**p, "added_p50_ms": p["p50_ms"] - out["direct"]["p50_ms"],
                                   "added_p99_ms": p["p99_ms"] - out["direct"]["p99_ms"],
                                   "gateway_cpu_ms_per_request": cpu[g.name] / n * 1000.0}
    return out


def _rate(tokens: int, first: float, last: float) -> float:
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0


@dataclass
class Stream:
    rate: float = 0.0
    tokens: int = 0
    error: str = ""


async def _grpc_stream(stub: engine_pb2_grpc.EngineStub, model: str, prompt: str, tokens: int) -> Stream:
    request = engine_pb2.GenerateRequest(model=model, text=prompt, sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True))
    first = last = 0.0
    count = 0
    try:
        async for msg in stub.Generate(request, timeout=600):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                count += len(msg.token_ids)
    except grpc.aio.AioRpcError as exc:
        return Stream(error=f"{exc.code().name}: {exc.details()}")
    return Stream(_rate(count, first, last), count, "" if count == tokens else f"{count} of {tokens} tokens")


async def _sse_stream(http: aiohttp.ClientSession, model: str, prompt: str, tokens: int) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = 0.0
    count = 0
    done = False
    try:
        async with http.post("/v1/completions", json=body) as response:
            if response.status != 200:
                return Stream(error=f"HTTP {response.status}: {(await response.read())[:200]!r}")
            async for line in response.content:  # one line a read: SSE events are "data: ...\n\n"
                if line.startswith(b"data: [DONE]"):
                    done = True
                if not line.startswith(b"data: ") or done:
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    return Stream(error=str(chunk["error"])[:200])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    last = time.perf_counter()
                    first = first or last
                if chunk.get("usage"):
                    count = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Stream(error=f"{type(exc).__name__}: {exc}")
    error = "" if count == tokens and done else f"{count} of {tokens} tokens, [DONE] {'seen' if done else 'missing'}"
    return Stream(_rate(count, first, last), count, error)


@dataclass
class Rounds:
    rates: list[float] = field(default_factory=list)  # mean per-stream rate of each round
    totals: list[float] = field(default_factory=list)  # every stream's tokens over the round's wall time
    cpu: float = 0.0  # the gateway's
    client_cpu: float = 0.0  # this process's: the streams' client
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    # The same width of 1-token streams after each round: the gateway's CPU for a request and its one
    # token, so that a round's CPU splits into what each request costs and what each token after it does.
    short_cpu: float = 0.0
    short_streams: int = 0

    def add(self, streams: list[Stream], seconds: float) -> None:
        ok = [s.rate for s in streams if not s.error]
        self.rates.append(float(np.mean(ok)) if ok else 0.0)
        tokens = sum(s.tokens for s in streams)
        self.totals.append(tokens / seconds if seconds > 0 else 0.0)
        self.tokens += tokens
        self.errors += [s.error for s in streams if s.error]


async def stream_rates(engine: str, gateways: list[Gateway], model: str, streams: int, tokens: int,
                       repeats: int) -> dict[str, Any]:
    """Rounds alternate the paths (direct, then each gateway); the median round is reported
    (the cores are shared with the engine and with anything else running)."""
    prompts = [f"Stream {i} of {streams}: tell me about caches." for i in range(streams)]
    direct = Rounds()
    through = {g.name: Rounds() for g in gateways}
    timeout = aiohttp.ClientTimeout(total=600)
    clients = {g.name: aiohttp.ClientSession(base_url=f"http://{g.service.address}", timeout=timeout,
                                             connector=aiohttp.TCPConnector(limit=streams + 8))
               for g in gateways}
    try:
        async with grpc.aio.insecure_channel(engine) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for _ in range(repeats):
                mine = time.process_time()  # every thread of this process: grpc's own included
                t = time.perf_counter()
                results = await asyncio.gather(*(_grpc_stream(stub, model, p, tokens) for p in prompts))
                direct.add(list(results), time.perf_counter() - t)
                direct.client_cpu += time.process_time() - mine
                for g in gateways:
                    c, mine = cpu_seconds(g.pid), time.process_time()
                    t = time.perf_counter()
                    results = await asyncio.gather(*(_sse_stream(clients[g.name], model, p, tokens)
                                                     for p in prompts))
                    elapsed = time.perf_counter() - t
                    through[g.name].cpu += cpu_seconds(g.pid) - c
                    through[g.name].client_cpu += time.process_time() - mine
                    through[g.name].add(list(results), elapsed)
                    c = cpu_seconds(g.pid)
                    short = await asyncio.gather(*(_sse_stream(clients[g.name], model, p, 1) for p in prompts))
                    through[g.name].short_cpu += cpu_seconds(g.pid) - c
                    through[g.name].short_streams += len(short)
                    through[g.name].errors += [s.error for s in short if s.error]
    finally:
        for client in clients.values():
            await client.close()
    out: dict[str, Any] = {"streams": streams, "tokens": tokens, "repeats": repeats,
                           "direct_tokens_per_s": float(np.median(direct.rates)), "direct_rounds": direct.rates,
                           "direct_total_tokens_per_s": float(np.median(direct.totals)),
                           "direct_errors": len(direct.errors),
                           "direct_client_cpu_us_per_token": direct.client_cpu / direct.tokens * 1e6 if direct.tokens else 0.0,
                           "gateways": {}}
    for g in gateways:
        r = through[g.name]
        rate = float(np.median(r.rates))
        total = float(np.median(r.totals))
        out["gateways"][g.name] = {
            "tokens_per_s": rate, "rounds": r.rates,
            "ratio": rate / out["direct_tokens_per_s"] if out["direct_tokens_per_s"] else 0.0,
            "total_tokens_per_s": total, "total_rounds": r.totals,
            "total_ratio": total / out["direct_total_tokens_per_s"] if out["direct_total_tokens_per_s"] else 0.0,
            "gateway_cpu_us_per_token": r.cpu / r.tokens * 1e6 if r.tokens else 0.0,
            **_split_cpu(r, streams * repeats, tokens),
            "client_cpu_us_per_token": r.client_cpu / r.tokens * 1e6 if r.tokens else 0.0,
            "errors": len(r.errors), "error_samples": sorted(set(r.errors))[:5]}
    return out


def _split_cpu(r: Rounds, streams: int, tokens: int) -> dict[str, float]:
    """A round's gateway CPU as a fixed cost per request (a 1-token stream's, its one token included) and
    the cost of each token after the first: (CPU per N-token stream - CPU per 1-token stream) / (N - 1).
    The blended per-token figure divides the fixed cost by the tokens a stream happens to carry."""
    if not r.short_streams or not streams or tokens < 2:
        return {}
    request = r.short_cpu / r.short_streams
    return {"gateway_cpu_ms_per_stream_request": request * 1e3,
            "gateway_cpu_us_per_later_token": (r.cpu / streams - request) / (tokens - 1) * 1e6}


def _variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is NAME=FLAGS, not {text!r}")
    return name, shlex.split(flags)


def _rows(latency: dict[str, Any], rates: list[dict[str, Any]], names: list[str]) -> list[list[Any]]:
    d = latency["direct"]
    lat = latency["gateways"]
    rows: list[list[Any]] = [
        ["1-token completion p50 (ms)", d["p50_ms"], *(f"{lat[n]['p50_ms']:.3g} (+{lat[n]['added_p50_ms']:.2f})"
                                                        for n in names)],
        ["1-token completion p99 (ms)", d["p99_ms"], *(f"{lat[n]['p99_ms']:.3g} (+{lat[n]['added_p99_ms']:.2f})"
                                                        for n in names)],
        ["gateway CPU per request (ms)", "", *(lat[n]["gateway_cpu_ms_per_request"] for n in names)],
    ]
    for r in rates:
        s = r["streams"]
        g = r["gateways"]
        if s <= 32:  # 256 Python readers on these cores take tokens in bursts: first-to-last spans mean nothing
            rows.append([f"tokens/s per stream, {s} stream{'s' if s > 1 else ''}", r["direct_tokens_per_s"],
                         *(f"{g[n]['tokens_per_s']:.3g} (x{g[n]['ratio']:.3f})" for n in names)])
        rows.append([f"tokens/s of all {s}, over the round", r["direct_total_tokens_per_s"],
                     *(f"{g[n]['total_tokens_per_s']:.3g} (x{g[n]['total_ratio']:.3f})" for n in names)])
        rows.append([f"gateway CPU per streamed token, {s} (us)", "",
                     *(g[n]["gateway_cpu_us_per_token"] for n in names)])
        if all("gateway_cpu_us_per_later_token" in g[n] for n in names):
            rows.append([f"  of which each token after a stream's first, {s} (us)", "",
                         *(g[n]["gateway_cpu_us_per_later_token"] for n in names)])
            rows.append([f"  and a 1-token stream (the request and its token), {s} (ms)", "",
                         *(g[n]["gateway_cpu_ms_per_stream_request"] for n in names)])
        rows.append([f"client CPU per streamed token, {s} (us)", r["direct_client_cpu_us_per_token"],
                     *(g[n]["client_cpu_us_per_token"] for n in names)])
        rows.append([f"failed streams of {s} x {r['repeats']} (and as many 1-token streams)", r["direct_errors"], *(g[n]["errors"] for n in names)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ignis-tiny", help="checkpoint directory or ignis-tiny")
    parser.add_argument("--requests", type=int, default=300, help="1-token completions per path")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream with 1 stream")
    parser.add_argument("--tokens-32", type=int, default=64, help="tokens per stream with 32 streams")
    parser.add_argument("--tokens-256", type=int, default=16, help="tokens per stream with 256 streams")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each streaming measurement")
    parser.add_argument("--bare-relay", action=argparse.BooleanOptionalAction, default=True,
                        help="measure bench/bare_relay.py beside the gateways: the floor of a token's cost")
    parser.add_argument("--variant", action="append", type=_variant, default=None, metavar="NAME=FLAGS",
                        help="a gateway to measure, started with FLAGS; repeatable "
                             f"(default: {' and '.join(repr(v) for v in DEFAULT_VARIANTS)})")
    args = parser.parse_args()
    variants = args.variant or [_variant(v) for v in DEFAULT_VARIANTS]
    names = [name for name, _ in variants]
    model = "bench-model"
    load_before = os.getloadavg()[0]
    widths = ((1, args.tokens), (32, args.tokens_32), (256, args.tokens_256))
    with tempfile.TemporaryDirectory(prefix="ignis-bench-gateway-") as scratch:
        engine = launch_engine(Path(scratch), args.model, ["--served-model-name", model, "--max-queue", "1024"])
        gateways: list[Gateway] = []
        try:
            for i, (name, flags) in enumerate(variants):
                service = launch_gateway(Path(scratch) / f"gateway-{i}", [engine.address],
                                         ["--max-connections", "4096", *flags])
                gateways.append(Gateway(name, flags, service))
            if args.bare_relay:
                relay = launch("bare-relay", "bench.bare_relay", ["--engine", engine.address],
                               Path(scratch) / "bare-relay", listening)
                gateways.append(Gateway(BARE_RELAY, [], relay))
                names.append(BARE_RELAY)
            # warm every path once (first-use costs are not the steady state)
            one_token_latency(engine.address, gateways, model, 10, 5)
            asyncio.run(stream_rates(engine.address, gateways, model, 8, 8, 1))
            latency = one_token_latency(engine.address, gateways, model, args.requests, args.warmup)
            rates = [asyncio.run(stream_rates(engine.address, gateways, model, n, tokens, args.repeats))
                     for n, tokens in widths]
        finally:
            for g in gateways:
                g.service.stop()
            engine.stop()
    load_after = os.getloadavg()[0]
    table = markdown(["measure", "engine over gRPC",
                      *(f"gateway: {n}" if n != BARE_RELAY else "bare relay (the floor)" for n in names)],
                     _rows(latency, rates, names))
    shown = "; ".join(f"{n}: {shlex.join(f) or '(no flags)'}" for n, f in variants)
    table += (f"\n\nGateways: {shown}. "
              + ("The bare relay (bench/bare_relay.py) is the floor: a wakeup, a frame parse and a loopback "
                 "send per token, no framework; its 'gateway CPU' rows are its own. " if args.bare_relay else "")
              + f"Load average (1 min) {load_before:.2f} before, {load_after:.2f} after.")
    print(table)
    path = save("gateway", {"model": args.model, "variants": {n: f for n, f in variants}, "latency": latency,
                            "streams": rates, "load_before": load_before, "load_after": load_after,
                            "args": {k: v for k, v in vars(args).items() if k != "variant"}}, table)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
