"""Images as the vision tower takes them: decoded bytes -> resized, normalised patches, and their identity.

Resizing and normalisation are transformers' own Qwen2-VL image processor (the one its auto mapping gives
Qwen3.5), PIL backend: it needs no torchvision, and one backend for every install keeps an image's pixels,
hence its digest, the same everywhere. The digest is over what the tower will see (pixels after
preprocessing, the grid and the settings that shaped them), so two encodings of one picture (PNG and
lossless WebP) share it and one picture under another `max_pixels` does not.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NewType

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from common.images import open_decoded

ImageDigest = NewType("ImageDigest", bytes)  # 16 bytes: sha256 of a preprocessed image, truncated
DIGEST_BYTES = 16
_DIGEST_TAG = b"ignis-image-v1\0"  # bump when what the digest covers changes

# Below Pillow's own decompression-bomb limit (Image.MAX_IMAGE_PIXELS, ~89.5M), so ours answers first.
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192

# Qwen3.5's published preprocessor_config.json (the Qwen3-VL processor's): used where a checkpoint has none.
# patch_size, temporal_patch_size and merge_size come from config.json's vision_config when it has one.
QWEN3_5_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# The processor's settings that must agree with the tower's config (processor name, vision_config name).
_TOWER_KEYS = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
               ("merge_size", "spatial_merge_size"))


@dataclass(frozen=True, slots=True)
class ProcessorSettings:
    """Every image-processor setting that changes the pixels the tower sees (all go into the digest)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    resample: int  # PIL resampling filter
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"image processor: need 0 < min_pixels <= max_pixels, got {self.min_pixels} and "
                             f"{self.max_pixels}")
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError("image processor: patch_size, temporal_patch_size and merge_size must be positive")

    @classmethod
    def of(cls, processor: Qwen2VLImageProcessorPil) -> ProcessorSettings:
        size: Any = processor.size  # a SizeDict once the processor is built
        return cls(min_pixels=int(size.shortest_edge), max_pixels=int(size.longest_edge),
                   patch_size=int(processor.patch_size), temporal_patch_size=int(processor.temporal_patch_size),
                   merge_size=int(processor.merge_size),
                   image_mean=tuple(float(x) for x in processor.image_mean),
                   image_std=tuple(float(x) for x in processor.image_std),
                   rescale_factor=float(processor.rescale_factor), resample=int(processor.resample),
                   do_resize=bool(processor.do_resize), do_rescale=bool(processor.do_rescale),
                   do_normalize=bool(processor.do_normalize))

    def processor(self) -> Qwen2VLImageProcessorPil:
        return Qwen2VLImageProcessorPil(
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}, patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size, merge_size=self.merge_size,
            image_mean=list(self.image_mean), image_std=list(self.image_std), rescale_factor=self.rescale_factor,
            resample=self.resample, do_resize=self.do_resize, do_rescale=self.do_rescale,
            do_normalize=self.do_normalize, do_convert_rgb=True)

    def identity(self) -> bytes:
        """Canonical bytes of the settings, for the digest."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()


@dataclass(slots=True, eq=False)
class PreparedImage:
    grid_thw: tuple[int, int, int]  # patches, before merging
    num_tokens: int  # placeholder tokens in the prompt: t*h*w / merge_size**2
    digest: ImageDigest
    pixels: torch.Tensor | None = None  # [t*h*w, C*T*P*P] float32, in the processor's merge-block patch order
    # Makes the pixels again where they were not kept (an image known by its bytes: engine/vision/media.py).
    remake: Callable[[], torch.Tensor] | None = None

    def drop_pixels(self) -> None:
        """Let the pixels go where they can be made again (the tower has run on them)."""
        if self.remake is not None:
            self.pixels = None

    @property
    def pixel_values(self) -> torch.Tensor:
        """The pixels, made from the image's bytes the first time they are asked for where they were not kept."""
        if self.pixels is None:
            if self.remake is None:
                raise RuntimeError("a prepared image with neither pixels nor a way to make them (this is a bug)")
            self.pixels = self.remake()
        return self.pixels


def load_processor_settings(checkpoint: Path, *, min_pixels: int | None = None,
                            max_pixels: int | None = None) -> ProcessorSettings:
    """The checkpoint folder's preprocessor_config.json as transformers reads it (or Qwen3.5's defaults
    where there is none), `min_pixels` / `max_pixels` overriding it. A processor whose patches disagree
    with config.json's vision_config is a ValueError."""
    overrides: dict[str, Any] = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    vision = _vision_config(checkpoint)
    if (checkpoint / "preprocessor_config.json").is_file():
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(checkpoint), **overrides)
    else:
        from_vision = {mine: vision[theirs] for mine, theirs in _TOWER_KEYS if theirs in vision}
        # A deep copy: the processor writes min_pixels / max_pixels into the `size` dict it is given.
        processor = Qwen2VLImageProcessorPil(**{**copy.deepcopy(QWEN3_5_PROCESSOR_DEFAULTS), **from_vision,
                                                **overrides})
    settings = ProcessorSettings.of(processor)
    for mine, theirs in _TOWER_KEYS:
        if theirs in vision and getattr(settings, mine) != vision[theirs]:
            raise ValueError(f"{checkpoint}: preprocessor_config.json's {mine} {getattr(settings, mine)} "
                             f"differs from config.json's vision_config {theirs} {vision[theirs]}")
    return settings


def _vision_config(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / "config.json"
    if not path.is_file():
        return {}
    vision = json.loads(path.read_text()).get("vision_config")
    return vision if isinstance(vision, dict) else {}


def preprocess_images(images: Sequence[Image.Image], settings: ProcessorSettings) -> list[PreparedImage]:
    """One record per image, in order. An image the processor cannot take (an aspect ratio over 200:
    transformers' smart_resize) is a ValueError."""
    if not images:
        return []
    out = settings.processor()(images=list(images), return_tensors="np")
    pixels: np.ndarray = out["pixel_values"]  # [sum t*h*w, C*T*P*P] float32
    grids = [(int(t), int(h), int(w)) for t, h, w in out["image_grid_thw"].tolist()]
    identity = settings.identity()
    prepared = []
    start = 0
    for grid in grids:
        t, h, w = grid
        rows = np.ascontiguousarray(pixels[start:start + t * h * w], dtype="<f4")
        start += t * h * w
        prepared.append(PreparedImage(grid, t * h * w // settings.merge_size ** 2, image_digest(identity, grid, rows),
                                      torch.from_numpy(rows)))
    return prepared


def placeholder_count(height: int, width: int, settings: ProcessorSettings) -> int:
    """The placeholder tokens an image of this size becomes (transformers' smart_resize, as the processor
    sizes it), known before its pixels are made."""
    factor = settings.patch_size * settings.merge_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=settings.min_pixels, max_pixels=settings.max_pixels) \
        if settings.do_resize else (height, width)
    return (h // settings.patch_size) * (w // settings.patch_size) // settings.merge_size ** 2


def image_digest(settings_identity: bytes, grid: tuple[int, int, int], pixels: np.ndarray) -> ImageDigest:
    """sha256 over (settings, grid as little-endian int64, pixels as little-endian float32), 16 bytes."""
    h = hashlib.sha256(_DIGEST_TAG)
    h.update(struct.pack("<Q", len(settings_identity)) + settings_identity)
    h.update(struct.pack("<3q", *grid))
    h.update(np.ascontiguousarray(pixels, dtype="<f4").data.cast("B"))
    return ImageDigest(h.digest()[:DIGEST_BYTES])


def decode_image(data: bytes, max_bytes: int, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """PNG, JPEG or WebP bytes -> a fully decoded RGB image (transparency composited onto white, as
    transformers' convert_to_rgb does; an animation's first frame). Anything else, corrupt or truncated
    data, or an image over `max_bytes` / `max_image_pixels`, is a ValueError saying which."""
    if len(data) > max_bytes:
        raise ValueError(f"the image is {len(data)} bytes, over the limit of {max_bytes}")
    with open_decoded(data, max_image_pixels) as img:
        return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")
