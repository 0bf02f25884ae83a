"""The batched multi-adapter LoRA product (punica / S-LoRA "BGMV"): the torch reference and the checks
both implementations share.

Layout. A step's T rows each use their own adapter out of S resident ones:

- x [T, in]: the rows (float32, bfloat16 or float16).
- a [S, R, in]: each slot's A matrix, its rank padded to R with zero rows (adapters of rank 8 and 16
  share one tensor of R = 16).
- b [out, S, R]: each slot's B matrix, the LoRA scaling (alpha / rank) already folded in. Out-major so
  the resident slots are a view `big_b[:, :n, :]` of an [out, S_max, R] buffer; any strides are taken.
- slots [T] int64 or int32: each row's slot, -1 for a row without an adapter.

    delta[t] = b[:, s, :] @ (a[s] @ x[t]),  s = slots[t];  delta[t] = 0 where s == -1

Arithmetic: both products multiply and sum in float32, the intermediate v = a[s] @ x[t] [R] included
(rounding it to x's dtype would add an error the base layer's output does not have), and delta is
rounded to x's dtype once. a and b may be any floating dtype; they are read in float32.

Slot values outside [-1, S) are the caller's to prevent: checking them would read slots back to the
host, which the kernel (kernels/triton_lora.py) never does.
"""

from __future__ import annotations

import torch


def check_operands(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """Shapes and dtypes both implementations take (a caller's mistake is a ValueError)."""
    if x.ndim != 2 or a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"x must be [T, in], a [S, R, in] and b [out, S, R], got {tuple(x.shape)}, "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    (t, hidden), (s, rank) = x.shape, a.shape[:2]
    if a.shape[2] != hidden or tuple(b.shape[1:]) != (s, rank):
        raise ValueError(f"for x [T, in={hidden}] and a [S={s}, R={rank}, in], a must be [{s}, {rank}, {hidden}] "
                         f"and b [out, {s}, {rank}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if not (x.is_floating_point() and a.is_floating_point() and b.is_floating_point()):
        raise ValueError(f"x, a and b must be floating, got {x.dtype}, {a.dtype} and {b.dtype}")
    if tuple(slots.shape) != (t,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int64 or int32 [T={t}], got {slots.dtype} {tuple(slots.shape)}")


def lora_delta_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in] through each row's adapter (a [S, R, in], b [out, S, R], slots [T], -1 = none) -> delta
    [T, out] in x's dtype, in float32 (the module docstring's layout and arithmetic). Gathers each row's
    weights: clear, not fast (the oracle the Triton kernel is tested against)."""
    check_operands(x, a, b, slots)
    delta = torch.zeros(x.shape[0], b.shape[0], dtype=torch.float32, device=x.device)  # [T, out]
    used = slots >= 0
    s = slots[used].long()  # [n]: the slots of the rows with an adapter
    v = torch.bmm(a[s].float(), x[used].float()[:, :, None])  # [n, R, 1] = a[s] @ x[t]
    delta[used] = torch.bmm(b[:, s, :].float().transpose(0, 1), v)[:, :, 0]  # [n, out, R] @ [n, R, 1]
    return delta.to(x.dtype)
