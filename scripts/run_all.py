"""`make run`: start tierstore, engine and gateway on loopback, wait until each is healthy,
print how to talk to them, and stop all three cleanly on Ctrl-C.

    python scripts/run_all.py [--model DIR|ignis-tiny] [--config ignis.toml] [--set reuse.retained_device=16]
                              [--gateway-port 8000] [--engine-port 50051] [--tierstore-port 50061]
                              [--no-tierstore] [-- EXTRA ENGINE FLAGS]

Settings (`--config`, `--set`, and IGNIS_SECTION__KEY variables) reach the engine and the
tierstore alike. `make run ARGS="..."` passes its ARGS here; `MODEL=DIR make run` serves DIR.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "ignis-tierstore-"  # tierstore/arena.py names its shared-memory file so


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path


def wait_ready(child: Child, timeout: float) -> None:
    """Each service writes its port file only once it is serving (the engine: once the model is loaded)."""
    deadline = time.monotonic() + timeout
    while not (child.ready_file.exists() and child.ready_file.read_text().strip()):
        if child.process.poll() is not None:
            raise SystemExit(f"{child.name} exited with status {child.process.returncode} (its log is above)")
        if time.monotonic() > deadline:
            raise SystemExit(f"{child.name} did not become ready in {timeout:.0f}s")
        time.sleep(0.1)


def arenas() -> set[Path]:
    return set(SHM_DIR.glob(ARENA_PREFIX + "*")) if SHM_DIR.is_dir() else set()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("MODEL") or "ignis-tiny",
                        help="checkpoint directory, or ignis-tiny (default; $MODEL)")
    parser.add_argument("--config", default=None, metavar="PATH", help="TOML settings file (engine and tierstore)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a setting for the engine and the tierstore (repeatable)")
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("--engine-port", type=int, default=50051)
    parser.add_argument("--tierstore-port", type=int, default=50061)
    parser.add_argument("--engine-metrics-port", type=int, default=9400)
    parser.add_argument("--tierstore-metrics-port", type=int, default=9401)
    parser.add_argument("--no-tierstore", action="store_true", help="device-only reuse: do not start the tierstore")
    parser.add_argument("engine_args", nargs="*", help="extra engine flags (after --)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    settings = (["--config", args.config] if args.config else []) + [f for s in args.set for f in ("--set", s)]
    scratch = Path(tempfile.mkdtemp(prefix="ignis-run-"))
    arenas_before = arenas()
    children: list[Child] = []

    def start(name: str, module: str, flags: list[str]) -> Child:
        ready = scratch / f"{name}.port"
        # A session of its own: Ctrl-C reaches only us, and we stop the services in order.
        proc = subprocess.Popen([sys.executable, "-m", module, *flags, "--port-file", str(ready)], cwd=ROOT,
                                start_new_session=True)
        child = Child(name, proc, ready)
        children.append(child)
        return child

    def stop_all() -> None:
        for child in reversed(children):  # gateway, engine, tierstore: callers first
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(30)
            except subprocess.TimeoutExpired:
                print(f"{child.name} did not stop in 30 s: killed", flush=True)
                child.process.kill()
                child.process.wait()
        for leftover in arenas() - arenas_before:  # only if the tierstore could not remove its own
            leftover.unlink(missing_ok=True)
            print(f"removed {leftover}", flush=True)
        print("\nall services stopped", flush=True)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tierstore = f"127.0.0.1:{args.tierstore_port}"
    try:
        if not args.no_tierstore:
            wait_ready(start("tierstore", "tierstore", [
                "--port", str(args.tierstore_port), "--metrics-port", str(args.tierstore_metrics_port),
                *settings]), 120)
        print(f"starting the engine ({args.model}); the first run generates ignis-tiny ...", flush=True)
        engine_flags = ["--model", args.model, "--port", str(args.engine_port),
                        "--metrics-port", str(args.engine_metrics_port), *settings]
        if not args.no_tierstore:
            engine_flags += ["--tierstore", tierstore]
        wait_ready(start("engine", "engine", engine_flags + args.engine_args), 1800)
        wait_ready(start("gateway", "gateway", [
            "--host", "127.0.0.1", "--port", str(args.gateway_port),
            "--engine", f"127.0.0.1:{args.engine_port}"]), 120)
        print_banner(args)
        while all(c.process.poll() is None for c in children):
            time.sleep(0.5)
        dead = [c.name for c in children if c.process.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping the rest", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all()


def print_banner(args: argparse.Namespace) -> None:
    model_id = "ignis-tiny" if args.model == "ignis-tiny" else Path(args.model).name
    url = f"http://127.0.0.1:{args.gateway_port}"
    lines = [
        "",
        f"gateway   (OpenAI API)  {url}/v1        metrics {url}/metrics",
        f"engine    (gRPC)        127.0.0.1:{args.engine_port}     metrics http://127.0.0.1:{args.engine_metrics_port}/metrics",
    ]
    if not args.no_tierstore:
        lines.append(f"tierstore (gRPC)        127.0.0.1:{args.tierstore_port}     "
                     f"metrics http://127.0.0.1:{args.tierstore_metrics_port}/metrics")
    lines += [
        "",
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"  -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'",
        "",
        "from openai import OpenAI",
        f"client = OpenAI(base_url=\"{url}/v1\", api_key=\"unused\")",
        f"r = client.chat.completions.create(model=\"{model_id}\", messages=[{{\"role\": \"user\", \"content\": \"hi\"}}])",
        "print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)",
        "",
        f"grpcurl -plaintext 127.0.0.1:{args.engine_port} list",
        "",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
