"""GET /v1/ignis/state (what the engines hold, as JSON), GET /v1/ignis/state/stream (the same as
Server-Sent Events, one a second) and GET /monitor (the page that draws it).

The JSON has one section per engine, each from the engine's ListState RPC: the KV page
pool, the slots, the sequences by class, tokens per second, the retained states one row
each (the device's in eviction order, then the host's, KV-RAM's and KV-disk's), the tiers
and the recent requests. The page (gateway/static/monitor/) is one client of it: plain
HTML, JS and CSS, no build step, reading the stream; its icon is an SVG beside it, and
/favicon.ico, which browsers ask of any page without a link to an icon, is a 204 (not a 404).

Query: ``limit`` rows of retained state per engine (1..1000, default 1000); ``engine``
(an address as listed) with ``page_token`` pages one engine's list further (JSON only);
``interval`` seconds between two events of the stream (0.25..60, default 1). An engine
that does not answer has ``"error"`` in its section; the others are still shown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from importlib import resources

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.request_class import from_pb
from gateway.aliases import JSONObject, SSEBytes
from gateway.engines import EngineClient
from gateway.errors import OpenAIError, from_grpc, invalid
from gateway.sse import EventStream, data_event
from gateway.state import state_of
from ignis.v1 import common_pb2, engine_pb2

MAX_LIMIT = 1000  # the engine's largest page
MIN_INTERVAL, MAX_INTERVAL, DEFAULT_INTERVAL = 0.25, 60.0, 1.0  # seconds between two stream events
CALL_TIMEOUT = 10.0  # seconds per engine: a slow one is reported, not waited for
# The page and its assets: public (they carry no data; the JSON they fetch needs the key).
STATIC_FILES = {"/monitor": ("index.html", "text/html; charset=utf-8"),
                "/monitor/monitor.js": ("monitor.js", "text/javascript; charset=utf-8"),
                "/monitor/monitor.css": ("monitor.css", "text/css; charset=utf-8"),
                "/monitor/favicon.svg": ("favicon.svg", "image/svg+xml")}
MONITOR_PATHS = tuple(STATIC_FILES)
FAVICON = "/favicon.ico"  # public too

_TIER = {v: k.removeprefix("REUSE_TIER_").lower() for k, v in common_pb2.ReuseTier.items()}
_KIND = {v: k.removeprefix("REUSE_KIND_").lower() for k, v in common_pb2.ReuseKind.items()}


def _class(value: int) -> str:
    try:
        return from_pb(value).label
    except ValueError:  # an engine newer than this gateway: show what it sent
        return str(value)


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return MAX_LIMIT
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise invalid(f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw[:32]!r}", param="limit")
    return int(raw)


def _interval(request: Request) -> float:
    raw = request.query_params.get("interval")
    if raw is None:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not MIN_INTERVAL <= value <= MAX_INTERVAL:  # NaN fails too
        raise invalid(f"interval must be a number of seconds from {MIN_INTERVAL} to {MAX_INTERVAL}, "
                      f"got {raw[:32]!r}", param="interval")
    return value


async def ignis_state(request: Request) -> Response:
    pool = state_of(request).pool
    limit = _limit(request)
    address = request.query_params.get("engine")
    token = request.query_params.get("page_token", "")
    if token and address is None:
        raise invalid("page_token pages one engine's list: give engine=<address> too", param="page_token")
    engines = pool.engines
    if address is not None:
        engines = [e for e in pool.engines if e.address == address]
        if not engines:
            known = ", ".join(e.address for e in pool.engines)
            raise invalid(f"no engine {address[:100]!r} behind this gateway; engines: {known}", param="engine")
    return JSONResponse(await _gather(engines, limit, token, strict=address is not None))


async def ignis_state_stream(request: Request) -> Response:
    """The state of every engine as one `data:` event per interval, until the client leaves or the server
    stops (its drain: an endless stream would hold the stop for its whole grace)."""
    state = state_of(request)
    pool = state.pool
    limit, interval = _limit(request), _interval(request)
    if "page_token" in request.query_params or "engine" in request.query_params:
        raise invalid("the stream shows every engine's first states: page with /v1/ignis/state",
                      param="page_token" if "page_token" in request.query_params else "engine")

    async def events() -> AsyncIterator[SSEBytes]:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            yield data_event(await _gather(pool.engines, limit, "", strict=False))
            if await state.shutdown.sleep(max(interval - (loop.time() - started), 0.0)):  # pacing, not readiness
                return

    return EventStream(events())


async def _gather(engines: Sequence[EngineClient], limit: int, token: str, strict: bool) -> JSONObject:
    sections = await asyncio.gather(*(_section(e, limit, token, strict) for e in engines))
    return {"object": "ignis.state", "time": time.time(), "engines": list(sections)}


async def _section(engine: EngineClient, limit: int, token: str, strict: bool) -> JSONObject:
    head: JSONObject = {"address": engine.address, "healthy": engine.healthy}
    try:
        reply = await engine.stub.ListState(engine_pb2.ListStateRequest(page_size=limit, page_token=token),
                                            timeout=CALL_TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        if strict and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # a bad page token: the caller's mistake
            err = from_grpc(exc)
            raise OpenAIError(400, err.message, param="page_token") from None
        return {**head, "error": f"{exc.code().name}: {exc.details() or ''}"}
    return {**head, **engine_section(reply)}


def engine_section(r: engine_pb2.ListStateResponse) -> JSONObject:
    """One engine's part of /v1/ignis/state (the shape docs/architecture.md documents)."""
    s, pool = r.stats, r.stats.page_pool
    free = max(pool.total_pages - pool.used_pages - pool.cached_pages, 0)
    t = r.tiers
    tiers: JSONObject = {"configured": t.configured, "reachable": t.reachable,
                         "engine": {"spills": t.engine_spills, "spill_failures": t.engine_spill_failures,
                                    "restores": t.engine_restores, "restore_failures": t.engine_restore_failures,
                                    "restores_rejected": t.engine_restores_rejected}}
    if t.HasField("store"):
        st = t.store
        tiers["ram"] = {"bytes_used": st.ram_bytes_used, "bytes_total": st.ram_bytes_total, "states": st.states_ram,
                        "usable": st.arena_usable}
        tiers["disk"] = {"bytes_used": st.disk_bytes_used, "bytes_total": st.disk_bytes_total,
                         "states": st.states_disk, "usable": st.disk_usable}
        tiers["store"] = {"spills": st.spills, "restores": st.restores, "evictions": st.evictions,
                          "checksum_failures": st.checksum_failures}
    c = s.counters
    return {
        "model": r.model,
        "taken_at": r.taken_at,
        "snapshot_ms": round(r.snapshot_ms, 3),
        "pool": {"total": pool.total_pages, "used": pool.used_pages, "cached": pool.cached_pages, "free": free,
                 "page_size": pool.page_size, "registered": r.registered_pages},
        "slots": {"state": _slots(s.state_slots), "retained_device": _slots(s.retained_device_slots),
                  "retained_host": _slots(s.retained_host_slots)},
        "sequences": {"running": {"interactive": s.running.interactive, "agent": s.running.agent},
                      "waiting": {"interactive": s.waiting.interactive, "agent": s.waiting.agent}},
        "throughput": {"prefill_tokens_per_second": r.prefill_tokens_per_second,
                       "decode_tokens_per_second": r.decode_tokens_per_second},
        "counters": {"requests_finished": c.requests_finished, "prompt_tokens": c.prompt_tokens,
                     "reused_tokens": c.reused_tokens, "generated_tokens": c.generated_tokens,
                     "retained_state_hits": c.retained_state_hits, "retained_state_misses": c.retained_state_misses},
        "states": [_state(row) for row in r.states],
        "states_total": r.states_total,
        "next_page_token": r.next_page_token or None,
        "tiers": tiers,
        "recent": [_recent(q) for q in r.recent],
    }


def _slots(s: engine_pb2.SlotStats) -> JSONObject:
    return {"total": s.total, "used": s.used}


def _state(row: engine_pb2.RetainedStateRow) -> JSONObject:
    return {"name": row.name, "kind": _KIND.get(row.kind, "none"), "tier": _TIER.get(row.tier, "none"),
            "class": _class(row.request_class), "tokens": row.tokens, "bytes": row.bytes,
            "age_seconds": round(row.age_seconds, 3), "idle_seconds": round(row.idle_seconds, 3), "hits": row.hits,
            "protected": row.protected, "rank": row.rank if row.HasField("rank") else None, "pages": row.pages,
            "ready": row.ready}


def _recent(q: engine_pb2.RecentRequest) -> JSONObject:
    return {"request_id": q.request_id, "class": _class(q.request_class), "prompt_tokens": q.prompt_tokens,
            "cached_tokens": q.cached_tokens, "tier": _TIER.get(q.tier, "none"), "kind": _KIND.get(q.kind, "none"),
            "ttft_ms": round(q.ttft_ms, 3), "completion_tokens": q.completion_tokens,
            "finish_reason": q.finish_reason, "finished_at": q.finished_at}


_STATIC = resources.files("gateway") / "static" / "monitor"


async def monitor_file(request: Request) -> Response:
    """The Monitor's page and assets, read from the package (so an installed wheel serves them too)."""
    name, media_type = STATIC_FILES[request.url.path]
    return Response((_STATIC / name).read_bytes(), media_type=media_type,
                    headers={"Cache-Control": "no-cache"})


async def favicon(request: Request) -> Response:
    """No icon here (the Monitor links its own): a 204 a browser keeps for a day instead of logging a 404."""
    return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})
