"""Checking an image's bytes before they go to the engine: a PNG, JPEG or WebP that decodes whole.

The gateway opens the file with Pillow, reads its size from the header and refuses one over
``--max-image-pixels`` before decoding a pixel (a decompression bomb: a few KB of PNG can
claim 100000x100000), then decodes it fully, on a worker thread (a large JPEG takes a
fraction of a second). So a corrupt, truncated or oversized image is a 400 here, and
nothing bad reaches the engine's step. The decoded pixels are dropped: the engine decodes the
bytes again with its image processor (engine/vision/).
"""

from __future__ import annotations

from collections import OrderedDict

import anyio.to_thread

from common.images import PILLOW_MAX_PIXELS, open_decoded, salted_key
from gateway.errors import invalid

__all__ = ["PILLOW_MAX_PIXELS", "check_image", "image_problem"]


# Images that passed, by sha256 of their bytes, the most recent PASSED_KEPT: a conversation re-sends its
# screenshots every turn, and a full decode of each (~0.1 s for 1024x768) would come back every turn.
PASSED_KEPT = 4096
_passed: OrderedDict[tuple[bytes, int], None] = OrderedDict()


async def check_image(data: bytes, param: str, max_pixels: int, cache_salt: str = "") -> None:
    """400 naming `param` unless `data` is a PNG, JPEG or WebP of at most `max_pixels` that decodes. An image
    known to pass is known per `cache_salt`: another tenant cannot time whether it was sent before."""
    key = (salted_key(cache_salt, data), max_pixels)
    if key in _passed:  # the event loop's thread alone reads and writes it
        _passed.move_to_end(key)
        return
    problem = await anyio.to_thread.run_sync(image_problem, data, max_pixels)
    if problem is not None:
        raise invalid(f"'{param}': {problem}", param=param, code="invalid_image")
    _passed[key] = None
    while len(_passed) > PASSED_KEPT:
        _passed.popitem(last=False)


def image_problem(data: bytes, max_pixels: int) -> str | None:
    """What is wrong with the image in `data`, or None. Blocking: run it off the event loop."""
    try:
        with open_decoded(data, max_pixels, "--max-image-pixels"):
            return None
    except ValueError as exc:
        return str(exc)
