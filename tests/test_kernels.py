"""Kernels against their torch references (and the references against each other)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.causal_conv import causal_conv1d
from kernels.gated_delta import (chunk_gated_delta_rule, gated_delta_decode_step_, recurrent_gated_delta_rule,
                                 unit_lower_inverse)
from kernels.paged_attention import paged_attention, paged_decode_attention


def make_gdn_inputs(b: int, t: int, hk: int = 2, hv: int = 4, d: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, hk, d, generator=g), torch.randn(b, t, hk, d, generator=g),
            torch.randn(b, t, hv, d, generator=g), -torch.rand(b, t, hv, generator=g) * 2,
            torch.rand(b, t, hv, generator=g)]


def test_unit_lower_inverse_matches_triangular_solve() -> None:
    a = torch.randn(3, 64, 64, dtype=torch.float64)
    rhs = torch.randn(3, 64, 8, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    assert torch.allclose(unit_lower_inverse(a) @ rhs, expected, atol=1e-9)


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", [1, 37, 64, 130])
def test_chunked_equals_recurrent_and_continues_from_state(t: int, acc: torch.dtype) -> None:
    q, k, v, g, beta = make_gdn_inputs(2, t)
    rec, rec_state = recurrent_gated_delta_rule(q, k, v, g, beta, None)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, None, acc=acc)
    assert (out - rec).abs().max() < 1e-5 and (state - rec_state).abs().max() < 1e-5
    # Split anywhere and carry the state: same result.
    cut = t // 3
    if cut:
        a, s1 = chunk_gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], None, acc=acc)
        b, s2 = chunk_gated_delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1, acc=acc)
        assert (torch.cat([a, b], 1) - out).abs().max() < 1e-5 and (s2 - state).abs().max() < 1e-5


def test_causal_conv_with_carried_state_equals_whole() -> None:
    x = torch.randn(2, 6, 20)
    w = torch.randn(6, 4)
    whole, _ = causal_conv1d(x, w, None)
    expected = F.silu(F.conv1d(F.pad(x, (3, 0)), w.unsqueeze(1), groups=6))
    assert torch.allclose(whole, expected, atol=1e-6)
    first, state = causal_conv1d(x[..., :7], w, None)
    second, _ = causal_conv1d(x[..., 7:], w, state)
    assert torch.allclose(torch.cat([first, second], -1), whole, atol=1e-6)


def make_paged(ctx: int, page: int = 4, hkv: int = 2, d: int = 8, pages: int = 32, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pages, page, hkv, d, generator=g)
    v_cache = torch.randn(pages, page, hkv, d, generator=g)
    table = torch.randperm(pages, generator=g)[: -(-ctx // page)]
    k = k_cache[table].reshape(-1, hkv, d)[:ctx]
    v = v_cache[table].reshape(-1, hkv, d)[:ctx]
    return k_cache, v_cache, table, k, v


@pytest.mark.parametrize("tq", [7, 1, 19], ids=["chunk-after-context", "decode", "fresh-prefill"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_equals_dense_causal_attention(window: int | None, tq: int) -> None:
    ctx, heads = 19, 4
    k_cache, v_cache, table, k, v = make_paged(ctx)
    q = torch.randn(tq, heads, 8)
    out = paged_attention(q, k_cache, v_cache, table, ctx, 8**-0.5, window)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 8**-0.5
    qpos = torch.arange(ctx - tq, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_batched_decode_attention_equals_per_sequence(window: int | None) -> None:
    lengths = [3, 17, 9]
    page = 4
    k_cache, v_cache, _, _, _ = make_paged(1, page=page)
    g = torch.Generator().manual_seed(1)
    tables = [torch.randperm(32, generator=g)[: -(-n // page)] for n in lengths]
    q = torch.randn(3, 4, 8)
    longest = max(lengths)
    positions = torch.arange(longest)
    padded = torch.zeros(3, -(-longest // page), dtype=torch.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    pages = padded[:, positions // page]
    offsets = (positions % page).expand(3, -1)
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    batched = paged_decode_attention(q, k_cache, v_cache, pages, offsets, valid, 8**-0.5, window)
    for i, n in enumerate(lengths):
        alone = paged_attention(q[i : i + 1], k_cache, v_cache, tables[i], n, 8**-0.5, window)
        assert torch.allclose(batched[i], alone[0], atol=1e-6)


def test_decode_step_in_place_equals_the_recurrent_rule() -> None:
    q, k, v, g, beta = make_gdn_inputs(3, 1)
    start = torch.randn(3, 4, 16, 16)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, start)
    slots = torch.zeros(5, 4, 16, 16)  # a state pool; the sequences sit in slots 4, 0, 2
    for b, slot in enumerate((4, 0, 2)):
        slots[slot] = start[b]
    stepped = gated_delta_decode_step_(q, k, v, g, beta, [slots[4], slots[0], slots[2]])
    assert (stepped - out).abs().max() < 1e-6
    assert (slots[[4, 0, 2]] - state).abs().max() < 1e-6  # updated where they lie
    assert torch.equal(slots[1], torch.zeros(4, 16, 16)) and torch.equal(slots[3], torch.zeros(4, 16, 16))


def test_decode_conv_step_equals_the_convolution() -> None:
    x = torch.randn(2, 6, 9)
    w = torch.randn(6, 4)
    whole, _ = causal_conv1d(x, w, None)
    _, state = causal_conv1d(x[..., :8], w, None)
    step, _ = causal_conv1d(x[..., 8:], w, state)
    assert torch.allclose(step[..., 0], whole[..., 8], atol=1e-6)
