"""`python -m engine` / `ignis-engine`: serve one model over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from http.server import HTTPServer
from pathlib import Path

import lmdb
import torch

from common.cli_help import DefaultsHelpFormatter
from common.logs import configure_logging
from common.settings import Settings, parse_service_args
from common.tracing import run_traced
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
    "dtype": "engine.dtype",
    "kv_dtype": "engine.kv_dtype",
    "weight_dtype": "engine.weight_dtype",
    "device": "engine.device",
    "tierstore": "tierstore.address",  # --tierstore HOST:PORT
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter, prog="ignis-engine",
        description="Serve a model over gRPC (ignis.v1.Engine).")
    parser.add_argument("--model", default=TINY_NAME,
                        help=f"checkpoint directory, a Hugging Face repo id already in the local cache, or {TINY_NAME}")
    parser.add_argument("--served-model-name", default=None, help="model id clients use (default: from --model)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving (for tests)")
    parser.add_argument("--metrics-port", type=int, default=0, help="HTTP port of /metrics (0: off)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds to finish in-flight work on shutdown")
    parser.add_argument("--session-socket", action=argparse.BooleanOptionalAction, default=True,
                        help="also serve GenerateSession on a private Unix socket, for a gateway on this host "
                             "(engine/session_socket.py)")
    return parse_service_args(parser, _SETTING_FLAGS, argv)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_core(model_path: Path, settings: Settings) -> EngineCore:
    e = settings.engine
    loaded = load_model(model_path, dtype=e.dtype, device=resolve_device(e.device),
                        onednn_linears=e.cpu_linear == "onednn", weight_dtype=e.weight_dtype)
    tokenizer = Tokenizer.from_dir(model_path)
    return EngineCore(loaded, tokenizer, EngineConfig.from_settings(settings))


async def serve(args: argparse.Namespace, settings: Settings, tracing: bool = False) -> int:
    model_id = args.served_model_name or (TINY_NAME if args.model == TINY_NAME else Path(args.model).name)
    r = settings.responses
    try:  # opened before the model loads: a folder that is not ours fails the start at once
        responses = ResponseStore(r.path, r.max_stored, r.ttl) if r.path else None
    except (OSError, lmdb.Error) as exc:
        log.error("cannot open the response store %s: %s", r.path, exc)
        return 2
    service = EngineService(model_id, responses=responses)
    server, port, health = create_server(service, f"{args.host}:{args.port}", tracing)
    await set_serving(health, False)
    await server.start()
    log.info("engine listening on %s:%d (loading %s)", args.host, port, args.model)
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
        on_own_thread, lambda: build_core(resolve_model_path(args.model), settings)))
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
        log.info("engine serving %s on %s:%d", model_id, args.host, port)
        if args.port_file:
            Path(args.port_file).write_text(str(port))
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
