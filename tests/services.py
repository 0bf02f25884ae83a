"""Start the real services as processes on free loopback ports, and stop them.

Readiness is polled (gRPC health / HTTP), never slept for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunningService:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def _wait_for_port_file(proc: subprocess.Popen[bytes], port_file: Path, log_path: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"service did not become ready in {timeout}s:\n{log_path.read_text(errors='replace')}")


def wait_grpc_serving(address: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} did not report SERVING within {timeout}s")


def start_engine(workdir: Path, model: str = "ignis-tiny", args: list[str] | None = None,
                 env: dict[str, str] | None = None, timeout: float = 180.0) -> RunningService:
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "engine.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / "engine.log"
    cmd = [sys.executable, "-m", "engine", "--model", model, "--port", "0", "--port-file", str(port_file),
           *(args or [])]
    full_env = {**os.environ, **(env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    port = _wait_for_port_file(proc, port_file, log_path, timeout)
    wait_grpc_serving(f"127.0.0.1:{port}", timeout)
    return RunningService("engine", proc, port, log_path)


def start_gateway(workdir: Path, engines: list[str], args: list[str] | None = None,
                  env: dict[str, str] | None = None, timeout: float = 60.0) -> RunningService:
    """`python -m gateway` on a free port in front of `engines`; ready once it answers HTTP.

    /health may answer 503 (no engine up): that still means the gateway serves.
    """
    import httpx

    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "gateway.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / "gateway.log"
    cmd = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
    for address in engines:
        cmd += ["--engine", address]
    cmd += args or []
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT)
    port = _wait_for_port_file(proc, port_file, log_path, timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code in (200, 503):
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the gateway did not answer within {timeout}s:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)
    return RunningService("gateway", proc, port, log_path)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tierstore(workdir: Path, args: list[str] | None = None, env: dict[str, str] | None = None,
                    metrics: bool = False, timeout: float = 60.0) -> RunningService:
    """`python -m tierstore` on a free port; ready once gRPC health says SERVING.

    Pass the tier sizes in ``args`` (``--kv-host-pool-bytes``, ``--kv-disk-path``,
    ``--kv-disk-bytes``). With ``metrics``, /metrics listens on ``extra["metrics"]``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "tierstore.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / "tierstore.log"
    cmd = [sys.executable, "-m", "tierstore", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
    extra: dict[str, int] = {}
    if metrics:
        extra["metrics"] = _free_port()
        cmd += ["--metrics-port", str(extra["metrics"])]
    cmd += args or []
    with log_path.open("ab") as log:  # appended: a restart on the same workdir keeps the earlier log
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT)
    port = _wait_for_port_file(proc, port_file, log_path, timeout)
    wait_grpc_serving(f"127.0.0.1:{port}", timeout)
    return RunningService("tierstore", proc, port, log_path, extra)
