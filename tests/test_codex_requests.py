"""What Codex CLI sends /v1/responses by default, served: namespace, custom (freeform) and hosted
tools, `include`, `prompt_cache_key`, `client_metadata`, compressed bodies; and the real CLI
(`npm i @openai/codex`) finishing a turn over HTTP and over its WebSocket transport (claiming its
prewarmed prompt there), skipped where npm or its registry is not reachable.

Real processes on loopback: an engine on the random-weight ignis-tiny, a gateway in front."""

from __future__ import annotations

import copy
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import zstandard
from websockets.sync.client import connect

from services import RunningService, start_engine, start_gateway

lark = pytest.importorskip("lark", reason="lark (a test extra) is the oracle for custom tools' grammars")

MODEL = "ignis-tiny"
ROOM = 600  # seconds a call may take: on a loaded machine Codex's apply_patch grammar compiled for over 120
DATA = Path(__file__).parent / "data" / "codex"
APPLY_PATCH_GRAMMAR = (DATA / "tool_apply_patch.lark").read_text()
# Codex's freeform apply_patch, as codex-rs/tools/src/apply_patch_tool.rs builds it (models whose
# metadata asks for the freeform tool get it beside the captured defaults).
APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap "
                              "the patch in JSON.",
               "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR}}
MAX_REQUEST_BYTES = 1 << 20
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def codex_body(**changes: Any) -> dict[str, Any]:
    """Codex's captured default request (tests/data/codex/README.md), with apply_patch added."""
    body: dict[str, Any] = json.loads((DATA / "default_request.json").read_text())
    body["tools"] = [*body["tools"], copy.deepcopy(APPLY_PATCH)]
    body.update({"max_output_tokens": 8, **changes})
    return body


def checkpoint(tiny_model_dir: Path, root: Path, generation: dict[str, Any]) -> Path:
    """ignis-tiny with its own generation_config.json."""
    for path in tiny_model_dir.iterdir():
        if path.name != "generation_config.json":  # written below: through a link it would change the shared one
            (root / path.name).symlink_to(path)
    (root / "generation_config.json").write_text(json.dumps(generation))
    return root


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    # Codex sends no max_output_tokens: the checkpoint's generation_config.json bounds what it gets.
    model = checkpoint(tiny_model_dir, tmp_path_factory.mktemp("model"), {"max_new_tokens": 16})
    service = start_engine(tmp_path_factory.mktemp("engine"), str(model), ["--served-model-name", MODEL])
    yield service
    assert service.stop() == 0, service.log()


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address],
                            ["--max-request-bytes", str(MAX_REQUEST_BYTES)])
    yield service
    assert service.stop() == 0, service.log()


def url(gateway: RunningService) -> str:
    return f"http://127.0.0.1:{gateway.port}/v1/responses"


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_codex_default_request_streams_over_http(gateway: RunningService) -> None:
    body = codex_body()
    assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search", "custom"}
    assert body["include"] == ["reasoning.encrypted_content"] and body["prompt_cache_key"] and body["client_metadata"]
    r = httpx.post(url(gateway), json=body, timeout=ROOM)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1]["type"] in TERMINAL[:2], events[-1]
    assert events[-1]["response"]["tools"] == body["tools"]  # echoed as sent, hosted ones too


def test_codex_default_request_over_the_websocket(gateway: RunningService) -> None:
    body = codex_body()
    body.pop("stream")
    with connect(f"ws://127.0.0.1:{gateway.port}/v1/responses", open_timeout=30) as ws:
        ws.send(json.dumps({"type": "response.create", **body}))
        while True:
            event = json.loads(ws.recv(timeout=ROOM))
            assert event["type"] != "error", event
            if event["type"] in TERMINAL:
                break
    assert event["type"] in TERMINAL[:2]


def test_a_forced_custom_tool_comes_back_as_custom_tool_call(gateway: RunningService) -> None:
    definition = 'start: WORD ("-" WORD)~0..2\nWORD: /[a-z]{1,4}/'
    word = {"type": "custom", "name": "word", "description": "a word", "format": {
        "type": "grammar", "syntax": "lark", "definition": definition}}
    body = codex_body(stream=False, tools=[*codex_body()["tools"], word], tool_choice={"type": "custom", "name": "word"},
                      parallel_tool_calls=False, max_output_tokens=96)
    r = httpx.post(url(gateway), json=body, timeout=ROOM)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "completed", out
    [call] = out["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "word" and call["call_id"], call
    lark.Lark(definition).parse(call["input"])  # the raw text, held to the grammar


def test_a_forced_custom_tool_streams_its_input_events(gateway: RunningService) -> None:
    definition = 'start: "yes" | "no"'
    body = codex_body(tools=[{"type": "custom", "name": "vote", "format": {
        "type": "grammar", "syntax": "lark", "definition": definition}}],
        tool_choice={"type": "custom", "name": "vote"}, parallel_tool_calls=False, max_output_tokens=64)
    r = httpx.post(url(gateway), json=body, timeout=ROOM)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    kinds = [e["type"] for e in events]
    assert "response.custom_tool_call_input.done" in kinds, kinds
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert done["input"] in ("yes", "no")
    assert events[-1]["response"]["output"][0]["input"] == done["input"]


def test_codex_apply_patch_grammar_compiles_on_the_engine(gateway: RunningService) -> None:
    """Forced: the engine converts and holds Codex's Lark grammar (a bad one would be a 400)."""
    body = codex_body(stream=False, tool_choice={"type": "custom", "name": "apply_patch"},
                      parallel_tool_calls=False, max_output_tokens=48)
    r = httpx.post(url(gateway), json=body, timeout=ROOM)
    assert r.status_code == 200, r.text
    out = r.json()
    calls = [i for i in out["output"] if i["type"] == "custom_tool_call"]
    if out["status"] == "completed":  # a random model rarely ends a patch in 48 tokens
        lark.Lark(APPLY_PATCH_GRAMMAR.replace("/(.*)/", "/(.+)/?")).parse(calls[0]["input"])
    else:
        assert out["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_namespace_member_is_named_as_declared(gateway: RunningService) -> None:
    pick = {"type": "function", "name": "pick", "strict": True, "parameters": {
        "type": "object", "required": ["n"], "additionalProperties": False,
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}
    body = codex_body(stream=False, tools=[{"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                                            "tools": [pick]}, {"type": "web_search"}],
                      tool_choice={"type": "function", "namespace": "multi_agent_v1", "name": "pick"},
                      parallel_tool_calls=False, max_output_tokens=64)
    r = httpx.post(url(gateway), json=body, timeout=ROOM)
    assert r.status_code == 200, r.text
    out = r.json()
    [call] = out["output"]
    assert (call["type"], call["namespace"], call["name"]) == ("function_call", "multi_agent_v1", "pick"), call
    assert 0 <= json.loads(call["arguments"])["n"] <= 9
    # Codex resends the call and its output: the namespace is read back, the turn goes on.
    follow = codex_body(stream=False, tools=body["tools"], input=[
        *body["input"], {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch\n"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}])
    r = httpx.post(url(gateway), json=follow, timeout=ROOM)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_compressed_bodies(gateway: RunningService, encoding: str) -> None:
    raw = json.dumps(codex_body(stream=False)).encode()
    packed = gzip.compress(raw) if encoding == "gzip" else zstandard.ZstdCompressor().compress(raw)
    r = httpx.post(url(gateway), content=packed, timeout=ROOM,
                   headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response"


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_decompression_bomb_is_413(gateway: RunningService, encoding: str) -> None:
    """A few KiB that would inflate to 64 MiB: refused once the limit's worth came out."""
    zeros = b"\0" * (64 << 20)
    bomb = gzip.compress(zeros, 9) if encoding == "gzip" else zstandard.ZstdCompressor(level=19).compress(zeros)
    assert len(bomb) < 100_000
    r = httpx.post(url(gateway), content=bomb, timeout=60,
                   headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert httpx.post(url(gateway), json=codex_body(stream=False), timeout=ROOM).status_code == 200  # still serving


def test_an_unknown_encoding_is_415(gateway: RunningService) -> None:
    r = httpx.post(url(gateway), content=b"{}", timeout=30,
                   headers={"Content-Type": "application/json", "Content-Encoding": "br"})
    assert r.status_code == 415, r.text


# ---------------------------------------------------------------- the real client


def _codex_cli(root: Path) -> Path:
    """`codex` from npm, installed once under `root`; skips with the reason when it cannot be."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: Codex CLI comes from npm (@openai/codex)")
    try:
        version = subprocess.run([npm, "view", "@openai/codex", "version"], capture_output=True, text=True,
                                 timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip("the npm registry did not answer in 60 s")
    if version.returncode != 0:
        pytest.skip(f"the npm registry is not reachable: {version.stderr.strip()[-300:]}")
    binary = root / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        done = subprocess.run([npm, "install", "--prefix", str(root), f"@openai/codex@{version.stdout.strip()}"],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"npm could not install @openai/codex: {done.stderr.strip()[-300:]}")
    return binary


@pytest.fixture(scope="module")
def ending_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """An engine whose random model ends its answers: a third of the vocabulary is EOS
    (generation_config.json), so a reply completes in a few tokens, as Codex needs to end its turn
    (an answer cut at max_output_tokens is an error to Codex)."""
    from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE

    model = checkpoint(tiny_model_dir, tmp_path_factory.mktemp("ending-model"),
                       {"max_new_tokens": 64, "eos_token_id": list(range(256, TINY_VOCAB_SIZE - 64, 3))})
    engine = start_engine(tmp_path_factory.mktemp("ending-engine"), str(model), ["--served-model-name", MODEL])
    yield engine
    assert engine.stop() == 0, engine.log()


@pytest.fixture(scope="module")
def ending_gateway(ending_engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """A gateway on `ending_engine`, logging every request (uvicorn's access log)."""
    gateway = start_gateway(tmp_path_factory.mktemp("ending-gateway"), [ending_engine.address], ["--access-log"])
    yield gateway
    assert gateway.stop() == 0, gateway.log()


def _codex_exec(codex: Path, gateway: RunningService, tmp_path_factory: pytest.TempPathFactory,
                provider_options: str = "") -> subprocess.CompletedProcess[str]:
    """`codex exec "say hi"` with its default configuration, on a custom provider `ignis` (the
    Responses wire) pointing at `gateway`, plus `provider_options` (`,key=value...`)."""
    home, work = tmp_path_factory.mktemp("codex-home"), tmp_path_factory.mktemp("codex-work")
    provider = (f'model_providers.ignis={{name="ignis",base_url="http://127.0.0.1:{gateway.port}/v1",'
                f'wire_api="responses",env_key="IGNIS_TEST_KEY"{provider_options}}}')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), IGNIS_TEST_KEY="test", NO_COLOR="1")
    return subprocess.run([str(codex), "exec", "--skip-git-repo-check", "-c", "model_provider=ignis", "-c", provider,
                           "-m", MODEL, "say hi"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=ROOM)


def test_codex_exec_finishes_a_turn(ending_gateway: RunningService, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`codex exec` with its default configuration (a custom provider on the Responses wire, over
    HTTP) against the gateway: the turn ends, no request is refused."""
    gateway = ending_gateway
    codex = _codex_cli(tmp_path_factory.mktemp("codex-cli"))
    done = _codex_exec(codex, gateway, tmp_path_factory)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "ERROR" not in output and "invalid_request_error" not in output, output


def _requests_done(log: str) -> list[dict[str, Any]]:
    """The engine's `ignis.request.done` events in `log`, in order."""
    events = (json.loads(line) for line in log.splitlines() if '"ignis.request.done"' in line)
    return [e for e in events if e.get("event") == "ignis.request.done"]


def test_codex_exec_over_the_websocket_claims_its_prewarm(ending_engine: RunningService,
                                                          ending_gateway: RunningService,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """`codex exec` on the Responses WebSocket transport (the provider's `supports_websockets`): at
    startup Codex opens the socket and prewarms the prompt (`response.create` with `generate: false`,
    prefilled, no output), then sends the turn on the same socket with `previous_response_id` naming
    the prewarm and only the new items; the engine serves the turn from the prewarm's retained state.

    `websocket_connect_timeout_ms` is also how long Codex's first turn waits for the startup prewarm
    (15 s by default in 0.171.0, codex-rs startup_prewarm.rs): past it Codex drops
    the prewarm and sends the whole prompt on a new socket. Prefilling Codex's ~16k-token default
    prompt on a loaded CPU takes longer than that, so the wait is widened to what a call may take."""
    gateway, engine = ending_gateway, ending_engine
    codex = _codex_cli(tmp_path_factory.mktemp("codex-cli"))
    gateway_seen, engine_seen = len(gateway.log()), len(engine.log())
    done = _codex_exec(codex, gateway, tmp_path_factory,
                       f",supports_websockets=true,websocket_connect_timeout_ms={ROOM * 1000}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "ERROR" not in output and "invalid_request_error" not in output, output

    # Served over the WebSocket: one upgrade on /v1/responses carried the prewarm and the turn (a
    # prewarm Codex gave up on would show as a second socket), and no HTTP request.
    gateway_log = gateway.log()[gateway_seen:]
    assert gateway_log.count('"WebSocket /v1/responses" [accepted]') == 1, gateway_log
    assert '"POST /v1/responses' not in gateway_log, gateway_log
    assert "Traceback" not in gateway_log, gateway_log

    # The prewarm: the prompt prefilled, nothing generated; then the turn, which reused its state.
    requests = _requests_done(engine.log()[engine_seen:])
    assert len(requests) == 2, requests
    prewarm, turn = requests
    assert prewarm["tokens_out"] == 0 and prewarm["finish_reason"] == "length", prewarm
    assert prewarm["prompt_tokens"] > 1000, prewarm  # Codex's instructions and tools
    assert turn["finish_reason"] == "stop" and turn["tokens_out"] > 0, turn
    assert turn["prompt_tokens"] > prewarm["prompt_tokens"], (prewarm, turn)
    assert turn["cached_tokens"] == prewarm["prompt_tokens"], (prewarm, turn)
    assert turn["kind"] != "none" and turn["tier"] != "none", turn
