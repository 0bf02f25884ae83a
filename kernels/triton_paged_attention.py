"""Attention over the paged KV cache in Triton: the same two entry points as
kernels/paged_attention.py (the torch reference), reading pages where they lie.

- paged_attention: the causal chunk of one sequence (a fresh prefill, or a chunk
  after a prefix already in pages). One program per (query block, query head); it
  walks key blocks up to the block's last position (and from its window's start),
  looking up each key's page in the page table, with an online softmax in fp32.
- paged_decode_attention: one new token for each of B sequences. One program per
  (sequence, KV head, context split): the query heads sharing that KV head are the
  rows of one tile (grouped-query attention without repeating K/V), long contexts
  are split across programs and merged by a second kernel (split-K, "flash decoding").

Any page size, head dims up to 256 (64, 128, 256 are the served ones), fp32/fp16/bf16
caches; scores and the softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import (LAUNCH, block, check_last_dim_contiguous, check_same_device, dot,
                                    dot_flags, interpreting, on_its_device)

NEG = tl.constexpr(-1.0e30)  # the running max starts here, not at -inf: a fully masked block then gives 0, never NaN


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_ot, stride_oh,
    tq, context_len, scale, window,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_ok = rows < tq
    # q: [BLOCK_M, BLOCK_D] for positions context_len - tq + rows
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context_len - tq + rows
    first = context_len - tq + pid_m * BLOCK_M
    hi = tl.minimum(first + BLOCK_M, context_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_ctx = pos < context_len
        page = tl.load(table_ptr + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
        off = pos % PAGE
        kv_mask = in_ctx[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_ko + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        s = dot(q.to(k.dtype), tl.trans(k), UPCAST, IEEE) * scale  # [BLOCK_M, BLOCK_N]
        allowed = (pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vo + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [pages, P, Hkv, D] alike, got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    heads, dim = q.shape[-2], q.shape[-1]
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != dim or heads % kv_heads:
        raise ValueError(f"q heads/dim {heads}/{dim} do not fit a cache of {kv_heads} KV heads of dim "
                         f"{k_cache.shape[3]}")
    if dim > 256:
        raise ValueError(f"head dim {dim} is above the 256 these kernels are built for")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    return heads, kv_heads, dim


@on_its_device
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions of a sequence over its cache.

    q: [Tq, H, D] for positions context_len-Tq .. context_len-1 (their K/V already written);
    k_cache/v_cache: [num_pages, P, Hkv, D] (any page stride); page_table: [n] page ids.
    Returns [Tq, H, D] in q's dtype.
    """
    tq = q.shape[0]
    heads, kv_heads, dim = _check_cache(q, k_cache, v_cache)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table)
    page = k_cache.shape[1]
    if not 0 < tq <= context_len or page_table.numel() * page < context_len:
        raise ValueError(f"{tq} queries, context {context_len}, {page_table.numel()} pages of {page}: inconsistent")
    table = page_table.contiguous()
    out = torch.empty(tq, heads, dim, dtype=q.dtype, device=q.device)
    upcast, ieee = dot_flags(k_cache.dtype, q.device)
    block_d = block(dim)
    block_m = min(32 if block_d > 128 else 64, block(tq))  # a short chunk (or one token) takes a 16-row tile
    block_n = 32 if block_d > 128 else 64
    grid = (triton.cdiv(tq, block_m), heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, table, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        tq, context_len, scale, sliding_window or 0,
        GROUP=heads // kv_heads, PAGE=page, HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
        UPCAST=upcast, IEEE=ieee,
        num_warps=8 if block_d > 64 else 4, **LAUNCH,
    )
    return out


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, pages_ptr, offsets_ptr, lengths_ptr,
    acc_ptr, m_ptr, l_ptr, out_ptr,
    stride_qb, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_pb, stride_fb,
    stride_ob, stride_oh,
    scale, window, partition, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # q: [GROUP_PAD, BLOCK_D], the query heads reading this KV head
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    length = tl.load(lengths_ptr + b)
    lo = split * partition
    hi = tl.minimum(lo + partition, length)
    if HAS_WINDOW:
        lo = tl.maximum(lo, length - window)

    m_i = tl.full([GROUP_PAD], NEG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        page = tl.load(pages_ptr + b * stride_pb + pos, mask=ok, other=0).to(tl.int64)
        off = tl.load(offsets_ptr + b * stride_fb + pos, mask=ok, other=0).to(tl.int64)
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_ko + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        s = dot(q.to(k.dtype), tl.trans(k), UPCAST, IEEE) * scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vo + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new
    if SPLIT:
        # partials: acc [B, H, splits, D], m/l [B, H, splits], unnormalised
        part = (b * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(m_ptr + part, m_i, mask=g_ok)
        tl.store(l_ptr + part, l_i, mask=g_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row = (b * tl.num_programs(1) + head) * num_splits + s
    m = tl.load(m_ptr + row, mask=s_ok, other=NEG)
    l_part = tl.load(l_ptr + row, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    weight = tl.exp(m - tl.max(m, 0))  # splits past the context hold m = NEG, l = 0: weight 0
    total = tl.sum(l_part * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def decode_splits(batch: int, kv_heads: int, longest: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(splits, partition): enough programs to fill the device, each at least 4 key blocks."""
    if interpreting(device):
        target = 1
    else:
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    most = triton.cdiv(longest, 4 * block_n)
    splits = max(1, min(most, triton.cdiv(target, batch * kv_heads)))
    partition = triton.cdiv(triton.cdiv(longest, splits), block_n) * block_n
    return triton.cdiv(longest, partition), partition


@on_its_device
def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One new token for each of B sequences, attention over each one's whole context.

    q: [B, H, D]; pages/offsets/valid: [B, L] (position -> page, offset; valid marks each
    sequence's first `length` positions, as engine.model.batch.DecodeGather builds it).
    Returns [B, H, D]. `num_splits` forces the context split (tests); None picks it.
    """
    bsz = q.shape[0]
    heads, kv_heads, dim = _check_cache(q, k_cache, v_cache)
    check_same_device(q=q, k_cache=k_cache, pages=pages, offsets=offsets, valid=valid)
    if pages.shape != offsets.shape or pages.shape != valid.shape or pages.shape[0] != bsz:
        raise ValueError(f"pages/offsets/valid must all be [B={bsz}, L], got {tuple(pages.shape)}, "
                         f"{tuple(offsets.shape)}, {tuple(valid.shape)}")
    for name, t in (("pages", pages), ("offsets", offsets)):
        check_last_dim_contiguous(name, t)
    longest = pages.shape[1]
    lengths = valid.sum(dim=1, dtype=torch.int32)  # valid is a prefix: its count is the context length
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    if bsz == 0 or longest == 0:
        return out.zero_()
    upcast, ieee = dot_flags(k_cache.dtype, q.device)
    block_d = block(dim)
    block_n = 32 if block_d > 128 else 64
    group = heads // kv_heads
    if num_splits is None:
        splits, partition = decode_splits(bsz, kv_heads, longest, block_n, q.device)
    else:
        partition = triton.cdiv(triton.cdiv(longest, num_splits), block_n) * block_n
        splits = triton.cdiv(longest, partition)
    split = splits > 1
    scratch = torch.empty(bsz * heads * splits * dim if split else 1, dtype=torch.float32, device=q.device)
    m = torch.empty(bsz * heads * splits if split else 1, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    _decode_kernel[(bsz, kv_heads, splits)](
        q, k_cache, v_cache, pages, offsets, lengths,
        scratch, m, l_sum, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        pages.stride(0), offsets.stride(0),
        out.stride(0), out.stride(1),
        scale, sliding_window or 0, partition, splits,
        GROUP=group, GROUP_PAD=block(group), HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None, SPLIT=split,
        UPCAST=upcast, IEEE=ieee,
        num_warps=4, **LAUNCH,
    )
    if split:
        _merge_kernel[(bsz, heads)](
            scratch, m, l_sum, out, out.stride(0), out.stride(1), splits,
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=block(splits, 2), num_warps=4, **LAUNCH,
        )
    return out
