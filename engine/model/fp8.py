"""FP8 checkpoints with fine-grained block scales, as the Qwen FP8 releases ship them.

``quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128]}``: each quantized
linear weight is stored as ``float8_e4m3fn`` beside ``<name>_scale_inv``, one float32 scale per
block of 128 x 128 weights (the last block of a row or column partial when 128 does not divide the
shape); the weight is ``fp8 * scale_inv`` of its block. ``activation_scheme: dynamic`` is accepted
(the GEMM here never quantizes activations: kernels/fp8_gemm.py says why); a checkpoint asking for
static activation scales is refused.

How they are served depends on the device (`fp8_gemm_absent`):
- CUDA (compute capability 8.9+, Triton): the linear layers keep their FP8 weights and scales
  (`Fp8Linear`, half the memory of bf16) and run the block-scaled GEMM of kernels/select.py
  (kernels/triton_fp8_gemm.py). The MoE experts, stacked into 3-D tensors that GEMM does not
  take, and a quantized weight of anything but a linear layer (or of the LM head) are dequantized
  at load.
- Elsewhere (the CPU has no FP8 GEMM): every weight is dequantized once, at load, into the
  compute dtype (then `engine.weight_dtype` as for any checkpoint).
The load log says which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.model.errors import CheckpointError
from kernels.fp8_gemm import FP8_DTYPE, dequantize_blocks, scale_grid
from kernels.select import kernels_for

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


def fp8_gemm_absent(device: torch.device) -> str | None:
    """None where linear layers on `device` keep their FP8 weights and run the block-scaled GEMM (CUDA
    on the Triton kernels, compute capability 8.9+: Ada, Hopper, Blackwell convert float8_e4m3fn in
    hardware and Triton refuses the type below); else why not, for the load log."""
    if device.type != "cuda":
        return f"no FP8 GEMM on {device.type}"
    if kernels_for(device).name != "triton":
        return "Triton is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no FP8 conversions (8.9+ does)"
    return None


def _check_scale(weight: torch.Tensor, scale_inv: torch.Tensor, blocks: Fp8Blocks, name: str) -> None:
    want = scale_grid((weight.shape[-2], weight.shape[-1]), (blocks.rows, blocks.cols))
    if tuple(scale_inv.shape[-2:]) != want or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise CheckpointError(f"tensor {name + SCALE_SUFFIX!r} has shape {list(scale_inv.shape)} but its weight "
                              f"{list(weight.shape)} in blocks of {blocks.rows}x{blocks.cols} needs "
                              f"{[*weight.shape[:-2], *want]}")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, blocks: Fp8Blocks, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight` (fp8, [..., out, in]) times its block's scale, computed in float32, kept in `dtype`."""
    _check_scale(weight, scale_inv, blocks, name)
    return dequantize_blocks(weight, scale_inv, (blocks.rows, blocks.cols)).to(dtype)


def dequantize_all(tensors: dict[str, torch.Tensor], blocks: Fp8Blocks, dtype: torch.dtype,
                   keep: Callable[[str], bool] = lambda name: False) -> tuple[dict[str, torch.Tensor], int]:
    """Every weight with a `_scale_inv` beside it dequantized into `dtype` (the compute dtype: only one
    tensor at a time is ever float32, not the whole model), the scales dropped; (tensors, how many).
    A float8_e4m3fn weight for which `keep(name)` holds stays as it is, its scale beside it (for
    `use_fp8_linears`). A scale without its weight, or an fp8 weight without its scale, names the tensor."""
    out: dict[str, torch.Tensor] = {}
    done = 0
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight not in tensors:
                raise CheckpointError(f"tensor {name!r} scales a weight the checkpoint does not have")
            if _kept(weight, tensors[weight], keep):
                out[name] = tensor
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is not None and _kept(name, tensor, keep):
            out[name] = tensor
        elif scale is not None:
            out[name] = dequantize(tensor, scale, blocks, name, dtype)
            done += 1
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"tensor {name!r} is fp8 but has no {name + SCALE_SUFFIX!r} beside it")
        else:
            out[name] = tensor  # not quantized (norms, embeddings, lm_head, ignored layers)
    return out, done


def _kept(name: str, weight: torch.Tensor, keep: Callable[[str], bool]) -> bool:
    return weight.dtype == FP8_DTYPE and weight.ndim == 2 and keep(name)


class Fp8Linear(nn.Module):
    """A linear layer served from its FP8 weight [out, in] and float32 block scales (`weight_scale_inv`,
    the checkpoint's names, so the state dict loads as stored) through the block-scaled GEMM of
    kernels/select.py; the output is in the input's dtype, accumulated in float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool, blocks: Fp8Blocks,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = (blocks.rows, blocks.cols)
        grid = scale_grid((out_features, in_features), self.block)
        # Not trained: fp8 and the scales are read as stored.
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(grid, dtype=torch.float32, device=device), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        gemm = kernels_for(x.device).fp8_block_linear
        return gemm(x, self.weight, self.weight_scale_inv, self.block, self.bias)


def fp8_linear_weights(model: nn.Module) -> set[str]:
    """The weights (parameter names) that may stay FP8: those of `model`'s linear layers but the LM head
    (the logits' layer, which the releases do not quantize either, and whose dtype is the model's)."""
    return {f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name != "lm_head"}


def use_fp8_linears(model: nn.Module, tensors: dict[str, torch.Tensor], blocks: Fp8Blocks) -> set[str]:
    """Swap each linear of `model` (built on meta) whose weight `tensors` holds as fp8 beside its scale (what
    `dequantize_all` kept) for an Fp8Linear; returns the names of the tensors kept in their dtype (the
    weights and the scales). A kept weight no linear takes is a bug."""
    kept: set[str] = set()
    for name in sorted(fp8_linear_weights(model)):
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None or tensors[name].dtype != FP8_DTYPE:
            continue  # not quantized in this checkpoint (a router, a shared-expert gate): stays nn.Linear
        _check_scale(tensors[name], scale, blocks, name)
        path = name.removesuffix(".weight")
        parent, _, child = path.rpartition(".")
        linear = model.get_submodule(path)
        assert isinstance(linear, nn.Linear)
        setattr(model.get_submodule(parent), child, Fp8Linear(linear.in_features, linear.out_features,
                                                              linear.bias is not None, blocks, linear.weight.device))
        kept.update((name, name + SCALE_SUFFIX))
    stray = sorted(n for n in tensors if n.endswith(SCALE_SUFFIX) and n not in kept)
    if stray:
        raise RuntimeError(f"fp8 weight {stray[0].removesuffix(SCALE_SUFFIX)!r} was kept for a linear layer the "
                           "model does not have (this is a bug)")
    return kept


def load_note(checkpoint: str, blocks: Fp8Blocks, served: int, dequantized: int, dtype: torch.dtype,
              absent: str | None) -> str:
    """The load log's line on how the fp8 weights are served."""
    grid = f"blocks of {blocks.rows}x{blocks.cols}"
    if absent is not None:
        return f"{checkpoint}: {dequantized} fp8 weights ({grid}) dequantized at load to {dtype} ({absent})"
    rest = (f"; {dequantized} dequantized at load to {dtype} (MoE experts, weights of no linear layer)"
            if dequantized else "")
    return (f"{checkpoint}: {served} fp8 linear weights ({grid}) served as fp8 through the block-scaled "
            f"GEMM (Triton){rest}")
