"""`python -m tierstore` / `ignis-tierstore`: serve the lower tiers over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path

from common.cli_help import DefaultsHelpFormatter
from common.logs import configure_logging
from common.settings import Settings, default_tierstore_socket, parse_service_args
from common.tracing import run_traced
from common.metrics import serve_metrics
from common.secret_auth import Listeners, SocketLock
from common.secret_auth import listeners as secret_listeners
from tierstore.copy_ahead import CopyAhead
from tierstore.match_socket import MatchSocket
from tierstore.metrics import store_registry
from tierstore.server import TierStoreService, create_server, set_serving, set_tier_health
from tierstore.store import StoreConfig, TierStore

log = logging.getLogger("ignis.tierstore")

# Flags that are shorthands for settings keys (they win over file and environment).
_SETTING_FLAGS = {
    "kv_host_pool_bytes": "reuse.kv_host_pool_bytes",
    "kv_disk_path": "kv_disk.path",
    "kv_disk_bytes": "kv_disk.bytes",
    "socket": "tierstore.socket",
    "secret_file": "tierstore.secret_file",
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, prog="ignis-tierstore",
                                     description="Serve the KV-RAM arena and KV-disk tier (ignis.v1.TierStore).")
    parser.add_argument("--host", default="127.0.0.1", help="TCP bind address, with --port (default: loopback)")
    parser.add_argument("--port", type=int, default=None,
                        help="also serve gRPC over TCP on this port (0 picks a free one), every call but health "
                             "checks authenticated with the secret in --secret-file; default: the Unix socket only")
    parser.add_argument("--port-file", default=None, help="write the bound TCP port here once serving")
    parser.add_argument("--ready-file", default=None,
                        help="write JSON {address, socket, port, arena, pid} here once serving (for launchers)")
    parser.add_argument("--metrics-port", type=int, default=0, help="HTTP port of /metrics (0: off)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to finish in-flight calls on shutdown")
    parser.add_argument("--lease-seconds", type=float, default=60.0,
                        help="lease length of an Acquire that asks for 0 (default 60)")
    parser.add_argument("--reservation-seconds", type=float, default=300.0,
                        help="a reservation not committed within this is abandoned (default 300)")
    return parse_service_args(parser, _SETTING_FLAGS, argv)


def listeners(args: argparse.Namespace, settings: Settings) -> Listeners:
    """(addresses to bind, the socket's lock, the TCP secret); OSError (AccessError) if they cannot be private."""
    t = settings.tierstore
    return secret_listeners("tierstore", t.socket, default_tierstore_socket(), args.host, args.port, t.secret_file)


def start_match_socket(store: TierStore, lock: SocketLock | None) -> MatchSocket | None:
    """Match served beside the gRPC socket (match_socket.py), when there is one; a store that cannot
    bind it still serves, Match over gRPC only."""
    if lock is None:
        return None
    match_socket = MatchSocket(store, Path(f"{lock.path}.match"))
    try:
        match_socket.start()
    except OSError as exc:
        log.warning("Match over gRPC only: cannot serve the match socket %s: %s", match_socket.path, exc)
        return None
    return match_socket


def write_atomically(path: str, text: str) -> None:
    """Written whole, then renamed: a poller never reads half of it."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def serve(args: argparse.Namespace, settings: Settings, tracing: bool = False) -> int:
    os.umask(0o077)  # everything the tierstore creates is its own: arena, socket, blobs, index
    faulthandler.enable()  # a SIGBUS (a file truncated under a mapping) leaves a traceback, not silence
    try:
        addresses, lock, secret = listeners(args, settings)
    except OSError as exc:
        log.error("cannot start the tierstore: %s", exc)
        return 2
    config = StoreConfig(arena_bytes=settings.reuse.kv_host_pool_bytes, disk_path=settings.kv_disk.path,
                         disk_bytes=settings.kv_disk.bytes,
                         interactive_ttl=settings.reuse.retained_interactive_ttl,
                         lease_seconds=args.lease_seconds, reservation_seconds=args.reservation_seconds,
                         copy_ahead=settings.kv_disk.copy_ahead)
    try:
        store = await asyncio.to_thread(TierStore, config)  # reconciles the disk tier: may take a moment
    except (OSError, ValueError) as exc:
        log.error("cannot start the tierstore: %s", exc)
        if lock is not None:
            lock.close()
        return 2
    stats = store.stats()
    log.info("arena %s (%d bytes); kv-disk %s: %d states, %d of %d bytes", store.arena.path.name,
             stats.arena_bytes_total, config.disk_path if config.disk_bytes else "off", stats.states_disk,
             stats.disk_bytes_used, stats.disk_bytes_total)
    try:
        metrics = serve_metrics(args.host, args.metrics_port, store_registry(store.stats)) if args.metrics_port else None
    except OSError as exc:  # the port is taken: say so instead of a traceback
        log.error("cannot serve /metrics on %s:%d: %s", args.host, args.metrics_port, exc)
        store.close()
        if lock is not None:
            lock.close()
        return 2

    match_socket = start_match_socket(store, lock)
    try:
        server, port, health = create_server(
            TierStoreService(store, str(match_socket.path) if match_socket is not None else ""),
            addresses, tracing, secret)
    except OSError as exc:
        log.error("cannot start the tierstore: %s", exc)
        if match_socket is not None:
            match_socket.close()
        store.close()
        if lock is not None:
            lock.close()
        return 2
    if lock is not None:
        lock.bound()
    await server.start()
    await set_serving(health, True)
    await set_tier_health(health, store.stats())
    served = [a for a in addresses if a.startswith("unix:")] + ([f"{args.host}:{port} (TCP, secret required)"]
                                                                 if args.port is not None else [])
    if match_socket is not None:
        served.append(f"{match_socket.path} (Match, framed)")
    log.info("tierstore serving on %s", " and ".join(served))
    if args.port_file and args.port is not None:
        write_atomically(args.port_file, str(port))
    if args.ready_file:
        write_atomically(args.ready_file, json.dumps({
            "address": addresses[0] if lock is not None else f"{args.host}:{port}",
            "socket": str(lock.path) if lock is not None else None, "port": port if args.port is not None else None,
            "arena": str(store.arena.path), "pid": os.getpid()}))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def sweep() -> None:  # leases and reservations run out, faults are found, even when nobody calls
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(store.expire)
            await set_tier_health(health, await asyncio.to_thread(store.stats))  # the lock may wait on I/O

    sweeper = asyncio.ensure_future(sweep())
    copier = CopyAhead(store)
    copier.start()
    await stop.wait()
    log.info("shutting down: finishing in-flight calls for up to %.0fs", args.grace)
    await set_serving(health, False)
    await server.stop(args.grace)
    sweeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper
    await asyncio.to_thread(copier.stop)  # its copy in flight is published or dropped before the store closes
    if match_socket is not None:
        match_socket.close()
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()
    store.close()  # removes the shared-memory file
    if lock is not None:
        lock.close()  # and the socket
    log.info("tierstore stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    args, settings = parse_args(argv)
    sys.exit(run_traced("ignis-tierstore", lambda tracing: serve(args, settings, tracing)))


if __name__ == "__main__":
    main()
