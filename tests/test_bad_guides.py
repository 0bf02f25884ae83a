"""Guides that cannot be built or cannot be finished end their request with a clear error, and nothing
else (issue 49, attack round items 1 and 7).

A tool whose `parameters` is not an object made xgrammar's builder raise an AssertionError that no
handler caught: the call never ended, and 256 of them held every place of the gateway's session
stream (a normal request got 429). A grammar with no terminating derivation (`root ::= root "a"`)
compiled, and its request failed at the first token with "this is a bug". Both are the request's
input: a 400 naming it at the gateway, INVALID_ARGUMENT over gRPC, and the services keep serving.
An unexpected exception while a request is prepared ends that call with INTERNAL, never UNKNOWN
and never a call left open.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import pytest

from engine.call_status import Abort
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.guided.compiler import GuidedCompiler, GuidedError
from engine.guided.spec import GuideKind, GuidedSpec
from engine.model.loader import load_model
from engine.server import EngineService
from engine.session import GenerateSession
from engine.text.tokenizer import Tokenizer
from ignis.v1 import engine_pb2
from services import RunningService, start_gateway

BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": "not an object"}}


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
    yield service
    service.stop()


@pytest.fixture(scope="module")
def http(gateway: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=120) as client:
        yield client


def chat(http: httpx.Client, **extra: object) -> httpx.Response:
    body = {"model": "ignis-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return http.post("/v1/chat/completions", json=body)


def test_a_tool_whose_parameters_is_not_an_object_is_a_400_and_holds_nothing(http: httpx.Client) -> None:
    """300 of them (more than a session stream's 256 places) one after another, then a normal request."""
    for _ in range(300):
        reply = chat(http, tools=[BAD_TOOL], tool_choice="required")
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and "tool" in error["message"]
    assert chat(http).status_code == 200


def test_a_grammar_that_cannot_finish_is_refused_at_admission(engine: RunningService, http: httpx.Client) -> None:
    from ignis.v1 import engine_pb2_grpc

    request = engine_pb2.GenerateRequest(model="ignis-tiny", text="x")
    request.sampling.max_tokens = 4
    request.guided.grammar = 'root ::= root "a"'
    with grpc.insecure_channel(engine.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "accepts no output" in (raised.value.details() or "")
    assert chat(http).status_code == 200


def test_the_compiler_refuses_an_empty_language_and_compiles_a_finishing_grammar(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    compiler = GuidedCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    with pytest.raises(GuidedError, match="accepts no output"):
        compiler.compile(GuidedSpec(GuideKind.GRAMMAR, 'root ::= root "a"'))
    compiler.compile(GuidedSpec(GuideKind.GRAMMAR, 'root ::= "a" | "b"'))  # a finishing grammar still compiles


@pytest.mark.parametrize("stage", ["render", "sampling params", "compile"])
def test_any_exception_while_preparing_a_call_ends_it_with_internal(tiny_model_dir: Path, stage: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception of any type injected at each stage of preparing a call: the call ends INTERNAL on the
    session stream (its place freed), Generate aborts INTERNAL, and the next call is served."""
    import engine.server as server

    loaded = load_model(tiny_model_dir)
    core = EngineCore(loaded, Tokenizer.from_dir(tiny_model_dir), EngineConfig(page_size=16, kv_cache_bytes=8 << 20,
                                                                               max_num_seqs=4))
    core.start()
    service = EngineService("ignis-tiny", core)
    armed = {"on": True}

    def boom(*args: object, **kwargs: object) -> object:
        if armed["on"]:
            raise ZeroDivisionError(f"injected at {stage}")
        return real(*args, **kwargs)

    target = {"render": (server, "render_input"), "sampling params": (server, "sampling_params"),
              "compile": (GuidedCompiler, "compile")}[stage]
    real = getattr(*target)
    monkeypatch.setattr(*target, boom)

    def request(rid: str) -> engine_pb2.GenerateRequest:
        r = engine_pb2.GenerateRequest(request_id=rid, model="ignis-tiny", text="hello there")
        r.sampling.max_tokens = 2
        if stage == "compile":
            r.guided.regex = "[ab]+"
        return r

    async def run() -> None:
        session = GenerateSession(service)
        outbox: asyncio.Queue[engine_pb2.SessionRequest | None] = asyncio.Queue()

        async def requests():  # type: ignore[no-untyped-def]
            while (item := await outbox.get()) is not None:
                yield item

        ends: dict[int, engine_pb2.SessionEnd] = {}
        await outbox.put(engine_pb2.SessionRequest(tag=1, call=engine_pb2.SessionCall(request=request("a"))))
        stream = session.serve(requests())
        async for response in stream:
            for event in response.events:
                if event.HasField("end"):
                    ends[event.tag] = event.end
                    if event.tag == 1:
                        armed["on"] = False
                        await outbox.put(engine_pb2.SessionRequest(
                            tag=2, call=engine_pb2.SessionCall(request=request("b"))))
            if 2 in ends:
                await outbox.put(None)
        assert ends[1].code == grpc.StatusCode.INTERNAL.value[0] and "internal error" in ends[1].details
        assert ends[2].code == grpc.StatusCode.OK.value[0]
        armed["on"] = True
        with pytest.raises(Abort) as raised:
            await service.engine_request(request("c"))
        assert raised.value.code is grpc.StatusCode.INTERNAL

    try:
        asyncio.run(asyncio.wait_for(run(), 120))  # before the fix the call never ended: fail, do not hang
    finally:
        core.stop()


@pytest.mark.parametrize("schema, construct", [
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "required property 'a'"),
    ({"not": {}}, "'not'"),
    ({"anyOf": []}, "empty 'anyOf'"),
    ({"type": "object", "properties": {"x": {"if": {"type": "string"}, "then": {"minLength": 2}}}}, "'if'"),
    ({"allOf": [{"type": "object"}, {"required": []}]}, "'allOf' of more than one"),
])
def test_a_schema_the_grammar_would_not_enforce_is_a_400_naming_the_construct(
        http: httpx.Client, schema: dict[str, object], construct: str) -> None:
    """Issue 49, attack item 8: these produced output that violates them ({} for a required property,
    a number for not-anything, an empty string for anyOf of nothing)."""
    reply = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert reply.status_code == 400, reply.text
    assert "invalid json_schema" in reply.json()["error"]["message"] and construct in reply.json()["error"]["message"]


def test_the_schema_check_names_the_path_and_passes_what_it_enforces() -> None:
    from engine.guided.schema_support import unenforced_construct

    nested = {"type": "object", "properties": {"items": {"type": "array", "items": {"not": {"type": "null"}}}},
              "required": ["items"]}
    assert unenforced_construct(nested) == \
        "'not' (a schema the output must fail) is not enforced (at #/properties/items/items/not)"
    enforced = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"anyOf": [{"type": "string"},
                {"type": "null"}]}, "c": {"allOf": [{"$ref": "#/$defs/C"}]}}, "required": ["a", "b"],
                "additionalProperties": False, "$defs": {"C": {"type": "object", "properties": {}}}}
    assert unenforced_construct(enforced) is None


def test_a_grammar_that_dead_ends_mid_output_fails_its_request_only(tiny_model_dir: Path) -> None:
    """`x` can never finish, so after "a" nothing is allowed: that request fails saying so (not "this is a
    bug"), and the request batched beside it finishes as it would alone."""
    from engine.offline import run_to_completion
    from engine.request import EngineRequest
    from engine.sampling.params import SamplingParams

    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    core = EngineCore(load_model(tiny_model_dir), tokenizer, EngineConfig(page_size=16, kv_cache_bytes=8 << 20,
                                                                          max_num_seqs=4))
    compiler = GuidedCompiler(tokenizer, core.loaded.config.vocab_size, core.eos_ids)
    guide = compiler.compile(GuidedSpec(GuideKind.GRAMMAR, 'root ::= "a" x\nx ::= x "b"'))
    prompt = tuple(tokenizer.encode("Say something:"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        alone, = run_to_completion(core, EngineRequest("alone", prompt, params), start=True)
        stuck, beside = run_to_completion(core, EngineRequest("stuck", prompt, params, guided=guide),
                                          EngineRequest("beside", prompt, params))
    finally:
        core.stop()
    assert stuck[-1].error is not None and "guided decoding: the grammar allows no token" in stuck[-1].error
    assert [t for u in stuck for d in u.deltas for t in d.token_ids] == tokenizer.encode("a")
    tokens = [[t for u in run for d in u.deltas for t in d.token_ids] for run in (alone, beside)]
    assert beside[-1].error is None and tokens[0] == tokens[1] and len(tokens[0]) == 8
