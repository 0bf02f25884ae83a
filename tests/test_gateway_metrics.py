"""The gateway's /metrics (gateway/metrics.py, gateway/routes/metrics.py) and its favicon (issue 47, items 12
and 13): the exposition format is negotiated as the engine's and the tierstore's is (OpenMetrics when the
scraper asks for it), every route is labelled by its template (unknown paths stay "other", so the label's
values are bounded), and /favicon.ico is answered, not a 404.

A real gateway process with no engine behind it: none of this needs one."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as text_families
from starlette.routing import Route

from common.launch import free_port
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.metrics import RouteLabels
from services import RunningService, start_gateway

KEY = "metrics-key"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    # An engine address where nothing listens: /health is 503, everything here still answers.
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [f"127.0.0.1:{free_port()}"],
                            ["--api-key", KEY])
    yield service
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


@pytest.fixture(scope="module")
def http(gateway: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{gateway.address}", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def requests_total(text: str) -> dict[tuple[str, str, str], float]:
    """ignis_gateway_requests_total by (route, method, status), from the Prometheus text."""
    found = {}
    for family in text_families(text):
        for sample in family.samples:
            if sample.name == "ignis_gateway_requests_total":
                labels = sample.labels
                found[(labels["route"], labels["method"], labels["status"])] = sample.value
    return found


# ---------------------------------------------------------------- the format


def test_openmetrics_when_the_scraper_asks_for_it(http: httpx.Client) -> None:
    # What Prometheus sends by default (scrape_protocols: OpenMetrics first).
    accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    reply = http.get("/metrics", headers={"Accept": accept})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0"), reply.headers
    assert reply.text.endswith("# EOF\n")
    names = {family.name for family in text_string_to_metric_families(reply.text)}  # parses as OpenMetrics
    assert {"ignis_gateway_requests", "ignis_gateway_connections_open"} <= names


def test_the_prometheus_text_otherwise(http: httpx.Client) -> None:
    for headers in ({}, {"Accept": "text/plain"}, {"Accept": "*/*"}):
        reply = http.get("/metrics", headers=headers)
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8", (headers, reply.headers)
        assert "# EOF" not in reply.text and "ignis_gateway_requests_total" in reply.text


# ---------------------------------------------------------------- the route label


def test_each_route_is_labelled_by_its_template(http: httpx.Client) -> None:
    asked = [("GET", "/v1/responses/resp_0123", "/v1/responses/{response_id}"),
             ("DELETE", "/v1/responses/resp_0123", "/v1/responses/{response_id}"),
             ("GET", "/v1/responses/resp_0123/input_items", "/v1/responses/{response_id}/input_items"),
             ("GET", "/v1/ignis/state", "/v1/ignis/state"),
             ("GET", "/monitor", "/monitor"),
             ("GET", "/monitor/monitor.js", "/monitor/monitor.js"),
             ("GET", "/v1/models/org/some-model", "/v1/models/{model}"),
             ("POST", "/tokenize", "/tokenize"),
             ("GET", "/favicon.ico", "/favicon.ico"),
             # paths no route serves stay "other", whatever they are
             ("GET", "/v1/responses/resp_0123/input_items/more", "other"),
             ("GET", "/wp-login.php", "other"),
             ("GET", "/v1/responses-but-not", "other")]
    before = requests_total(http.get("/metrics").text)
    statuses = {}
    for method, path, _ in asked:
        statuses[(method, path)] = str(http.request(method, path).status_code)
    after = requests_total(http.get("/metrics").text)
    for method, path, route in asked:
        key = (route, method, statuses[(method, path)])
        assert after.get(key, 0) - before.get(key, 0) >= 1, (method, path, key, sorted(after))
    counted = {route for (route, method, status), n in after.items() if n != before.get((route, method, status), 0)}
    assert counted <= {route for _, _, route in asked} | {"/metrics"}, counted  # nothing else, no raw paths


def test_every_route_of_the_app_has_its_own_label() -> None:
    app = create_app(GatewayConfig(engines=["127.0.0.1:9"]))
    routes = [r for r in app.routes if isinstance(r, Route)]
    labels = RouteLabels(r.path for r in routes)
    for route in routes:
        example = re.sub(r"\{[^}]+\}", "x", route.path)
        assert labels.label(example) == re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", route.path), route.path
    assert labels.label("/nowhere") == "other"
    assert labels.label("/v1/responses/a/b") == "other"


# ---------------------------------------------------------------- the favicon


def test_favicon_is_no_404_and_needs_no_key(gateway: RunningService) -> None:
    reply = httpx.get(f"http://{gateway.address}/favicon.ico", timeout=60)  # browsers ask it without a key
    assert reply.status_code == 204 and reply.content == b"", reply
    page = httpx.get(f"http://{gateway.address}/monitor", timeout=60)
    [href] = re.findall(r'<link rel="icon"[^>]* href="([^"]+)"', page.text)
    icon = httpx.get(f"http://{gateway.address}{href}", timeout=60)
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
    assert icon.content.startswith(b"<svg") and len(icon.content) < 2048


def test_the_favicon_route_is_public_only_for_itself(gateway: RunningService) -> None:
    assert httpx.get(f"http://{gateway.address}/v1/ignis/state", timeout=60).status_code == 401
