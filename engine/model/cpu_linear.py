"""Linear layers on oneDNN for fp32 CPU inference.

torch's fp32 `F.linear` goes to MKL sgemm, which is inefficient at the few rows a
decode step has: streaming a model's weights at batch 8 ran at ~7 GB/s on the 2-core
benchmark machine. oneDNN's inner-product on weights reordered once at load streams
them 15% faster at one row and 30% faster at eight (measured, 48 distinct 3072x1024
weights: 36.1 -> 30.8 ms and 82.0 -> 57.4 ms). For a long prefill chunk MKL stays ahead
(2048-token prefill 10-18% slower on oneDNN through the model), so many rows go to MKL on
the original (memory-mapped) weight. Results differ by summation order only (fp32 rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


ONEDNN_MAX_ROWS = 64  # decode steps and short chunks; longer runs go to MKL


class OneDnnLinear(nn.Module):
    """nn.Linear with a second copy of its weight in oneDNN's layout, used for few rows."""

    packed_weight: torch.Tensor
    packed_bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the original (memory-mapped) tensor, for many rows
        self.bias = linear.bias
        self.register_buffer("packed_weight", linear.weight.detach().to_mkldnn(), persistent=False)
        packed_bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()
        self.register_buffer("packed_bias", packed_bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > ONEDNN_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch._C._nn.mkldnn_linear(rows.contiguous().to_mkldnn(), self.packed_weight, self.packed_bias)
        return out.to_dense().view(*x.shape[:-1], self.out_features)


def use_onednn_linears(model: nn.Module) -> None:
    """Swap every fp32 CPU nn.Linear of `model` for an OneDnnLinear (others stay as they are)."""
    if not torch.backends.mkldnn.is_available():
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32:
                setattr(parent, name, OneDnnLinear(child))
