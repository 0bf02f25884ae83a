"""`make run` (scripts/run_all.py): three services up and answering, then Ctrl-C leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.launch import free_port

ROOT = Path(__file__).resolve().parent.parent


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def arenas() -> set[Path]:
    return set(Path("/dev/shm").glob("ignis-tierstore-*"))


def test_make_run_serves_then_ctrl_c_stops_all_three_and_removes_the_arena(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("gateway", "engine", "tierstore", "engine-metrics",
                                            "tierstore-metrics")}
    before = arenas()
    with (tmp_path / "run.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "scripts/run_all.py", "--model", str(tiny_model_dir),
             "--set", "reuse.kv_host_pool_bytes=16MiB", "--set", f"kv_disk.path={tmp_path / 'kv-disk'}",
             *[f for name, port in ports.items() for f in (f"--{name}-port", str(port))]],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "IGNIS_LOG_LEVEL": "WARNING"})
    try:
        deadline = time.monotonic() + 300
        while b"Ctrl-C stops everything." not in (output := (tmp_path / "run.log").read_bytes()):
            assert proc.poll() is None, output.decode(errors="replace")
            assert time.monotonic() < deadline, output.decode(errors="replace")
            time.sleep(0.2)
        text = output.decode()
        assert f"http://127.0.0.1:{ports['gateway']}/v1" in text and "grpcurl" in text and "from openai" in text

        base = f"http://127.0.0.1:{ports['gateway']}"
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 3}
        first = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        for name in ("engine-metrics", "tierstore-metrics"):
            assert httpx.get(f"http://127.0.0.1:{ports[name]}/metrics").status_code == 200
        new_arenas = arenas() - before
        assert len(new_arenas) == 1  # the tierstore's shared-memory file, while it runs
        services = children_of(proc.pid)
        assert len(services) == 3

        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the foreground process
        assert proc.wait(60) == 0, (tmp_path / "run.log").read_text()
        assert "all services stopped" in (tmp_path / "run.log").read_text()
        assert not [pid for pid in services if alive(pid)]  # no orphans
        assert not (arenas() - before)  # the arena file is gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
