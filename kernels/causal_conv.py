"""Depthwise causal 1-D convolution with carried state (the "conv taps" of GDN layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a depthwise causal conv over new inputs, continuing from `state`.

    x: [B, C, T] new inputs; weight: [C, K]; state: [B, C, K-1] (the last K-1
    inputs seen before x) or None for a fresh sequence (zeros).
    Returns (silu(conv) [B, C, T], new_state [B, C, K-1]).
    """
    b, c, t = x.shape
    kernel = weight.shape[-1]
    if state is None:
        state = torch.zeros(b, c, kernel - 1, dtype=x.dtype, device=x.device)
    full = torch.cat([state.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]
    if t == 1:  # a decode step: one dot product per channel, no convolution machinery
        out = (full.to(weight.dtype) * weight).sum(-1, keepdim=True)
    else:
        out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=c)  # [B, C, T]
    return F.silu(out).to(x.dtype), full[:, :, -(kernel - 1):].clone()
