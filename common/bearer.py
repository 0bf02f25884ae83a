"""The tierstore's shared secret, as both sides read it, and the client half of its check: a
gRPC interceptor adding ``authorization: Bearer <secret>`` to every call (over TCP the
tierstore refuses calls without it; tierstore/auth.py is the server half). Used by the
engine's tierstore client, the tierstore and the example client, which may not import
each other."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

MIN_SECRET = 16  # bytes: a shorter secret is refused


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path`` (whitespace stripped). OSError when it cannot be read, ValueError
    when it is too short or the file is not ours (whoever made it would have chosen the secret)."""
    file = Path(path)
    with file.open("rb") as f:
        st = os.fstat(f.fileno())
        secret = f.read().strip()
    if st.st_uid != os.getuid():
        raise ValueError(f"the secret file {file} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if len(secret) < MIN_SECRET:
        raise ValueError(f"the secret in {file} is {len(secret)} bytes; use at least {MIN_SECRET} "
                         "(e.g. `openssl rand -hex 32`)")
    return secret


class BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor):
    def __init__(self, secret: bytes) -> None:
        self._header = ("authorization", "Bearer " + secret.decode())

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
