"""A real engine process on a free port, driven by the generated gRPC stubs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.model.loader import load_model
from engine.offline import greedy_generate
from engine.text.tokenizer import Tokenizer
from ignis.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services import RunningService, start_engine

MODEL = "ignis-tiny"


@pytest.fixture(scope="module")
def stub(engine: RunningService) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def make_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=g).tolist()


def make_request(ids: list[int] | None = None, text: str | None = None, **sampling: object) -> engine_pb2.GenerateRequest:
    params = engine_pb2.SamplingParams(**sampling)  # type: ignore[arg-type]
    if ids is not None:
        return engine_pb2.GenerateRequest(model=MODEL, token_ids=engine_pb2.TokenIds(ids=ids), sampling=params)
    return engine_pb2.GenerateRequest(model=MODEL, text=text or "", sampling=params)


def collect(stub: engine_pb2_grpc.EngineStub, request: engine_pb2.GenerateRequest) -> dict[int, list[engine_pb2.GenerateResponse]]:
    by_choice: dict[int, list[engine_pb2.GenerateResponse]] = {}
    for msg in stub.Generate(request, timeout=120):
        by_choice.setdefault(msg.index, []).append(msg)
    return by_choice


def tokens_of(messages: list[engine_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def text_of(messages: list[engine_pb2.GenerateResponse]) -> str:
    return "".join(m.text for m in messages)


def stats(stub: engine_pb2_grpc.EngineStub) -> engine_pb2.GetStatsResponse:
    return stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)


def wait_idle(stub: engine_pb2_grpc.EngineStub, timeout: float = 30) -> engine_pb2.GetStatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(stub)
        busy = s.running.interactive + s.running.agent + s.waiting.interactive + s.waiting.agent
        if (busy == 0 and s.page_pool.used_pages == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def test_streaming_greedy_equals_offline_generate(stub: engine_pb2_grpc.EngineStub, tiny_model_dir: Path) -> None:
    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content="Tell me about caches.")])
    rendered = stub.Tokenize(engine_pb2.TokenizeRequest(model=MODEL, chat=chat))
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    assert rendered.prompt.endswith("<|im_start|>assistant\n")
    assert list(rendered.token_ids) == tokenizer.encode(rendered.prompt)
    request = engine_pb2.GenerateRequest(model=MODEL, chat=chat,
                                         sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    messages = collect(stub, request)[0]
    assert len(messages) == 24  # streamed: one message per token
    expected = greedy_generate(load_model(tiny_model_dir), list(rendered.token_ids), 24).token_ids
    assert tokens_of(messages) == expected
    assert text_of(messages) == tokenizer.decode(expected)
    final = messages[-1]
    assert final.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == rendered.count
    assert final.usage.completion_tokens == 24
    assert final.usage.time_to_first_token_ms > 0


def test_concurrent_requests_match_their_solo_runs(stub: engine_pb2_grpc.EngineStub) -> None:
    prompts = [make_prompt(n, seed=n) for n in (3, 17, 40, 64, 90, 130, 7, 250, 33, 16, 48, 200, 5, 75, 120, 31)]
    solo = [tokens_of(collect(stub, make_request(p, temperature=0, max_tokens=6 + i % 5, ignore_eos=True))[0])
            for i, p in enumerate(prompts)]
    results: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        req = make_request(prompts[i], temperature=0, max_tokens=6 + i % 5, ignore_eos=True)
        results[i] = tokens_of(collect(stub, req)[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo
    assert wait_idle(stub).page_pool.used_pages == 0


def test_seeded_sampling_is_reproducible_alone_and_batched(stub: engine_pb2_grpc.EngineStub) -> None:
    prompt = make_prompt(20, seed=99)
    req = make_request(prompt, temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tokens_of(collect(stub, req)[0])
    batched: list[list[int]] = []
    others = [make_request(make_prompt(30 + i, seed=i), temperature=0.7, max_tokens=12) for i in range(3)]
    threads = [threading.Thread(target=lambda r=r: collect(stub, r)) for r in others]
    for t in threads:
        t.start()
    batched.append(tokens_of(collect(stub, req)[0]))
    for t in threads:
        t.join()
    assert batched[0] == alone
    other_seed = tokens_of(collect(stub, make_request(prompt, temperature=1.0, top_p=0.9, seed=4321,
                                                      max_tokens=12, ignore_eos=True))[0])
    assert other_seed != alone


def test_stop_strings_are_excluded(stub: engine_pb2_grpc.EngineStub) -> None:
    prompt = make_prompt(12, seed=5)
    full = text_of(collect(stub, make_request(prompt, temperature=0, max_tokens=30, ignore_eos=True))[0])
    assert len(full) > 12
    stop = full[5:9]  # likely spans a token boundary
    cut = full.index(stop)
    messages = collect(stub, make_request(prompt, temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert text_of(messages) == full[:cut]
    assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_STOP
    assert messages[-1].stop_string == stop


def test_n_choices_fork_from_one_prompt(stub: engine_pb2_grpc.EngineStub) -> None:
    prompt = make_prompt(37, seed=8)  # not page-aligned: the fork copies the partial last page
    greedy = tokens_of(collect(stub, make_request(prompt, temperature=0, max_tokens=8, ignore_eos=True))[0])
    choices = collect(stub, make_request(prompt, temperature=0, max_tokens=8, ignore_eos=True, n=3))
    assert sorted(choices) == [0, 1, 2]
    assert all(tokens_of(choices[i]) == greedy for i in range(3))
    seeded_one = tokens_of(collect(stub, make_request(prompt, temperature=1.0, seed=77, max_tokens=8, ignore_eos=True))[0])
    seeded = collect(stub, make_request(prompt, temperature=1.0, seed=77, max_tokens=8, ignore_eos=True, n=3))
    assert tokens_of(seeded[0]) == seeded_one
    assert len({tuple(tokens_of(seeded[i])) for i in range(3)}) > 1
    final = [m for msgs in choices.values() for m in msgs if m.HasField("usage")]
    assert len(final) == 1 and final[0].usage.completion_tokens == 24
    assert wait_idle(stub).page_pool.used_pages == 0


def test_cancel_mid_stream_frees_everything(stub: engine_pb2_grpc.EngineStub) -> None:
    before = stats(stub).counters.requests_cancelled
    call = stub.Generate(make_request(make_prompt(50, seed=3), temperature=0, max_tokens=2000, ignore_eos=True))
    received = 0
    for _ in call:
        received += 1
        if received == 3:
            assert stats(stub).page_pool.used_pages > 0
            call.cancel()
            break
    s = wait_idle(stub)
    assert s.page_pool.used_pages == 0
    assert s.state_slots.used == 0
    assert s.counters.requests_cancelled == before + 1


def test_deadline_cancels_the_sequence(stub: engine_pb2_grpc.EngineStub) -> None:
    before = stats(stub).counters.requests_cancelled
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Generate(make_request(make_prompt(20, seed=4), temperature=0, max_tokens=3000, ignore_eos=True),
                               timeout=1.0):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    s = wait_idle(stub)
    assert s.page_pool.used_pages == 0 and s.counters.requests_cancelled == before + 1


@pytest.mark.parametrize(
    "request_factory, message",
    [
        (lambda: engine_pb2.GenerateRequest(model=MODEL, text=""), "empty"),
        (lambda: engine_pb2.GenerateRequest(model=MODEL), "no input"),
        (lambda: make_request([1, 2, 3], temperature=5.0), "temperature"),
        (lambda: make_request([1, 2, 3], top_p=0.0), "top_p"),
        (lambda: make_request([1, 2, 3], n=0), "n"),
        (lambda: make_request([99999]), "outside the vocabulary"),
        (lambda: make_request([5] * 40000), "context"),
        (lambda: make_request([5] * 10, max_tokens=40000), "40000 in the completion"),
        (lambda: engine_pb2.GenerateRequest(model=MODEL, chat=engine_pb2.ChatInput(
            messages=[engine_pb2.ChatMessage(role="wizard", content="x")])), "role"),
        (lambda: engine_pb2.GenerateRequest(model=MODEL, chat=engine_pb2.ChatInput(
            messages=[engine_pb2.ChatMessage(role="user", content="x")], tools_json="{not json")), "tools"),
    ],
)
def test_bad_input_is_invalid_argument_and_engine_keeps_serving(
    stub: engine_pb2_grpc.EngineStub, request_factory: object, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, request_factory())  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    ok = collect(stub, make_request([10, 11, 12], temperature=0, max_tokens=2))[0]
    assert len(tokens_of(ok)) >= 1


def test_an_unknown_model_is_not_found(stub: engine_pb2_grpc.EngineStub) -> None:
    for call in (lambda: collect(stub, engine_pb2.GenerateRequest(model="gpt-17", text="hi")),
                 lambda: stub.Tokenize(engine_pb2.TokenizeRequest(model="gpt-17", text="hi"), timeout=10)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "not served here" in err.value.details()


def test_health_and_reflection(engine: RunningService) -> None:
    with grpc.insecure_channel(engine.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ignis.v1.Engine"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"ignis.v1.Engine", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_list_models(stub: engine_pb2_grpc.EngineStub) -> None:
    models = stub.ListModels(engine_pb2.ListModelsRequest()).models
    assert [m.id for m in models] == [MODEL]
    assert models[0].architecture == "Qwen3_5ForCausalLM" and models[0].max_model_len == 32768


def test_engine_answers_during_a_long_prefill(stub: engine_pb2_grpc.EngineStub, engine: RunningService) -> None:
    """A long prompt is prefilled in chunks on the engine thread: health and a short
    request are served while it is still running."""
    long_request = make_request(make_prompt(16000, seed=11), temperature=0, max_tokens=1)
    done = threading.Event()
    result: list[object] = []

    def run_long() -> None:
        result.append(collect(stub, long_request))
        done.set()

    worker = threading.Thread(target=run_long)
    worker.start()
    deadline = time.monotonic() + 30
    while stats(stub).running.interactive == 0 and not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    with grpc.insecure_channel(engine.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert tokens_of(collect(stub, make_request([10, 11, 12], temperature=0, max_tokens=1))[0])
    short_done_first = not done.is_set()
    worker.join()
    assert short_done_first, "the short request should finish while the 16k prefill is still running"
    assert result and result[0]


def test_agent_class_is_accepted(stub: engine_pb2_grpc.EngineStub) -> None:
    req = make_request([10, 11, 12], temperature=0, max_tokens=2)
    req.request_class = common_pb2.REQUEST_CLASS_AGENT
    assert tokens_of(collect(stub, req)[0])


def test_queue_bound_is_resource_exhausted(tiny_model_dir: Path, tmp_path: Path) -> None:
    service = start_engine(tmp_path, str(tiny_model_dir), ["--served-model-name", MODEL, "--max-queue", "1"])
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            first = stub.Generate(make_request(make_prompt(30, 1), temperature=0, max_tokens=500, ignore_eos=True))
            next(first)  # admitted and streaming
            with pytest.raises(grpc.RpcError) as err:
                collect(stub, make_request([10, 11], max_tokens=2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    assert tokens_of(collect(stub, make_request([10, 11], temperature=0, max_tokens=2))[0])
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    time.sleep(0.05)
            else:
                pytest.fail("the engine never accepted work again")
    finally:
        assert service.stop() == 0, service.log()


async def test_unavailable_while_loading_and_shutting_down(tmp_path: Path) -> None:
    """Before a model is attached (loading) and after shutdown begins, calls answer UNAVAILABLE
    while health reports NOT_SERVING."""
    from engine.server import EngineService, create_server, set_serving

    service = EngineService(MODEL)
    address = f"unix:{tmp_path / 'engine.sock'}"  # over TCP, calls without the secret are UNAUTHENTICATED
    server, _, health = create_server(service, address)
    await set_serving(health, False)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for call in (lambda: stub.Generate(make_request([1, 2, 3])).read(),
                         lambda: stub.Tokenize(engine_pb2.TokenizeRequest(text="hi")),
                         lambda: stub.GetStats(engine_pb2.GetStatsRequest())):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            service.accepting = False
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(make_request([1, 2, 3])).read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
