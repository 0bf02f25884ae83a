"""One request never hurts another (issue 14): bad sampling fields are refused at admission
with INVALID_ARGUMENT naming the field while other streams decode, and a failure inside the
shared step ends only the request it belongs to."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.outputs import RequestUpdate
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService

MODEL = "ignis-tiny"
STREAMS = 8
VOCAB = 4096  # ignis-tiny


def prompt(seed: int, n: int = 24) -> list[int]:
    return torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate_request(ids: list[int], **sampling: object) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(model=MODEL, token_ids=engine_pb2.TokenIds(ids=ids),
                                      sampling=engine_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]


def chat_request(**chat: object) -> engine_pb2.GenerateRequest:
    messages = [engine_pb2.ChatMessage(role="user", content="hello")]
    return engine_pb2.GenerateRequest(model=MODEL, chat=engine_pb2.ChatInput(messages=messages, **chat),  # type: ignore[arg-type]
                                      sampling=engine_pb2.SamplingParams(max_tokens=2))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (what, request, the text the INVALID_ARGUMENT message must contain)
BAD = [
    ("logit_bias id past the vocabulary", generate_request(prompt(90), max_tokens=4, logit_bias={VOCAB + 5: 1.0}),
     "logit_bias"),
    ("stop_token_ids past the vocabulary with min_tokens",
     generate_request(prompt(91), max_tokens=4, min_tokens=1, stop_token_ids=[VOCAB + 1]), "stop_token_ids[0]"),
    ("chat_template_kwargs setting messages",
     chat_request(chat_template_kwargs_json=json.dumps({"messages": []})), "chat_template_kwargs"),
    ("tools nested far too deep", chat_request(tools_json=nested(5000)), "nested too deeply"),
    ("a prompt longer than any context", engine_pb2.GenerateRequest(
        model=MODEL, text="x" * (10 << 20), sampling=engine_pb2.SamplingParams(max_tokens=1)), "characters"),
]


@pytest.fixture(scope="module")
def stub(engine: RunningService) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def tokens(stub: engine_pb2_grpc.EngineStub, request: engine_pb2.GenerateRequest) -> list[int]:
    return [t for msg in stub.Generate(request, timeout=120) for t in msg.token_ids]


def test_bad_fields_are_refused_while_eight_streams_decode_and_all_eight_finish_exactly(
        stub: engine_pb2_grpc.EngineStub) -> None:
    streams = [generate_request(prompt(i), max_tokens=40, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
               for i in range(STREAMS)]
    alone = [tokens(stub, r) for r in streams]
    started = [threading.Event() for _ in streams]
    got: list[list[int]] = [[] for _ in streams]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for msg in stub.Generate(streams[i], timeout=120):
                got[i].extend(msg.token_ids)
                started[i].set()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(120)
    refused = []
    for what, request, field in BAD:
        with pytest.raises(grpc.RpcError) as info:
            tokens(stub, request)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, what
        assert field in info.value.details(), (what, info.value.details())
        refused.append(what)
    for t in threads:
        t.join(120)
    assert errors == [] and refused == [what for what, _, _ in BAD]
    assert got == alone  # the same tokens as each stream run alone


def test_a_denormal_temperature_samples_greedily(stub: engine_pb2_grpc.EngineStub) -> None:
    ids = prompt(7)
    denormal = tokens(stub, generate_request(ids, max_tokens=8, ignore_eos=True, temperature=1e-45))
    assert denormal == tokens(stub, generate_request(ids, max_tokens=8, ignore_eos=True, temperature=0.0))


def test_a_negative_seed_is_a_seed(stub: engine_pb2_grpc.EngineStub) -> None:
    """The proto field is uint64: -5 arrives as 2**64 - 5 and is read back as -5."""
    request = generate_request(prompt(8), max_tokens=12, ignore_eos=True, temperature=1.0, seed=2**64 - 5)
    assert tokens(stub, request) == tokens(stub, request)


# --- a failure the validation did not catch -------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def request(rid: str, seed: int, **params: object) -> EngineRequest:
    sampling = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, seed=seed, **params)  # type: ignore[arg-type]
    return EngineRequest(rid, tuple(prompt(seed)), sampling)


def outputs(updates: list[RequestUpdate]) -> tuple[list[int], str | None]:
    return [t for u in updates for d in u.deltas for t in d.token_ids], updates[-1].error


def test_a_failure_inside_the_sampling_step_ends_only_its_own_request(
        tiny: tuple[LoadedModel, Tokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a bad logit_bias past admission (as a validation gap would): the batched sampling
    raises, the batch is sampled one by one, the bad request fails alone, and the others get
    exactly the tokens of a run without it (their seeded generators were not advanced twice)."""
    loaded, tokenizer = tiny
    good = [request(f"g{i}", seed=i) for i in range(4)]
    clean = EngineCore(loaded, tokenizer, EngineConfig(kv_cache_bytes=8 << 20))
    want = [outputs(u) for u in run_to_completion(clean, *good, start=True, timeout=120)]
    clean.stop()

    core = EngineCore(loaded, tokenizer, EngineConfig(kv_cache_bytes=8 << 20))
    monkeypatch.setattr(SamplingParams, "check_vocabulary", lambda self, vocab: None)
    bad = request("bad", seed=99, logit_bias={VOCAB + 3: 1.0})
    try:
        results = run_to_completion(core, good[0], good[1], bad, good[2], good[3], start=True, timeout=120)
        got = [outputs(u) for u in results]
        assert got[2][1] is not None and "sampling failed" in got[2][1]
        assert [got[i] for i in (0, 1, 3, 4)] == want
        assert all(error is None for _, error in want)
        core.check_integrity()
    finally:
        core.stop()


def test_the_cache_salt_memo_is_bounded_in_count_and_bytes(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    """200 salts of 1 MB each (and thousands more) cost the memo 16-byte keys, at most 4,096 of them."""
    loaded, tokenizer = tiny
    core = EngineCore(loaded, tokenizer, EngineConfig(kv_cache_bytes=1 << 20))
    try:
        big = [core.namespace_hash(str(i) * (1 << 20)) for i in range(200)]
        assert len(set(big)) == 200  # each salt its own namespace
        for i in range(5000):
            core.namespace_hash(f"tenant-{i}")
        memo = core._namespaces  # the memo itself: what it keeps is what this test is about
        assert len(memo) == 4096 and all(len(k) == 16 for k in memo)
        assert core.namespace_hash("7" * (1 << 20)) == big[7]  # memoised or not, the same namespace
    finally:
        core.stop()
