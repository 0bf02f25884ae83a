"""Guided decoding in a real engine (ignis-tiny, random weights), over gRPC.

Random weights write noise; every assertion here holds only because the grammar forces it.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from engine.text.tokenizer import Tokenizer
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService

MODEL = "ignis-tiny"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 8}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "required": ["a"], "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}}]


@pytest.fixture(scope="module")
def stub(engine: RunningService) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def request(guided: engine_pb2.GuidedDecoding | None = None, text: str = "Tell me about the table.",
            **sampling: object) -> engine_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 200)
    req = engine_pb2.GenerateRequest(model=MODEL, text=text,
                                     sampling=engine_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]
    if guided is not None:
        req.guided.CopyFrom(guided)
    return req


def generate(stub: engine_pb2_grpc.EngineStub, req: engine_pb2.GenerateRequest) -> dict[int, tuple[str, list[int], int]]:
    """choice -> (text, token ids, finish reason)."""
    out: dict[int, tuple[str, list[int], int]] = {}
    for msg in stub.Generate(req, timeout=120):
        text, ids, finish = out.get(msg.index, ("", [], 0))
        out[msg.index] = (text + msg.text, ids + list(msg.token_ids), msg.finish_reason or finish)
    return out


def schema_guide(schema: object = SCHEMA, strict: bool = True) -> engine_pb2.GuidedDecoding:
    return engine_pb2.GuidedDecoding(json_schema=json.dumps(schema), strict=strict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_finishes_with_stop(stub: engine_pb2_grpc.EngineStub, temperature: float) -> None:
    text, ids, finish = generate(stub, request(schema_guide(), temperature=temperature, seed=3))[0]
    value = json.loads(text)
    assert set(value) == {"name", "ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    assert finish == engine_pb2.FINISH_REASON_STOP


def test_every_sampling_mode_respects_the_grammar(stub: engine_pb2_grpc.EngineStub) -> None:
    guide = engine_pb2.GuidedDecoding(regex=r"[0-9]{3}-[a-c]{2}")
    for sampling in ({"temperature": 0.0}, {"temperature": 1.3, "top_p": 0.9, "seed": 1},
                     {"temperature": 0.8, "top_k": 5, "min_p": 0.05, "seed": 2},
                     {"temperature": 1.0, "presence_penalty": 1.5, "frequency_penalty": 1.0,
                      "repetition_penalty": 1.3, "seed": 4},
                     {"temperature": 1.0, "logprobs": True, "top_logprobs": 3, "seed": 5},
                     {"temperature": 1.0, "min_tokens": 3, "seed": 6}):
        text, _, finish = generate(stub, request(guide, **sampling))[0]
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", text), (sampling, text)
        assert finish == engine_pb2.FINISH_REASON_STOP


def test_logprobs_report_the_masked_distribution(stub: engine_pb2_grpc.EngineStub) -> None:
    req = request(engine_pb2.GuidedDecoding(choice=engine_pb2.GuidedChoice(choices=["yes", "no"])),
                  temperature=1.0, seed=8, logprobs=True, top_logprobs=5)
    msgs = list(stub.Generate(req, timeout=60))
    first = next(lp for m in msgs for lp in m.logprobs)
    # Only tokens that begin "yes" or "no" are possible: the alternatives all are, and their mass is 1.
    assert all(("yes".startswith(t.token) or "no".startswith(t.token)) and t.token for t in first.top_logprobs
               if t.logprob > -1e30)
    assert "".join(m.text for m in msgs) in ("yes", "no")


def test_choice_and_grammar(stub: engine_pb2_grpc.EngineStub) -> None:
    choices = ["red", "green", 'blue "sky"']
    for seed in range(4):
        text, _, _ = generate(stub, request(engine_pb2.GuidedDecoding(
            choice=engine_pb2.GuidedChoice(choices=choices)), temperature=1.0, seed=seed))[0]
        assert text in choices
    text, _, _ = generate(stub, request(engine_pb2.GuidedDecoding(
        grammar='root ::= "(" [a-z]+ ")" | "<" [0-9] ">"'), temperature=1.0, seed=1, max_tokens=400))[0]
    assert re.fullmatch(r"\([a-z]+\)|<[0-9]>", text), text


def test_json_object(stub: engine_pb2_grpc.EngineStub) -> None:
    text, _, finish = generate(stub, request(engine_pb2.GuidedDecoding(json_object=True), temperature=0.0,
                                             max_tokens=400))[0]
    if finish == engine_pb2.FINISH_REASON_STOP:
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert text.startswith("{")


def test_n_choices_each_follow_their_own_grammar(stub: engine_pb2_grpc.EngineStub) -> None:
    out = generate(stub, request(schema_guide(), temperature=1.0, seed=11, n=3))
    assert sorted(out) == [0, 1, 2]
    for text, _, finish in out.values():
        assert finish == engine_pb2.FINISH_REASON_STOP and set(json.loads(text)) == {"name", "ok", "n"}


def test_tool_calls_required_and_named(stub: engine_pb2_grpc.EngineStub) -> None:
    for seed in range(3):
        guide = engine_pb2.GuidedDecoding(tool_calls=engine_pb2.GuidedToolCalls(
            tools_json=json.dumps(TOOLS), tool_choice="required", parallel_tool_calls=False))
        text, _, finish = generate(stub, request(guide, temperature=1.0, seed=seed))[0]
        m = re.fullmatch(r'<tool_call>\n(\{.*\})\n</tool_call>', text, re.DOTALL)
        assert m and finish == engine_pb2.FINISH_REASON_STOP, text
        assert json.loads(m.group(1))["name"] in ("get_weather", "add")
    guide = engine_pb2.GuidedDecoding(tool_calls=engine_pb2.GuidedToolCalls(
        tools_json=json.dumps(TOOLS), tool_choice="add"))
    text, _, _ = generate(stub, request(guide, temperature=1.0, seed=5))[0]
    call = json.loads(re.fullmatch(r'<tool_call>\n(\{.*\})\n</tool_call>', text, re.DOTALL).group(1))  # type: ignore[union-attr]
    assert call["name"] == "add" and 0 <= call["arguments"]["a"] <= 9


@pytest.mark.parametrize("guide, fragment", [
    (engine_pb2.GuidedDecoding(json_schema='{"type": "objec"}'), "invalid json_schema"),
    (engine_pb2.GuidedDecoding(json_schema="{not json"), "invalid json_schema: not valid JSON"),
    (engine_pb2.GuidedDecoding(regex="a("), "invalid regex"),
    (engine_pb2.GuidedDecoding(grammar="root ::= foo"), "invalid grammar"),
    (engine_pb2.GuidedDecoding(choice=engine_pb2.GuidedChoice()), "at least one choice"),
    (engine_pb2.GuidedDecoding(tool_calls=engine_pb2.GuidedToolCalls(tools_json=json.dumps(TOOLS), tool_choice="nope")),
     "'nope', which is not among the tools"),
])
def test_an_invalid_guide_is_invalid_argument(stub: engine_pb2_grpc.EngineStub, guide: engine_pb2.GuidedDecoding,
                                             fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request(guide))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (err.value.details() or ""), err.value.details()
    assert generate(stub, request(max_tokens=3))[0][2]  # the engine keeps serving


def test_a_guided_neighbour_leaves_the_batch_unharmed(stub: engine_pb2_grpc.EngineStub) -> None:
    plain = request(text="The user asked about the database.", temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = generate(stub, plain)[0][1]
    results: dict[str, dict[int, tuple[str, list[int], int]]] = {}

    def run(name: str, req: engine_pb2.GenerateRequest) -> None:
        results[name] = generate(stub, req)

    # Started together they share steps (the guided one is longer, so it spans the plain one).
    threads = [threading.Thread(target=run, args=("guided", request(schema_guide(), temperature=1.0, seed=2,
                                                                     n=2))),
               threading.Thread(target=run, args=("plain", plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["plain"][0][1] == alone
    for text, _, _ in results["guided"].values():
        assert set(json.loads(text)) == {"name", "ok", "n"}


def test_after_reasoning_the_grammar_waits_for_the_end_of_the_block(stub: engine_pb2_grpc.EngineStub,
                                                                    tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    assert think is not None and end is not None
    # Nudged to open a block and close it at once: inside it nothing is masked, so </think> can come.
    bias = {think: 50.0, end: 100.0}
    guide = schema_guide()
    guide.after_reasoning = True
    text, ids, finish = generate(stub, request(guide, temperature=1.0, seed=3, logit_bias=bias))[0]
    assert ids[:2] == [think, end] and finish == engine_pb2.FINISH_REASON_STOP
    assert set(json.loads(tokenizer.decode(ids[2:]))) == {"name", "ok", "n"}
    # Without it the grammar holds from the first token: the markers are masked, bias or not.
    text, ids, _ = generate(stub, request(schema_guide(), temperature=1.0, seed=3, logit_bias=bias))[0]
    assert think not in ids and end not in ids and set(json.loads(text)) == {"name", "ok", "n"}
