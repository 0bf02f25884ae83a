"""M-RoPE for prompts with images (Qwen3.5): each token's (t, h, w) positions, and the rotary cos/sin they give.

Text advances all three rows together by one per token. An image of grid (t, h, w) patches is a run of
t*(h/m)*(w/m) placeholder tokens (m: spatial_merge_size) at (s + frame, s + row, s + column) on the merged
grid, s being the position the image starts at; the text after it continues from s + max(h, w)/m. So after
a prompt the positions trail the token index by a fixed `rope_delta` (<= 0), which decoding adds to every
later token's index on all three rows.

The same as transformers' `Qwen3_5Model.get_rope_index` (models/qwen3_5/modeling_qwen3_5.py) for one
sequence, which finds image spans as runs of image tokens (its `mm_token_type_ids`); text alone gives three
equal rows 0..L-1, so a text-only request keeps today's positions.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MRopePositions:
    positions: torch.Tensor  # [3, L] int64: rows t, h, w
    rope_delta: int  # max position + 1 - L: a token at index i >= L sits at i + rope_delta on every row


def mrope_positions(token_ids: Sequence[int], image_grids: Sequence[tuple[int, int, int]], *, image_token_id: int,
                    spatial_merge_size: int, vision_start_token_id: int | None = None) -> MRopePositions:
    """Positions of a prompt whose images (grids (t, h, w) in patches, in prompt order) are runs of
    `image_token_id`. Each run must hold exactly its image's placeholder count, and, where
    `vision_start_token_id` is given, follow that token: else a ValueError (the prompt and the images
    disagree, e.g. a user typed the placeholder token)."""
    m = spatial_merge_size
    grids = list(image_grids)
    parts: list[torch.Tensor] = []
    start = 0  # the position the next part starts at
    image = 0
    index = 0
    for is_image, run in itertools.groupby(token_ids, lambda token: token == image_token_id):
        length = sum(1 for _ in run)
        if not is_image:
            parts.append(torch.arange(start, start + length, dtype=torch.int64).expand(3, -1))
            start += length
        else:
            if image == len(grids):
                raise ValueError(f"the image placeholder run at token {index} has no image: "
                                 f"{len(grids)} image(s) given")
            t, h, w = grids[image]
            if h % m or w % m:
                raise ValueError(f"image {image}'s grid {(t, h, w)} is not a multiple of spatial_merge_size {m}")
            if length != t * (h // m) * (w // m):
                raise ValueError(f"image {image}'s placeholder run at token {index} has {length} tokens but its grid "
                                 f"{(t, h, w)} needs {t * (h // m) * (w // m)}")
            if vision_start_token_id is not None and (index == 0 or token_ids[index - 1] != vision_start_token_id):
                raise ValueError(f"image {image}'s placeholder run at token {index} does not follow the vision "
                                 f"start token {vision_start_token_id}")
            parts.append(_image_positions(start, t, h // m, w // m))
            start += max(h, w) // m
            image += 1
        index += length
    if image != len(grids):
        raise ValueError(f"{len(grids)} image(s) given but the prompt has {image} placeholder run(s)")
    if not parts:
        return MRopePositions(torch.zeros(3, 0, dtype=torch.int64), 0)
    positions = torch.cat(parts, dim=1)
    return MRopePositions(positions, int(positions.max()) + 1 - positions.shape[1])


def _image_positions(start: int, t: int, h: int, w: int) -> torch.Tensor:
    # [3, t*h*w] over the merged grid, frame-major then row-major (the merger's token order)
    frames, rows, cols = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([frames, rows, cols]).reshape(3, -1) + start
