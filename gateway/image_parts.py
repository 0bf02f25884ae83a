"""Image content parts: read where they are parsed, filled in before the engine call.

Parsing a request is synchronous (gateway/messages.py, gateway/items.py) and reading an image may
fetch it, so it takes two passes: the parser puts an empty ``ContentPart(type="image")`` in its place
among the text parts and notes its URL in an `ImageSource`; then `attach_images`, awaited by the
route before the engine call, reads and checks each image (gateway/media.py,
gateway/image_check.py) and fills its part's ``image_data``. Parts and sources are in the same
order: the order the parser met them.

The shapes: Chat Completions' ``{"type": "image_url", "image_url": {"url", "detail"}}`` (or
``"image_url": "..."``, as vLLM takes it) and the Responses API's
``{"type": "input_image", "image_url": "...", "detail"}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.grpc_server import MAX_MESSAGE_BYTES
from gateway.body import Fields
from gateway.errors import invalid
from gateway.image_check import check_image
from gateway.media import MediaPolicy, read_image
from ignis.v1 import engine_pb2

IMAGE_PART_TYPES = ("image_url", "input_image")
DETAILS = ("auto", "low", "high")
# One request's images together: the request crosses to the engine as one message of at most
# MAX_MESSAGE_BYTES (64 MiB); a quarter of it is left for the text.
MAX_REQUEST_IMAGE_BYTES = MAX_MESSAGE_BYTES * 3 // 4


@dataclass(frozen=True, slots=True)
class ImageSource:
    """Where one image part's bytes come from."""

    url: str
    param: str  # the URL's JSON path (messages[1].content[0].image_url.url): every 400 about it names it


def image_part(f: Fields, kind: str, images: list[ImageSource]) -> engine_pb2.ContentPart:
    """The part `f` (of type `kind`, one of IMAGE_PART_TYPES), its bytes to come; notes its source in `images`."""
    if kind == "input_image" and f.has("file_id") and not f.has("image_url"):
        raise invalid(f"'{f.path('file_id')}': file ids are not supported: send the image as 'image_url' "
                      "(a data URL)", param=f.path("file_id"))
    nested = f.raw("image_url")
    if isinstance(nested, dict):  # chat's {"url", "detail"}
        spec = Fields(nested, f.path("image_url"))
        url, url_param = spec.string("url", required=True) or "", spec.path("url")
        detail = spec.string("detail", choices=DETAILS)
    else:  # Responses' (and vLLM's lenient chat) string, with `detail` beside it
        url, url_param = f.string("image_url", required=True) or "", f.path("image_url")
        detail = f.string("detail", choices=DETAILS)
    images.append(ImageSource(url, url_param))
    return engine_pb2.ContentPart(type="image", detail=detail or "auto")


async def attach_images(chat: engine_pb2.ChatInput, images: list[ImageSource], policy: MediaPolicy,
                        cache_salt: str = "") -> None:
    """Read and check each image of `chat` (400 naming the first bad one) and fill in its bytes.

    One image at a time: a request holds one decoded image at most (up to `max_pixels` x 4 bytes).
    """
    if not images:
        return
    if len(images) > policy.max_images:
        raise invalid(f"a request may carry at most {policy.max_images} images (--max-images-per-request), "
                      f"got {len(images)}", param=images[policy.max_images].param, code="too_many_images")
    parts = [part for msg in chat.messages for part in msg.content_parts if part.type == "image"]
    if len(parts) != len(images):
        raise RuntimeError(f"{len(parts)} image parts for {len(images)} image sources; this is a bug")
    total = 0
    for part, source in zip(parts, images):
        data = await read_image(source.url, source.param, policy)
        total += len(data)
        if total > MAX_REQUEST_IMAGE_BYTES:
            raise invalid(f"'{source.param}': the request's images come to more than {MAX_REQUEST_IMAGE_BYTES} "
                          "bytes together", param=source.param, code="image_too_large")
        await check_image(data, source.param, policy.max_pixels, cache_salt)
        part.image_data = data
