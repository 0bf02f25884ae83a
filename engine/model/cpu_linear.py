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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear(nn.Module):
    """nn.Linear whose weight is also kept in oneDNN's blocked layout, which every call uses."""

    packed_weight: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the original (memory-mapped) tensor: state_dict, tied weights
        self.bias = linear.bias
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # only fp32 weights are packed; anything else is a caller's choice
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, bias, "none", [], "")


def use_onednn_linears(model: nn.Module) -> None:
    """Swap every fp32 CPU nn.Linear of `model` for an OneDnnLinear (others stay as they are)."""
    if not onednn_available():
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32:
                setattr(parent, name, OneDnnLinear(child))
