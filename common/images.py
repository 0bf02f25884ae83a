"""Opening a client's image without trusting it: a PNG, JPEG or WebP whose size is checked from its header
before a pixel is decoded (a few KB of PNG can claim 100000x100000), then decoded whole, so a corrupt or
truncated file fails here and not later. The gateway runs it to answer a 400 before the engine sees the
image; the engine runs it again on what it is sent (it trusts no caller) before its image processor."""

from __future__ import annotations

import hashlib
import io

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")  # Pillow tries no other decoder
# Pillow warns above this many pixels and refuses above twice as many (None: Pillow's check is off).
PILLOW_MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 2**62


def salted_key(cache_salt: str, data: bytes) -> bytes:
    """An image's key in a cache of what was learnt from it (the gateway's passed images, the engine's
    catalog): sha256 of the tenant's salt and the bytes, so whether an image was sent before does not
    show in another tenant's time."""
    salt = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()
    return hashlib.sha256(salt + data).digest()


def open_decoded(data: bytes, max_pixels: int, limit: str = "") -> Image.Image:
    """The image in `data`, decoded whole (the caller closes it). A ValueError says what is wrong: not a PNG,
    JPEG or WebP, corrupt or truncated, or over `max_pixels` (`limit`: the setting to name in the message)."""
    hint = f" ({limit})" if limit else ""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    # Pillow's own bound, read from the header (its warning is an exception where warnings are errors).
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValueError(f"the image is too large to decode: its header claims more than {max_pixels} "
                         f"pixels{hint}") from None
    except UnidentifiedImageError:
        raise ValueError("the image is not a PNG, JPEG or WebP file (or its header is corrupt)") from None
    except Exception as exc:  # a header Pillow recognises can still fail to parse, in many ways
        raise ValueError(f"the image header is corrupt: {type(exc).__name__}: {exc}") from None
    try:
        width, height = image.size  # from the header: nothing is decoded yet
        if width * height > max_pixels:
            raise ValueError(f"the image is {width}x{height} pixels, over the limit of {max_pixels}{hint}")
        try:
            image.load()
        # Decoders fail on bad data in many ways (OSError, SyntaxError, EOFError, zlib and struct errors): a
        # client's broken image is a client error, never a server one.
        except Exception as exc:
            raise ValueError(f"the image could not be decoded (corrupt or truncated): {type(exc).__name__}: "
                             f"{exc}") from None
    except ValueError:
        image.close()
        raise
    return image
