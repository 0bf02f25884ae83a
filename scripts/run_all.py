"""`make run`: start the services on loopback, wait until each is healthy, print how to
talk to them, and stop them all cleanly on Ctrl-C.

    python scripts/run_all.py [--model DIR|ignis-tiny] [--engine-port 50051] [--gateway-port 8000] [-- ENGINE ARGS]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not become ready in {timeout:.0f}s")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("MODEL") or "ignis-tiny")
    parser.add_argument("--engine-port", type=int, default=50051)
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("engine_args", nargs="*", help="extra engine flags (after --)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ignis-run-"))
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # Ctrl-C reaches us, we stop them
        procs.append((name, proc))
        return proc

    def stop_all(*_: object) -> None:
        for name, proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print("\nall services stopped")

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        engine_ready = scratch / "engine.port"
        engine = start("engine", [sys.executable, "-m", "engine", "--model", args.model, "--port",
                                  str(args.engine_port), "--port-file", str(engine_ready), *args.engine_args])
        print(f"starting the engine ({args.model}); the first run generates ignis-tiny ...", flush=True)
        wait_for_file(engine_ready, engine, "engine", 600)
        gateway_url = None
        if (ROOT / "gateway" / "__main__.py").exists():
            gateway_ready = scratch / "gateway.port"
            gateway = start("gateway", [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port",
                                        str(args.gateway_port), "--engine", f"127.0.0.1:{args.engine_port}",
                                        "--port-file", str(gateway_ready)])
            wait_for_file(gateway_ready, gateway, "gateway", 120)
            gateway_url = f"http://127.0.0.1:{args.gateway_port}"
        model_id = "ignis-tiny" if args.model == "ignis-tiny" else Path(args.model).name
        print(f"\nengine  (gRPC) 127.0.0.1:{args.engine_port}   grpcurl -plaintext 127.0.0.1:{args.engine_port} list")
        if gateway_url:
            print(f"gateway (HTTP) {gateway_url}/v1\n")
            print(f"curl {gateway_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                  f"  -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'\n")
            print("from openai import OpenAI\n"
                  f"client = OpenAI(base_url=\"{gateway_url}/v1\", api_key=\"unused\")\n"
                  f"r = client.chat.completions.create(model=\"{model_id}\", messages=[{{\"role\": \"user\", \"content\": \"hi\"}}])\n"
                  "print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)\n")
        print("Ctrl-C stops everything.", flush=True)
        while all(p.poll() is None for _, p in procs):
            time.sleep(0.5)
        dead = [n for n, p in procs if p.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping the rest")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
