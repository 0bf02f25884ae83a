"""`python -m engine` / `ignis-engine`: serve one model over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from http.server import HTTPServer
from pathlib import Path

import lmdb
import torch

from common.cli_help import DefaultsHelpFormatter
from common.logs import configure_logging
from common.secret_auth import Listeners, listeners as secret_listeners
from common.settings import Settings, default_engine_socket, parse_service_args
from common.tracing import run_traced
from engine import cpu_host
from engine.config import EngineConfig
from engine.core import EngineCore
from common.metrics import serve_metrics
from engine.model.errors import CheckpointError
from engine.model.loader import load_model
from engine.model.openmp import on_own_thread
from engine.model.tiny import TINY_NAME, resolve_model_path
from engine.responses_store import ResponseStore
from engine.server import EngineService, create_server, set_serving
from engine.session_socket import SessionSocket
from engine.text.tokenizer import Tokenizer

log = logging.getLogger("ignis.engine")

# Flags that are shorthands for settings keys (they win over file and environment).
_SETTING_FLAGS = {
    "max_model_len": "engine.max_model_len",
    "max_queue": "engine.max_queue",
    "max_num_seqs": "engine.max_num_seqs",
    "page_size": "engine.page_size",
    "kv_cache_bytes": "engine.kv_cache_bytes",
    "prefill_chunk_tokens": "engine.prefill_chunk_tokens",
    "step_time_target_ms": "engine.step_time_target_ms",
    "dtype": "engine.dtype",
    "kv_dtype": "engine.kv_dtype",
    "weight_dtype": "engine.weight_dtype",
    "device": "engine.device",
    "tierstore": "tierstore.address",  # --tierstore HOST:PORT
    "socket": "engine.socket",
    "secret_file": "engine.secret_file",
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter, prog="ignis-engine",
        description="Serve a model over gRPC (ignis.v1.Engine).")
    parser.add_argument("--model", default=TINY_NAME,
                        help=f"checkpoint directory, a Hugging Face repo id already in the local cache, or {TINY_NAME}")
    parser.add_argument("--served-model-name", default=None, help="model id clients use (default: from --model)")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", type=lora_argument,
                        help="serve a LoRA adapter (a PEFT folder) as model NAME beside the base model; repeatable. "
                             "Turns lora.enabled on")
    parser.add_argument("--host", default="127.0.0.1", help="TCP bind address, with --port (default: loopback only)")
    parser.add_argument("--port", type=int, default=None,
                        help="also serve gRPC over TCP on this port (0 picks a free one), every call but health "
                             "checks authenticated with the secret in --secret-file; default: the Unix socket "
                             "(engine.socket) only")
    parser.add_argument("--port-file", default=None, help="write the bound TCP port here once serving (for tests)")
    parser.add_argument("--ready-file", default=None,
                        help="write JSON {address, socket, port, pid} here once serving (for launchers)")
    parser.add_argument("--metrics-port", type=int, default=0, help="HTTP port of /metrics (0: off)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds to finish in-flight work on shutdown")
    parser.add_argument("--session-socket", action=argparse.BooleanOptionalAction, default=True,
                        help="also serve GenerateSession on a private Unix socket, for a gateway on this host "
                             "(engine/session_socket.py)")
    args, settings = parse_service_args(parser, _SETTING_FLAGS, argv)
    if args.lora:
        settings.lora.enabled = True
        if len({name for name, _ in args.lora}) < len(args.lora):
            parser.error("--lora: two adapters with one name")
    return args, settings


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lora_argument(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def build_core(model_path: Path, settings: Settings, model_id: str = "", loras: list[tuple[str, str]] | None = None
               ) -> EngineCore:
    e = settings.engine
    device = resolve_device(e.device)
    if device.type == "cpu":  # what a CPU step's speed depends on, for comparing two machines' logs
        log.info("%s", cpu_host.describe().summary())
    loaded = load_model(model_path, dtype=e.dtype, device=device,
                        onednn_linears=e.cpu_linear != "torch", weight_dtype=e.weight_dtype,
                        decode_linear="onednn" if e.cpu_linear == "torch" else e.cpu_linear)
    tokenizer = Tokenizer.from_dir(model_path)
    core = EngineCore(loaded, tokenizer, EngineConfig.from_settings(settings))
    for name, path in loras or []:  # before the step thread starts: each is placed at once
        if name == model_id:
            raise ValueError(f"--lora {name}={path}: {name!r} is the base model's name")
        assert core.adapters is not None  # --lora turned lora.enabled on
        adapter = core.adapters.sites.read(path)
        served = core.load_adapter(name, adapter).result()
        log.info("serving LoRA adapter %s (rank %d) from %s", served.name, served.rank, served.path)
    return core


def listeners(args: argparse.Namespace, settings: Settings) -> Listeners:
    """(addresses to bind, the socket's lock, the TCP secret); OSError (AccessError) if they cannot be private."""
    e = settings.engine
    return secret_listeners("engine", e.socket, default_engine_socket(), args.host, args.port, e.secret_file)


def write_atomically(path: str, text: str) -> None:
    """Written whole, then renamed: a poller never reads half of it."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def serve(args: argparse.Namespace, settings: Settings, tracing: bool = False) -> int:
    try:
        addresses, lock, secret = listeners(args, settings)
    except OSError as exc:
        log.error("cannot start the engine: %s", exc)
        return 2
    try:
        return await serve_on(args, settings, addresses, secret, tracing)
    finally:
        if lock is not None:
            lock.close()  # removes the socket


async def serve_on(args: argparse.Namespace, settings: Settings, addresses: list[str], secret: bytes | None,
                   tracing: bool) -> int:
    model_id = args.served_model_name or (TINY_NAME if args.model == TINY_NAME else Path(args.model).name)
    r = settings.responses
    try:  # opened before the model loads: a folder that is not ours fails the start at once
        responses = ResponseStore(r.path, r.max_stored, r.ttl) if r.path else None
    except (OSError, lmdb.Error) as exc:
        log.error("cannot open the response store %s: %s", r.path, exc)
        return 2
    service = EngineService(model_id, responses=responses)
    try:
        server, port, health = create_server(service, addresses, tracing, secret)
    except OSError as exc:
        log.error("cannot start the engine: %s", exc)
        if responses is not None:
            responses.close()
        return 2
    socket = addresses[0].removeprefix("unix:") if addresses[0].startswith("unix:") else ""
    if socket:
        os.chmod(socket, 0o600)  # whatever the umask was (its folder is 0700 anyway)
    served = " and ".join([f"{socket} (Unix socket)"] * bool(socket) +
                          [f"{args.host}:{port} (TCP, secret required)"] * (args.port is not None))
    await set_serving(health, False)
    await server.start()
    log.info("engine listening on %s (loading %s)", served, args.model)
    session_socket = SessionSocket(service)
    if args.session_socket:
        try:
            await session_socket.start()
            service.session_socket = session_socket.path
            log.info("GenerateSession also on %s", session_socket.path)
        except OSError as exc:
            log.warning("GenerateSession over gRPC only: cannot serve a session socket: %s", exc)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # On a thread that ends with it: no OpenMP team outlives the load (engine/model/openmp.py).
    load = asyncio.ensure_future(asyncio.to_thread(
        on_own_thread, lambda: build_core(resolve_model_path(args.model), settings, model_id, args.lora)))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED)
    core = None
    metrics: HTTPServer | None = None
    if load.done():
        try:
            core = load.result()
        except (CheckpointError, ValueError, OSError) as exc:
            log.error("cannot load %s: %s", args.model, exc)
            await server.stop(0)
            return 2
        core.start()
        service.attach(core)
        if args.metrics_port:
            try:
                metrics = serve_metrics(args.host, args.metrics_port, core.metrics.registry)
            except OSError as exc:  # the port is taken: say so instead of a traceback
                log.error("cannot serve /metrics on %s:%d: %s", args.host, args.metrics_port, exc)
                core.stop()
                await server.stop(0)
                return 2
            log.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
        await set_serving(health, True)
        log.info("engine serving %s on %s", model_id, served)
        if args.port_file and args.port is not None:
            write_atomically(args.port_file, str(port))
        if args.ready_file:
            write_atomically(args.ready_file, json.dumps({
                "address": f"unix:{socket}" if socket else f"{args.host}:{port}", "socket": socket or None,
                "port": port if args.port is not None else None, "pid": os.getpid()}))
        await stop.wait()

    log.info("shutting down: finishing in-flight work for up to %.0fs", args.grace)
    service.accepting = False
    await set_serving(health, False)
    await server.stop(args.grace)  # in-flight RPCs get `grace` seconds, then are cancelled
    await session_socket.close()  # its calls had the same seconds
    if core is not None:
        core.stop()
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()
    load.cancel()
    if responses is not None:
        responses.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    args, settings = parse_args(argv)
    sys.exit(run_traced("ignis-engine", lambda tracing: serve(args, settings, tracing)))


if __name__ == "__main__":
    main()
