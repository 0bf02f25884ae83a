"""`--api-key`: a pure-ASGI middleware answering 401 (OpenAI body) without ``Authorization: Bearer <key>``.

A WebSocket handshake (the Responses API's WebSocket mode) is checked the same way: refused with the
401 body where the server can send an HTTP answer to a handshake, else closed (1008) before it opens.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import OpenAIError, refuse


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, public_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.key = api_key.encode()
        self.public_paths = frozenset(public_paths)  # probes and scrapes carry no key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in self.public_paths:
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if not auth:
                err = OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
                await refuse(err, scope, receive, send)
                return
            # compare_digest: the time taken does not tell how much of the key matched.
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                err = OpenAIError(401, "incorrect API key provided", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
                await refuse(err, scope, receive, send)
                return
        await self.app(scope, receive, send)

