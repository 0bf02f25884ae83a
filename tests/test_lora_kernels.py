"""The batched multi-adapter LoRA product: the torch reference (kernels/lora.py) against a float64 loop
written here from the definition, and the Triton kernels (kernels/triton_lora.py) against the reference.

As in tests/test_moe_gemm.py, the Triton cases run on a CPU in Triton's interpreter, in a child pytest
that imports Triton under TRITON_INTERPRET=1 (test_interpreted_cases); on CUDA the `cuda` cases run the
compiled kernels in this process. Run the child's cases directly with
`TRITON_INTERPRET=1 pytest tests/test_lora_kernels.py`. Shapes are small (the interpreter pays per
program): in x out of 40 x 72 (no tile divides them), S = 3 slots of R = 16 with slot 1 of real rank 8
(zero padding), slots mixing -1, 0, 1 and 2, and b a view of the first 3 slots of a [out, 5, R] buffer
whose other slots are NaN (a kernel ignoring b's strides, or reading a row's wrong slot, shows).

Tolerances: the kernels compute the reference's arithmetic (float32 products and sums, rounded once)
in another summation order, so fp32 agrees to 1e-5; in 16-bit the output's rounding (an ulp at
|delta| ~ 2-4) sets 1.6e-2 (bf16) and 2e-3 (fp16), as for the other kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from kernels import lora
from triton_harness import (INTERPRETED, Target, compile_only_for_hopper, compiled_in_a_child,  # noqa: F401
                            run_interpreted_child, target)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
ROWS = [pytest.param(1, id="T1"), pytest.param(5, id="T5"), pytest.param(33, id="T33")]
SLOT_CYCLE = [2, -1, 0, 1, 2, 0, -1]  # T=1 takes slot 2, T=5 every slot and a row without an adapter
parent_only = pytest.mark.skipif(INTERPRETED, reason="the parent run checks this")


class Lora(NamedTuple):
    x: torch.Tensor  # [T, in]
    a: torch.Tensor  # [S, R, in]
    b: torch.Tensor  # [out, S, R]: a view of the first S slots of [out, S_max, R]
    slots: torch.Tensor  # int64 [T], -1 = no adapter

    def to(self, device: torch.device) -> Lora:
        # b stays a view of the first S slots of a NaN buffer as wide as its own (.to() may copy it dense).
        n_out, s, rank = self.b.shape
        big_b = torch.full((n_out, self.b.stride(0) // rank, rank), float("nan"), dtype=self.b.dtype, device=device)
        big_b[:, :s] = self.b
        return Lora(self.x.to(device), self.a.to(device), big_b[:, :s], self.slots.to(device))


def make_lora(t: int, dtype: torch.dtype, seed: int, hidden: int = 40, n_out: int = 72, s: int = 3,
              rank: int = 16, s_max: int = 5, weight_dtype: torch.dtype | None = None) -> Lora:
    """Random adapters (deltas ~1) in S of s_max slots, slot 1 of real rank rank // 2; the unused
    slots of b's buffer are NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    a = torch.randn(s, rank, hidden, generator=g) * hidden**-0.5
    big_b = torch.full((n_out, s_max, rank), float("nan"))
    big_b[:, :s] = torch.randn(n_out, s, rank, generator=g) * rank**-0.5
    a[1, rank // 2:] = 0  # slot 1's rank padded with zero rows of A (and zero columns of B)
    big_b[:, 1, rank // 2:] = 0
    slots = torch.tensor(SLOT_CYCLE * (t // len(SLOT_CYCLE) + 1))[:t]
    wd = dtype if weight_dtype is None else weight_dtype
    return Lora(x.to(dtype), a.to(wd), big_b.to(wd)[:, :s], slots)


def oracle(case: Lora) -> torch.Tensor:
    """Row by row in float64 from the definition: delta[t] = b[:, s, :] @ (a[s] @ x[t]), zero where s == -1."""
    x, a, b, slots = case
    delta = torch.zeros(x.shape[0], b.shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s >= 0:
            delta[t] = b[:, s, :].double() @ (a[s].double() @ x[t].double())
    return delta


# --- the reference -----------------------------------------------------------------------------------

@parent_only
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("dtype", [*DTYPES, pytest.param(torch.float16, id="fp16")])
def test_the_reference_is_the_float64_oracle(dtype: torch.dtype, t: int) -> None:
    case = make_lora(t, dtype, seed=t)
    assert not case.b.is_contiguous()
    got = lora.lora_delta_reference(*case)
    assert got.shape == (t, 72) and got.dtype == dtype
    want = oracle(case)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert (got[case.slots == -1] == 0).all()


@parent_only
def test_the_reference_takes_int32_slots_no_rows_and_no_adapters() -> None:
    case = make_lora(5, torch.float32, seed=1)
    torch.testing.assert_close(lora.lora_delta_reference(*case._replace(slots=case.slots.int())),
                               lora.lora_delta_reference(*case), atol=0, rtol=0)
    assert lora.lora_delta_reference(*case._replace(x=case.x[:0], slots=case.slots[:0])).shape == (0, 72)
    none = case._replace(a=case.a[:0], b=case.b[:, :0], slots=torch.full((5,), -1))  # S = 0: nothing resident
    assert torch.equal(lora.lora_delta_reference(*none), torch.zeros(5, 72))


@parent_only
def test_wrong_operands_are_named() -> None:
    x, a, b, slots = make_lora(5, torch.float32, seed=0)
    for args, words in (((x[None], a, b, slots), "x must be \\[T, in\\]"),
                        ((x, a[:, :, :8], b, slots), "a must be \\[3, 16, 40\\]"),
                        ((x, a, b[:, :2], slots), "b \\[out, 3, 16\\]"),
                        ((x, a, b[:, :, :8], slots), "b \\[out, 3, 16\\]"),
                        ((x, a.int(), b, slots), "must be floating"),
                        ((x, a, b, slots.float()), "slots must be int64 or int32 \\[T=5\\]"),
                        ((x, a, b, slots[:4]), "slots must be")):
        with pytest.raises(ValueError, match=words):
            lora.lora_delta_reference(*args)


# --- the Triton kernels ------------------------------------------------------------------------------

@parent_only
def test_interpreted_cases() -> None:
    """Every `interpret` case, in a child pytest that imports Triton under TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)


def check_kernel(target: Target, case: Lora) -> torch.Tensor:
    """The kernel's result on target's device, asserted against the reference (on the CPU)."""
    assert target.ops.lora_delta is not None
    got = target.ops.lora_delta(*case.to(target.device))
    assert got is not None  # the Triton kernel takes every layout
    dtype = case.x.dtype
    assert got.shape == (case.x.shape[0], case.b.shape[0]) and got.dtype == dtype
    assert got.device.type == target.device.type
    want = lora.lora_delta_reference(*case)
    torch.testing.assert_close(got.cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert (got.cpu()[case.slots == -1] == 0).all()
    return got


@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_matches_the_reference(target: Target, dtype: torch.dtype, t: int) -> None:
    case = make_lora(t, dtype, seed=t)
    assert case.b.stride() == (5 * 16, 16, 1)
    check_kernel(target, case)


def test_the_kernel_takes_the_operands_the_engine_passes(target: Target) -> None:
    """int32 slots, x's rows picked out of a wider tensor (its other columns NaN), fp32 adapters under
    fp16 rows, a rank that is not a power of two, no rows, and no adapter resident."""
    case = make_lora(9, torch.float16, seed=4, rank=12, weight_dtype=torch.float32)
    wide = torch.cat([case.x, torch.full((9, 8), float("nan"), dtype=torch.float16)], dim=1)
    strided = case._replace(x=wide[:, :40], slots=case.slots.int())
    assert strided.x.stride(0) == 48
    check_kernel(target, strided)
    assert target.ops.lora_delta is not None
    empty = target.ops.lora_delta(*case._replace(x=case.x[:0], slots=case.slots[:0]).to(target.device))
    assert empty is not None
    assert empty.shape == (0, 72) and empty.dtype == torch.float16
    none = case._replace(a=case.a[:0], b=case.b[:, :0], slots=torch.full((9,), -1))
    got = target.ops.lora_delta(*none.to(target.device))
    assert got is not None
    assert torch.equal(got.cpu(), torch.zeros(9, 72, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_over_several_blocks_of_every_side(target: Target, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's tiles cover a case in one block a side; these small ones make every loop and
    grid side take several partial blocks: R=12 in blocks of 8 (two shrink programs a row, two expand
    turns), in=40 in steps of 16 and out=72 in blocks of 16."""
    from kernels import triton_lora

    monkeypatch.setattr(triton_lora, "tiles", lambda rank, hidden, n_out, device: triton_lora.Tiles(8, 16, 16))
    check_kernel(target, make_lora(5, dtype, seed=6, rank=12))


# --- compiled for the GPU, without one -----------------------------------------------------------------

def compile_for_hopper() -> dict[str, int]:
    """Compile (never launch) both kernels for sm_90 through the wrapper (tests/triton_harness.py's way)
    at a 4096-wide projection with 8 slots: decode (T=8) and a prefill chunk (T=512) in bf16 at R=16,
    and fp32 at R=64 (blocks of 32 ranks). Returns each compiled kernel's shared memory in bytes."""
    from kernels import triton_lora, triton_support

    compiled = compile_only_for_hopper(triton_lora, triton_support)
    hidden, n_out, s = 4096, 4096, 8
    for t, rank, dtype in ((8, 16, torch.bfloat16), (512, 16, torch.bfloat16), (512, 64, torch.float32)):
        a = torch.empty(s, rank, hidden, dtype=dtype)  # never touched: nothing runs
        b = torch.empty(n_out, 2 * s, rank, dtype=dtype)[:, :s]
        triton_lora.lora_delta(torch.zeros(t, hidden, dtype=dtype), a, b, torch.zeros(t, dtype=torch.long))
    return compiled


@parent_only
def test_the_kernels_compile_for_hopper_within_their_shared_memory() -> None:
    pytest.importorskip("triton")
    shared = compiled_in_a_child("test_lora_kernels")
    assert len(shared) == 6 and {name.split("/")[0] for name in shared} == {"_shrink_kernel", "_expand_kernel"}, shared
