"""A gateway reachable beyond this machine without an API key refuses to start unless told to
(issue 49, attack item 3): one line says why, and the exit status is 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.__main__ import parse_args


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "gateway.example"])
def test_a_public_bind_without_a_key_refuses_in_one_line(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IGNIS_API_KEY", raising=False)
    run = subprocess.run([sys.executable, "-m", "gateway", "--host", host, "--port", "0", "--engine", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "IGNIS_API_KEY"})
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--allow-unauthenticated" in lines[0] and f"--host {host}" in lines[0]


@pytest.mark.parametrize("argv", [["--host", "0.0.0.0", "--api-key", "k"], ["--host", "0.0.0.0", "--allow-unauthenticated"],
                                  ["--host", "127.0.0.1"], ["--host", "::1"], ["--host", "localhost"]])
def test_a_key_an_explicit_choice_or_loopback_starts(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IGNIS_API_KEY", raising=False)
    args, config = parse_args([*argv, "--engine", "127.0.0.1:1"])
    assert args.host == argv[1]
