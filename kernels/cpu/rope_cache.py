"""An attention layer's rotary embedding and KV-cache write on the CPU: kernels/cpu/rope_cache.c.

Behind engine/model/attention.py's step between the projections and the attention: q and k
rotated (engine/model/layers.py's Rotary.apply), K and V written at each token's page and offset
in the cache's dtype. Those torch ops are its oracle (tests/test_cpu_rope_cache.py): about 25 a
layer a step, where this is one call. Shapes or dtypes it does not take return None and the
caller runs the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import KV_DTYPE_CODES, LIBRARY, bind

MAX_HEAD_DIM = 1024  # the C kernel's per-thread row buffer

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr,
                        _i64, _int, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr]

RopeCache = Callable[..., "torch.Tensor | None"]


def load(path: Path = LIBRARY) -> RopeCache | None:
    """The kernel bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "rope_write_kv", _ARGTYPES, "rotary embedding and KV writes run in torch")
    return None if fn is None else functools.partial(_run, fn)


def _takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> bool:
    t, _, dim = q.shape
    return (all(x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 for x in (q, k, v))
            and k.shape == v.shape and k.shape[0] == t and k.shape[2] == dim and dim <= MAX_HEAD_DIM
            and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape and cos.shape[0] == t and cos.shape[1] % 2 == 0 and cos.shape[1] <= dim
            and k_cache.dtype in KV_DTYPE_CODES and v_cache.dtype == k_cache.dtype
            and k_cache.device.type == "cpu" and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
            and k_cache.shape[2:] == k.shape[1:] and v_cache.shape == k_cache.shape
            and pages.dtype == offsets.dtype == torch.int64 and pages.is_contiguous() and offsets.is_contiguous()
            and pages.shape == offsets.shape == (t,))


def _run(fn: Callable[..., int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
         offsets: torch.Tensor) -> torch.Tensor | None:
    """q: [T, H, D], k, v: [T, Hkv, D] (fp32, heads may be strided views); cos, sin: [T, R];
    k_cache, v_cache: [num_pages, P, Hkv, D]; pages, offsets: [T] where each token's K/V goes.
    Writes rope(k) and v into the caches; returns rope(q), contiguous [T, H, D]. None: not taken
    (nothing was written)."""
    if not _takes(q, k, v, cos, sin, k_cache, v_cache, pages, offsets):
        return None
    t, heads, dim = q.shape
    q_out = torch.empty(t, heads, dim, dtype=torch.float32)
    status = fn(q.data_ptr(), q.stride(0), q.stride(1), heads, k.data_ptr(), k.stride(0), k.stride(1),
                v.data_ptr(), v.stride(0), v.stride(1), k.shape[1], t, dim, cos.data_ptr(), sin.data_ptr(),
                cos.shape[1], KV_DTYPE_CODES[k_cache.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), pages.data_ptr(), offsets.data_ptr(),
                k_cache.shape[0], k_cache.shape[1], q_out.data_ptr())
    if status == -2:  # as index_put would: nothing was written
        raise IndexError(f"a K/V slot outside the cache's {k_cache.shape[0]} pages of {k_cache.shape[1]}")
    if status != 0:
        raise RuntimeError(f"rope_write_kv refused D {dim}, R {cos.shape[1]}: this is a bug")
    return q_out
