"""gRPC status codes as the numbers that travel inside messages (engine.proto's SessionEnd.code,
tierstore.proto's LocalMatchReply.code): each end turns them back into `grpc.StatusCode`."""

from __future__ import annotations

import grpc

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def code_of(number: int) -> grpc.StatusCode:
    """The status code numbered `number`; UNKNOWN for a number gRPC does not define."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
