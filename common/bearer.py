"""A service's shared secret, as both sides read it, and the client half of its check:
``authorization: Bearer <secret>`` added to every call (over TCP the tierstore and the engine
refuse calls without it; common/secret_auth.py is the server half). Used by the engine's
tierstore client, the gateway's engine channels, the services and the example client, which
may not import each other.

Two ways to add it: BearerInterceptor on a sync channel, and `with_bearer` on a stub of either
kind (a grpc.aio channel's interceptors wrap every call and every streamed message in another
task; this only appends the header when the call starts)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from common.private_files import given_by_root

MIN_SECRET = 16  # bytes: a shorter secret is refused


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path`` (whitespace stripped). OSError when it cannot be read, ValueError
    when it is too short or the file is not ours (whoever made it would have chosen the secret),
    unless root's and closed to others but its group: a Kubernetes Secret mounted for the pod's
    fsGroup (common/private_files.py)."""
    file = Path(path)
    with file.open("rb") as f:
        st = os.fstat(f.fileno())
        secret = f.read().strip()
    if st.st_uid != os.getuid() and not given_by_root(st):
        if st.st_uid == 0:
            raise ValueError(f"the secret file {file} is root's and open to others (mode {st.st_mode & 0o777:04o}): "
                             "a secret root owns may be readable by its group only (0440, e.g. a Kubernetes "
                             "Secret mounted for the pod's fsGroup)")
        raise ValueError(f"the secret file {file} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if len(secret) < MIN_SECRET:
        raise ValueError(f"the secret in {file} is {len(secret)} bytes; use at least {MIN_SECRET} "
                         "(e.g. `openssl rand -hex 32`)")
    return secret


def bearer_header(secret: bytes) -> tuple[str, str]:
    return ("authorization", "Bearer " + secret.decode())


class _WithHeader:
    """A stub's method that adds `header` to the metadata of each call."""

    __slots__ = ("_method", "_header")

    def __init__(self, method: Any, header: tuple[str, str]) -> None:
        self._method = method
        self._header = header

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._method(*args, metadata=(*(metadata or ()), self._header), **kwargs)


def with_bearer(stub: Any, secret: bytes) -> Any:
    """`stub` (a generated ``...Stub``), each of its methods now sending the secret; returned."""
    header = bearer_header(secret)
    for name, method in list(vars(stub).items()):
        if callable(method) and not name.startswith("_"):
            setattr(stub, name, _WithHeader(method, header))
    return stub


class BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor):
    def __init__(self, secret: bytes) -> None:
        self._header = bearer_header(secret)

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
