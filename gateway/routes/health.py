"""GET /health: 200 only when at least one engine answers a health check now."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.state import state_of


async def health(request: Request) -> Response:
    pool = state_of(request).pool
    ok = await pool.probe_all()
    engines = [{"address": e.address, "healthy": e.healthy, "models": sorted(e.models)} for e in pool.engines]
    if any(ok):
        return JSONResponse({"status": "ok", "engines": engines})
    return JSONResponse({"status": "unavailable", "engines": engines}, status_code=503,
                        headers={"Retry-After": "1"})
