"""The vision tower as the step runs it: an image's placeholder embeddings, from a bounded cache of
encoder outputs keyed by the image digest when it holds them, else from the tower.

An agent re-sends its screenshots every turn. A turn whose prefix state is claimed does not need them
at all; one that is not (its state was given up, or a page boundary cut an image's span so part of it is
prefilled again) finds the tower's output here instead of running the tower again. Least recently used
goes first; `capacity_bytes` 0 keeps nothing. An output is kept per namespace (the state's `h0`: model,
`cache_salt`, adapter), as state is: whether the tower ran must not tell one tenant what another sent.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.vision.preprocess import PreparedImage
from engine.vision.tower import VisionTower


@dataclass(slots=True)
class EncoderCounts:
    hits: int = 0  # images whose embeddings came from the cache
    misses: int = 0  # images the tower ran for
    seconds_encoding: float = 0.0


class ImageEncoder:
    def __init__(self, tower: VisionTower, capacity_bytes: int, dtype: torch.dtype) -> None:
        self.tower = tower
        self.capacity_bytes = max(0, capacity_bytes)
        self.dtype = dtype  # the text model's: embeddings are written into its rows
        self.counts = EncoderCounts()
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def embeddings(self, image: PreparedImage, namespace: bytes) -> tuple[torch.Tensor, bool]:
        """([num_tokens, hidden] in the text model's dtype, on its device; whether the tower ran for it)."""
        key = bytes(namespace) + bytes(image.digest)
        held = self._cache.get(key)
        if held is not None:
            self._cache.move_to_end(key)
            self.counts.hits += 1
            return held, False
        self.counts.misses += 1
        began = time.perf_counter()
        grid = torch.tensor([image.grid_thw], dtype=torch.int64)
        with torch.inference_mode():
            out = self.tower(image.pixel_values, grid).to(self.dtype)
        image.drop_pixels()  # ~24 KB a token: made again from the image's bytes if ever needed
        self.counts.seconds_encoding += time.perf_counter() - began
        if out.shape[0] != image.num_tokens:
            raise RuntimeError(f"the vision tower gave {out.shape[0]} rows for an image of {image.num_tokens} "
                               "tokens (this is a bug)")
        self._keep(key, out)
        return out, True

    def _keep(self, key: bytes, out: torch.Tensor) -> None:
        size = out.numel() * out.element_size()
        if size > self.capacity_bytes:
            return
        while self._bytes + size > self.capacity_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._bytes -= dropped.numel() * dropped.element_size()
        self._cache[key] = out
        self._bytes += size
