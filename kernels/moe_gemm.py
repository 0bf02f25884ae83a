"""The routed experts of an MoE layer: the torch reference, and the alignment the grouped kernel shares.

Layout (transformers v5, engine/model/layers.py's Experts): gate_up [E, 2I, H] (rows :I the gate
projection, rows I: the up projection) and down [E, H, I]. A step routes each of T tokens to K
experts: expert_ids [T, K], weights [T, K]. Each (token, slot) is a *pair*, numbered p = t * K + k
(P = T * K pairs):

    y[t] = sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = expert_ids[t, k]

The grouped kernel (kernels/triton_moe_gemm.py, the layout of vLLM's fused_moe) runs one launch per
projection over every pair, never a Python loop over experts. align_by_expert sorts the pairs by
expert and pads each expert's run to a multiple of BLOCK_M with the sentinel P, so every BLOCK_M
rows of the sorted list belong to one expert (block_expert): a program multiplies its rows by that
expert's weights alone. Everything stays on the device (no host sync in a step): the number of
blocks is bounded on the host from P and E (max_blocks), and blocks past the padded length (a
device scalar) hold the sentinel, expert E, and return at once in the kernel.

Arithmetic, which the kernel reproduces up to fp32 summation order: both projections multiply in
float32 (the weights are exact in it); h = silu(gate) * up is rounded to x's dtype, since the
down projection's operand is h in the activations' dtype (the tensor cores' input, as in every
serving kernel); each pair's row times its routing weight stays float32, the K rows of a token
are summed in float32, and the sum is rounded to x's dtype once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Alignment(NamedTuple):
    """The pairs sorted by expert, each expert's run padded to a multiple of block_m."""

    pair_ids: torch.Tensor  # int32 [blocks * block_m]: a pair per row, the sentinel P in padding
    block_expert: torch.Tensor  # int32 [blocks]: each block's expert; E past the end
    padded_len: torch.Tensor  # int32 [1]: the rows in use (the sum of the padded runs)


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """A bound on the blocks of any routing of `pairs` pairs: each expert hit (at most min(E, P) of
    them) wastes under block_m rows of padding, so the sum of ceil(count / block_m) is at most
    ceil((P + min(E, P) * (block_m - 1)) / block_m). At decode (P = 8, E = 128, block_m 16): 8 blocks."""
    return -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """expert_ids [T, K] -> the Alignment of its T * K pairs, computed on expert_ids' device without a sync."""
    flat = expert_ids.reshape(-1).long()  # [P]
    pairs = flat.numel()
    dev = flat.device
    # index_add_, not bincount: CUDA's bincount reads its input's max back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # [P]: pair ids grouped by expert, in pair order within one
    by_expert = flat[order]
    rank = torch.arange(pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[by_expert]  # place in its run
    row = (padded_ends - padded)[by_expert] + rank  # [P]: each sorted pair's row in the padded list
    blocks = max_blocks(pairs, num_experts, block_m)
    pair_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=dev)
    pair_ids.scatter_(0, row, order.to(torch.int32))
    starts = torch.arange(blocks, device=dev) * block_m
    # right=True skips experts with no rows (their end equals the previous one's).
    block_expert = torch.searchsorted(padded_ends, starts, right=True).to(torch.int32)
    return Alignment(pair_ids, block_expert, padded_ends[-1:].to(torch.int32))


def check_operands(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                   weights: torch.Tensor) -> None:
    """Shapes and dtypes both implementations take (a caller's mistake is a ValueError)."""
    if x.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(f"x must be [T, H], gate_up [E, 2I, H] and down [E, H, I], got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    (t, hidden), (e, inter) = x.shape, (down.shape[0], down.shape[2])
    if tuple(gate_up.shape) != (e, 2 * inter, hidden) or tuple(down.shape) != (e, hidden, inter):
        raise ValueError(f"for x [T, H={hidden}] and down [E={e}, H, I={inter}], gate_up must be "
                         f"[{e}, {2 * inter}, {hidden}] and down [{e}, {hidden}, {inter}], got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if not x.is_floating_point() or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x, gate_up and down must share one floating dtype, got {x.dtype}, {gate_up.dtype} "
                         f"and {down.dtype}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != t or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int64 or int32 [T={t}, K], got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)}")
    if tuple(weights.shape) != tuple(expert_ids.shape) or not weights.is_floating_point():
        raise ValueError(f"weights must be floating [{t}, {expert_ids.shape[1]}] like expert_ids, got "
                         f"{weights.dtype} {tuple(weights.shape)}")


def moe_experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """x [T, H] through the experts expert_ids [T, K] picks, weighted by weights [T, K] -> [T, H] in x's
    dtype: one loop turn per expert hit, in float32 (the module docstring's arithmetic)."""
    check_operands(x, gate_up, down, expert_ids, weights)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for expert in expert_ids.unique().tolist():
        token, slot = torch.where(expert_ids == expert)
        gate, up = F.linear(x[token].float(), gate_up[expert].float()).chunk(2, dim=-1)  # [n, I] each
        h = (F.silu(gate) * up).to(x.dtype).float()  # the down projection's operand, in x's dtype
        y = F.linear(h, down[expert].float())  # [n, H]
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out.to(x.dtype)
