"""Kernels against references written here from their definitions, not against each other.

test_kernels.py checks the chunked gated delta rule against the recurrent one and
batched decode attention against per-sequence attention, all at the default
softmax scale: a mistake shared by both sides (or a scale silently replaced by the
default) passes there. These oracles are plain float64 loops and einsums.
"""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta import chunk_gated_delta_rule, gated_delta_decode_step_, recurrent_gated_delta_rule
from kernels.paged_attention import paged_attention, paged_decode_attention

# --- attention with a non-default scale -------------------------------------------------------

SCALE = 0.37  # not head_dim ** -0.5 (0.354 at D = 8): a kernel that drops `scale` fails
HEADS, KV_HEADS, D, PAGE, POOL = 4, 2, 8, 4, 16


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v for the last Tq of Tk positions, causal (and windowed), float64.

    q: [Tq, H, D]; k, v: [Tk, Hkv, D]; query head h reads KV head h // (H / Hkv).
    """
    tq, heads, _ = q.shape
    tk, kv_heads, _ = k.shape
    out = torch.empty(tq, heads, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        for i in range(tq):
            pos = tk - tq + i  # the query's position: it sees keys 0..pos
            first = 0 if window is None else max(0, pos - window + 1)
            keys = k[first : pos + 1, kv].double()  # [n, D]
            weights = torch.softmax(keys @ q[i, h].double() * scale, dim=0)  # [n]
            out[i, h] = weights @ v[first : pos + 1, kv].double()
    return out


def make_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(POOL, PAGE, KV_HEADS, D, generator=g) * 2,  # * 2: scale errors show in the softmax
            torch.randn(POOL, PAGE, KV_HEADS, D, generator=g))


def contiguous(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    return cache[table].reshape(-1, KV_HEADS, D)[:n]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("tq", [13, 6, 1], ids=["fresh-prefill", "chunk-after-context", "decode"])
def test_paged_attention_with_a_custom_scale_equals_the_reference(tq: int, window: int | None) -> None:
    ctx = 13
    k_cache, v_cache = make_cache(seed=tq)
    table = torch.tensor([9, 2, 14, 5])  # 13 tokens in 4 pages, out of order
    q = torch.randn(tq, HEADS, D, generator=torch.Generator().manual_seed(100 + tq)) * 2
    out = paged_attention(q, k_cache, v_cache, table, ctx, SCALE, window)
    want = reference_attention(q, contiguous(k_cache, table, ctx), contiguous(v_cache, table, ctx), SCALE, window)
    assert out.shape == (tq, HEADS, D)
    assert (out.double() - want).abs().max() < 1e-5
    # The scale matters here: the default one gives a measurably different answer.
    default = reference_attention(q, contiguous(k_cache, table, ctx), contiguous(v_cache, table, ctx), D ** -0.5,
                                  window)
    assert (default - want).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 6])
def test_batched_decode_attention_with_a_custom_scale_equals_the_reference(window: int | None) -> None:
    lengths = [3, 11, 7]
    tables = [torch.tensor([4]), torch.tensor([12, 0, 7]), torch.tensor([3, 15])]
    k_cache, v_cache = make_cache(seed=7)
    q = torch.randn(len(lengths), HEADS, D, generator=torch.Generator().manual_seed(8)) * 2
    longest = max(lengths)
    positions = torch.arange(longest)
    padded = torch.zeros(len(lengths), -(-longest // PAGE), dtype=torch.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    pages = padded[:, positions // PAGE]  # [B, L]
    offsets = (positions % PAGE).expand(len(lengths), -1)
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    out = paged_decode_attention(q, k_cache, v_cache, pages, offsets, valid, SCALE, window)
    assert out.shape == (len(lengths), HEADS, D)
    for i, n in enumerate(lengths):
        want = reference_attention(q[i : i + 1], contiguous(k_cache, tables[i], n), contiguous(v_cache, tables[i], n),
                                   SCALE, window)
        assert (out[i].double() - want[0]).abs().max() < 1e-5


# --- the gated delta rule, token by token from its definition ----------------------------------

HK, HV, DK, DV = 2, 4, 8, 6  # grouped: value head j reads key head j // (HV / HK)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # FLA / transformers' l2norm, eps 1e-6


def reference_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token, one sequence and one value head at a time, in float64.

    Per value head j (key head j // (Hv / Hk)), with q and k L2-normalised and q scaled by Dk^-1/2,
    as transformers' torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel=True:
        S <- exp(g_t) S                              S: [Dk, Dv]
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = S^T q_t
    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dk, Dv] or None.
    """
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    out = torch.empty(b, t, hv, dv, dtype=torch.float64)
    final = torch.zeros(b, hv, dk, dv, dtype=torch.float64)
    for s in range(b):
        for j in range(hv):
            kh = j // (hv // hk)
            S = torch.zeros(dk, dv, dtype=torch.float64) if state is None else state[s, j].double().clone()
            for i in range(t):
                q_t = l2_normalized(q[s, i, kh].double()) * dk ** -0.5
                k_t = l2_normalized(k[s, i, kh].double())
                v_t = v[s, i, j].double()
                S = S * torch.exp(g[s, i, j].double())
                S = S + beta[s, i, j].double() * torch.outer(k_t, v_t - S.T @ k_t)
                out[s, i, j] = S.T @ q_t
            final[s, j] = S
    return out, final


def make_gdn(b: int, t: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, HK, DK, generator=gen)
    k = torch.randn(b, t, HK, DK, generator=gen)
    v = torch.randn(b, t, HV, DV, generator=gen)
    g = -torch.rand(b, t, HV, generator=gen) * 0.5  # log decay in (-0.5, 0]: the initial state still counts
    beta = torch.rand(b, t, HV, generator=gen)
    state = torch.randn(b, HV, DK, DV, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("with_state", [True, False], ids=["initial-state", "zero-state"])
@pytest.mark.parametrize("t", [1, 11, 21], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("acc", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_chunked_gated_delta_rule_equals_the_definition(t: int, with_state: bool, acc: torch.dtype) -> None:
    q, k, v, g, beta, state = make_gdn(2, t, seed=t)
    start = state if with_state else None
    want, want_state = reference_gated_delta(q, k, v, g, beta, start)
    # chunk_size 8: 21 tokens are two full chunks and a padded third.
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, None if start is None else start.clone(), chunk_size=8,
                                        acc=acc)
    tol = 1e-5 if acc is torch.float32 else 1e-6  # states go out as fp32 either way
    assert out.shape == (2, t, HV, DV) and final.shape == (2, HV, DK, DV) and final.dtype == torch.float32
    assert (out.double() - want).abs().max() < tol
    assert (final.double() - want_state).abs().max() < tol
    if start is not None:  # the state passed in is read, not written
        assert torch.equal(start, state)


@pytest.mark.parametrize("with_state", [True, False], ids=["initial-state", "zero-state"])
def test_recurrent_gated_delta_rule_equals_the_definition(with_state: bool) -> None:
    q, k, v, g, beta, state = make_gdn(2, 9, seed=3)
    start = state if with_state else None
    want, want_state = reference_gated_delta(q, k, v, g, beta, start)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, start)
    assert (out.double() - want).abs().max() < 1e-5
    assert (final.double() - want_state).abs().max() < 1e-5


def test_decode_step_equals_the_definition_in_each_state_slot() -> None:
    q, k, v, g, beta, state = make_gdn(3, 1, seed=5)
    want, want_state = reference_gated_delta(q, k, v, g, beta, state)
    slots = torch.zeros(4, HV, DK, DV)  # a state pool: the sequences sit in slots 2, 0, 3
    for b, slot in enumerate((2, 0, 3)):
        slots[slot] = state[b]
    out = gated_delta_decode_step_(q, k, v, g, beta, [slots[2], slots[0], slots[3]])
    assert out.shape == (3, 1, HV, DV)
    assert (out.double() - want).abs().max() < 1e-5
    assert (slots[[2, 0, 3]].double() - want_state).abs().max() < 1e-5
    assert torch.equal(slots[1], torch.zeros(HV, DK, DV))


def test_the_definition_agrees_with_transformers() -> None:
    """The oracle's convention (grouping, normalisation, scale, update order) is transformers'."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = make_gdn(2, 5, seed=9)
    want, want_state = reference_gated_delta(q, k, v, g, beta, state)
    hf, hf_state = torch_recurrent_gated_delta_rule(
        q.repeat_interleave(HV // HK, dim=2), k.repeat_interleave(HV // HK, dim=2), v, g, beta,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert hf_state is not None
    assert (hf.double() - want).abs().max() < 1e-5 and (hf_state.double() - want_state).abs().max() < 1e-5
