"""`make run`: start tierstore, engine and gateway on loopback, wait until each is healthy,
print how to talk to them, and stop all three cleanly on Ctrl-C.

    python scripts/run_all.py [--model DIR|ignis-tiny] [--config ignis.toml] [--set reuse.retained_device=16]
                              [--gateway-port 8000] [--engine-port PORT] [--tierstore-port PORT]
                              [--no-tierstore] [GATEWAY FLAGS] [-- EXTRA ENGINE FLAGS]

Settings (`--config`, `--set`, and IGNIS_SECTION__KEY variables) reach the engine and the
tierstore alike. `make run ARGS="..."` passes its ARGS here; `MODEL=DIR make run` serves DIR.

Every other flag is the gateway's (`python -m gateway --help`), checked before anything starts:
`--api-key KEY`, `--allowed-origins ORIGIN`, `--header-timeout S`, `--access-log`, `--grace S`, ...
(`make run ARGS="--api-key sk-x --access-log"`). Its `--port` is `--gateway-port` here, and its
`--engine`, `--engine-secret-file` and `--port-file` are set here.

The gateway reaches the engine, and the engine the tierstore, over their Unix sockets
(`engine.socket` and `tierstore.socket`, by default in `$XDG_RUNTIME_DIR/ignis/` or
`/tmp/ignis-<uid>/`). With `--engine-port` / `--tierstore-port`, the engine / the tierstore
also serves TCP, every call authenticated with the secret in `engine.secret_file` /
`tierstore.secret_file` (a new one in the run's scratch folder unless `--set` names one).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.__main__ import parse_args as parse_gateway_args

ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "ignis-tierstore-"  # tierstore/arena.py names its shared-memory file so
# The gateway's flags this script sets itself; for each, what to give instead (None: nothing).
GATEWAY_FLAGS_SET_HERE = {"--port": "--gateway-port", "--engine": None, "--engine-dns": None,
                          "--engine-secret-file": None, "--port-file": None}


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    stop_within: float  # seconds from SIGTERM; then it is killed


def wait_ready(child: Child, timeout: float) -> None:
    """Each service writes its port file only once it is serving (the engine: once the model is loaded)."""
    deadline = time.monotonic() + timeout
    while not (child.ready_file.exists() and child.ready_file.read_text().strip()):
        if child.process.poll() is not None:
            raise SystemExit(f"{child.name} exited with status {child.process.returncode} (its log is above)")
        if time.monotonic() > deadline:
            raise SystemExit(f"{child.name} did not become ready in {timeout:.0f}s")
        time.sleep(0.1)


def remove_arenas_of(pid: int) -> list[Path]:
    """The arena files of the tierstore `pid` (named ignis-tierstore-<pid>-<instance>: it may have
    recreated its arena) that nobody holds any more: what it could not remove itself. Other stacks'
    arenas are never touched."""
    removed = []
    for path in SHM_DIR.glob(f"{ARENA_PREFIX}{pid}-*") if SHM_DIR.is_dir() else ():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live tierstore holds its arena's lock
        except BlockingIOError:
            continue
        else:
            path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's flags; `gateway_args` (the flags it does not know, checked by the gateway's own
    parser, which `gateway` holds parsed) and `engine_args` (after ``--``) pass through."""
    argv = sys.argv[1:] if argv is None else argv
    ours, engine_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    # No abbreviations: a gateway flag must never be read as a prefix of one of ours (--engine of --engine-port).
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--model", default=os.environ.get("MODEL") or "ignis-tiny",
                        help="checkpoint directory, or ignis-tiny (default; $MODEL)")
    parser.add_argument("--config", default=None, metavar="PATH", help="TOML settings file (engine and tierstore)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a setting for the engine and the tierstore (repeatable)")
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("--engine-port", type=int, default=None,
                        help="also serve the engine over TCP here (secret in engine.secret_file); "
                             "default: its Unix socket only")
    parser.add_argument("--tierstore-port", type=int, default=None,
                        help="also serve the tierstore over TCP here (secret in tierstore.secret_file); "
                             "default: its Unix socket only")
    parser.add_argument("--engine-metrics-port", type=int, default=9400)
    parser.add_argument("--tierstore-metrics-port", type=int, default=9401)
    parser.add_argument("--no-tierstore", action="store_true", help="device-only reuse: do not start the tierstore")
    args, gateway_args = parser.parse_known_args(ours)
    for flag in gateway_args:
        name = flag.partition("=")[0]
        if name in GATEWAY_FLAGS_SET_HERE:
            instead = GATEWAY_FLAGS_SET_HERE[name]
            parser.error(f"{name} is set by make run" + (f": give {instead}" if instead else ""))
    try:  # the gateway's own check, now: not after the engine took minutes to load
        args.gateway, _ = parse_gateway_args(["--engine", "unix:/checked-by-run-all", *gateway_args])
    except SystemExit as exc:
        if exc.code:
            print("(make run passes the flags it does not know to the gateway: python -m gateway --help)",
                  file=sys.stderr)
        raise
    args.gateway_args, args.engine_args = gateway_args, engine_args
    return args


def main() -> int:
    args = parse_args()
    settings = (["--config", args.config] if args.config else []) + [f for s in args.set for f in ("--set", s)]
    scratch = Path(tempfile.mkdtemp(prefix="ignis-run-"))
    children: list[Child] = []

    def start(name: str, module: str, flags: list[str], stop_within: float = 30.0) -> Child:
        on_socket = module in ("tierstore", "engine")  # they write JSON {address, socket, port, ...}
        ready = scratch / f"{name}.{'ready' if on_socket else 'port'}"
        announce = "--ready-file" if on_socket else "--port-file"
        # A session of its own: Ctrl-C reaches only us, and we stop the services in order.
        proc = subprocess.Popen([sys.executable, "-m", module, *flags, announce, str(ready)], cwd=ROOT,
                                start_new_session=True)
        child = Child(name, proc, ready, stop_within)
        children.append(child)
        return child

    def stop_all() -> None:
        for child in reversed(children):  # gateway, engine, tierstore: callers first
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(child.stop_within)
            except subprocess.TimeoutExpired:
                print(f"{child.name} did not stop in {child.stop_within:g} s: killed", flush=True)
                child.process.kill()
                child.process.wait()
        for child in children:  # only if the tierstore could not remove its own (it was killed)
            if child.name == "tierstore":
                for leftover in remove_arenas_of(child.process.pid):
                    print(f"removed {leftover}", flush=True)
        shutil.rmtree(scratch, ignore_errors=True)  # port files, and the TCP secret if there was one
        print("\nall services stopped", flush=True)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Ctrl-C stops everything even when it was started from a background job or a script, which start
    # their children with SIGINT ignored (and then Python installs no KeyboardInterrupt handler): in a
    # full test run in the background, make run's SIGINT was ignored and the stack never stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tierstore = ""
    tcp: list[str] = []
    try:
        if not args.no_tierstore:
            tcp = [] if args.tierstore_port is None else \
                ["--port", str(args.tierstore_port), "--set", f"tierstore.secret_file={scratch / 'tierstore.secret'}"]
            # The user's --set come later: a tierstore.secret_file among them wins.
            child = start("tierstore", "tierstore", ["--metrics-port", str(args.tierstore_metrics_port), *tcp,
                                                     *settings])
            wait_ready(child, 120)
            tierstore = json.loads(child.ready_file.read_text())["address"]
        print(f"starting the engine ({args.model}); the first run generates ignis-tiny ...", flush=True)
        # The engine uses the tierstore's socket (no secret), or its TCP port if tierstore.socket is "".
        secret = tcp[2:] if tierstore and not tierstore.startswith("unix:") else []
        engine_tcp = [] if args.engine_port is None else \
            ["--port", str(args.engine_port), "--set", f"engine.secret_file={scratch / 'engine.secret'}"]
        engine_flags = ["--model", args.model, "--metrics-port", str(args.engine_metrics_port), *secret,
                        *engine_tcp, *settings]  # the user's --set come later: an engine.secret_file there wins
        if not args.no_tierstore:
            engine_flags += ["--tierstore", tierstore]
        engine = start("engine", "engine", engine_flags + args.engine_args)
        wait_ready(engine, 1800)
        # Over its socket, the engine's own folder: no secret (with engine.socket = "", TCP and its secret).
        ready = json.loads(engine.ready_file.read_text())
        secret_file = [f.partition("=")[2] for f in engine_flags if f.startswith("engine.secret_file=")]
        engine_secret = [] if ready["socket"] else ["--engine-secret-file", secret_file[-1]]
        wait_ready(start("gateway", "gateway", [
            "--host", "127.0.0.1", "--port", str(args.gateway_port), "--engine", ready["address"],
            *engine_secret, *args.gateway_args],  # the user's come later: a --host there wins
            stop_within=max(30.0, args.gateway.grace + 20.0)), 120)  # its drain (--grace), and the streams' ends
        print_banner(args, tierstore, ready["address"])
        while all(c.process.poll() is None for c in children):
            time.sleep(0.5)
        dead = [c.name for c in children if c.process.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping the rest", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all()


def print_banner(args: argparse.Namespace, tierstore: str, engine: str) -> None:
    model_id = "ignis-tiny" if args.model == "ignis-tiny" else Path(args.model).name
    host = args.gateway.host if args.gateway.host not in ("0.0.0.0", "::") else "127.0.0.1"  # any: loopback too
    url = f"http://{f'[{host}]' if ':' in host else host}:{args.gateway_port}"
    # The key itself stays out of the banner (terminal scrollback, logs).
    key = "<your API key>" if args.gateway.api_key else "unused"
    auth = [f"  -H 'Authorization: Bearer {key}' \\"] if args.gateway.api_key else []
    lines = [
        "",
        f"gateway   (OpenAI API)  {url}/v1        metrics {url}/metrics",
    ]
    tcp = f" and 127.0.0.1:{args.engine_port} (secret)" if args.engine_port is not None else ""
    lines.append(f"engine    (gRPC)        {engine}{tcp}     "
                 f"metrics http://127.0.0.1:{args.engine_metrics_port}/metrics")
    if not args.no_tierstore:
        tcp = f" and 127.0.0.1:{args.tierstore_port} (secret)" if args.tierstore_port is not None else ""
        lines.append(f"tierstore (gRPC)        {tierstore}{tcp}     "
                     f"metrics http://127.0.0.1:{args.tierstore_metrics_port}/metrics")
    lines += [
        "",
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        *auth,
        f"  -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}], "
        "\"max_tokens\": 32}'",
        "",
        "from openai import OpenAI",
        f"client = OpenAI(base_url=\"{url}/v1\", api_key=\"{key}\")",
        f"r = client.chat.completions.create(model=\"{model_id}\", messages=[{{\"role\": \"user\", \"content\": \"hi\"}}],",
        "                                   max_tokens=32)  # unset: up to the end of the context",
        "print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)",
        "",
        f"grpcurl -plaintext -unix {engine.removeprefix('unix:')} list" if engine.startswith("unix:")
        else f"grpcurl -plaintext -H 'authorization: Bearer <secret>' {engine} list",
        "",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
