"""`python -m common.healthcheck`, run as the container healthchecks run it, against real services."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import RunningService, start_gateway, start_tierstore

ROOT = Path(__file__).resolve().parent.parent


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "common.healthcheck", *args], cwd=ROOT,
                          capture_output=True, text=True)


def unused_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tierstore(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    work = tmp_path_factory.mktemp("tierstore")
    service = start_tierstore(work, ["--kv-host-pool-bytes", "1MiB", "--kv-disk-bytes", "0"])
    yield service
    assert service.stop() == 0, service.log()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """A real gateway whose only engine is down: /health answers 503, /metrics 200."""
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [f"127.0.0.1:{unused_port()}"])
    yield service
    assert service.stop() == 0, service.log()


def test_grpc_serving_server_is_healthy(tierstore: RunningService) -> None:
    result = probe("grpc", tierstore.address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"healthy: {tierstore.address}: SERVING"


def test_grpc_named_service(tierstore: RunningService) -> None:
    assert probe("grpc", tierstore.address, "--service", "ignis.v1.TierStore").returncode == 0
    unknown = probe("grpc", tierstore.address, "--service", "ignis.v1.NoSuchService")
    assert unknown.returncode == 1
    assert "NOT_FOUND" in unknown.stderr


def test_grpc_nothing_listening_fails_without_waiting_for_the_deadline() -> None:
    # A deadline long enough that timing out would say DEADLINE_EXCEEDED: the probe must not wait for it.
    result = probe("grpc", f"127.0.0.1:{unused_port()}", "--timeout", "120")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr, result.stderr


def test_grpc_probe_of_an_http_port_fails(gateway: RunningService) -> None:
    result = probe("grpc", gateway.address)
    assert result.returncode == 1
    assert result.stderr.startswith("unhealthy: "), result.stderr


def test_http_200_is_healthy(gateway: RunningService) -> None:
    result = probe("http", f"http://{gateway.address}/metrics")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("HTTP 200")


def test_http_503_and_404_are_unhealthy(gateway: RunningService) -> None:
    down = probe("http", f"http://{gateway.address}/health")  # its engine is down
    assert down.returncode == 1
    assert down.stderr.strip().endswith("HTTP 503")
    missing = probe("http", f"http://{gateway.address}/no-such-path")
    assert missing.returncode == 1
    assert missing.stderr.strip().endswith("HTTP 404")


def test_http_nothing_listening_fails() -> None:
    result = probe("http", f"http://127.0.0.1:{unused_port()}/health", "--timeout", "120")
    assert result.returncode == 1
    assert "refused" in result.stderr.lower(), result.stderr


def test_usage_error_is_not_healthy() -> None:
    assert probe("grpc").returncode != 0
    assert probe("tcp", "127.0.0.1:1").returncode != 0
