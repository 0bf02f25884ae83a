"""The client half of the tierstore's shared-secret check: a gRPC interceptor adding
``authorization: Bearer <secret>`` to every call (over TCP the tierstore refuses calls
without it; tierstore/auth.py is the server half). Used by the engine's tierstore client
and by the example client, which may not import each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


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
