"""`make run` (scripts/run_all.py): three services up and answering, the gateway on the engine's and the
engine on the tierstore's Unix socket, the gateway's own flags passed through to it, then Ctrl-C leaves
nothing of its own behind and touches nothing of anyone else's."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from common.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-run-all-test"


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


def arenas_of(pid: int) -> set[Path]:
    return set(Path("/dev/shm").glob(f"ignis-tierstore-{pid}-*"))


def module_of(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"-m") + 1].decode()


def test_make_run_serves_then_ctrl_c_stops_all_three_and_removes_the_arena(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("gateway", "engine", "engine-metrics", "tierstore-metrics")}
    sockets = tmp_path / "run"
    sockets.mkdir(mode=0o700)
    socket = sockets / "ts.sock"  # not the default runtime path: other stacks may be running on this host
    engine_socket = sockets / "engine.sock"
    # Another stack's arena, made after ours started and not yet locked (its tierstore is starting):
    # the old shutdown removed every arena newer than itself.
    foreign = Path("/dev/shm") / f"ignis-tierstore-{os.getpid()}-another-stack"
    with (tmp_path / "run.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "scripts/run_all.py", "--model", str(tiny_model_dir),
             "--set", "reuse.kv_host_pool_bytes=16MiB", "--set", f"kv_disk.path={tmp_path / 'kv-disk'}",
             "--set", f"tierstore.socket={socket}", "--set", f"engine.socket={engine_socket}",
             *[f for name, port in ports.items() for f in (f"--{name}-port", str(port))],
             "--api-key", KEY, "--access-log"],  # the gateway's flags (issue 47 item 10)
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "IGNIS_LOG_LEVEL": "WARNING"})
    services: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while b"Ctrl-C stops everything." not in (output := (tmp_path / "run.log").read_bytes()):
            assert proc.poll() is None, output.decode(errors="replace")
            assert time.monotonic() < deadline, output.decode(errors="replace")
            time.sleep(0.2)
        text = output.decode()
        assert f"http://127.0.0.1:{ports['gateway']}/v1" in text and "grpcurl" in text and "from openai" in text
        assert '"max_tokens": 32}' in text and "max_tokens=32)" in text  # a random model would run to the context
        assert "Bearer <your API key>" in text and KEY not in text  # the snippets ask for the key; never print it
        assert f"tierstore (gRPC)        unix:{socket}" in text  # the engine's link: the socket, no TCP
        # The gateway's link: the engine's socket; its TCP port (--engine-port) takes the secret only.
        assert f"engine    (gRPC)        unix:{engine_socket} and 127.0.0.1:{ports['engine']} (secret)" in text
        foreign.write_bytes(b"")

        base = f"http://127.0.0.1:{ports['gateway']}"
        assert httpx.get(f"{base}/v1/models").status_code == 401  # --api-key reached the gateway
        auth = {"Authorization": f"Bearer {KEY}"}
        model = httpx.get(f"{base}/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 3}
        first = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=120)
        assert first.status_code == 200, first.text
        for name in ("engine-metrics", "tierstore-metrics"):
            assert httpx.get(f"http://127.0.0.1:{ports[name]}/metrics").status_code == 200
        services.extend(children_of(proc.pid))
        assert len(services) == 3
        [tierstore] = [pid for pid in services if module_of(pid) == "tierstore"]
        files = arenas_of(tierstore)  # its shared-memory file and the table published beside it, while it runs
        assert len(files) == 2 and len([f for f in files if f.name.endswith(".table")]) == 1
        engine_args = Path(f"/proc/{[p for p in services if module_of(p) == 'engine'][0]}/cmdline").read_bytes()
        assert f"unix:{socket}".encode() in engine_args
        gateway_args = Path(f"/proc/{[p for p in services if module_of(p) == 'gateway'][0]}/cmdline").read_bytes()
        assert f"\0--engine\0unix:{engine_socket}\0".encode() in gateway_args
        assert b"POST /v1/chat/completions HTTP/1.1\" 200" in (tmp_path / "run.log").read_bytes()  # --access-log

        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the foreground process
        assert proc.wait(300) == 0, (tmp_path / "run.log").read_text()  # a loaded machine took over 60 s
        assert "all services stopped" in (tmp_path / "run.log").read_text()
        assert not [pid for pid in services if alive(pid)]  # no orphans
        assert not arenas_of(tierstore) and not socket.exists()  # its arena file and its socket are gone
        assert not engine_socket.exists()
        assert foreign.exists()  # and nobody else's
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in services:  # killed, run_all leaves them: they must not outlive a failed test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        foreign.unlink(missing_ok=True)


def load_run_all() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "scripts" / "run_all.py")
    assert spec is not None and spec.loader is not None
    run_all = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_all", run_all)  # its dataclasses look their module up there
    spec.loader.exec_module(run_all)
    return run_all


def test_flags_it_does_not_know_go_to_the_gateway_checked_by_the_gateway_first(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IGNIS_API_KEY", raising=False)
    run_all = load_run_all()
    args = run_all.parse_args(["--api-key", "sk-x", "--model", "m", "--allowed-origins", "http://localhost:3000",
                               "--header-timeout=30", "--access-log", "--", "--served-model-name", "n"])
    assert args.model == "m" and args.engine_args == ["--served-model-name", "n"]
    assert args.gateway_args == ["--api-key", "sk-x", "--allowed-origins", "http://localhost:3000",
                                 "--header-timeout=30", "--access-log"]
    assert args.gateway.api_key == "sk-x" and args.gateway.header_timeout == 30.0
    refused: list[tuple[list[str], str]] = [
        (["--port", "9"], "--port is set by make run: give --gateway-port"),
        (["--engine=unix:/x"], "--engine is set by make run"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--header-timeout", "soon"], "--header-timeout: invalid float value")]
    for argv, said in refused:
        with pytest.raises(SystemExit) as exited:
            run_all.parse_args(argv)
        assert exited.value.code == 2
        assert said in capsys.readouterr().err


def test_after_a_killed_tierstore_only_its_own_unheld_arenas_are_removed(tmp_path: Path) -> None:
    import fcntl

    run_all = load_run_all()
    shm = Path("/dev/shm")
    ours = [shm / f"ignis-tierstore-{os.getpid()}-{name}" for name in ("first", "recreated", "held")]
    theirs = shm / f"ignis-tierstore-{os.getppid()}-theirs"
    for path in (*ours, theirs):
        path.write_bytes(b"")
    held = os.open(ours[2], os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live tierstore holds its arena's lock
        assert sorted(run_all.remove_arenas_of(os.getpid())) == sorted(ours[:2])
        assert ours[2].exists() and theirs.exists()
    finally:
        os.close(held)
        for path in (*ours, theirs):
            path.unlink(missing_ok=True)
