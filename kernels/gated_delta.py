"""Gated delta rule (Gated DeltaNet linear attention): torch reference kernels.

State per value head is a [Dk, Dv] matrix S. For each token t:
    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T      (the delta rule)
    o_t = S^T q_t
The chunked form computes the same thing a chunk at a time with matmuls (the
"UT transform"), which is what prefill uses; the recurrent form is for decode.

Both forms accumulate in fp32, like the fused kernels, transformers and llama.cpp
do; `acc=torch.float64` gives the tight reference the kernel tests hold them to.
The chunk grid follows where a prefill starts, so prefills cut at different points
round differently: ~2e-5 in the logits of the tiny test models, measured. float64
would hold that under 3e-6 but costs 12x on the CPU (one 2048-token layer at the
benchmark geometry: 1.87 s against 155 ms), which made hybrid prefill slower than
llama.cpp's. States go in and out as fp32 either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as the FLA library (and transformers), so logits agree bit-for-bit-ish.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    acc: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """Expand grouped key heads to value heads, move heads first, upcast, normalise q/k."""
    # q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(acc).contiguous() for x in (q, k, v, g, beta))
    q = l2_normalize(q)
    k = l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for L the strictly lower triangle of a: [..., C, C].

    L is nilpotent (L^C = 0), so (I + L)^-1 = sum_k (-L)^k = prod_j (I + (-L)^(2^j)):
    log2(C) squarings and products, batched matmuls instead of one small
    triangular solve per (head, chunk) — several times faster on the CPU.
    """
    size = a.shape[-1]
    eye = torch.eye(size, dtype=a.dtype, device=a.device)
    power = -a.tril(-1)
    inverse = eye + power
    span = 2
    while span < size:
        power = power @ power
        inverse = inverse @ (eye + power)
        span *= 2
    return inverse


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
    initial_state: [B, Hv, Dk, Dv] or None for zeros.
    Returns (out [B, T, Hv, Dv] in v's dtype, final_state [B, Hv, Dk, Dv] fp32).
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, acc)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - t % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    # [B, H, N, C, D]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, n, chunk_size).cumsum(dim=-1)  # cumulative log decay inside each chunk
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [B,H,N,C,C]

    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    # Solve (I + strictly-lower(ut)) X = rhs: condenses C delta-rule updates into matmuls.
    inverse = unit_lower_inverse(ut)
    u = inverse @ v_beta
    w = inverse @ (k_beta * g.exp().unsqueeze(-1))

    state = (
        torch.zeros(b, h, dk, dv, dtype=q.dtype, device=q.device)
        if initial_state is None
        else initial_state.to(q.dtype)
    )
    out = torch.empty(b, h, n, chunk_size, dv, dtype=q.dtype, device=q.device)
    q_decayed = q * g.exp().unsqueeze(-1)
    k_to_end = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B,H,N,1,1]
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * chunk_size, dv)[:, :, :t]
    return out.transpose(1, 2).to(out_dtype).contiguous(), state.float()


def gated_delta_decode_step_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: list[torch.Tensor],
) -> torch.Tensor:
    """One token for each of B sequences, each state updated where it lies (no gather, no copy).

    q, k: [B, 1, Hk, Dk]; v: [B, 1, Hv, Dv]; g, beta: [B, 1, Hv]; states[b]: the sequence's own
    contiguous fp32 [Hv, Dk, Dv] (a view into its state slot). Returns out [B, 1, Hv, Dv] in v's
    dtype. The same arithmetic as recurrent_gated_delta_rule, one sequence at a time: a batched
    step would gather every state (1 MiB a layer at hidden 1024) and scatter it back.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, 1, D], g/beta [B, Hv, 1]
    decay = g[:, :, 0].exp()
    out = torch.empty(v.shape[0], v.shape[1], v.shape[-1], dtype=torch.float32, device=v.device)
    for b, state in enumerate(states):
        k_t = k[b]  # [Hv, 1, Dk] row vectors
        state.mul_(decay[b].view(-1, 1, 1))
        delta = (v[b] - torch.bmm(k_t, state)) * beta[b].view(-1, 1, 1)
        state.baddbmm_(k_t.transpose(1, 2), delta)  # S += k delta^T
        out[b] = torch.bmm(q[b], state)[:, 0]
    return out.unsqueeze(1).to(out_dtype)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule; same contract as chunk_gated_delta_rule.

    The reference the chunked form and the engine's decode step (gated_delta_decode_step_)
    are tested against; fp32, one batched matrix-vector product per update.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, torch.float32)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    state = (
        torch.zeros(b * h, dk, dv, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.to(torch.float32).reshape(b * h, dk, dv).clone()
    )
    out = torch.empty(b, h, t, dv, dtype=torch.float32, device=q.device)
    for i in range(t):
        k_t = k[:, :, i].reshape(b * h, 1, dk)  # row vector
        state.mul_(g[:, :, i].exp().reshape(b * h, 1, 1))
        remembered = torch.bmm(k_t, state)  # S^T k: [BH, 1, Dv]
        delta = (v[:, :, i].reshape(b * h, 1, dv) - remembered) * beta[:, :, i].reshape(b * h, 1, 1)
        state.baddbmm_(k_t.transpose(1, 2), delta)  # S += k delta^T
        out[:, :, i] = torch.bmm(q[:, :, i].reshape(b * h, 1, dk), state).reshape(b, h, dv)
    return out.transpose(1, 2).to(out_dtype).contiguous(), state.reshape(b, h, dk, dv)
