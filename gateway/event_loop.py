"""The gateway's event loop (`--loop`): asyncio's own, or uvloop (libuv, in C).

Most of the gateway's own work per streamed token is the event loop's: an epoll wake-up, a socket
write, the gRPC poller's hand-off. uvloop does those in C; bench/gateway.py measures a gateway on
each loop side by side in one run. grpc.aio runs on either.
"""

from __future__ import annotations

import asyncio

LOOPS = ("asyncio", "uvloop")


def install(name: str) -> None:
    """Make `asyncio.run` (common.tracing.run_traced) create loops of `name`."""
    if name not in LOOPS:
        raise ValueError(f"--loop must be one of {', '.join(LOOPS)}, not {name!r}")
    if name == "uvloop":
        import uvloop

        # A policy rather than a loop_factory: run_traced (shared by the services) calls asyncio.run.
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(None)  # asyncio's default


def running_loop() -> str:
    """The running loop's kind, as the serving log line names it."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
