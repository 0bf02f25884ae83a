"""The CPU's in-place paged decode attention (kernels/cpu/paged_decode.c) against its torch
reference (kernels/paged_attention.py: paged_decode_attention), on K/V laid out as the engine's
DeviceCache holds them (strided views of one page-major pool, pages scattered and shuffled)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.device_cache import CacheGeometry, DeviceCache, StateShape
from kernels.cpu import paged_decode
from kernels.paged_attention import paged_decode_attention as reference
from kernels.paged_attention import positional
from kernels.select import cpu_kernels, kernels_for
from cpu_kernels import built_kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]
CPU = torch.device("cpu")
# Both sides read the same stored K/V and accumulate in fp32: only the summation order differs.
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def kernel() -> paged_decode.DecodeFn:
    return built_kernel(paged_decode.load)


def make_inputs(lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, page: int = 16,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [B, H, D] and a two-layer DeviceCache in `dtype` whose layer-1 K/V views the kernel reads;
    each sequence's pages are drawn shuffled from the pool; pages/offsets/valid [B, L] as
    engine/model/batch.py builds them (padding points at page 0)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // page) for n in lengths]
    num_pages = sum(needed) + 2
    cache = DeviceCache(StateShape((0, 1), kv_heads, dim), CacheGeometry(page, num_pages, 0, torch.float32, dtype), CPU)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    order = torch.randperm(num_pages, generator=g)
    longest = max(lengths)
    table = torch.zeros(len(lengths), max(needed), dtype=torch.int64)
    first = 0
    for i, n in enumerate(needed):
        table[i, :n] = order[first:first + n]
        first += n
    positions = torch.arange(longest)
    pages = table[:, positions // page]
    offsets = (positions % page).expand(len(lengths), -1)
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    q = torch.randn(len(lengths), heads, dim, generator=g)
    return q, cache.k_cache(1), cache.v_cache(1), pages, offsets, valid


def check(kernel: paged_decode.DecodeFn, lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
          page: int = 16, window: int | None = None) -> None:
    """Both forms of the kernel against the reference: positions [B, L], and each sequence's page
    table [B, W] with its length (the form a decode-only engine step passes)."""
    q, k, v, pages, offsets, valid = make_inputs(lengths, heads, kv_heads, dim, dtype, page)
    assert k.dtype == dtype and not k.is_contiguous()  # the pool's strided view, read in place
    scale = dim**-0.5
    ref = reference(q, k, v, pages, offsets, valid, scale, window)
    table, context = pages[:, ::page].contiguous(), torch.tensor(lengths)
    assert torch.equal(torch.stack(positional(table, context, page)), torch.stack((pages, offsets, valid)))
    tabled = built_kernel(paged_decode.load_from_table)
    for form, ours in (("positions", kernel(q, k, v, pages, offsets, valid, scale, window)),
                       ("table", tabled(q, k, v, table, context, page, scale, window))):
        assert ours.shape == ref.shape == q.shape and ours.dtype == q.dtype
        diff = (ours - ref).abs().max().item()
        assert diff < TOLERANCE, \
            f"{form}: lengths {lengths} H {heads} Hkv {kv_heads} D {dim} {dtype} window {window}: {diff:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("lengths", [[1], [16], [17], [1, 16, 17, 700], [2048, 5, 33]],
                         ids=["one-token", "a-page", "page+1", "ragged", "long"])
def test_ragged_lengths_match_reference(kernel: paged_decode.DecodeFn, lengths: list[int], dtype: torch.dtype) -> None:
    check(kernel, lengths, 8, 2, 128, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_gqa_ratios_and_head_dims(kernel: paged_decode.DecodeFn, group: int, dim: int, dtype: torch.dtype) -> None:
    check(kernel, [40, 3, 129], 2 * group, 2, dim, dtype)


@pytest.mark.parametrize("batch", [1, 2, 8, 64])
def test_batch_sizes(kernel: paged_decode.DecodeFn, batch: int) -> None:
    lengths = [1 + (37 * i) % 300 for i in range(batch)]
    check(kernel, lengths, 8, 2, 128, torch.bfloat16)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_page_sizes(kernel: paged_decode.DecodeFn, page: int) -> None:
    check(kernel, [1, 63, 64, 65, 200], 4, 2, 64, torch.float32, page=page)


@pytest.mark.parametrize("window", [1, 16, 100])
def test_sliding_window(kernel: paged_decode.DecodeFn, window: int) -> None:
    check(kernel, [1, 16, 50, 300], 8, 4, 64, torch.float16, window=window)


def test_head_dim_off_the_vector_width(kernel: paged_decode.DecodeFn) -> None:
    """A head dim that is no multiple of 16 takes the plain C loops (no AVX-512 path)."""
    check(kernel, [5, 70], 4, 2, 72, torch.bfloat16)
    check(kernel, [33], 2, 1, 8, torch.float32)


def test_bf16_queries_come_back_bf16(kernel: paged_decode.DecodeFn) -> None:
    """A bf16 model: q is upcast, the sums stay fp32 and the result is rounded once to q's dtype."""
    q, k, v, pages, offsets, valid = make_inputs([30, 200], 8, 2, 128, torch.bfloat16)
    ours = kernel(q.bfloat16(), k, v, pages, offsets, valid, 128**-0.5)
    exact = reference(q.bfloat16().float(), k, v, pages, offsets, valid, 128**-0.5)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - exact).abs().max().item() <= 2**-8 * exact.abs().max().item()


def test_shapes_it_does_not_take_run_the_reference(kernel: paged_decode.DecodeFn) -> None:
    q, k, v, pages, offsets, valid = make_inputs([20, 9], 128, 1, 64, torch.float32)  # 128 query heads per KV head
    assert not paged_decode.supports(q, k)
    expected = reference(q, k, v, pages, offsets, valid, 0.125)
    assert torch.equal(kernel(q, k, v, pages, offsets, valid, 0.125), expected)
    tabled = built_kernel(paged_decode.load_from_table)
    assert torch.equal(tabled(q, k, v, pages[:, ::16].contiguous(), torch.tensor([20, 9]), 16, 0.125), expected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12), kv_heads=st.integers(1, 4),
       group=st.sampled_from([1, 2, 3, 4, 8]), dim=st.sampled_from([16, 48, 64, 128, 256]),
       dtype=st.sampled_from(DTYPES), page=st.sampled_from([1, 8, 16, 32]),
       window=st.none() | st.integers(1, 64))
def test_random_shapes_match_reference(kernel: paged_decode.DecodeFn, lengths: list[int], kv_heads: int, group: int,
                                       dim: int, dtype: torch.dtype, page: int, window: int | None) -> None:
    check(kernel, lengths, kv_heads * group, kv_heads, dim, dtype, page, window)


def test_the_cpu_selects_it(kernel: paged_decode.DecodeFn) -> None:
    ops = kernels_for(CPU)
    assert ops.name == "cpu" and ops.decode_in_place
    assert isinstance(ops.paged_decode_attention, type(kernel)) and ops.paged_decode_from_table is not None


def test_a_missing_library_falls_back_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ignis.engine"):
        assert paged_decode.load(tmp_path / "absent.so") is None
    assert "decode attention runs the torch reference" in caplog.text


def test_reference_kernels_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IGNIS_CPU_KERNELS", "reference")
    ops = cpu_kernels()
    assert ops.name == "torch" and not ops.decode_in_place and ops.paged_decode_attention is reference
    assert ops.paged_decode_from_table is None  # so decode batches hold the [B, L] form the reference takes


def test_the_bench_runs_both_kernels_in_each_dtype(kernel: paged_decode.DecodeFn, tmp_path: Path) -> None:
    """bench/decode_attention.py on a small geometry: a row per batch and KV dtype, both kernels timed,
    the CPU's kernels left as they were."""
    import json

    from bench import decode_attention

    argv = ["--hidden", "256", "--layers", "2", "--context", "40", "--batch", "3", "--repeats", "1", "--steps", "1",
            "--threads", str(torch.get_num_threads()), "--models", str(tmp_path / "models"), "--out", str(tmp_path)]
    assert decode_attention.main(argv) == 0
    rows = json.loads((tmp_path / "decode-attention.json").read_text())["rows"]
    assert [(r["batch"], r["kv_dtype"]) for r in rows] == [(b, d) for b in (1, 3) for d in ("float32", "bfloat16",
                                                                                             "float16")]
    assert all(r["attention_native_ms"] > 0 and r["forward_reference_fp32_ms"] > 0 for r in rows)
    assert "| 3 | fp16 |" in (tmp_path / "decode-attention.md").read_text()
    assert kernels_for(CPU).decode_in_place
