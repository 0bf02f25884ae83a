"""FP8 checkpoints with fine-grained block scales, as the Qwen FP8 releases ship them.

``quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128]}``: each quantized
linear weight is stored as ``float8_e4m3fn`` beside ``<name>_scale_inv``, one float32 scale per
block of 128 x 128 weights (the last block of a row or column partial when 128 does not divide the
shape); the weight is ``fp8 * scale_inv`` of its block. Activations are quantized on the fly
(``activation_scheme: dynamic``) by the serving kernels; a checkpoint asking for static activation
scales is refused.

On the CPU there is no FP8 GEMM: the weights are dequantized once, at load, and served in the
compute dtype (then `engine.weight_dtype` as for any checkpoint). A block-scaled FP8 GEMM on CUDA is
not built yet: there too the weights are dequantized at load (the load log says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.model.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    rows: int  # weights per block along the output dimension
    cols: int  # along the input dimension


def parse_fp8(quantization: Any) -> Fp8Blocks | None:
    """The block geometry of a `quantization_config` ignis serves; None for no quantization. A method
    or a scheme it does not serve is a CheckpointError naming it."""
    if not quantization:
        return None
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
    if method != "fp8":
        raise CheckpointError(f"config.json: quantization {method!r} is not supported; ignis serves unquantized "
                              "checkpoints (float32, bfloat16, float16 weights) and fp8 with block scales")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"config.json: fp8 quantization needs weight_block_size [rows, cols], got {block!r} "
                              "(per-tensor fp8 is not served)")
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(f"config.json: fp8 activation_scheme {scheme!r} is not supported (dynamic is)")
    return Fp8Blocks(block[0], block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, blocks: Fp8Blocks, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight` (fp8, [..., out, in]) times its block's scale, computed in float32, kept in `dtype`."""
    rows, cols = weight.shape[-2], weight.shape[-1]
    want = (-(-rows // blocks.rows), -(-cols // blocks.cols))
    if tuple(scale_inv.shape[-2:]) != want or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise CheckpointError(f"tensor {name + SCALE_SUFFIX!r} has shape {list(scale_inv.shape)} but its weight "
                              f"{list(weight.shape)} in blocks of {blocks.rows}x{blocks.cols} needs "
                              f"{[*weight.shape[:-2], *want]}")
    scale = scale_inv.float().repeat_interleave(blocks.rows, dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(blocks.cols, dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_all(tensors: dict[str, torch.Tensor], blocks: Fp8Blocks, dtype: torch.dtype
                   ) -> tuple[dict[str, torch.Tensor], int]:
    """Every weight with a `_scale_inv` beside it dequantized into `dtype` (the compute dtype: only one
    tensor at a time is ever float32, not the whole model), the scales dropped; (tensors, how many).
    A scale without its weight, or an fp8 weight without its scale, names the tensor."""
    out: dict[str, torch.Tensor] = {}
    done = 0
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in tensors:
                raise CheckpointError(f"tensor {name!r} scales a weight the checkpoint does not have")
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is not None:
            out[name] = dequantize(tensor, scale, blocks, name, dtype)
            done += 1
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"tensor {name!r} is fp8 but has no {name + SCALE_SUFFIX!r} beside it")
        else:
            out[name] = tensor  # not quantized (norms, embeddings, lm_head, ignored layers)
    return out, done
