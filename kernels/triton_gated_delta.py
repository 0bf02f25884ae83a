"""The gated delta rule in Triton, behind the torch reference's signatures (kernels/gated_delta.py).

Chunked prefill, two kernels, everything in fp32 (IEEE matmuls, never TF32):
1. _chunk_prepare, all chunks at once, one program per (chunk, sequence, value head):
   L2-normalise k, the cumulative log decay gc inside the chunk, the strictly lower
   A = (beta k k^T) * exp(gc_i - gc_j), its unit lower inverse by the same product of
   squares as the reference (log2(C) - 1 squarings, all matmuls), then
   u = A^-1 (beta v) and w = A^-1 (beta k exp(gc)) into fp32 scratch.
2. _chunk_scan, one program per (value block, sequence, value head), over the chunks
   in order, the [Dk, BV] state block in registers:
       v_new = u - w S;  o = (q exp(gc)) S + ((q k^T) * decay) v_new
       S <- exp(gc_last) S + (k exp(gc_last - gc))^T v_new

Decode: _decode_step, one program per (value block, sequence, value head), updates that
sequence's state where it lies (one strided fp32 [Hv, Dk, Dv] view per sequence, as the
reference takes them) and writes the output.

Grouped key heads (Hk < Hv) are read in place: value head h reads key head h // (Hv / Hk).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_support import (LAUNCH, block, check_last_dim_contiguous, check_same_device, interpreting,
                                    on_its_device)

EPS = 1e-6  # l2_normalize's epsilon (the FLA / transformers formula)


@triton.jit
def _l2norm_rows(x):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6))[:, None]


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _chunk_prepare(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, gc_ptr,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sbeta_b, sbeta_t, sbeta_h,
    t_len, t_pad, hv, ratio,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CHUNK: tl.constexpr, SQUARINGS: tl.constexpr,
):
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hv
    h = bh % hv
    kh = h // ratio
    t = chunk * CHUNK + tl.arange(0, CHUNK)
    t_ok = t < t_len
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(k_ptr + b * sk_b + t[:, None] * sk_t + kh * sk_h + dk[None, :],
                mask=t_ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
    k = _l2norm_rows(k)
    v = tl.load(v_ptr + b * sv_b + t[:, None] * sv_t + h * sv_h + dv[None, :],
                mask=t_ok[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * sg_b + t * sg_t + h * sg_h, mask=t_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b * sbeta_b + t * sbeta_t + h * sbeta_h, mask=t_ok, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, 0)  # cumulative log decay inside the chunk

    i = tl.arange(0, CHUNK)[:, None]
    j = tl.arange(0, CHUNK)[None, :]
    lower = i > j
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
    k_beta = k * beta[:, None]
    eye = (i == j).to(tl.float32)
    power = -(_mm(k_beta, tl.trans(k)) * decay)  # -L, strictly lower
    inverse = eye + power
    for _ in tl.static_range(SQUARINGS):  # (I + L)^-1 = prod_j (I + (-L)^(2^j))
        power = _mm(power, power)
        inverse = _mm(inverse, eye + power)
    u = _mm(inverse, v * beta[:, None])
    w = _mm(inverse, k_beta * tl.exp(gc)[:, None])
    row = bh * t_pad + t  # scratch: [B * Hv, T_pad, ...], padded rows written too (zeros in, zeros out)
    tl.store(u_ptr + row[:, None] * DV + dv[None, :], u, mask=(dv < DV)[None, :])
    tl.store(w_ptr + row[:, None] * DK + dk[None, :], w, mask=(dk < DK)[None, :])
    tl.store(gc_ptr + row, gc)


@triton.jit
def _chunk_scan(
    q_ptr, k_ptr, w_ptr, u_ptr, gc_ptr, state_ptr, out_ptr, final_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, so_b, so_t, so_h,
    t_len, t_pad, hv, ratio, num_chunks, scale,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, HAS_STATE: tl.constexpr,
):
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hv
    h = bh % hv
    kh = h // ratio
    dk = tl.arange(0, BLOCK_DK)
    dv = vb * BV + tl.arange(0, BV)
    dk_ok = dk < DK
    dv_ok = dv < DV
    s_mask = dk_ok[:, None] & dv_ok[None, :]
    s_offs = bh * DK * DV + dk[:, None] * DV + dv[None, :]  # states: [B, Hv, Dk, Dv] contiguous
    if HAS_STATE:
        state = tl.load(state_ptr + s_offs, mask=s_mask, other=0.0)
    else:
        state = tl.zeros([BLOCK_DK, BV], tl.float32)
    i = tl.arange(0, CHUNK)[:, None]
    j = tl.arange(0, CHUNK)[None, :]
    for c in range(num_chunks):
        t = c * CHUNK + tl.arange(0, CHUNK)
        t_ok = t < t_len
        qk_mask = t_ok[:, None] & dk_ok[None, :]
        q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + kh * sq_h + dk[None, :], mask=qk_mask, other=0.0)
        q = _l2norm_rows(q.to(tl.float32)) * scale
        k = tl.load(k_ptr + b * sk_b + t[:, None] * sk_t + kh * sk_h + dk[None, :], mask=qk_mask, other=0.0)
        k = _l2norm_rows(k.to(tl.float32))
        row = bh * t_pad + t
        gc = tl.load(gc_ptr + row)
        g_last = tl.load(gc_ptr + bh * t_pad + c * CHUNK + CHUNK - 1)
        w = tl.load(w_ptr + row[:, None] * DK + dk[None, :], mask=dk_ok[None, :], other=0.0)
        u = tl.load(u_ptr + row[:, None] * DV + dv[None, :], mask=dv_ok[None, :], other=0.0)
        v_new = u - _mm(w, state)  # [CHUNK, BV]
        decay = tl.exp(tl.where(i >= j, gc[:, None] - gc[None, :], float("-inf")))
        intra = _mm(q, tl.trans(k)) * decay
        out = _mm(q * tl.exp(gc)[:, None], state) + _mm(intra, v_new)
        tl.store(out_ptr + b * so_b + t[:, None] * so_t + h * so_h + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & dv_ok[None, :])
        k_to_end = k * tl.exp(g_last - gc)[:, None]
        state = state * tl.exp(g_last) + _mm(tl.trans(k_to_end), v_new)
    tl.store(final_ptr + s_offs, state, mask=s_mask)


def _check_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
               ) -> tuple[int, int, int, int, int, int, int]:
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (b, t) or g.shape != (b, t, hv) or beta.shape != (b, t, hv):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if hv % hk:
        raise ValueError(f"{hv} value heads cannot share {hk} key heads")
    if max(dk, dv) > 256:
        raise ValueError(f"head dims {dk}/{dv} are above the 256 these kernels are built for")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, x)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta)
    return b, t, hk, hv, dk, dv, hv // hk


@on_its_device
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
    acc: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g (log decay), beta: [B, T, Hv];
    initial_state: [B, Hv, Dk, Dv] or None for zeros (read, never written).
    Returns (out [B, T, Hv, Dv] in v's dtype, final_state [B, Hv, Dk, Dv] fp32).
    `acc` must be float32: the kernel accumulates in fp32 (the reference's float64 is for tests).
    """
    if acc != torch.float32:
        raise ValueError(f"the Triton chunked delta rule accumulates in float32, not {acc}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    bsz, t, _, hv, dk, dv, ratio = _check_gdn(q, k, v, g, beta)
    device = v.device
    out = torch.empty(bsz, t, hv, dv, dtype=v.dtype, device=device)
    final = torch.empty(bsz, hv, dk, dv, dtype=torch.float32, device=device)
    if initial_state is not None:
        if initial_state.shape != (bsz, hv, dk, dv):
            raise ValueError(f"initial_state must be [{bsz}, {hv}, {dk}, {dv}], got {tuple(initial_state.shape)}")
        initial_state = initial_state.to(torch.float32).contiguous()
    if t == 0:
        final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return out, final
    num_chunks = triton.cdiv(t, chunk_size)
    t_pad = num_chunks * chunk_size
    w = torch.empty(bsz * hv, t_pad, dk, dtype=torch.float32, device=device)
    u = torch.empty(bsz * hv, t_pad, dv, dtype=torch.float32, device=device)
    gc = torch.empty(bsz * hv, t_pad, dtype=torch.float32, device=device)
    block_dk, block_dv = block(dk), block(dv)
    warps = 4 if interpreting(device) or chunk_size * max(block_dk, block_dv) <= 4096 else 8
    _chunk_prepare[(num_chunks, bsz * hv)](
        k, v, g, beta, w, u, gc,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
        t, t_pad, hv, ratio,
        DK=dk, DV=dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        CHUNK=chunk_size, SQUARINGS=int(math.log2(chunk_size)) - 1,
        num_warps=warps, **LAUNCH,
    )
    # 32 value columns a program: more programs for the sequential scan, ~105 KB of shared memory at
    # Dk = 128; one stage (the chunks depend on each other; three stages triple the buffers to 300 KB).
    bv = block_dv if interpreting(device) else min(block_dv, 32)
    _chunk_scan[(triton.cdiv(dv, bv), bsz * hv)](
        q, k, w, u, gc, initial_state if initial_state is not None else final, out, final,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        t, t_pad, hv, ratio, num_chunks, dk**-0.5,
        DK=dk, DV=dv, BLOCK_DK=block_dk, BV=bv,
        CHUNK=chunk_size, HAS_STATE=initial_state is not None,
        num_warps=4, num_stages=1, **LAUNCH,
    )
    return out, final


@triton.jit
def _decode_step(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slot_offsets_ptr, out_ptr,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sbeta_b, sbeta_h, ss_h, ss_k, so_b, so_h,
    hv, ratio, scale,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BV: tl.constexpr,
):
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hv
    h = bh % hv
    kh = h // ratio
    dk = tl.arange(0, BLOCK_DK)
    dv = vb * BV + tl.arange(0, BV)
    dk_ok = dk < DK
    dv_ok = dv < DV
    q = tl.load(q_ptr + b * sq_b + kh * sq_h + dk, mask=dk_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + kh * sk_h + dk, mask=dk_ok, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-6))
    v = tl.load(v_ptr + b * sv_b + h * sv_h + dv, mask=dv_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * sg_b + h * sg_h).to(tl.float32))
    beta = tl.load(beta_ptr + b * sbeta_b + h * sbeta_h).to(tl.float32)
    base = states_ptr + tl.load(slot_offsets_ptr + b) + h * ss_h  # this sequence's own state, in place
    ptrs = base + dk[:, None] * ss_k + dv[None, :]
    mask = dk_ok[:, None] & dv_ok[None, :]
    state = tl.load(ptrs, mask=mask, other=0.0) * decay  # [BLOCK_DK, BV]
    delta = (v - tl.sum(k[:, None] * state, 0)) * beta  # beta (v - S^T k)
    state = state + k[:, None] * delta[None, :]
    tl.store(ptrs, state, mask=mask)
    out = tl.sum(q[:, None] * state, 0)
    tl.store(out_ptr + b * so_b + h * so_h + dv, out.to(out_ptr.dtype.element_ty), mask=dv_ok)


def _slot_offsets(states: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(base view, element offset of each state from it): the states as one strided pool."""
    first = states[0]
    for s in states:
        if s.dtype != torch.float32 or s.shape != first.shape or s.stride() != first.stride() or s.stride(-1) != 1:
            raise ValueError("every state must be an fp32 [Hv, Dk, Dv] view with the same strides, last one 1")
        if s.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            raise ValueError("the states must be views into one state pool (cache.recurrent)")
    base = min(states, key=lambda s: s.data_ptr())
    offsets = [(s.data_ptr() - base.data_ptr()) // 4 for s in states]
    return base, torch.tensor(offsets, dtype=torch.int64).to(device, non_blocking=True)


@on_its_device
def gated_delta_decode_step_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: list[torch.Tensor],
) -> torch.Tensor:
    """One token for each of B sequences, each state updated where it lies (no gather, no copy).

    q, k: [B, 1, Hk, Dk]; v: [B, 1, Hv, Dv]; g, beta: [B, 1, Hv]; states[b]: the sequence's own
    fp32 [Hv, Dk, Dv] view into the state pool. Returns out [B, 1, Hv, Dv] in v's dtype.
    """
    bsz, t, _, hv, dk, dv, ratio = _check_gdn(q, k, v, g, beta)
    if t != 1 or len(states) != bsz:
        raise ValueError(f"a decode step takes one token for each of {len(states)} states, got [B={bsz}, T={t}]")
    out = torch.empty(bsz, 1, hv, dv, dtype=v.dtype, device=v.device)
    if bsz == 0:
        return out
    if states[0].shape != (hv, dk, dv):
        raise ValueError(f"each state must be [{hv}, {dk}, {dv}], got {tuple(states[0].shape)}")
    base, offsets = _slot_offsets(states, v.device)
    block_dk = block(dk, 1)
    bv = block(dv, 1) if interpreting(v.device) else min(block(dv, 1), 32)
    _decode_step[(triton.cdiv(dv, bv), bsz * hv)](
        q, k, v, g, beta, base, offsets, out,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        g.stride(0), g.stride(2), beta.stride(0), beta.stride(2), base.stride(0), base.stride(1),
        out.stride(0), out.stride(2),
        hv, ratio, dk**-0.5,
        DK=dk, DV=dv, BLOCK_DK=block_dk, BV=bv,
        num_warps=4, **LAUNCH,
    )
    return out
