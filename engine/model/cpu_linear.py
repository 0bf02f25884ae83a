"""Linear layers on oneDNN for fp32 CPU inference.

torch's fp32 `F.linear` goes to MKL's sgemm, which on this AMD EPYC runs at half the
core's peak and, at the few rows of a decode step, far below the memory's bandwidth.
oneDNN's inner product on a weight reordered once at load into its blocked layout
(`mkldnn::_reorder_linear_weight` / `_linear_pointwise`, the pair inductor's CPU backend
freezes linears into) is faster at every row count (measured, 2 threads, 48 distinct
3072x1024 weights: 29.4 -> 14.2 ms at 1 row, 46.3 -> 15.5 ms at 8, i.e. 39-43 GB/s
against a 48 GB/s streaming read; at 2048 rows 192 -> 428 GFLOPS). It also beats the older
`to_mkldnn` path (dense <-> mkldnn conversions on every call): 17.7 and 25.0 ms there.
Results differ from MKL's by summation order only (fp32 rounding, ~1e-6 relative).

`engine.weight_dtype=bfloat16` packs the weights in bf16 instead, half the bytes a decode step
streams, and each call rounds its input rows to bf16 and returns fp32: oneDNN's AVX512-BF16
dot products accumulate in fp32, as llama.cpp does with a bf16 GGUF (it converts activations
to bf16 for its bf16 dot product too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear(nn.Module):
    """nn.Linear whose weight is also kept in oneDNN's blocked layout (in `weight_dtype`), which
    every fp32 call uses."""

    packed_weight: torch.Tensor
    packed_bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight_dtype = weight_dtype
        self.weight = linear.weight  # the original (memory-mapped) tensor: state_dict, tied weights
        self.bias = linear.bias
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(weight_dtype))
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().to(weight_dtype)
        self.register_buffer("packed_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # only fp32 models are packed; anything else is a caller's choice
            return F.linear(x, self.weight, self.bias)
        rows = x.contiguous() if self.weight_dtype == torch.float32 else x.to(self.weight_dtype)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.packed_bias, "none", [], "")
        return out if out.dtype == torch.float32 else out.float()


def use_onednn_linears(model: nn.Module, weight_dtype: torch.dtype = torch.float32) -> None:
    """Swap every fp32 CPU nn.Linear of `model` for an OneDnnLinear (others stay as they are)."""
    if not onednn_available():
        if weight_dtype != torch.float32:
            raise RuntimeError("engine.weight_dtype needs oneDNN (torch.backends.mkldnn), which this torch lacks")
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32:
                setattr(parent, name, OneDnnLinear(child, weight_dtype))
