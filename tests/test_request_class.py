"""The request class, read in one place (common/request_class.py) by all three services, with one rule
for a class that is neither interactive nor agent: the caller's mistake, everywhere (issue 41)."""

from __future__ import annotations

import grpc
import pytest

from common.request_class import NAMES, RequestClass, from_name, from_pb
from ignis.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services import RunningService


def test_names_numbers_and_rank() -> None:
    assert NAMES == ("interactive", "agent")
    assert from_pb(common_pb2.REQUEST_CLASS_UNSPECIFIED) is RequestClass.INTERACTIVE
    assert from_pb(common_pb2.REQUEST_CLASS_INTERACTIVE) is RequestClass.INTERACTIVE
    assert from_pb(common_pb2.REQUEST_CLASS_AGENT) is RequestClass.AGENT
    assert from_name("Agent") is RequestClass.AGENT and from_name("interactive").pb == common_pb2.REQUEST_CLASS_INTERACTIVE
    assert RequestClass.INTERACTIVE < RequestClass.AGENT  # lower ranks higher: admitted first, evicted last
    assert [c.label for c in RequestClass] == list(NAMES)
    for bad in (3, 7, -1):
        with pytest.raises(ValueError, match=f"unknown request_class {bad}"):
            from_pb(bad)
    with pytest.raises(ValueError, match="one of interactive, agent"):
        from_name("batch")


def test_the_engine_refuses_an_unknown_class_and_keeps_serving(engine: RunningService) -> None:
    """It used to serve one as interactive, where the tierstore refused it."""
    request = engine_pb2.GenerateRequest(model="ignis-tiny", text="hello", request_class=7)  # type: ignore[arg-type]
    request.sampling.max_tokens = 2
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(request, timeout=60))
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown request_class 7" in (raised.value.details() or "")
        request.request_class = common_pb2.REQUEST_CLASS_AGENT
        assert [m for m in stub.Generate(request, timeout=60)]
