"""The chaos bench's stack: the services it starts and restarts, their budgets, the prompts
and their reference answers (bench/chaos.py runs the faults)."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from common.launch import Service, grpc_serving, launch, launch_gateway
from bench.workload import WORDS
from ignis.v1 import engine_pb2, engine_pb2_grpc, tierstore_pb2
from tierstore.client import TierStoreClient


MODEL = "ignis-tiny"
MAX_TOKENS = 24
CONVERSATIONS, TURNS = 6, 3
ENGINE_ARGS = ["--kv-cache-bytes", "4MiB", "--max-num-seqs", "8", "--set", "reuse.retained_device=2",
               "--set", "reuse.retained_interactive_ttl=0"]
TIERSTORE_ARGS = ["--kv-host-pool-bytes", "2MiB", "--kv-disk-bytes", "12MiB", "--lease-seconds", "15",
                  "--set", "reuse.retained_interactive_ttl=0"]


@dataclass(frozen=True, slots=True)
class Mode:
    pre: int  # random requests of a window before its fault
    extra: int  # random requests after the sweep (every prompt once) that follows the fault
    aborts: int
    deadline: float  # seconds a request may take before it is lost


SMOKE = Mode(pre=3, extra=0, aborts=50, deadline=30.0)
FULL = Mode(pre=8, extra=12, aborts=200, deadline=60.0)

# (row key, what the table calls it), in the order; the warm-up and steady rows are the control.
ROWS = [("warm-up", "0 warm-up, no fault"), ("steady", "0 steady, no fault"),
        ("tierstore-kill", "1 tierstore kill -9, restart"), ("engine-kill", "2 engine kill -9, restart"),
        ("corrupt-blobs", "3 corrupt blobs"), ("delete-blobs", "4 delete blobs"),
        ("truncate-index", "5 truncated LMDB index"), ("read-only-disk", "6 read-only disk"),
        ("arena-deleted", "7 arena file deleted"), ("aborts", "8 aborted streams")]


# ---------------------------------------------------------------- prompts and their reference answers


@dataclass(slots=True)
class Prompt:
    key: str  # "c2t1": conversation 2, turn 1
    messages: list[dict[str, str]]
    reference: str = ""
    margins: list[tuple[int, float]] = field(default_factory=list)  # per token: (end byte, top-1 minus top-2 logprob)


def conversation_turns(seed: int) -> tuple[str, list[list[str]]]:
    """A shared system prompt, and each conversation's user messages (seeded word salad)."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    system = "You are a careful assistant. " + words(50)
    return system, [[f"Task {c}: " + words(40)] + [f"Next {c}.{t}: " + words(20) for t in range(1, TURNS)]
                    for c in range(CONVERSATIONS)]


def body(prompt: Prompt, stream: bool, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "messages": prompt.messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "stream": stream, **extra}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def references(scratch: Path, seed: int) -> list[Prompt]:
    """Every turn of every conversation on a fresh engine with reuse off (later turns carry the
    reference replies of earlier ones), with each token's top-2 margin to tell a near tie apart."""
    system, convs = conversation_turns(seed)
    folder = scratch / "reference"
    engine = launch("engine", "engine", ["--model", MODEL, "--set", "reuse.prompt=false", "--set",
                                         f"engine.integrity_key_file={scratch / 'reference.key'}"],
                    folder, grpc_serving, timeout=300)

    async def conversation(http: httpx.AsyncClient, c: int, users: list[str]) -> list[Prompt]:
        out: list[Prompt] = []
        history = [{"role": "system", "content": system}]
        for t, user in enumerate(users):
            p = Prompt(f"c{c}t{t}", [*history, {"role": "user", "content": user}])
            reply = await http.post("/chat/completions", json=body(p, False, logprobs=True, top_logprobs=2))
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            p.reference, end = choice["message"]["content"] or "", 0
            for tok in choice["logprobs"]["content"]:
                end += len(tok["bytes"])
                tops = sorted((x["logprob"] for x in tok["top_logprobs"]), reverse=True)
                p.margins.append((end, tops[0] - tops[1] if len(tops) > 1 else float("inf")))
            out.append(p)
            history = [*p.messages, {"role": "assistant", "content": p.reference}]
        return out

    async def everything(base_url: str) -> list[Prompt]:
        # Room for a loaded machine: all conversations at once, each reply a reference (no deadline is measured here).
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            done = await asyncio.gather(*(conversation(http, c, users) for c, users in enumerate(convs)))
        return [p for conv in done for p in conv]

    try:
        gateway = launch_gateway(folder, [engine.address])
        try:
            return asyncio.run(everything(f"http://{gateway.address}/v1"))
        finally:
            gateway.stop()
    finally:
        engine.stop()


def divergence(prompt: Prompt, text: str) -> str:
    """Where a wrong answer leaves the reference, and the reference's top-2 margin there (a tiny one is a near tie)."""
    want, got = prompt.reference.encode(), text.encode()
    same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    for i, (end, margin) in enumerate(prompt.margins):
        if end > same:
            return f"{prompt.key}: differs at token {i} (reference top-2 margin {margin:.3g}): got {text[:60]!r}"
    return f"{prompt.key}: differs after the reference's end: got {text[:60]!r}"


# ---------------------------------------------------------------- the stack under test


def rss_mib(pid: int) -> float:
    """VmRSS of a process from /proc (psutil is not in the venv); 0 once it is gone."""
    status = Path(f"/proc/{pid}/status")
    for line in (status.read_text() if status.exists() else "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def arena_maps(pid: int) -> tuple[int, int]:
    """Tierstore arena files a process maps, and how many of them are deleted (a mapping kept past its arena)."""
    maps = Path(f"/proc/{pid}/maps")
    paths = {line.split(None, 5)[5] for line in (maps.read_text() if maps.exists() else "").splitlines()
             if "/ignis-tierstore-" in line and len(line.split(None, 5)) == 6}
    return len(paths), sum(p.endswith("(deleted)") for p in paths)


class Stack:
    """The tierstore, engine and gateway of the run, restartable in place."""

    def __init__(self, scratch: Path) -> None:
        self.dir = scratch / "stack"
        self.kv_disk = self.dir / "kv-disk"
        self.key = scratch / "integrity.key"
        self.tierstore: Service | None = None
        self.engine: Service | None = None
        self.gateway: Service | None = None

    def start(self) -> None:
        self.start_tierstore()
        self.start_engine()
        self.start_gateway()

    def start_gateway(self, port: int = 0) -> None:
        assert self.engine is not None
        self.gateway = launch_gateway(self.dir, [self.engine.address], ["--probe-interval", "0.5", "--port", str(port)])

    def start_tierstore(self) -> None:
        self.tierstore = launch("tierstore", "tierstore", [*TIERSTORE_ARGS, "--kv-disk-path", str(self.kv_disk)],
                                self.dir, grpc_serving, timeout=60, append_log=True)

    def start_engine(self, port: int = 0) -> None:
        assert self.tierstore is not None
        args = ["--model", MODEL, "--tierstore", self.tierstore.address, *ENGINE_ARGS,
                "--set", f"engine.integrity_key_file={self.key}", *(["--port", str(port)] if port else [])]
        self.engine = launch("engine", "engine", args, self.dir, grpc_serving, timeout=300, append_log=True)

    def gateway_port(self) -> int:
        assert self.gateway is not None
        return self.gateway.port

    def revive(self) -> list[str]:
        """Services that died on their own (not killed by the bench), each restarted in place."""
        died = []
        for name, restart in (("tierstore", self.start_tierstore),
                              ("engine", lambda: self.start_engine(self.engine.port if self.engine else 0)),
                              ("gateway", lambda: self.start_gateway(self.gateway_port()))):
            service: Service | None = getattr(self, name)
            if service is not None and (rc := service.process.poll()) is not None:
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
                died.append(f"the {name} died ({how}; log {service.log_path}); restarted")
                restart()
        return died

    def store_stats(self) -> tierstore_pb2.StatsResponse | None:
        assert self.tierstore is not None
        try:
            with TierStoreClient(self.tierstore.address, timeout=3) as client:
                return client.stats()
        except grpc.RpcError:
            return None

    def engine_stats(self) -> engine_pb2.GetStatsResponse | None:
        assert self.engine is not None
        with grpc.insecure_channel(self.engine.address) as channel:
            try:
                return engine_pb2_grpc.EngineStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=3)
            except grpc.RpcError:
                return None

    def engine_rss(self) -> float:
        assert self.engine is not None
        return rss_mib(self.engine.process.pid)

    def engine_arenas(self) -> tuple[int, int]:
        assert self.engine is not None
        return arena_maps(self.engine.process.pid)

    def blobs(self) -> list[Path]:
        return sorted(p for p in (self.kv_disk / "blobs").iterdir() if len(p.name) == 32)

    def blob_bytes(self) -> int:
        """What the blob files take in whole 4 KiB blocks, as the disk tier counts them against its budget."""
        total = 0
        for path in self.blobs():
            try:
                total += -(-path.stat().st_size // 4096) * 4096
            except FileNotFoundError:
                pass
        return total

    def stop(self) -> None:
        for service in (self.gateway, self.engine, self.tierstore):
            if service is not None:
                service.stop()


# ---------------------------------------------------------------- traffic


