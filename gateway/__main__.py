"""`python -m gateway` / `ignis-gateway`: serve the OpenAI API in front of one or more engines."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Iterator

import uvicorn

from common.bearer import read_secret
from common.cli_help import DefaultsHelpFormatter
from common.heap import freeze_startup_heap
from common.logs import configure_logging
from common.sizes import parse_size
from common.tracing import run_traced
from gateway.app import create_app
from gateway.config import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_STREAM_BUFFER_BYTES, UPSTREAMS, GatewayConfig
from gateway.connection_faults import UvicornWarnings
from gateway.event_loop import LOOPS, install, running_loop
from gateway.http_protocol import HTTP_PARSERS, protocol_class
from gateway.media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES
from gateway.session_socket import loopback_host
from gateway.shutdown import Shutdown
from gateway.state import GatewayState

log = logging.getLogger("ignis.gateway")
BACKLOG = 1024  # listen queue; also how many connections asyncio accepts per wake-up at most
WS_PING_INTERVAL = WS_PING_TIMEOUT = 20.0  # seconds (uvicorn's defaults, said here)
# Past --grace: time for the streams the stop ended to send their last event; then uvicorn cancels what is left.
END_MARGIN = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, with the gateway's stop (gateway/shutdown.py), ending with status 0 after it.

    A SIGTERM/SIGINT drains for `grace` seconds, then ends the generations still running with a final
    event; a second signal ends them at once. (uvicorn would cancel them at the grace's end, and
    re-raise the signal once it has shut down, so the process would end killed by it.)
    """

    def __init__(self, config: uvicorn.Config, stop: Shutdown, grace: float) -> None:
        super().__init__(config)
        self.gateway_stop, self.grace = stop, grace

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and not self.gateway_stop.ended:
            log.info("%s again: ending the open streams now", signal.Signals(sig).name)
            self.gateway_stop.end()
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("stopping: open streams have %g s to finish (--grace), then end with an error event; "
                 "a second signal ends them now", self.grace)
        for server in self.servers:  # no new connection from here (uvicorn's shutdown closes them again)
            server.close()
        self.gateway_stop.drain()
        ending = asyncio.get_running_loop().call_later(self.grace, self.gateway_stop.end)
        try:
            # The WebSockets close themselves (1001) after their turn: uvicorn's shutdown would cut them (1012).
            try:
                async with asyncio.timeout(self.grace + END_MARGIN):
                    await self.gateway_stop.sockets_closed()
            except TimeoutError:
                log.warning("WebSockets still open %g s after the grace: closed with 1012", END_MARGIN)
            await super().shutdown(sockets)
        finally:
            ending.cancel()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, GatewayConfig]:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter, prog="ignis-gateway",
        description="OpenAI-compatible REST gateway to engines.")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    parser.add_argument("--engine", action="append", default=[], metavar="HOST:PORT|unix:PATH",
                        help="an engine's gRPC address: unix:/path of its socket on this host (engine.socket), or "
                             "HOST:PORT over TCP (with --engine-secret-file); repeat for several engines")
    parser.add_argument("--engine-secret-file", default="", metavar="PATH",
                        help="the engines' shared secret (their engine.secret_file), sent on every call over TCP "
                             "(default: none; a TCP engine then refuses every call but health checks)")
    parser.add_argument("--api-key", default=os.environ.get("IGNIS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $IGNIS_API_KEY, or none)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve on a --host beyond loopback without an API key (anyone who reaches the port "
                             "may use every API, stored responses and the Monitor included)")
    parser.add_argument("--metrics-auth", action="store_true",
                        help="require the API key on /metrics too (default: /metrics and /health are open)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving (for tests)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="deadline of one generation in seconds (default: none)")
    parser.add_argument("--upstream", choices=UPSTREAMS, default="session",
                        help="how generations reach an engine: session (one GenerateSession stream per engine, "
                             "a step's tokens for all its requests in one message, on the engine's session "
                             "socket when it is on this host), grpc-session (the same stream, always over gRPC) "
                             "or calls (a Generate call per request)")
    parser.add_argument("--engine-dns", action="append", default=[], metavar="NAME:PORT",
                        help="a DNS name (e.g. a Kubernetes headless Service) whose every A/AAAA address is an "
                             "engine at PORT; repeatable, may be combined with --engine")
    parser.add_argument("--dns-refresh", type=float, default=10.0,
                        help="seconds between lookups of the --engine-dns names (default: 10)")
    parser.add_argument("--routing", choices=["bounded", "affinity", "round-robin"], default="bounded",
                        help="engine choice: bounded (a conversation's engine unless it carries more than "
                             "--load-bound x the mean load; the default), affinity (the prompt head's engine "
                             "always), round-robin")
    parser.add_argument("--load-bound", type=float, default=1.25,
                        help="bounded routing: an engine takes at most ceil(BOUND x mean in-flight requests); "
                             ">= 1 (default: 1.25)")
    parser.add_argument("--probe-interval", type=float, default=2.0, help="seconds between engine health probes")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a request may take to send its headers; then it is closed (default: 10)")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request may take to send its body after the headers; then 408 (default: 30)")
    parser.add_argument("--max-connections", type=int, default=2048,
                        help="open connections at most; more are answered 503 and closed (default: 2048)")
    parser.add_argument("--max-connections-per-client", type=int, default=None, metavar="N",
                        help="open connections from one client address at most; more from it are answered 429 "
                             "and closed, so one peer cannot take the whole budget (default: half of "
                             "--max-connections; 0: no limit, e.g. behind a proxy that is the only client)")
    parser.add_argument("--max-request-bytes", type=_size, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body, e.g. 16MiB; a larger one is a 413 (default: 16MiB)")
    parser.add_argument("--max-stream-buffer", type=_size, default=DEFAULT_MAX_STREAM_BUFFER_BYTES,
                        help="engine messages held for one stream whose client reads slower than the engine "
                             "writes, e.g. 8MiB; past it the stream ends with an error and the engine stops "
                             "its request (--upstream session; default: 8MiB)")
    parser.add_argument("--fault-log-interval", type=float, default=10.0,
                        help="seconds between the summary log lines of slow, refused and malformed connections "
                             "(default: 10)")
    parser.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                        help="a browser origin allowed to call the API (CORS) and open a WebSocket (repeatable, "
                             "'*' for any; default: no CORS, WebSockets from loopback pages only)")
    parser.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral", "qwen3_coder"],
                        default="", help="how tool calls are read from model text, for every model "
                                         "(default: what each engine reads off its chat template, else hermes)")
    parser.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1", "none"], default="",
                        help="split <think>...</think> into reasoning_content, for every model "
                             "(default: what each engine reads off its chat template)")
    parser.add_argument("--allowed-media-domains", action="append", default=[], metavar="HOST",
                        help="a host whose http(s) image URLs the gateway fetches for clients (repeatable; "
                             "default: none: only data: URLs are read, the server fetches no URL for a client)")
    parser.add_argument("--allowed-local-media-path", default="", metavar="DIR",
                        help="a folder whose files clients may name as file:// image URLs (symlinks resolved, "
                             "must stay inside it; default: none)")
    parser.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES, metavar="N",
                        help="images in one request at most; more is a 400 (0: images refused; default: 16)")
    parser.add_argument("--max-image-bytes", type=_size, default=DEFAULT_MAX_IMAGE_BYTES,
                        help="one image's encoded file at most, e.g. 20MiB; a larger one is a 400 (default: 20MiB)")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                        help="one image's width x height at most, read from its header before decoding; a larger "
                             "one is a 400 (default: 33177600, 7680x4320)")
    parser.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds open requests have to finish on shutdown (SIGTERM/SIGINT); then streams end "
                             "with an error event (response.failed on /v1/responses), others with a 503")
    parser.add_argument("--http", choices=HTTP_PARSERS, default=HTTP_PARSERS[0],
                        help="HTTP/1.1 parser: httptools (llhttp, in C) or h11 (pure Python)")
    parser.add_argument("--loop", choices=LOOPS, default="asyncio",
                        help="event loop: asyncio's own or uvloop (libuv; see the README for what differs)")
    args = parser.parse_args(argv)
    try:
        config = GatewayConfig(engines=args.engine, engine_secret_file=args.engine_secret_file, api_key=args.api_key or None, metrics_auth=args.metrics_auth,
                               request_timeout=args.request_timeout, upstream=args.upstream,
                               probe_interval=args.probe_interval,
                               header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                               max_connections=args.max_connections,
                               max_connections_per_client=args.max_connections_per_client,
                               max_request_bytes=args.max_request_bytes,
                               max_stream_buffer_bytes=args.max_stream_buffer,
                               fault_log_interval=args.fault_log_interval, routing=args.routing,
                               load_bound=args.load_bound, engine_dns=args.engine_dns,
                               dns_refresh=args.dns_refresh, tool_call_parser=args.tool_call_parser,
                               reasoning_parser=args.reasoning_parser, allowed_origins=args.allowed_origins,
                               allowed_media_domains=args.allowed_media_domains,
                               allowed_local_media_path=args.allowed_local_media_path,
                               max_images_per_request=args.max_images_per_request,
                               max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels)
    except ValueError as exc:
        parser.error(str(exc))
    if config.api_key is None and not loopback_host(args.host) and not args.allow_unauthenticated:
        parser.exit(2, f"ignis-gateway: error: --host {args.host} is reachable beyond this machine and no API key is "
                       "set: give --api-key (or $IGNIS_API_KEY), or say --allow-unauthenticated\n")
    return args, config



def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _raise_fd_limit(needed: int) -> None:
    """Lift the soft open-files limit towards the hard one so `needed` descriptors fit, or warn once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("the open-files limit is %d (hard); --max-connections needs about %d: lower it or raise "
                    "the limit (ulimit -n)", hard, needed)


async def serve(args: argparse.Namespace, config: GatewayConfig) -> int:
    if config.engine_secret_file:
        try:  # here, not in the lifespan: a clear line, not a traceback (read again when the engine pool starts)
            read_secret(config.engine_secret_file)
        except (OSError, ValueError) as exc:
            log.error("cannot read --engine-secret-file: %s", exc)
            return 2
    # Bind first, so --port 0 has a port to report and the port file is written only once serving.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP,
    # and accepted sockets inherit proto 0 otherwise: every keep-alive answer then waits ~40 ms for an ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    app = create_app(config)
    state: GatewayState = app.state.gateway
    # An upgraded WebSocket's liveness is its ping/pong (a ping every 20 s, the pong due within 20 s),
    # never the HTTP header deadline (gateway/http_protocol.py stops watching it once upgraded).
    uv_config = uvicorn.Config(app, log_level="info", access_log=args.access_log,
                               timeout_graceful_shutdown=args.grace + END_MARGIN, lifespan="on", log_config=None,
                               http=protocol_class(config, state.faults, state.metrics, args.http), backlog=BACKLOG,
                               ws_ping_interval=WS_PING_INTERVAL, ws_ping_timeout=WS_PING_TIMEOUT)
    # Connections, plus one accept batch (asyncio takes up to `backlog` per wake-up) and some to spare.
    _raise_fd_limit(config.max_connections + BACKLOG + 256)
    # Floods of broken clients are counted into one summary line, not logged one by one.
    asyncio.get_running_loop().set_exception_handler(state.faults.accept_failures)
    logging.getLogger("uvicorn.error").addFilter(UvicornWarnings(state.faults))
    server = _Server(uv_config, state.shutdown, args.grace)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        log.info("gateway serving on %s:%d, engines: %s, routing: %s, http: %s, loop: %s", args.host, port,
                 ", ".join([*config.engines, *(f"dns:{n}" for n in config.engine_dns)]), config.routing,
                 args.http, running_loop())
        freeze_startup_heap()  # the app is up: what start-up made stays (common/heap.py)
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(args.port_file)  # readers never see a half-written file

    announcer = asyncio.create_task(announce())
    await server.serve(sockets=[sock])
    announcer.cancel()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    args, config = parse_args(argv)
    install(args.loop)

    async def serve_traced(tracing: bool) -> int:
        config.tracing = tracing
        return await serve(args, config)

    sys.exit(run_traced("ignis-gateway", serve_traced))


if __name__ == "__main__":
    main()
