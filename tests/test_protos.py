"""The generated stubs in ignis/v1 (from protos/): import, round-trip, presence."""

from __future__ import annotations

import json

from ignis.v1 import common_pb2, engine_pb2, engine_pb2_grpc, tierstore_pb2, tierstore_pb2_grpc


def make_generate_request() -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id="req-1",
        model="tiny",
        chat=engine_pb2.ChatInput(
            messages=[
                engine_pb2.ChatMessage(role="system", content="You are terse."),
                engine_pb2.ChatMessage(
                    role="assistant",
                    tool_calls=[
                        engine_pb2.ToolCall(
                            id="call_1",
                            type="function",
                            function=engine_pb2.ToolCallFunction(name="f", arguments='{"x": 1}'),
                        )
                    ],
                ),
                engine_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="2"),
                engine_pb2.ChatMessage(
                    role="user", content_parts=[engine_pb2.ContentPart(type="text", text="hi")]
                ),
            ],
            tools_json=json.dumps([{"type": "function", "function": {"name": "f"}}]),
            add_generation_prompt=False,
        ),
        sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=0, seed=7, stop=["\n\n"]),
        request_class=common_pb2.REQUEST_CLASS_AGENT,
        cache_salt="tenant-a",
        reuse=engine_pb2.ReusePolicy(
            lookup=engine_pb2.ReusePolicy.LOOKUP_BYPASS,
            commit=engine_pb2.ReusePolicy.COMMIT_PREFILL_STATE_ONLY,
        ),
        echo=True,
    )


def test_generate_request_round_trip() -> None:
    req = make_generate_request()
    back = engine_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("input") == "chat"
    assert back.chat.messages[1].tool_calls[0].function.arguments == '{"x": 1}'
    assert back.request_class == common_pb2.REQUEST_CLASS_AGENT
    assert back.reuse.commit == engine_pb2.ReusePolicy.COMMIT_PREFILL_STATE_ONLY


def test_optional_fields_keep_presence() -> None:
    back = engine_pb2.GenerateRequest.FromString(make_generate_request().SerializeToString())
    s = back.sampling
    # Set to zero is not the same as unset: greedy, and a prompt-only echo.
    assert s.HasField("temperature") and s.temperature == 0.0
    assert s.HasField("max_tokens") and s.max_tokens == 0
    assert s.HasField("seed") and s.seed == 7
    assert not s.HasField("top_p")
    assert not s.HasField("repetition_penalty")
    assert not s.HasField("n")
    assert not s.HasField("skip_special_tokens")
    chat = back.chat
    assert chat.HasField("add_generation_prompt") and chat.add_generation_prompt is False
    assert not engine_pb2.ChatInput().HasField("add_generation_prompt")
    # An assistant message that only calls tools has null content, not "".
    assert not chat.messages[1].HasField("content")
    assert chat.messages[2].HasField("content") and chat.messages[2].content == "2"
    assert not chat.messages[0].HasField("name")
    assert not back.HasField("add_special_tokens")


def test_enum_defaults_are_the_documented_defaults() -> None:
    req = engine_pb2.GenerateRequest(text="x")
    assert req.WhichOneof("input") == "text"
    assert req.request_class == common_pb2.REQUEST_CLASS_UNSPECIFIED
    assert req.reuse.lookup == engine_pb2.ReusePolicy.LOOKUP_USE_CACHE
    assert req.reuse.commit == engine_pb2.ReusePolicy.COMMIT_INCLUDING_GENERATED_TOKENS
    assert engine_pb2.GenerateResponse().finish_reason == engine_pb2.FINISH_REASON_NONE


def test_generate_response_final_message_round_trip() -> None:
    resp = engine_pb2.GenerateResponse(
        index=1,
        token_ids=[5, 6],
        text="ok",
        logprobs=[
            engine_pb2.TokenLogprob(
                token_id=5, token="o", logprob=-0.5, token_bytes=b"o",
                top_logprobs=[engine_pb2.TopLogprob(token_id=5, token="o", logprob=-0.5, token_bytes=b"o")],
            )
        ],
        finish_reason=engine_pb2.FINISH_REASON_STOP,
        stop_string="\n\n",
        usage=engine_pb2.Usage(
            prompt_tokens=40,
            completion_tokens=2,
            cached_tokens=32,
            reuse=engine_pb2.ReuseInfo(
                tier=common_pb2.REUSE_TIER_RAM, kind=common_pb2.REUSE_KIND_CHECKPOINT, reused_tokens=32
            ),
            time_to_first_token_ms=12.5,
        ),
        prompt_logprobs=[engine_pb2.TokenLogprob(token_id=1, token="<s>")],
    )
    back = engine_pb2.GenerateResponse.FromString(resp.SerializeToString())
    assert back == resp
    assert back.WhichOneof("matched_stop") == "stop_string"
    assert back.HasField("usage")
    assert back.usage.reuse.tier == common_pb2.REUSE_TIER_RAM
    assert not back.prompt_logprobs[0].HasField("logprob")  # first prompt token has none
    assert back.logprobs[0].HasField("logprob")
    assert not engine_pb2.GenerateResponse(index=0, text="a").HasField("usage")


def test_tierstore_match_round_trip() -> None:
    ns = bytes(range(16))
    pages = [bytes([i]) * 16 for i in range(1, 4)]
    req = tierstore_pb2.MatchRequest(namespace=ns, page_hashes=pages)
    back = tierstore_pb2.MatchRequest.FromString(req.SerializeToString())
    assert list(back.page_hashes) == pages
    assert all(len(h) == 16 for h in back.page_hashes)
    assert not back.HasField("tail_hash")
    # An explicitly set tail hash keeps presence, even if all zero bytes.
    tail = bytes(16)
    with_tail = tierstore_pb2.MatchRequest.FromString(
        tierstore_pb2.MatchRequest(namespace=ns, page_hashes=pages, tail_hash=tail).SerializeToString()
    )
    assert with_tail.HasField("tail_hash") and with_tail.tail_hash == tail

    resp = tierstore_pb2.MatchResponse(
        hits=[
            tierstore_pb2.MatchHit(
                hash=pages[2], tokens=48, tier=common_pb2.REUSE_TIER_RAM, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                extent=tierstore_pb2.Extent(offset=4096, length=1 << 20), nbytes=1 << 20,
            ),
            tierstore_pb2.MatchHit(hash=pages[1], tokens=32, tier=common_pb2.REUSE_TIER_DISK,
                                   kind=common_pb2.REUSE_KIND_PREFIX, nbytes=4096),
        ]
    )
    back_resp = tierstore_pb2.MatchResponse.FromString(resp.SerializeToString())
    assert back_resp == resp
    assert back_resp.hits[0].extent.offset == 4096
    assert not back_resp.hits[1].HasField("extent")  # disk hits have no arena extent


def test_put_stream_messages_are_oneofs() -> None:
    header = tierstore_pb2.PutRequest(
        header=tierstore_pb2.PutHeader(
            hash=bytes(16),
            metadata=tierstore_pb2.StateMetadata(
                namespace=bytes(16), tokens=16, kind=common_pb2.REUSE_KIND_PAGES, page_hashes=[bytes(16)],
                checksum=bytes(16), nbytes=3,
            ),
        )
    )
    chunk = tierstore_pb2.PutRequest(data=b"abc")
    assert header.WhichOneof("part") == "header"
    assert chunk.WhichOneof("part") == "data"


def test_services_have_the_expected_methods() -> None:
    engine = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
    assert engine.full_name == "ignis.v1.Engine"
    assert [m.name for m in engine.methods] == ["Generate", "GenerateSession", "Tokenize", "ListModels", "GetStats",
                                                "ListState", "PutResponse", "GetResponse", "DeleteResponse",
                                                "LoadAdapter", "UnloadAdapter"]
    assert engine.methods_by_name["Generate"].server_streaming
    session = engine.methods_by_name["GenerateSession"]
    assert session.client_streaming and session.server_streaming
    tierstore = tierstore_pb2.DESCRIPTOR.services_by_name["TierStore"]
    assert tierstore.full_name == "ignis.v1.TierStore"
    assert [m.name for m in tierstore.methods] == [
        "Register", "Match", "Reserve", "Commit", "Acquire", "AcquireStream", "Release", "Drop", "Stats", "ListStates",
        "Put", "Get",
    ]
    assert tierstore.methods_by_name["AcquireStream"].server_streaming
    assert tierstore.methods_by_name["Put"].client_streaming
    assert tierstore.methods_by_name["Get"].server_streaming
    assert hasattr(engine_pb2_grpc, "EngineStub") and hasattr(engine_pb2_grpc, "add_EngineServicer_to_server")
    assert hasattr(tierstore_pb2_grpc, "TierStoreStub")
