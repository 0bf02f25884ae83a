"""Stored responses over HTTP: store, retrieve, delete, input_items, previous_response_id chains,
scopes (cache_salt and API key), a gateway restart, two gateways; the engine's store itself.

Real processes on loopback: one engine with a response store of its own (a scratch folder),
gateways in front of it, the openai SDK and httpx as clients."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

import grpc
import httpx
import openai
import pytest

from engine.responses_store import ResponseStore
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService, start_engine, start_gateway

MODEL = "ignis-tiny"
INSTRUCTIONS = "You are a terse assistant."


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses") / "store"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, store_dir: Path
           ) -> Iterator[RunningService]:
    service = start_engine(tmp_path_factory.mktemp("engine"), str(tiny_model_dir),
                           ["--served-model-name", MODEL, "--set", f"responses.path={store_dir}",
                            "--set", "reuse.retained_interactive_ttl=0"])
    yield service
    assert service.stop() == 0, service.log()


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
    yield service
    assert service.stop() == 0, service.log()


def sdk(gateway: RunningService, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=key, max_retries=0)


def http(gateway: RunningService, key: str = "key-a") -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=120,
                        headers={"Authorization": f"Bearer {key}"})


def assert_404(response: httpx.Response, param: str | None, code: str) -> dict[str, Any]:
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    return error


def create(client: httpx.Client, **body: Any) -> dict[str, Any]:
    reply = client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 6, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


# ------------------------------------------------------------------ chains


def test_a_chain_of_five_claims_each_previous_turn(gateway: RunningService) -> None:
    client = sdk(gateway)
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Count with me: one.",
                                    max_output_tokens=6, temperature=0)
    assert first.store is True and first.id.startswith("resp_") and first.previous_response_id is None
    chain = [first]
    for word in ("two", "three", "four", "five"):
        chain.append(client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=f"And {word}.",
                                             previous_response_id=chain[-1].id, max_output_tokens=6,
                                             temperature=0))
    for before, after in zip(chain, chain[1:]):
        assert after.previous_response_id == before.id
        assert after.usage is not None and before.usage is not None
        # The stored conversation renders as the client's own resend: the previous turn's whole
        # prompt (and its reply) is found retained.
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens
        assert after.usage.input_tokens_details.cached_tokens > before.usage.input_tokens_details.cached_tokens

    # Token-identical: the same conversation resent whole (no store, another tenant) has the
    # same prompt length as the last turn continued by id.
    items: list[Any] = [{"role": "user", "content": "Count with me: one."}]
    for i, resp in enumerate(chain):
        if i:
            items.append({"role": "user", "content": f"And {('two', 'three', 'four', 'five')[i - 1]}."})
        if i < len(chain) - 1:
            items.append({"role": "assistant", "content": resp.output_text})
    resent = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=items, max_output_tokens=1,
                                     store=False, extra_body={"cache_salt": "resend"})
    assert resent.usage is not None and chain[-1].usage is not None
    assert resent.usage.input_tokens == chain[-1].usage.input_tokens


def test_instructions_are_not_carried_over(gateway: RunningService) -> None:
    with http(gateway) as client:
        first = create(client, instructions="A long system prompt " * 8, input="hi")
        bare = create(client, input="again", previous_response_id=first["id"])
        assert bare["instructions"] is None
        # Without the instructions the prompt is shorter than the first turn's plus the new message.
        assert bare["usage"]["input_tokens"] < first["usage"]["input_tokens"]


def test_retrieve_returns_the_stored_response(gateway: RunningService) -> None:
    client = sdk(gateway)
    made = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=5,
                                   metadata={"run": "7"}, truncation="auto", parallel_tool_calls=False)
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    assert (got.metadata, got.truncation, got.parallel_tool_calls, got.store) == ({"run": "7"}, "auto", False, True)


def test_echoes_request_fields_as_sent(gateway: RunningService) -> None:
    with http(gateway) as client:
        text = {"format": {"type": "text"}, "verbosity": "low"}
        done = create(client, input="hi", store=False, truncation="disabled", parallel_tool_calls=True,
                      metadata={"a": "b"}, tool_choice="none", text=text)
        assert (done["store"], done["truncation"], done["parallel_tool_calls"], done["metadata"],
                done["tool_choice"], done["text"]) == (False, "disabled", True, {"a": "b"}, "none", text)
        assert_404(client.get(f"/v1/responses/{done['id']}"), None, "response_not_found")  # not stored
        bad = client.post("/v1/responses", json={"model": MODEL, "input": "x", "truncation": "sometimes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation"


def test_streamed_responses_are_stored_before_they_end(gateway: RunningService) -> None:
    client = sdk(gateway)
    events = list(client.responses.create(model=MODEL, input="Stream it.", max_output_tokens=5, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")  # the length limit: incomplete
    done = events[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(done.id).output_text == done.output_text
    follow = client.responses.create(model=MODEL, input="More.", previous_response_id=done.id, max_output_tokens=3)
    assert follow.usage is not None and done.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens


def test_input_items_are_paged_as_openai_does(gateway: RunningService) -> None:
    with http(gateway) as client:
        items = [{"role": "user", "content": f"message {i}"} if i % 2 == 0 else
                 {"role": "assistant", "content": f"reply {i}"} for i in range(5)]
        done = create(client, input=items)
        url = f"/v1/responses/{done['id']}/input_items"
        whole = client.get(url, params={"order": "asc"}).json()
        assert whole["object"] == "list" and whole["has_more"] is False
        assert [d["content"] for d in whole["data"]] == [  # string content as OpenAI lists it: one part
            [{"type": "input_text", "text": i["content"]} if i["role"] == "user" else
             {"type": "output_text", "text": i["content"], "annotations": []}] for i in items]
        ids = [d["id"] for d in whole["data"]]
        assert len(set(ids)) == 5 and (whole["first_id"], whole["last_id"]) == (ids[0], ids[-1])
        page = client.get(url, params={"order": "asc", "limit": 2}).json()
        assert [d["id"] for d in page["data"]] == ids[:2] and page["has_more"] is True
        page = client.get(url, params={"order": "asc", "limit": 2, "after": page["last_id"]}).json()
        assert [d["id"] for d in page["data"]] == ids[2:4] and page["has_more"] is True
        page = client.get(url, params={"order": "asc", "limit": 2, "after": page["last_id"]}).json()
        assert [d["id"] for d in page["data"]] == ids[4:] and page["has_more"] is False
        newest = client.get(url).json()  # desc by default, 20 a page
        assert [d["id"] for d in newest["data"]] == ids[::-1]
        for bad in ({"limit": 0}, {"limit": 101}, {"limit": "x"}, {"order": "up"}, {"after": "nope"}):
            assert client.get(url, params=bad).status_code == 400, bad
        # The SDK's pager walks the same pages.
        listed = [i.id for i in sdk(gateway).responses.input_items.list(done["id"], limit=2, order="asc")]
        assert listed == ids
        # A continuation's items are all that produced it: the earlier turn's inputs, its reply, the new input.
        follow = create(client, input="message 5", previous_response_id=done["id"])
        chained = client.get(f"/v1/responses/{follow['id']}/input_items", params={"order": "asc"}).json()["data"]
        [reply] = done["output"]
        assert [d["id"] for d in chained] == [*ids, reply["id"], chained[-1]["id"]]
        assert chained[5]["role"] == "assistant" and chained[5]["content"][0]["type"] == "output_text"
        assert chained[5]["content"][0]["text"] == reply["content"][0]["text"]
        assert chained[-1]["content"] == [{"type": "input_text", "text": "message 5"}]


def test_delete_then_continue_is_previous_response_not_found(gateway: RunningService) -> None:
    with http(gateway) as client:
        done = create(client, input="hi")
        gone = client.delete(f"/v1/responses/{done['id']}")
        assert gone.status_code == 200 and gone.json() == {"id": done["id"], "object": "response", "deleted": True}
        assert_404(client.delete(f"/v1/responses/{done['id']}"), None, "response_not_found")
        assert_404(client.get(f"/v1/responses/{done['id']}"), None, "response_not_found")
        reply = client.post("/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": done["id"]})
        error = assert_404(reply, "previous_response_id", "previous_response_not_found")
        assert error["message"] == f"Previous response with id '{done['id']}' not found."
        for rid in ("resp_nope", "resp_ffffffffffff_0123456789abcdef", "x" * 300):
            assert_404(client.post("/v1/responses", json={"model": MODEL, "input": "a", "previous_response_id": rid}),
                       "previous_response_id", "previous_response_not_found")
        assert client.get("/health").status_code == 200  # still serving


def test_another_salt_or_key_cannot_read_or_continue(gateway: RunningService) -> None:
    with http(gateway, "key-a") as a, http(gateway, "key-b") as b:
        done = create(a, input="secret", cache_salt="tenant-1")
        rid = done["id"]
        assert a.get(f"/v1/responses/{rid}", params={"cache_salt": "tenant-1"}).status_code == 200
        assert a.get(f"/v1/responses/{rid}", headers={"X-Ignis-Cache-Salt": "tenant-1"}).status_code == 200
        assert_404(a.get(f"/v1/responses/{rid}"), None, "response_not_found")  # no salt is another scope
        assert_404(a.get(f"/v1/responses/{rid}", params={"cache_salt": "tenant-2"}), None, "response_not_found")
        assert_404(b.get(f"/v1/responses/{rid}", params={"cache_salt": "tenant-1"}), None, "response_not_found")
        assert_404(b.delete(f"/v1/responses/{rid}", params={"cache_salt": "tenant-1"}), None, "response_not_found")
        for client, salt in ((a, "tenant-2"), (b, "tenant-1")):
            reply = client.post("/v1/responses", json={"model": MODEL, "input": "x", "cache_salt": salt,
                                                       "previous_response_id": rid})
            assert_404(reply, "previous_response_id", "previous_response_not_found")
        assert a.get(f"/v1/responses/{rid}/input_items", params={"cache_salt": "tenant-1"}).status_code == 200
        create(a, input="go on", cache_salt="tenant-1", previous_response_id=rid)


def test_records_outlive_a_gateway_restart_and_two_gateways_resolve_them(
        engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> None:
    workdir = tmp_path_factory.mktemp("restarted")
    first = start_gateway(workdir / "one", [engine.address])
    try:
        with http(first) as client:
            done = create(client, input="Remember this.")
    finally:
        assert first.stop() == 0, first.log()
    second = start_gateway(workdir / "two", [engine.address])
    third = start_gateway(workdir / "three", [engine.address])
    try:
        for gw in (second, third):
            with http(gw) as client:
                got = client.get(f"/v1/responses/{done['id']}")
                assert got.status_code == 200 and got.json()["output"] == done["output"]
        with http(third) as client:
            follow = create(client, input="And now?", previous_response_id=done["id"])
        with http(second) as client:
            assert client.get(f"/v1/responses/{follow['id']}").json()["previous_response_id"] == done["id"]
    finally:
        assert second.stop() == 0, second.log()
        assert third.stop() == 0, third.log()


def test_two_engines_each_keep_their_own_responses(engine: RunningService, tiny_model_dir: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp("two-engines")
    other = start_engine(work / "engine", str(tiny_model_dir),
                         ["--served-model-name", MODEL, "--set", f"responses.path={work / 'store'}"])
    gw = start_gateway(work / "gateway", [engine.address, other.address], ["--routing", "round-robin"])
    try:
        ids = {}
        for address in (engine.address, other.address):
            with grpc.insecure_channel(address) as channel:
                ids[engine_pb2_grpc.EngineStub(channel).ListModels(engine_pb2.ListModelsRequest()).engine_id] = address
        assert len(ids) == 2
        with http(gw) as client:
            made = [create(client, input=f"Topic {i}: tell me more.") for i in range(4)]
            owners = {r["id"].split("_")[1] for r in made}
            assert owners == set(ids)  # round-robin spread them, each id names where it is kept
            for r in made:
                assert client.get(f"/v1/responses/{r['id']}").json()["output"] == r["output"]
                # The continuation goes to the engine holding the record and its retained state.
                follow = create(client, input="Go on.", previous_response_id=r["id"])
                assert follow["id"].split("_")[1] == r["id"].split("_")[1]
                assert follow["usage"]["input_tokens_details"]["cached_tokens"] >= r["usage"]["input_tokens"]
    finally:
        assert gw.stop() == 0, gw.log()
        assert other.stop() == 0, other.log()


def test_the_engine_reports_its_store_id(engine: RunningService, store_dir: Path) -> None:
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        engine_id = stub.ListModels(engine_pb2.ListModelsRequest()).engine_id
        assert len(engine_id) == 12
        with pytest.raises(grpc.RpcError) as err:
            stub.GetResponse(engine_pb2.GetResponseRequest(id="resp_x", scope="s"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            stub.PutResponse(engine_pb2.PutResponseRequest(id="", scope="s", record=b"{}"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in store_dir.iterdir())


# ------------------------------------------------------------------ the store alone


def test_store_bound_ttl_scope_and_restart(tmp_path: Path) -> None:
    now = [1000.0]
    store = ResponseStore(tmp_path / "s", max_stored=3, ttl=10, clock=lambda: now[0])
    for i in range(5):
        store.put(f"r{i}", "a", b"record %d" % i)
        now[0] += 1
    assert len(store) == 3  # the two oldest went first
    assert [store.get(f"r{i}", "a") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.get("r4", "b") is None and not store.delete("r4", "b")  # another scope: not there
    found = store.get("r4", "a")
    assert found is not None and found.record == b"record 4"
    store.put("r4", "a", b"rewritten")  # the same id and scope: replaced, still one
    assert len(store) == 3 and store.get("r4", "a").record == b"rewritten"  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        store.put("r4", "b", b"taken")  # another scope may not overwrite it
    now[0] += 9.5  # r2 (made at 1002) and r3 (1003) are past the TTL; r4 was rewritten at 1005
    assert store.get("r2", "a") is None and store.get("r3", "a") is None
    assert store.get("r4", "a") is not None
    engine_id = store.engine_id
    store.close()
    again = ResponseStore(tmp_path / "s", max_stored=3, ttl=0)
    assert again.engine_id == engine_id and len(again) == 1
    assert again.delete("r4", "a") and not again.delete("r4", "a") and len(again) == 0
    again.close()


def test_a_full_store_drops_its_oldest_records(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "s", max_stored=1000, map_size=1 << 20)
    for i in range(40):  # 4 MB of records through a 1 MiB map
        store.put(f"r{i}", "a", bytes([i]) * 100_000)
    assert 0 < len(store) < 10
    assert store.get("r39", "a").record == bytes([39]) * 100_000  # type: ignore[union-attr]
    assert store.get("r0", "a") is None
    with pytest.raises(ValueError, match="larger than half"):
        store.put("huge", "a", bytes(600_000))
    store.close()


def test_store_refuses_a_folder_of_another_user_and_makes_its_own_private(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    ResponseStore(folder).close()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    if os.getuid() != 0 and Path("/").stat().st_uid != os.getuid():
        with pytest.raises(PermissionError):
            ResponseStore(Path("/"))
