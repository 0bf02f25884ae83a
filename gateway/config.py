"""The gateway's configuration (from the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GatewayConfig:
    engines: list[str]  # HOST:PORT of each engine's gRPC server
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    request_timeout: float | None = None  # gRPC deadline of one generation, seconds; None = none
    probe_interval: float = 2.0  # seconds between engine health probes
    probe_timeout: float = 2.0
    public_paths: tuple[str, ...] = field(default=("/health", "/metrics"))  # never need the key
    tracing: bool = False  # a server span per request (on when an OTLP endpoint is configured)

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("give at least one engine (--engine HOST:PORT)")
        for address in self.engines:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"engine address {address!r} is not HOST:PORT")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.probe_interval <= 0 or self.probe_timeout <= 0:
            raise ValueError("probe_interval and probe_timeout must be > 0")
