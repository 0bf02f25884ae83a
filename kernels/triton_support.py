"""What every Triton kernel here shares: the matmul helper and the launch checks.

Imported only where Triton runs: on CUDA (kernels/select.py) and, in the tests, under
TRITON_INTERPRET=1 on CPU tensors. Triton's interpreter multiplies bfloat16 operands of
tl.dot as their raw 16-bit patterns (triton 3.9), so under the interpreter the wrappers
ask for UPCAST: operands go to fp32 first (exact for bf16/fp16 values). On the GPU the
operands stay in their dtype and fp32 operands use IEEE precision, never TF32.
"""

from __future__ import annotations

import functools
from typing import Callable, ParamSpec, TypeVar

import torch
import triton
import triton.language as tl


# Passed to every launch: Triton 3.9 warns when fp fusion is left to its default (which changes in 3.10).
LAUNCH = {"enable_fp_fusion": True}


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """a @ b accumulated in fp32: a [M, K], b [K, N]."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


def interpreting(device: torch.device) -> bool:
    """Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1)."""
    return device.type != "cuda"


def dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """(UPCAST, IEEE) for operands of `dtype` on `device`."""
    return interpreting(device), dtype == torch.float32


P = ParamSpec("P")
R = TypeVar("R")


def on_its_device(fn: Callable[P, R]) -> Callable[P, R]:
    """Launch on the device of the wrapper's first tensor: Triton launches on the current CUDA
    device, which the engine does not set (a model on cuda:1 would otherwise launch on cuda:0)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        device = args[0].device  # type: ignore[attr-defined]
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {str(t.device) for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: { {k: str(t.device) for k, t in tensors.items()} }")


def block(n: int, least: int = 16) -> int:
    """The power-of-two block covering n (at least `least`: tl.dot wants 16 on every side)."""
    return max(least, triton.next_power_of_2(n))
