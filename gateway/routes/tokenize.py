"""POST /tokenize (vLLM's shape: the engine renders and tokenizes), and the endpoints not served.

`/tokenize` takes `prompt` (text; `add_special_tokens`, default true) or chat `messages` (with
`tools`, `add_generation_prompt`, `chat_template_kwargs`, rendered by the engine's template) and
answers `{"count", "max_model_len", "tokens"}`. `/detokenize` and `/v1/embeddings` answer an
OpenAI-shaped 404 that says they are not served.
"""

from __future__ import annotations

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.body import Fields, read_json
from gateway.errors import OpenAIError, from_grpc, invalid, unavailable
from gateway.image_parts import ImageSource, attach_images
from gateway.messages import chat_input
from gateway.state import state_of
from ignis.v1 import engine_pb2


async def tokenize(request: Request) -> Response:
    state = state_of(request)
    body = Fields(await read_json(request, state.config.max_request_bytes))
    model = body.string("model", required=True) or ""
    req = engine_pb2.TokenizeRequest(model=model)
    if body.has("messages"):
        if body.has("prompt"):
            raise invalid("give 'prompt' or 'messages', not both", param="prompt")
        images: list[ImageSource] = []
        req.chat.CopyFrom(chat_input(body, images))
        await attach_images(req.chat, images, state.media)  # the engine counts an image's tokens
    else:
        req.text = body.string("prompt", required=True) or ""
        add = body.boolean("add_special_tokens")
        if add is not None:
            req.add_special_tokens = add
    engines = [e for e in state.pool.engines if e.healthy and model in e.models]
    if not engines:
        known = ", ".join(sorted(state.pool.served_models())) or "none"
        if model in state.pool.served_models():
            raise unavailable(f"no engine serving {model!r} is healthy")
        raise OpenAIError(404, f"the model {model!r} does not exist; served models: {known}", param="model",
                          code="model_not_found")
    try:
        out = await engines[0].stub.Tokenize(req, timeout=state.config.request_timeout or 30.0)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err, prompt_param="messages" if body.has("messages") else "prompt") from None
    return JSONResponse({"count": out.count, "max_model_len": out.max_model_len, "tokens": list(out.token_ids)})


async def not_served(request: Request) -> Response:
    raise OpenAIError(404, f"{request.url.path} is not served by this gateway", code="not_found")
