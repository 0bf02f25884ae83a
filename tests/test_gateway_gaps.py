"""Small gaps a new user meets: CORS, /tokenize, endpoints not served, an unknown model."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from services import RunningService, start_gateway

MODEL = "ignis-tiny"
ORIGIN = "http://localhost:5173"


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address],
                            ["--allowed-origins", ORIGIN, "--api-key", "k"])
    yield service
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


@pytest.fixture(scope="module")
def http(gateway: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{gateway.address}", timeout=60, headers={"Authorization": "Bearer k"}) as c:
        yield c


def test_cors_preflight_is_answered_without_the_key(gateway: RunningService) -> None:
    r = httpx.options(f"http://{gateway.address}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    other = httpx.options(f"http://{gateway.address}/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_cors_headers_on_answers(http: httpx.Client) -> None:
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_by_default(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> None:
    service = start_gateway(tmp_path_factory.mktemp("plain"), [engine.address])
    try:
        r = httpx.get(f"http://{service.address}/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        assert service.stop() == 0


def test_tokenize_text_and_messages(http: httpx.Client) -> None:
    text = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert text["count"] == len(text["tokens"]) > 0 and text["max_model_len"] > 0
    chat = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hello world"}]})
    assert chat.status_code == 200 and chat.json()["count"] > text["count"]  # the template adds its markers
    bad = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/detokenize", "/v1/embeddings"])
def test_endpoints_not_served_say_so(http: httpx.Client, path: str) -> None:
    r = http.post(path, json={"model": MODEL, "input": "x"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert "not served" in err["message"] and err["code"] == "not_found"
