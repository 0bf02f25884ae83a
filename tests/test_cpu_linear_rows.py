"""The CPU's linear layer at decode row counts (kernels/cpu/linear_rows.c) against its oracle, F.linear
in float64 (kernels/cpu/linear_rows.py's `reference`; bf16: rows and outputs rounded to bf16, as
oneDNN's bf16 inner product): fp32 and bf16 weights, 1-20 rows (passes of
8 beyond 8), several segments with and without biases, `in` not a multiple of the vector width,
strided rows; the same on a portable build (what an AVX2-only CPU compiles), built here with gcc."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_kernels import build_for, built_kernel
from kernels.cpu import linear_rows
from kernels.cpu.linear_rows import RowWeights, reference

# fp32 sums over `in` in another order than float64's: ~1e-6 relative to the dot products' size.
TOLERANCE = 1e-4
# bf16: the outputs are rounded to bf16 on both sides; an fp32 sum next to a rounding boundary may land
# one bf16 ulp (2^-8 relative) the other way.
BF16_RTOL = 2**-7


@pytest.fixture(scope="module")
def kernel() -> linear_rows.LinearRows:
    return built_kernel(linear_rows.load)


BUILDS = {"avx2": ["-march=x86-64-v3"],  # an AVX2-only CPU: the AVX2 form
          "avx512f-only": ["-march=x86-64-v3", "-mavx512f"],  # AVX512F without BW/VL (Knights Landing): AVX2 form
          "portable": ["-march=x86-64"]}  # SSE2 only: the plain C form


@pytest.fixture(scope="module", params=sorted(BUILDS))
def portable(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> linear_rows.LinearRows:
    """The kernel as another CPU's `make kernels` builds it (gcc here, for each of BUILDS)."""
    fn = linear_rows.load(build_for("linear_rows.c", BUILDS[request.param], tmp_path_factory.mktemp(request.param)))
    assert fn is not None
    return fn


def weights(outs: list[int], inner: int, dtype: torch.dtype, bias: list[bool], seed: int) -> RowWeights:
    g = torch.Generator().manual_seed(seed)
    return RowWeights.of([torch.randn(o, inner, generator=g).to(dtype) for o in outs],
                         [torch.randn(o, generator=g) if b else None for o, b in zip(outs, bias)])


def check(fn: linear_rows.LinearRows, w: RowWeights, x: torch.Tensor) -> None:
    y = fn(x, w)
    assert y.shape == (*x.shape[:-1], w.out_features) and y.dtype == torch.float32
    rtol = BF16_RTOL if w.dtype == torch.bfloat16 else TOLERANCE
    torch.testing.assert_close(y, reference(x, w), rtol=rtol, atol=TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 20])
def test_rows_against_float64(kernel: linear_rows.LinearRows, dtype: torch.dtype, rows: int) -> None:
    # Three segments of widths that leave partial tiles, `in` with a tail of 13 past the 16-wide vectors.
    w = weights([37, 6, 128], 125, dtype, [True, False, True], seed=rows)
    check(kernel, w, torch.randn(rows, 125, generator=torch.Generator().manual_seed(100 + rows)))


def test_a_model_sized_linear(kernel: linear_rows.LinearRows) -> None:
    """Big enough that the rows split over the threads and the prefetch runs past the last tile."""
    for dtype in (torch.float32, torch.bfloat16):
        w = weights([1536, 512], 1024, dtype, [False, False], seed=3)
        check(kernel, w, torch.randn(8, 1024, generator=torch.Generator().manual_seed(4)))


def test_strided_and_batched_rows(kernel: linear_rows.LinearRows) -> None:
    w = weights([40], 64, torch.float32, [True], seed=5)
    wide = torch.randn(6, 100, generator=torch.Generator().manual_seed(6))
    check(kernel, w, wide[:, 10:74])  # rows 100 floats apart
    check(kernel, w, torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(7)))  # [B, T, in]
    check(kernel, w, torch.randn(0, 64))  # no rows: an empty result, no call into C past the checks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_portable_build(portable: linear_rows.LinearRows, dtype: torch.dtype) -> None:
    for rows in (1, 5, 8, 11):
        w = weights([37, 70], 99, dtype, [True, False], seed=rows)
        check(portable, w, torch.randn(rows, 99, generator=torch.Generator().manual_seed(rows)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(outs=st.lists(st.integers(1, 40), min_size=1, max_size=8), inner=st.integers(1, 70),
       rows=st.integers(1, 12), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_fuzzed_shapes(kernel: linear_rows.LinearRows, outs: list[int], inner: int, rows: int, bf16: bool,
                       seed: int) -> None:
    w = weights(outs, inner, torch.bfloat16 if bf16 else torch.float32, [i % 2 == 0 for i in range(len(outs))], seed)
    check(kernel, w, torch.randn(rows, inner, generator=torch.Generator().manual_seed(seed)))


def test_nan_and_inf_rows_stay_what_they_are(kernel: linear_rows.LinearRows) -> None:
    """bf16 rounding keeps a NaN a NaN, whatever its payload (one only in the low 16 bits included)."""
    for payload in (0x7F800001, 0x7FC00000, -0x00400000):
        x = torch.ones(1, 4)
        x.view(torch.int32)[0, 0] = payload
        for dtype in (torch.float32, torch.bfloat16):
            y = kernel(x, RowWeights.of([torch.ones(2, 4).to(dtype)], [None]))
            assert torch.isnan(y).all(), (hex(payload), dtype, y)
    x = torch.tensor([[float("inf"), 1.0, 1.0, 1.0]])
    assert torch.equal(kernel(x, RowWeights.of([torch.ones(2, 4).bfloat16()], [None])), torch.full((1, 2), float("inf")))


def test_expanded_rows(kernel: linear_rows.LinearRows) -> None:
    """Rows that share memory (an expand: row stride 0) are copied apart first, as oneDNN's path does."""
    w = weights([9], 20, torch.float32, [True], seed=8)
    check(kernel, w, torch.randn(1, 20, generator=torch.Generator().manual_seed(9)).expand(3, 20))


def test_bad_operands_are_refused() -> None:
    f32 = torch.randn(4, 8)
    with pytest.raises(ValueError, match="all be float32 or all bfloat16"):
        RowWeights.of([f32, f32.bfloat16()], [None, None])
    with pytest.raises(ValueError, match="one `in`"):
        RowWeights.of([f32, torch.randn(4, 9)], [None, None])
    with pytest.raises(ValueError, match="contiguous"):
        RowWeights.of([f32.t()], [None])
    with pytest.raises(ValueError, match="bias"):
        RowWeights.of([f32], [torch.randn(5)])
    with pytest.raises(ValueError, match="1-8 weights"):
        RowWeights.of([f32] * 9, [None] * 9)


def test_bad_rows_are_refused(kernel: linear_rows.LinearRows) -> None:
    w = weights([4], 8, torch.float32, [False], seed=0)
    with pytest.raises(ValueError, match="fp32 CPU rows of 8"):
        kernel(torch.randn(2, 9), w)
    with pytest.raises(ValueError, match="fp32 CPU rows of 8"):
        kernel(torch.randn(2, 8, dtype=torch.float64), w)
