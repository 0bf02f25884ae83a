"""`python -m tierstore` / `ignis-tierstore`: serve the lower tiers over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from common.logs import configure_logging
from common.settings import Settings, parse_service_args
from common.tracing import run_traced
from common.metrics import serve_metrics
from tierstore.metrics import store_registry
from tierstore.server import TierStoreService, create_server, set_serving
from tierstore.store import StoreConfig, TierStore

log = logging.getLogger("ignis.tierstore")

# Flags that are shorthands for settings keys (they win over file and environment).
_SETTING_FLAGS = {
    "kv_host_pool_bytes": "reuse.kv_host_pool_bytes",
    "kv_disk_path": "kv_disk.path",
    "kv_disk_bytes": "kv_disk.bytes",
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(prog="ignis-tierstore",
                                     description="Serve the KV-RAM arena and KV-disk tier (ignis.v1.TierStore).")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=50061, help="gRPC port (0 picks a free one)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving (for tests)")
    parser.add_argument("--metrics-port", type=int, default=0, help="HTTP port of /metrics (0: off)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to finish in-flight calls on shutdown")
    parser.add_argument("--lease-seconds", type=float, default=60.0,
                        help="lease length of an Acquire that asks for 0 (default 60)")
    parser.add_argument("--reservation-seconds", type=float, default=300.0,
                        help="a reservation not committed within this is abandoned (default 300)")
    return parse_service_args(parser, _SETTING_FLAGS, argv)


async def serve(args: argparse.Namespace, settings: Settings, tracing: bool = False) -> int:
    config = StoreConfig(arena_bytes=settings.reuse.kv_host_pool_bytes, disk_path=settings.kv_disk.path,
                         disk_bytes=settings.kv_disk.bytes,
                         interactive_ttl=settings.reuse.retained_interactive_ttl,
                         lease_seconds=args.lease_seconds, reservation_seconds=args.reservation_seconds)
    try:
        store = await asyncio.to_thread(TierStore, config)  # reconciles the disk tier: may take a moment
    except (OSError, ValueError) as exc:
        log.error("cannot start the tierstore: %s", exc)
        return 2
    stats = store.stats()
    log.info("arena %s (%d bytes); kv-disk %s: %d states, %d of %d bytes", store.arena.path,
             stats.arena_bytes_total, config.disk_path if config.disk_bytes else "off", stats.states_disk,
             stats.disk_bytes_used, stats.disk_bytes_total)
    metrics = serve_metrics(args.host, args.metrics_port, store_registry(store.stats)) if args.metrics_port else None

    server, port, health = create_server(TierStoreService(store), f"{args.host}:{args.port}", tracing)
    await server.start()
    await set_serving(health, True)
    log.info("tierstore serving on %s:%d", args.host, port)
    if args.port_file:  # written whole, then renamed: a poller never reads half a number
        tmp = Path(f"{args.port_file}.tmp")
        tmp.write_text(str(port))
        os.replace(tmp, args.port_file)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def sweep() -> None:  # leases and reservations run out even when nobody calls
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(store.expire)

    sweeper = asyncio.ensure_future(sweep())
    await stop.wait()
    log.info("shutting down: finishing in-flight calls for up to %.0fs", args.grace)
    await set_serving(health, False)
    await server.stop(args.grace)
    sweeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()
    store.close()  # removes the shared-memory file
    log.info("tierstore stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    args, settings = parse_args(argv)
    sys.exit(run_traced("ignis-tierstore", lambda tracing: serve(args, settings, tracing)))


if __name__ == "__main__":
    main()
