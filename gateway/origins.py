"""Which browser pages may use the API: `--allowed-origins`, for CORS on HTTP and on a WebSocket handshake.

CORS keeps a page from reading answers to its fetches, but a browser applies no CORS to a WebSocket:
a page from any site may open ``ws://127.0.0.1:8000/v1/responses`` and run generations. The browser
does send the page's ``Origin`` on the handshake, so it is matched against the same list, with
Starlette's CORS matching, and one not allowed is refused with a 403 before the socket opens. A client
with no ``Origin`` (an SDK, curl, Codex CLI) is not a browser page and is unaffected.

Without `--allowed-origins`, HTTP gets no CORS headers (as before), and a WebSocket is opened only for
pages served from loopback (``http://localhost:*``, ``http://127.0.0.1:*``, ``http://[::1]:*``, https too), as
local dev servers do: the developer's own pages work, other sites cannot drive a local gateway.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import OpenAIError, refuse

LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"  # the default for WebSocket handshakes


class OriginsMiddleware(CORSMiddleware):
    """Starlette's CORS for HTTP (only with `--allowed-origins`), and the Origin check of a WebSocket handshake."""

    def __init__(self, app: ASGIApp, allowed_origins: Sequence[str]) -> None:
        super().__init__(app, allow_origins=allowed_origins, allow_headers=["*"],
                         allow_methods=["GET", "POST", "DELETE"], expose_headers=["X-Request-Id"],
                         # No list: loopback pages only. This pattern is never used for HTTP (no CORS then).
                         allow_origin_regex=None if allowed_origins else LOOPBACK_ORIGINS)
        self.cors = bool(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and not self.is_allowed_origin(origin):
                hint = "" if self.cors else " (without --allowed-origins only loopback pages are)"
                err = OpenAIError(403, f"a WebSocket from the origin {origin!r} is not allowed{hint}",
                                  code="origin_not_allowed")
                await refuse(err, scope, receive, send)
                return
        elif scope["type"] == "http" and self.cors:
            await super().__call__(scope, receive, send)
            return
        await self.app(scope, receive, send)
