"""Errors a user can act on when a checkpoint cannot be served."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class CheckpointError(ValueError):
    """The directory is not a supported checkpoint; the message names the file and key."""


def check_tensors(expected: Mapping[str, tuple[int, ...]], tensors: Mapping[str, Any], where: str, part: str) -> None:
    """Every `expected` tensor in `tensors` with its shape, and no other: else a CheckpointError naming
    the first that is not (`where`: the checkpoint, `part`: what the tensors are for). Checked before
    anything is copied, so a broken download fails at load, not at the first request."""
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"{where}: tensor {name!r} is missing from the safetensors weights ({part})")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(tensor.shape)} but config.json "
                                  f"implies {list(shape)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: tensor {unexpected[0]!r} is not used by {part} "
                              f"({len(unexpected)} unexpected tensors)")
