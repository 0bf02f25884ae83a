"""A health probe for container healthchecks, using only what the ignis image already has.

    python -m common.healthcheck grpc HOST:PORT [--service NAME] [--timeout S]
    python -m common.healthcheck http URL [--timeout S]

Exits 0 when healthy: the standard gRPC health service (``grpc.health.v1.Health``)
answers SERVING for ``--service`` (default ``""``, the whole server), or the URL
answers HTTP 200. Otherwise exits 1 with one line on stderr saying why (Docker
keeps it in ``docker inspect``). Nothing listening fails at once: the gRPC call
does not wait for the channel to become ready, the HTTP connect is refused.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTHY, UNHEALTHY = 0, 1  # Docker reserves exit status 2


@dataclass(frozen=True, slots=True)
class ProbeResult:
    healthy: bool
    detail: str  # what was seen, for the operator


def probe_grpc(address: str, service: str = "", timeout: float = 3.0) -> ProbeResult:
    """SERVING from `address`'s gRPC health service for `service`?"""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return ProbeResult(False, f"{address}: {exc.code().name}: {exc.details()}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return ProbeResult(reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}")


def probe_http(url: str, timeout: float = 3.0) -> ProbeResult:
    """HTTP 200 from GET `url`?"""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # probe the service itself, no proxy
    try:
        with opener.open(url, timeout=timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:  # a 4xx/5xx answer: the server is up but not healthy
        status = exc.code
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return ProbeResult(False, f"{url}: {reason}")
    return ProbeResult(status == 200, f"{url}: HTTP {status}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.healthcheck", description="Exit 0 iff a service is healthy.")
    kinds = parser.add_subparsers(dest="kind", required=True)
    grpc_parser = kinds.add_parser("grpc", help="gRPC health check of HOST:PORT")
    grpc_parser.add_argument("address", metavar="HOST:PORT")
    grpc_parser.add_argument("--service", default="", help="service name to ask about (default: the server)")
    http_parser = kinds.add_parser("http", help="GET URL, healthy on 200")
    http_parser.add_argument("url")
    for sub in (grpc_parser, http_parser):
        sub.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.kind == "grpc":
        result = probe_grpc(args.address, args.service, args.timeout)
    else:
        result = probe_http(args.url, args.timeout)
    print(("healthy: " if result.healthy else "unhealthy: ") + result.detail,
          file=sys.stdout if result.healthy else sys.stderr)
    return HEALTHY if result.healthy else UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
