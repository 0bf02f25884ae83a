"""The CPU's rotary embedding + KV-cache write (kernels/cpu/rope_cache.c) against the torch ops it
stands for in engine/model/attention.py (Rotary.apply on q and k, k and v written at each token's
page and offset with .to(cache dtype)), in each KV dtype, with partial rotary, on q/k/v viewed
inside a fused projection's output; then that every attention layer of a model takes it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.cpu import rope_cache
from kernels.select import kernels_for
from cpu_kernels import built_kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernel() -> rope_cache.RopeCache:
    return built_kernel(rope_cache.load)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary.apply (engine/model/layers.py), written out for a [T, H, D] x and [T, R] tables."""
    r = cos.shape[-1]
    rot, keep = x[..., :r], x[..., r:]
    rotated = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
    return torch.cat([rot * cos[:, None, :] + rotated * sin[:, None, :], keep], dim=-1)


def check(kernel: rope_cache.RopeCache, t: int, heads: int, kv_heads: int, dim: int, rotary: int,
          dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(t, (heads + 2 * kv_heads) * dim + 3, generator=g)  # +3: rows wider than q|k|v
    q, k, v = fused[:, :-3].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)
    angles = torch.rand(t, rotary // 2, generator=g) * 6
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    page = 4
    num_pages = t // page + 2
    pool = torch.randn(num_pages, 2, 2, page, kv_heads, dim, generator=g).to(dtype)  # [pages, layers, k|v, P, H, D]
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # strided views, as DeviceCache hands them out
    slots = torch.randperm(num_pages * page, generator=g)[:t]
    pages, offsets = (slots // page).contiguous(), (slots % page).contiguous()

    want = pool.clone()
    want[:, 1, 0][pages, offsets] = rope(k, cos, sin).to(dtype)
    want[:, 1, 1][pages, offsets] = v.to(dtype)
    got = kernel(q, k, v, cos, sin, k_cache, v_cache, pages, offsets)
    assert got is not None and got.shape == (t, heads, dim) and got.is_contiguous()
    torch.testing.assert_close(got, rope(q, cos, sin), rtol=1e-6, atol=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(pool, want, rtol=1e-6, atol=1e-6)
    else:  # rounded to nearest even as .to() does: equal but where an fp32 ulp flipped a tie
        assert (pool.float() - want.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * 8
        assert (pool != want).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t, heads, kv_heads, dim, rotary", [(1, 8, 2, 128, 128), (5, 4, 4, 64, 32),
                                                             (300, 2, 1, 16, 16)])
def test_matches_the_torch_ops(kernel: rope_cache.RopeCache, dtype: torch.dtype, t: int, heads: int, kv_heads: int,
                               dim: int, rotary: int) -> None:
    check(kernel, t, heads, kv_heads, dim, rotary, dtype, seed=t + dim)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.integers(1, 12), kv_heads=st.integers(1, 3), group=st.integers(1, 3), dim=st.integers(1, 40),
       fraction=st.sampled_from([1.0, 0.5, 0.25]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_random_shapes(kernel: rope_cache.RopeCache, t: int, kv_heads: int, group: int, dim: int, fraction: float,
                       dtype: torch.dtype, seed: int) -> None:
    rotary = int(dim * fraction) // 2 * 2
    check(kernel, t, kv_heads * group, kv_heads, dim, rotary, dtype, seed)


def test_what_it_does_not_take_writes_nothing(kernel: rope_cache.RopeCache) -> None:
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos = sin = torch.ones(2, 8)
    cache = torch.zeros(3, 4, 1, 8)
    pages = offsets = torch.zeros(2, dtype=torch.int64)
    assert kernel(q.double(), k, k, cos, sin, cache, cache.clone(), pages, offsets) is None  # fp64 q
    assert kernel(q, k, k, torch.ones(2, 7), torch.ones(2, 7), cache, cache.clone(), pages, offsets) is None  # odd R
    assert kernel(q, k, k, cos, sin, cache, cache.clone(), pages.int(), offsets.int()) is None  # int32 slots
    assert torch.equal(cache, torch.zeros(3, 4, 1, 8))


def test_a_slot_outside_the_cache_raises_and_writes_nothing(kernel: rope_cache.RopeCache) -> None:
    """As the torch reference's index_put: an IndexError, and no token's K/V written (memory outside
    the pool is never touched)."""
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos = sin = torch.ones(2, 8)
    cache = torch.zeros(3, 4, 1, 8)
    for pages, offsets in (([0, 3], [0, 0]), ([0, 1], [0, 4]), ([-1, 0], [0, 0])):
        with pytest.raises(IndexError):
            kernel(q, k, k, cos, sin, cache, cache, torch.tensor(pages), torch.tensor(offsets))
        assert torch.equal(cache, torch.zeros(3, 4, 1, 8))


def test_a_missing_library_loads_as_none(tmp_path: Path) -> None:
    assert rope_cache.load(tmp_path / "absent.so") is None


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_every_attention_layer_takes_it(kernel: rope_cache.RopeCache, checkpoint_dir: Callable[[str], Path],
                                        monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Prefill and decode through the model: the kernel runs (not its fallback) in every attention
    layer, and the logits equal those of the torch ops."""
    from engine.model import attention
    from engine.model.loader import load_model
    from test_model import make_cache, make_prompt, run_chunks

    table = kernels_for(torch.device("cpu"))
    assert table.rope_and_cache is not None
    loaded = load_model(checkpoint_dir(arch), onednn_linears=True)
    ids, pages = make_prompt(40, seed=5), list(range(4))
    taken: list[bool] = []

    def counted(*args: torch.Tensor) -> torch.Tensor | None:
        out = kernel(*args)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(attention, "kernels_for", lambda device: dataclasses.replace(table, rope_and_cache=counted))
    native = run_chunks(loaded, make_cache(loaded), ids, [30] + [1] * 10, pages)
    layers = sum(1 for m in loaded.model.modules() if isinstance(m, attention.Attention))
    assert taken == [True] * (11 * layers)
    monkeypatch.setattr(attention, "kernels_for", lambda device: dataclasses.replace(table, rope_and_cache=None))
    torch_ops = run_chunks(loaded, make_cache(loaded), ids, [30] + [1] * 10, pages)
    assert (native - torch_ops).abs().max().item() < 1e-4
