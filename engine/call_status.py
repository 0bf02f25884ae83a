"""How an engine call ends early: `Abort` (a gRPC status and its message), and submit's errors as statuses."""

from __future__ import annotations

import grpc

from engine.core import EngineCore, EngineStopped, QueueFull
from engine.output_processor import Sink
from engine.request import EngineRequest


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def submit(core: EngineCore, request: EngineRequest, sink: Sink) -> None:
    """Queue `request`; a full queue, a stopping engine or an invalid request is an `Abort`."""
    try:
        core.submit(request, sink)
    except QueueFull as exc:
        raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
    except EngineStopped as exc:
        raise Abort(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
    except ValueError as exc:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
