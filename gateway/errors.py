"""OpenAI error bodies, and the map from an engine's gRPC status to HTTP.

Client mistakes are `OpenAIError` (a Starlette `HTTPException`) raised anywhere in a
handler; the app's exception handlers render every error as
``{"error": {"message", "type", "param", "code"}}`` and never leak a stack trace.
"""

from __future__ import annotations

import logging
import re

import grpc
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

log = logging.getLogger("ignis.gateway")

# HTTP status -> OpenAI error `type`.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI answers a bad key with this type and code "invalid_api_key"
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# Engine INVALID_ARGUMENT messages start with the field they are about ("top_p must be in ...");
# the gateway uses the same names as the OpenAI API for these.
_ENGINE_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "n", "top_logprobs", "logit_bias", "tools",
    "chat_template_kwargs", "messages", "tool_choice",
})


class OpenAIError(HTTPException):
    """An error answered with OpenAI's body. `param` names the offending request field."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code, message, headers)
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status_code, "server_error" if status_code >= 500 else
                                                   "invalid_request_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for a malformed or invalid request field."""
    return OpenAIError(400, message, param=param, code=code)


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


async def refuse(err: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer `err` instead of serving an HTTP request or opening a WebSocket: a handshake gets the
    HTTP answer where the server can send one (uvicorn can), else it is closed (1008) before it opens."""
    if scope["type"] == "http":
        await error_response(err)(scope, receive, send)
    elif "websocket.http.response" in scope.get("extensions", {}):
        await WebSocket(scope, receive, send).send_denial_response(error_response(err))
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": err.message})


def from_grpc(err: grpc.aio.AioRpcError | grpc.RpcError, *, prompt_param: str | None = None,
              max_tokens_param: str = "max_tokens") -> OpenAIError:
    """Map an engine's status to the HTTP status and OpenAI body the client sees.

    `prompt_param` / `max_tokens_param` are the names this endpoint uses for the
    prompt and the token limit, so a context error names the field the client sent.
    """
    code = err.code()
    details = err.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        return OpenAIError(404, details, param="model", code="model_not_found")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if "not served here" in details:  # an engine from before NOT_FOUND
            return OpenAIError(404, details, param="model", code="model_not_found")
        if "context" in details:
            return OpenAIError(400, details, param=_context_param(details, prompt_param, max_tokens_param),
                               code="context_length_exceeded")
        return invalid(details, param=_engine_param(details, max_tokens_param))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OpenAIError(429, f"the engine is at capacity, retry later: {details}", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(f"no engine is available: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, "the request timed out at the engine", code="timeout")
    if code == grpc.StatusCode.CANCELLED:
        return OpenAIError(499, "the request was cancelled", code="cancelled")
    # INTERNAL, UNKNOWN and the rest: the details may be an engine traceback; log them, say little.
    log.error("engine call failed with %s: %s", code.name, details)
    return OpenAIError(500, f"the engine failed to serve the request ({code.name})", code="engine_error")


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, code="service_unavailable", headers={"Retry-After": "1"})


# The engine's context error, in OpenAI's words (clients such as litellm match them).
_CONTEXT_ERROR = re.compile(r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens "
                            r"\((\d+) in the messages, \d+ in the completion\)")


def _context_param(details: str, prompt_param: str | None, max_tokens_param: str) -> str | None:
    """The field to blame: the token limit when the prompt alone would fit, else the prompt."""
    match = _CONTEXT_ERROR.search(details)
    if match is not None and int(match.group(2)) < int(match.group(1)):
        return max_tokens_param
    return prompt_param


def _engine_param(details: str, max_tokens_param: str) -> str | None:
    match = re.match(r"(?:messages\[\d+\](?:\.content\[\d+\])?|[a-z_]+)", details)
    if match is None:
        return None
    word = match.group(0)
    if word.startswith("messages["):
        return word
    if word == "max_tokens":
        return max_tokens_param
    return word if word in _ENGINE_FIELDS else None


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Every HTTPException (ours, or Starlette's 404/405) as an OpenAI body."""
    if isinstance(exc, OpenAIError):
        return error_response(exc)
    assert isinstance(exc, HTTPException)
    return error_response(OpenAIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))


class UnexpectedErrors:
    """Pure ASGI, outermost: a bug in a handler is logged once with its traceback and answered with
    a 500 OpenAI body, and the exception stops here, so the keep-alive connection stays open.

    (Starlette's own handler for ``Exception`` re-raises after answering; uvicorn then logs it a
    second time and closes the connection.) An answer already under way cannot be turned into a
    500: then the exception goes on to uvicorn, which closes the connection to end it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            err = OpenAIError(500, "internal error in the gateway", code="internal_error")
            await error_response(err)(scope, receive, send)
