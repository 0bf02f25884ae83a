"""A prompt's images as the engine carries them: where each image's tokens sit, their M-RoPE positions,
and the ids that put each image's content into the reuse key.

The chat template writes one `<|image_pad|>` per image; `prepare_prompt` widens each to the image's
placeholder count (its merged grid) and then writes, in place of those placeholders, **key ids**: values
at or above 2^31 (no vocabulary reaches them) drawn from the image's digest and the token's offset in
its span. Every part of the engine that names or compares state reads `token_ids` (the hash chain, the
retained states' names, the tierstore's keys), so an image's content is in the key with nothing else
changed: the same picture at the same place hits, another picture (or two swapped) misses from its first
token on, and a page that holds only part of a span is named by the whole image's digest, so it is
reused only where the whole image is the same. The model never embeds a key id: the rows of an image
span take the vision tower's output instead (`ChunkMedia.embeds`).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from common.images import salted_key
from engine.kv.chain_hash import MEDIA_KEY_BASE
from engine.model.batch import ChunkMedia
from engine.vision.positions import mrope_positions
from engine.vision.preprocess import (DEFAULT_MAX_IMAGE_PIXELS, ImageDigest, PreparedImage, ProcessorSettings,
                                      decode_image, load_processor_settings, placeholder_count, preprocess_images)

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_CATALOG_IMAGES = 4096  # ~100 bytes each


class ImageCatalog:
    """What this engine learnt of the images it prepared (grid, placeholder count, digest), by the sha256 of
    their bytes and the tenant's `cache_salt` (whether an image was sent before must not show in another
    tenant's time), the most recent `capacity`. A conversation re-sends its screenshots every turn: a known
    one is neither decoded nor preprocessed again to find its span and key; its pixels are made again
    (on the step thread) only if the tower must run for it. Prompt workers share it: a lock."""

    def __init__(self, capacity: int = DEFAULT_CATALOG_IMAGES) -> None:
        self.capacity = capacity
        self._known: OrderedDict[bytes, tuple[tuple[int, int, int], int, ImageDigest]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def prepare(self, images: Sequence[bytes], vision: VisionInput, cache_salt: str = "") -> list[PreparedImage]:
        """Each image's record, in order; a bad new image is a ValueError naming it (1-based)."""
        keys = [salted_key(cache_salt, data) for data in images]
        with self._lock:
            known = [self._known.get(key) for key in keys]
        fresh = [k for k, entry in enumerate(known) if entry is None]
        made = dict(zip(fresh, _prepare_new([images[k] for k in fresh], fresh, vision)))
        for k in fresh:  # its pixels go once the tower has run (~24 KB a token), made again if asked for
            made[k].remake = functools.partial(_pixels_of, images[k], vision)
        out = []
        for k, (data, entry) in enumerate(zip(images, known)):
            if entry is None:
                out.append(made[k])
                continue
            grid, count, digest = entry
            out.append(PreparedImage(grid, count, digest, remake=functools.partial(_pixels_of, data, vision)))
        with self._lock:
            self.hits += len(images) - len(fresh)
            for k in fresh:
                image = made[k]
                self._known[keys[k]] = (image.grid_thw, image.num_tokens, image.digest)
            for key in keys:
                if key in self._known:
                    self._known.move_to_end(key)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)
        return out


def _prepare_new(images: Sequence[bytes], numbers: Sequence[int], vision: VisionInput) -> list[PreparedImage]:
    decoded = []
    for k, data in zip(numbers, images):
        try:
            decoded.append(decode_image(data, vision.max_image_bytes, max_image_pixels=vision.max_image_pixels))
        except ValueError as exc:
            raise ValueError(f"image {k + 1}: {exc}") from None
    # Before the pixels are made (~24 KB a token): a few KB of flat PNG can ask for thousands of tokens.
    tokens = sum(placeholder_count(image.height, image.width, vision.settings) for image in decoded)
    if tokens > vision.max_image_tokens:
        raise ValueError(f"the images come to {tokens} tokens, more than this model's context "
                         f"({vision.max_image_tokens} tokens)")
    try:
        return preprocess_images(decoded, vision.settings)
    except ValueError as exc:
        raise ValueError(f"an image cannot be processed: {exc}") from None


def _pixels_of(data: bytes, vision: VisionInput) -> torch.Tensor:
    """A known image's pixels, made again from its bytes (they decoded before: the same bytes decode again)."""
    return _prepare_new([data], [0], vision)[0].pixel_values


@dataclass(frozen=True, slots=True)
class VisionInput:
    """What a model with a vision tower needs to take images: its processor and its special tokens."""

    settings: ProcessorSettings
    image_token_id: int
    vision_start_token_id: int | None
    spatial_merge_size: int
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_tokens: int = 1 << 20  # the engine sets its context length
    catalog: ImageCatalog = field(default_factory=ImageCatalog, compare=False)

    @classmethod
    def of_checkpoint(cls, path: Path, raw_config: dict[str, Any]) -> VisionInput:
        vision = raw_config.get("vision_config") or {}
        if "image_token_id" not in raw_config:
            raise ValueError(f"{path}/config.json names a vision_config but no image_token_id")
        start = raw_config.get("vision_start_token_id")
        return cls(load_processor_settings(path), int(raw_config["image_token_id"]),
                   None if start is None else int(start), int(vision.get("spatial_merge_size", 2)))


@dataclass(frozen=True, slots=True, eq=False)
class ImageSpan:
    start: int  # the prompt index of its first placeholder
    image: PreparedImage

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


@dataclass(frozen=True, slots=True, eq=False)
class PromptMedia:
    spans: tuple[ImageSpan, ...]
    positions: torch.Tensor  # [3, prompt length] int64
    rope_delta: int  # a token at index i past the prompt sits at i + rope_delta on every row
    image_token_id: int

    @property
    def num_prompt(self) -> int:
        return int(self.positions.shape[1])

    def widened_index(self, index: int) -> int:
        """Where token `index` of the prompt as rendered (one placeholder an image) is in the widened prompt:
        each image wholly before it adds its span less the one placeholder (the stable head's end)."""
        before = 0
        for span in self.spans:
            if span.start - before >= index:  # this image's placeholder is at or after `index`
                break
            before += span.image.num_tokens - 1
        return index + before

    def model_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` with each key id back to the image token (what sampling penalties count)."""
        image = self.image_token_id
        return [image if t >= MEDIA_KEY_BASE else t for t in ids]

    def chunk(self, start: int, end: int, encode: Callable[[PreparedImage], torch.Tensor]) -> ChunkMedia:
        """Rows [start, end) of the sequence (past the prompt too: a recompute after preemption);
        `encode(image)` gives an image's [num_tokens, hidden] tower output (asked only for images in it)."""
        prompt = self.num_prompt
        inside = min(end, prompt)
        positions: list[int] = self.positions[0, start:inside].tolist() if start < inside else []
        positions.extend(range(max(start, prompt) + self.rope_delta, end + self.rope_delta))
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        embeds: list[tuple[int, torch.Tensor]] = []
        for span in self.spans:
            lo, hi = max(span.start, start), min(span.end, end)
            if lo >= hi:
                continue
            rows.extend(range(lo - start, hi - start))
            parts.append(self.positions[:, lo:hi])
            embeds.append((lo - start, encode(span.image)[lo - span.start:hi - span.start]))
        rope = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64)
        return ChunkMedia(positions, rows, rope, tuple(embeds))


def span_keys(digest: bytes, count: int) -> list[int]:
    """The key ids of an image span: each the image digest hashed with the token's offset, at or above 2^31."""
    return [MEDIA_KEY_BASE | (xxhash.xxh32_intdigest(digest + j.to_bytes(4, "little")) & 0x7FFFFFFF)
            for j in range(count)]


def prepare_prompt(ids: Sequence[int], images: Sequence[bytes], vision: VisionInput, cache_salt: str = ""
                   ) -> tuple[tuple[int, ...], PromptMedia]:
    """The rendered prompt (one image token per image, in order) with its images: each placeholder
    widened to the image's span of key ids, and the prompt's media. Bad images, or placeholders that do
    not match the images, are a ValueError saying which."""
    prepared = vision.catalog.prepare(images, vision, cache_salt)
    image_token = vision.image_token_id
    found = sum(1 for t in ids if t == image_token)
    if found != len(prepared):
        raise ValueError(f"the prompt has {found} image placeholder token(s) for {len(prepared)} image(s) "
                         "(a message may not contain the image placeholder as text)")
    widened: list[int] = []
    spans: list[ImageSpan] = []
    pending = iter(prepared)
    for t in ids:
        if t != image_token:
            widened.append(t)
            continue
        image = next(pending)
        spans.append(ImageSpan(len(widened), image))
        widened.extend([image_token] * image.num_tokens)
    rope = mrope_positions(widened, [image.grid_thw for image in prepared], image_token_id=image_token,
                           spatial_merge_size=vision.spatial_merge_size,
                           vision_start_token_id=vision.vision_start_token_id)
    for span in spans:
        widened[span.start:span.end] = span_keys(span.image.digest, span.image.num_tokens)
    return tuple(widened), PromptMedia(tuple(spans), rope.positions, rope.rope_delta, image_token)
