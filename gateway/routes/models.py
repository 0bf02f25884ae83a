"""GET /v1/models and GET /v1/models/{model}: the union of what the engines serve now."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.aliases import JSONObject
from gateway.errors import OpenAIError
from gateway.state import state_of
from ignis.v1 import engine_pb2


def model_object(card: engine_pb2.ModelCard) -> JSONObject:
    """vLLM's fields: `parent` is a LoRA adapter's base model (null for a base model), `root` where the
    adapter was read from (a base model's own id)."""
    return {"id": card.id, "object": "model", "created": card.created, "owned_by": card.owned_by or "ignis",
            "root": card.root or card.id, "parent": card.parent or None,
            "max_model_len": card.max_model_len, "architecture": card.architecture, "dtype": card.dtype,
            "page_size": card.page_size}


async def list_models(request: Request) -> Response:
    cards = await state_of(request).pool.list_models()
    return JSONResponse({"object": "list", "data": [model_object(c) for c in sorted(cards, key=lambda c: c.id)]})


async def get_model(request: Request) -> Response:
    model_id = request.path_params["model"]
    for card in await state_of(request).pool.list_models():
        if card.id == model_id:
            return JSONResponse(model_object(card))
    raise OpenAIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
