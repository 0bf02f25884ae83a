"""The block-scaled FP8 linear (torch reference): y = x @ dequant(W).T (+ bias).

W is a float8_e4m3fn weight [N, K] as FP8 checkpoints ship it (quantization_config
`weight_block_size: [rows, cols]`), with one float32 `scale_inv` per block of rows x cols
weights: dequant(W)[n, k] = W[n, k] * scale_inv[n // rows, k // cols]. When a block size does
not divide N or K, the last block of that dimension is partial; the scale grid still has one
entry for it.

Weight-only, not w8a8: the activations stay in their dtype (bf16/fp16/fp32) and are never
quantized. Why: an e4m3 value is exact in bf16, fp16 and fp32, so the Triton kernel
(kernels/triton_fp8_gemm.py) converts each weight tile to the activations' dtype with no
rounding, multiplies in the tensor cores with fp32 accumulation and applies each K-block's
scale to that block's fp32 partial sum. That is this function's arithmetic up to fp32
summation order, so the kernel is checked against it to fp32-accumulation tolerance, and the
model equals the same checkpoint dequantized (what the oracle tests hold the engine to; in a bf16
model a layer's only rounding is its output's, where weights dequantized into bf16 also round
fp8 * scale to 8 bits).
vLLM's w8a8 block GEMM (activations quantized per token and 128-column group to fp8,
scale = amax / 448) would double the tensor cores' rate at prefill, but costs a few 1e-2
relative error on every linear and matches a reference only if the kernel's division and fp8
rounding are bit-identical to torch's; decode, where a step streams the weights, gains the same
from FP8 weights either way (half the bytes of bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [N, K] weight in blocks of rows x cols: (ceil(N / rows), ceil(K / cols))."""
    (n, k), (rows, cols) = shape, block
    return -(-n // rows), -(-k // cols)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., N, K] (fp8) times its block's scale, in float32. The caller checks the grid's shape."""
    rows, cols = weight.shape[-2], weight.shape[-1]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]  # partial last block cut
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * scale


def check_operands(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None) -> None:
    """Shapes and dtypes both implementations take (a caller's mistake is a ValueError)."""
    if weight.dtype != FP8_DTYPE or weight.ndim != 2:
        raise ValueError(f"weight must be a 2-D {FP8_DTYPE}, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension is {x.shape[-1]} but the weight [N={n}, K={k}] takes {k}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if min(block) < 1:
        raise ValueError(f"block must be positive (rows, cols), got {block}")
    if tuple(scale_inv.shape) != scale_grid((n, k), block) or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv must be float32 {list(scale_grid((n, k), block))} for a [{n}, {k}] weight in "
                         f"blocks of {block[0]}x{block[1]}, got {scale_inv.dtype} {list(scale_inv.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32/bf16/fp16) through the fp8 weight [N, K] with float32 scale_inv
    [ceil(N / rows), ceil(K / cols)] -> [..., N] in x's dtype, computed in float32."""
    check_operands(x, weight, scale_inv, block, bias)
    w = dequantize_blocks(weight, scale_inv, block)  # [N, K] fp32: each fp8 * scale rounded once
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)
