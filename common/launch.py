"""Start the services as processes on free loopback ports (tests and benchmarks), and stop them.

Each service is told ``--port 0 --port-file F``; readiness is polled (the port
file, then gRPC health or HTTP /health), never slept for. The engine and the tierstore
serve a Unix socket instead (their link is private: common/secret_auth.py): each is told
``--socket S --ready-file F``, S in a 0700 folder of the workdir (the same S for the
same workdir and name, so a restarted service is found where the last one was), and its
``address`` is ``unix:S``; a ``--port`` in its args adds TCP (give it a ``--secret-file``:
over TCP every call but health needs the secret).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
SOCKET_SERVICES = {"tierstore", "engine"}  # modules served on a Unix socket rather than a port
_MAX_SOCKET_PATH = 100  # of sun_path's 107 bytes, with room to spare


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    extra: dict[str, int] = field(default_factory=dict)  # other ports it listens on (e.g. metrics)
    socket: Path | None = None  # a Unix socket service's socket (its port, if any, is TCP)

    @property
    def address(self) -> str:
        return f"unix:{self.socket}" if self.socket is not None else f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def launch(name: str, module: str, args: list[str], workdir: Path, ready: Callable[[int], bool],
           timeout: float = 600.0, env: dict[str, str] | None = None, append_log: bool = False,
           extra: dict[str, int] | None = None, prefix: list[str] | None = None) -> Service:
    """`python -m module --port 0 --port-file F args` (a `--port` in args wins); returns once `ready(port)`.

    `append_log` keeps an earlier log in the same workdir (a restart of the same service). `prefix`: a
    command that runs it (it must exec it in the same process, as setpriv does).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    on_socket = module in SOCKET_SERVICES
    port_file = workdir / f"{name}.{'ready' if on_socket else 'port'}"
    port_file.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    flags = ["--socket", str(socket_path(workdir, name)), "--ready-file", str(port_file)] if on_socket else \
        ["--port", "0", "--port-file", str(port_file)]
    with log_path.open("ab" if append_log else "wb") as log:
        proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", module, *flags, *args],
                                cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    service = Service(name, proc, 0, log_path, dict(extra or {}))
    announced = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{service.log()}")
        if not announced and port_file.exists() and (text := port_file.read_text().strip()):
            announced = True
            if on_socket:
                info = json.loads(text)
                service.socket = Path(info["socket"]) if info["socket"] else None
                service.port = info["port"] or 0
            else:
                service.port = int(text)
        if announced and (grpc_serving(service.address) if on_socket else ready(service.port)):
            return service
        time.sleep(0.05)
    service.stop()
    raise TimeoutError(f"{name} was not ready within {timeout:.0f}s:\n{service.log()}")


def socket_path(workdir: Path, name: str) -> Path:
    """Where a socket service of `workdir` listens: in a 0700 folder of it, or, when that path is
    too long for a Unix socket, in a 0700 folder of the temp dir named after it."""
    path = workdir / "run" / f"{name}.sock"
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        digest = hashlib.sha256(os.fsencode(workdir.resolve())).hexdigest()[:16]
        base = Path(tempfile.gettempdir()) / f"ignis-{os.getuid()}-launch"
        base.mkdir(mode=0o700, exist_ok=True)
        os.chmod(base, 0o700)
        path = base / digest / f"{name}.sock"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)  # the engine and tierstore refuse a folder others may enter
    return path


def grpc_serving(port: int | str) -> bool:
    """SERVING from the gRPC health service at `port` on loopback, or at an address (``unix:/path``)."""
    with grpc.insecure_channel(port if isinstance(port, str) else f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def http_healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def launch_engine(workdir: Path, model: str = "ignis-tiny", args: list[str] | None = None) -> Service:
    """Its stored responses go under `workdir` unless `args` say where (--set wins over the environment)."""
    return launch("engine", "engine", ["--model", model, *(args or [])], workdir, grpc_serving,
                  env={"IGNIS_RESPONSES__PATH": str(workdir / "responses")})


def launch_tierstore(workdir: Path, arena_bytes: int, disk_bytes: int, env: dict[str, str] | None = None
                     ) -> Service:
    """A tierstore with an arena of `arena_bytes` and a disk tier of `disk_bytes` under `workdir`/kv-disk."""
    return launch("tierstore", "tierstore", ["--kv-host-pool-bytes", str(arena_bytes), "--kv-disk-path",
                                             str(workdir / "kv-disk"), "--kv-disk-bytes", str(disk_bytes)],
                  workdir, grpc_serving, env=env)


def launch_gateway(workdir: Path, engines: list[str], args: list[str] | None = None) -> Service:
    flags = ["--host", "127.0.0.1"] + [f for e in engines for f in ("--engine", e)] + (args or [])
    return launch("gateway", "gateway", flags, workdir, http_healthy, timeout=120)


def free_port() -> int:
    """A loopback port free right now, for a program that cannot write a port file (it may race; rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_binary(name: str, cmd: list[str], port: int, workdir: Path, ready: Callable[[int], bool],
                  timeout: float = 600.0, env: dict[str, str] | None = None) -> Service:
    """Start a non-Python program already told to listen on `port`; returns once `ready(port)`."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env={**os.environ, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT)
    service = Service(name, proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{service.log()}")
        if ready(port):
            return service
        time.sleep(0.05)
    service.stop()
    raise TimeoutError(f"{name} was not ready within {timeout:.0f}s:\n{service.log()}")
