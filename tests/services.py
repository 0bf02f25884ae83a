"""Start the real services as processes on free loopback ports, and stop them.

The launcher is common/launch.py (benchmarks and tests start services the same
way); readiness is polled (port file, then gRPC health or HTTP), never slept for.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from common.launch import Service as RunningService
from common.launch import free_port, grpc_serving, launch

__all__ = ["RunningService", "start_engine", "start_gateway", "start_tierstore"]


def start_engine(workdir: Path, model: str = "ignis-tiny", args: list[str] | None = None,
                 env: dict[str, str] | None = None, timeout: float = 180.0) -> RunningService:
    """`python -m engine`; its stored responses go under `workdir` (not the home folder) unless
    `args` or `env` say where (a later --set wins over the environment)."""
    env = {"IGNIS_RESPONSES__PATH": str(workdir / "responses"), **(env or {})}
    return launch("engine", "engine", ["--model", model, *(args or [])], workdir, grpc_serving, timeout, env)


def _gateway_answers(port: int) -> bool:
    # /health may answer 503 (no engine up): that still means the gateway serves.
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def start_gateway(workdir: Path, engines: list[str], args: list[str] | None = None,
                  env: dict[str, str] | None = None, timeout: float = 60.0) -> RunningService:
    """`python -m gateway` on a free port in front of `engines`; ready once it answers HTTP."""
    flags = ["--host", "127.0.0.1", *[f for e in engines for f in ("--engine", e)], *(args or [])]
    return launch("gateway", "gateway", flags, workdir, _gateway_answers, timeout, env)


def start_tierstore(workdir: Path, args: list[str] | None = None, env: dict[str, str] | None = None,
                    metrics: bool = False, timeout: float = 60.0, prefix: list[str] | None = None
                    ) -> RunningService:
    """`python -m tierstore` on a Unix socket of its own (``address`` is ``unix:...``, the same for the
    same workdir); ready once gRPC health says SERVING.

    Pass the tier sizes in ``args`` (``--kv-host-pool-bytes``, ``--kv-disk-path``,
    ``--kv-disk-bytes``); ``--port`` and ``--secret-file`` add TCP (``port``). With ``metrics``,
    /metrics listens on ``extra["metrics"]``. The log is appended: a restart on the same
    workdir keeps the earlier log. ``prefix``: a command that execs it (e.g. setpriv).
    """
    extra: dict[str, int] = {}
    flags = ["--host", "127.0.0.1"]
    if metrics:
        extra["metrics"] = free_port()
        flags += ["--metrics-port", str(extra["metrics"])]
    return launch("tierstore", "tierstore", [*flags, *(args or [])], workdir, grpc_serving, timeout, env,
                  append_log=True, extra=extra, prefix=prefix)
