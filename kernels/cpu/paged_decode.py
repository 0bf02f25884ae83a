"""Paged decode attention on the CPU, reading K/V in place: kernels/cpu/paged_decode.c via ctypes.

Behind the signature of the torch reference (kernels/paged_attention.py: paged_decode_attention),
which is its oracle. The library is built by `make kernels` (gcc -O3 -march=native -fopenmp);
`load()` returns None, logging why once, when it is not there, and the caller runs the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import KV_DTYPE_CODES, LIBRARY, bind
from kernels.paged_attention import paged_decode_attention as reference
from kernels.paged_attention import positional

MAX_GROUP, MAX_DIM = 64, 256  # the C kernel's fixed per-thread buffers (query heads per KV head, head dim)
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES: list[Any] = [_int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64,
             _ptr, _ptr, _i64, _int, _int, _int, ctypes.c_float, _i64, _i64]

DecodeFn = Callable[..., torch.Tensor]


def load(path: Path = LIBRARY) -> DecodeFn | None:
    """The in-place kernel bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "paged_decode_attention", _ARGTYPES, "decode attention runs the torch reference")
    return None if fn is None else functools.partial(_run, fn)


def load_from_table(path: Path = LIBRARY) -> DecodeFn | None:
    """The same kernel over each sequence's page table [B, W] and length [B] (`_run_from_table`), or None."""
    fn = bind(path, "paged_decode_attention", _ARGTYPES, "decode attention runs the torch reference")
    return None if fn is None else functools.partial(_run_from_table, fn)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C kernel takes these shapes and dtypes (else the reference runs)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    return (q.device.type == "cpu" and k_cache.dtype in KV_DTYPE_CODES and dim <= MAX_DIM and kv_heads > 0
            and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and k_cache.stride(-1) == 1)


def _run(fn: Callable[..., int], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
         offsets: torch.Tensor, valid: torch.Tensor, scale: float, sliding_window: int | None = None
         ) -> torch.Tensor:
    """q: [B, H, D]; k_cache/v_cache: [num_pages, P, Hkv, D]; pages/offsets/valid: [B, L] (valid a prefix
    of each row). Returns [B, H, D] in q's dtype, accumulated in fp32."""
    if not _takes(q, k_cache, v_cache):
        return reference(q, k_cache, v_cache, pages, offsets, valid, scale, sliding_window)
    assert pages.shape == offsets.shape == valid.shape and pages.shape[0] == q.shape[0], (pages.shape, valid.shape)
    # Checked in Python: no-op torch calls cost a dispatch each, in every attention layer of every step.
    if pages.dtype != torch.int64 or offsets.dtype != torch.int64:
        pages, offsets = pages.to(torch.int64), offsets.to(torch.int64)
    lengths = valid.sum(dim=1, dtype=torch.int64)  # [B]: valid is a prefix
    return _call(fn, q, k_cache, v_cache, pages, offsets, lengths, scale, sliding_window, 0)


def _run_from_table(fn: Callable[..., int], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    table: torch.Tensor, lengths: torch.Tensor, page_size: int, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q: [B, H, D]; table: [B, W] int64, each sequence's page table (padded); lengths: [B] int64, each
    one's context length (page_size * W at most). What _run computes over `positional(table, lengths,
    page_size)`, without building those [B, L] tensors (nor summing a mask) in every attention layer."""
    if not _takes(q, k_cache, v_cache):
        return reference(q, k_cache, v_cache, *positional(table, lengths, page_size), scale, sliding_window)
    assert table.dtype == lengths.dtype == torch.int64 and table.shape[0] == lengths.shape[0] == q.shape[0], \
        (table.shape, lengths.shape, q.shape)
    assert lengths.is_contiguous() and page_size > 0, (lengths.stride(), page_size)
    return _call(fn, q, k_cache, v_cache, table, table, lengths, scale, sliding_window, page_size)


def _takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return supports(q, k_cache) and v_cache.dtype == k_cache.dtype and v_cache.stride(-1) == 1


def _call(fn: Callable[..., int], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
          offsets: torch.Tensor, lengths: torch.Tensor, scale: float, sliding_window: int | None, page_size: int
          ) -> torch.Tensor:
    """The C call (page_size 0: `pages`/`offsets` are [B, L]; > 0: `pages` is [B, W] page tables)."""
    batch, heads, dim = q.shape
    assert k_cache.shape[-1] == dim and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    qf = q if q.dtype == torch.float32 and q.is_contiguous() else q.to(torch.float32).contiguous()  # [B, H, D]
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    ks, vs = k_cache.stride(), v_cache.stride()
    status = fn(KV_DTYPE_CODES[k_cache.dtype], qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                pages.data_ptr(), pages.stride(0), pages.stride(1), offsets.data_ptr(), offsets.stride(0),
                offsets.stride(1), lengths.data_ptr(), out.data_ptr(), batch, heads, k_cache.shape[2], dim,
                scale, sliding_window or 0, page_size)
    if status != 0:
        raise RuntimeError(f"paged_decode_attention refused q {tuple(q.shape)}, k {tuple(k_cache.shape)}: "
                           "this is a bug")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
