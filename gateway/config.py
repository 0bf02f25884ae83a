"""The gateway's configuration (from the command line)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gateway.discovery import DnsName
from gateway.media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES, MediaPolicy
from gateway.routing import RoutingRule

UPSTREAMS = ("session", "grpc-session", "calls")
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 32k-token prompt is well under 1 MiB, as text or as token ids
# A stream's engine messages held for a client that reads slower than the engine writes: ~40k tokens
# of plain text, ~4k with 20 logprobs each (gateway/session.py).
DEFAULT_MAX_STREAM_BUFFER_BYTES = 8 << 20


@dataclass(slots=True)
class GatewayConfig:
    engines: list[str]  # each engine's gRPC server: HOST:PORT (TCP) or unix:/path (its socket on this host)
    # The engines' shared secret (engine.secret_file), sent on every call over TCP; "": none (a TCP engine then
    # refuses every call but health).
    engine_secret_file: str = ""
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    metrics_auth: bool = False  # /metrics needs the key too (only with api_key)
    request_timeout: float | None = None  # gRPC deadline of one generation, seconds; None = none
    # How generations reach an engine: "session" (all on one GenerateSession stream per engine, a step's
    # tokens in one message: gateway/session.py; on the engine's session socket when it is on this host,
    # gateway/session_socket.py), "grpc-session" (the same stream, always over gRPC) or "calls" (one
    # Generate call each).
    upstream: str = "session"
    probe_interval: float = 2.0  # seconds between engine health probes
    probe_timeout: float = 2.0
    tracing: bool = False  # a server span per request (on when an OTLP endpoint is configured)
    # Slow clients and big bodies (gateway/http_protocol.py, gateway/body_deadline.py, gateway/body.py).
    header_timeout: float = 10.0  # seconds from a request's first byte (a connection's start) to its last header
    body_timeout: float = 30.0  # seconds from the end of the headers to the last byte of the body
    max_connections: int = 2048  # open connections; more are answered 503 and closed
    # Open connections from one client address; more from it are answered 429 and closed. None: half of
    # max_connections (so one peer never holds the whole budget); 0: no per-client limit.
    max_connections_per_client: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is a 413
    max_stream_buffer_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES  # a slow reader's stream is ended past this
    fault_log_interval: float = 10.0  # seconds between summary lines of slow/refused/malformed connections
    # Engine choice and discovery (gateway/routing.py, gateway/discovery.py).
    routing: str = "bounded"  # bounded | affinity | round-robin
    load_bound: float = 1.25  # bounded: an engine takes at most ceil(load_bound * mean in-flight)
    engine_dns: list[str] = field(default_factory=list)  # NAME:PORT, each address it resolves to is an engine
    dns_refresh: float = 10.0  # seconds between lookups of engine_dns
    # Output parsers (gateway/output_formats.py); "": the one the engine reads off the chat template.
    tool_call_parser: str = ""  # hermes | llama3_json | mistral | qwen3_coder
    reasoning_parser: str = ""  # qwen3 | deepseek_r1 | none
    # Browser origins allowed to call the API (CORS, preflight answered) and open a WebSocket; empty: no CORS
    # headers, and WebSockets from loopback pages only (gateway/origins.py).
    allowed_origins: list[str] = field(default_factory=list)
    # Images in prompts (gateway/media.py): data URLs always; http(s) URLs only from these hosts, file://
    # paths only under this folder ("": none), and the limits on them.
    allowed_media_domains: list[str] = field(default_factory=list)
    allowed_local_media_path: str = ""
    max_images_per_request: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if not self.engines and not self.engine_dns:
            raise ValueError("give at least one engine (--engine HOST:PORT|unix:/path or --engine-dns NAME:PORT)")
        for name in self.engine_dns:
            DnsName.parse(name)  # raises naming it
        if not self.dns_refresh > 0:
            raise ValueError(f"dns_refresh must be > 0 seconds, got {self.dns_refresh}")
        self.routing_rule()  # raises on an unknown rule or a bound below 1
        if not self.max_stream_buffer_bytes > 0:
            raise ValueError(f"max_stream_buffer_bytes must be > 0, got {self.max_stream_buffer_bytes}")
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"allowed origin {origin!r} is not '*' or scheme://host[:port]")
        if self.tool_call_parser not in ("", "hermes", "llama3_json", "mistral", "qwen3_coder"):
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}")
        if self.reasoning_parser not in ("", "qwen3", "deepseek_r1", "none"):
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}")
        for address in self.engines:
            if address.startswith("unix:"):
                if not os.path.isabs(address.removeprefix("unix:")):
                    raise ValueError(f"engine address {address!r}: a Unix socket needs an absolute path (unix:/path)")
                continue
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"engine address {address!r} is not HOST:PORT or unix:/path")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        if self.metrics_auth and self.api_key is None:
            raise ValueError("--metrics-auth puts /metrics behind the API key: give one (--api-key or $IGNIS_API_KEY)")
        if self.upstream not in UPSTREAMS:
            raise ValueError(f"upstream must be one of {', '.join(UPSTREAMS)}, got {self.upstream!r}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.probe_interval <= 0 or self.probe_timeout <= 0:
            raise ValueError("probe_interval and probe_timeout must be > 0")
        if not self.header_timeout > 0 or not self.body_timeout > 0:  # `not >`: NaN fails too
            raise ValueError(f"the header and body timeouts must be > 0 seconds, got {self.header_timeout} "
                             f"and {self.body_timeout}")
        if not self.fault_log_interval > 0:
            raise ValueError(f"fault_log_interval must be > 0 seconds, got {self.fault_log_interval}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 0:
            raise ValueError(f"max_connections_per_client must be >= 0 (0: no limit), got "
                             f"{self.max_connections_per_client}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1 KiB, got {self.max_request_bytes}")
        self.media_policy()  # raises naming the media flag that is wrong

    @property
    def client_connection_limit(self) -> int:
        """Open connections one client address may hold (0: no limit)."""
        if self.max_connections_per_client is None:
            return max(1, self.max_connections // 2)
        return self.max_connections_per_client

    def routing_rule(self) -> RoutingRule:
        return RoutingRule(self.routing, self.load_bound)

    def media_policy(self) -> MediaPolicy:
        return MediaPolicy.of(self.allowed_media_domains, self.allowed_local_media_path,
                              self.max_images_per_request, self.max_image_bytes, self.max_image_pixels)

    @property
    def public_paths(self) -> tuple[str, ...]:
        """Paths that never need the key: probes, and scrapes unless --metrics-auth."""
        return ("/health",) if self.metrics_auth else ("/health", "/metrics")
