"""The MoE experts' grouped GEMM: the torch reference (kernels/moe_gemm.py) against a float64 oracle
and the CPU's grouped experts, the alignment by expert, and the Triton kernel
(kernels/triton_moe_gemm.py) against the reference, and the layer's choice of path.

As in tests/test_fp8_gemm.py, the Triton cases run on a CPU in Triton's interpreter, in a child
pytest that imports Triton under TRITON_INTERPRET=1 (test_interpreted_cases); on CUDA the `cuda`
cases run the compiled kernel in this process. Run the child's cases directly with
`TRITON_INTERPRET=1 pytest tests/test_moe_gemm.py`. Shapes are small (the interpreter pays per
program): H x I of 48 x 40 (neither a power of two, so every tile is partial) and 64 x 32.

Tolerances: the kernel computes the reference's arithmetic (fp32 products and sums, h rounded to
x's dtype) in another summation order, so fp32 agrees to 1e-4 (seen: 1e-6); in bf16 the output's
rounding (an ulp at |y| ~ 2-4 where h rounds the other way) sets 1.6e-2, as for the other kernels.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import engine.model.layers as layers
from engine.model.layers import Experts
from kernels import moe_gemm
from kernels.select import torch_kernels
from triton_harness import (INTERPRETED, Target, compile_only_for_hopper, compiled_in_a_child,  # noqa: F401
                            run_interpreted_child, target)

TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (T, E, K, H, I): decode (one token), a few tokens, and 37 tokens (74 pairs on 4 experts: some
# expert gets more than one block of 16 rows).
CASES = [pytest.param((1, 4, 1, 48, 40), id="T1-E4-K1-H48-I40"),
         pytest.param((1, 8, 2, 64, 32), id="T1-E8-K2-H64-I32"),
         pytest.param((3, 8, 1, 64, 32), id="T3-E8-K1-H64-I32"),
         pytest.param((3, 4, 2, 48, 40), id="T3-E4-K2-H48-I40"),
         pytest.param((37, 8, 1, 48, 40), id="T37-E8-K1-H48-I40"),
         pytest.param((37, 4, 2, 64, 32), id="T37-E4-K2-H64-I32")]
parent_only = pytest.mark.skipif(INTERPRETED, reason="the parent run checks this")


class Moe(NamedTuple):
    x: torch.Tensor  # [T, H]
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    expert_ids: torch.Tensor  # int64 [T, K]
    weights: torch.Tensor  # [T, K]

    def to(self, device: torch.device) -> Moe:
        return Moe(*(t.to(device) for t in self))


def make_moe(t: int, e: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
             expert_ids: torch.Tensor | None = None) -> Moe:
    """Random experts (outputs ~1-3) and a top-k routing: distinct experts per token unless given."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(e, hidden, inter, generator=g) * inter**-0.5
    top_w, top_ids = torch.rand(t, e, generator=g).softmax(-1).topk(k, dim=-1)
    ids = top_ids if expert_ids is None else expert_ids
    return Moe(x.to(dtype), gate_up.to(dtype), down.to(dtype), ids, (top_w / top_w.sum(-1, keepdim=True)).to(dtype))


def oracle(moe: Moe) -> torch.Tensor:
    """Pair by pair in float64 (not the reference's code), h rounded to x's dtype as documented."""
    x, gate_up, down, ids, w = moe
    inter = down.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = gate_up[e].double() @ x[t].double()
            h = (F.silu(gu[:inter]) * gu[inter:]).to(x.dtype).double()
            y[t] += w[t, k].double() * (down[e].double() @ h)
    return y


# --- the reference and the alignment ----------------------------------------------------------------

@parent_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_is_the_float64_oracle(dtype: torch.dtype, case: tuple[int, int, int, int, int]) -> None:
    moe = make_moe(*case, dtype=dtype, seed=sum(case))
    got = moe_gemm.moe_experts_reference(*moe)
    assert got.shape == moe.x.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.double(), oracle(moe), atol=tol, rtol=tol)


@parent_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_equals_the_cpu_grouped_experts(dtype: torch.dtype) -> None:
    """engine/model/layers.py's Experts.grouped (torch._grouped_mm, what the CPU serves) is the same
    function: to fp32 summation order in fp32; in bf16 it rounds gate, up, silu and each weighted row
    to bf16 on the way, hence 3e-2."""
    t, e, k, hidden, inter = 37, 8, 2, 48, 40
    moe = make_moe(t, e, k, hidden, inter, dtype, seed=3)
    experts = Experts(e, hidden, inter).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(moe.gate_up)
        experts.down_proj.copy_(moe.down)
        grouped = experts.grouped(moe.x, moe.expert_ids, moe.weights)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(grouped.float(), moe_gemm.moe_experts_reference(*moe).float(), atol=tol, rtol=tol)


@parent_only
def test_align_by_expert_pads_each_expert_to_whole_blocks() -> None:
    # pairs 0..5 go to experts 2 0 | 2 3 | 0 2: expert 0 has pairs 1 4, expert 2 has 0 2 5, expert 3 has 3
    aligned = moe_gemm.align_by_expert(torch.tensor([[2, 0], [2, 3], [0, 2]]), num_experts=5, block_m=4)
    assert moe_gemm.max_blocks(6, 5, 4) == 6  # ceil((6 + 5 * 3) / 4): the grid's bound, not what is used
    assert aligned.pair_ids.tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6] + [6] * 12  # 6: padding
    assert aligned.block_expert.tolist() == [0, 2, 3, 5, 5, 5]  # 5: past the end
    assert aligned.padded_len.tolist() == [12]
    assert {t.dtype for t in aligned} == {torch.int32}


@parent_only
@pytest.mark.parametrize("t,e,k,block_m", [(1, 128, 8, 16), (37, 8, 2, 16), (300, 4, 2, 64), (5, 3, 3, 16)])
def test_every_pair_lands_once_in_a_block_of_its_expert(t: int, e: int, k: int, block_m: int) -> None:
    ids = torch.rand(t, e, generator=torch.Generator().manual_seed(t)).topk(k, dim=-1).indices
    aligned = moe_gemm.align_by_expert(ids, e, block_m)
    used = int(aligned.padded_len)
    rows = aligned.pair_ids.view(-1, block_m)
    assert rows.shape[0] == moe_gemm.max_blocks(t * k, e, block_m) and used % block_m == 0
    assert sorted(p for p in aligned.pair_ids[:used].tolist() if p < t * k) == list(range(t * k))
    assert (aligned.pair_ids[used:] == t * k).all() and (aligned.block_expert[used // block_m:] == e).all()
    flat = ids.flatten()
    for b in range(used // block_m):
        pairs = rows[b][rows[b] < t * k].long()
        assert len(pairs) and (flat[pairs] == aligned.block_expert[b]).all()  # no block is all padding
        assert torch.equal(pairs, pairs.sort().values)  # pair order within an expert


@parent_only
def test_wrong_operands_are_named() -> None:
    x, gate_up, down, ids, w = make_moe(3, 4, 2, 48, 40, torch.float32, seed=0)
    for args, words in (((x[None], gate_up, down, ids, w), "x must be \\[T, H\\]"),
                        ((x, gate_up[:, :10], down, ids, w), "gate_up must be \\[4, 80, 48\\]"),
                        ((x, gate_up.double(), down, ids, w), "share one floating dtype"),
                        ((x, gate_up, down, ids.float(), w), "expert_ids must be int64 or int32 \\[T=3, K\\]"),
                        ((x, gate_up, down, ids[:2], w), "expert_ids must be"),
                        ((x, gate_up, down, ids, w[:, :1]), "weights must be floating \\[3, 2\\]")):
        with pytest.raises(ValueError, match=words):
            moe_gemm.moe_experts_reference(*args)


# --- the Triton kernel ------------------------------------------------------------------------------

@parent_only
def test_interpreted_cases() -> None:
    """Every `interpret` case, in a child pytest that imports Triton under TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)


def check_kernel(target: Target, moe: Moe) -> torch.Tensor:
    """The kernel's result on target's device, asserted against the reference (on the CPU)."""
    assert target.ops.moe_experts is not None
    got = target.ops.moe_experts(*moe.to(target.device))
    dtype = moe.x.dtype
    assert got.shape == moe.x.shape and got.dtype == dtype and got.device.type == target.device.type
    want = moe_gemm.moe_experts_reference(*moe)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return got


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_matches_the_reference(target: Target, dtype: torch.dtype,
                                          case: tuple[int, int, int, int, int]) -> None:
    check_kernel(target, make_moe(*case, dtype=dtype, seed=sum(case)))


@pytest.mark.parametrize("routing", ["all-on-one-expert", "two-experts-for-all", "first-and-last-expert"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_with_no_tokens_and_experts_with_many(target: Target, dtype: torch.dtype, routing: str) -> None:
    """37 tokens on 8 experts, most of them with no pair: one expert's 37 pairs take three blocks."""
    t = 37
    ids = {"all-on-one-expert": torch.full((t, 1), 5),
           "two-experts-for-all": torch.tensor([[6, 1], [1, 6]]).repeat(19, 1)[:t],
           "first-and-last-expert": torch.tensor([[0, 7]]).repeat(t, 1)}[routing]
    check_kernel(target, make_moe(t, 8, ids.shape[1], 48, 40, dtype, seed=7, expert_ids=ids))


def test_the_kernel_takes_the_rows_the_engine_passes(target: Target) -> None:
    """x's rows picked out of a wider tensor (strided), int32 expert ids, routing weights in another
    layout, and no tokens at all."""
    moe = make_moe(5, 4, 2, 48, 40, torch.float32, seed=11)
    wide = torch.cat([moe.x, torch.full((5, 16), float("nan"))], dim=1)  # a kernel reading past H would show
    strided = moe._replace(x=wide[:, :48], expert_ids=moe.expert_ids.int(), weights=moe.weights.T.contiguous().T)
    assert strided.x.stride(0) == 64 and not strided.weights.is_contiguous()
    check_kernel(target, strided)
    assert target.ops.moe_experts is not None
    empty = target.ops.moe_experts(*moe._replace(x=moe.x[:0], expert_ids=moe.expert_ids[:0],
                                                 weights=moe.weights[:0]).to(target.device))
    assert empty.shape == (0, 48)


@pytest.mark.parametrize("t,dtype", [(1, torch.bfloat16), (37, torch.bfloat16), (37, torch.float32)])
def test_the_kernel_on_the_tiles_the_gpu_takes(target: Target, t: int, dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's tiles cover a case with a few programs; these are the GPU's: blocks of 16 rows
    at decode (32 columns: too few programs for 132 SMs at 64) and of 64 for 74 pairs on 4 experts,
    several columns blocks and a K loop of several partial steps (H=160, I=96)."""
    from kernels import triton_moe_gemm

    monkeypatch.setattr(triton_moe_gemm, "interpreting", lambda device: False)  # the tiles only: dots stay upcast
    monkeypatch.setattr(triton_moe_gemm, "_multiprocessors", lambda device: 132)
    moe = make_moe(t, 4, 2, 160, 96, dtype, seed=t)
    x = moe.x.to(target.device)
    block_m = triton_moe_gemm.block_m_for(2 * t, 4, x)
    assert block_m == (16 if t == 1 else 64)
    wide = dtype == torch.bfloat16
    want_tiles = (32, 128 if wide else 64) if t == 1 else (64, 64 if wide else 32)
    assert triton_moe_gemm.tiles(96, 160, block_m, moe_gemm.max_blocks(2 * t, 4, block_m), x)[:2] == want_tiles
    check_kernel(target, moe)


# --- the layer's choice of path ----------------------------------------------------------------------

@parent_only
def test_the_experts_run_the_grouped_kernel_where_the_device_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU, Experts.forward calls the device's moe_experts kernel (Triton on CUDA) with its own
    weights, and loops over experts only where there is none (CUDA without Triton). Shown on the meta
    device, which runs no arithmetic."""
    experts = Experts(4, 8, 6).to("meta")
    x = torch.zeros(3, 8, device="meta")
    ids, w = torch.zeros(3, 2, dtype=torch.long, device="meta"), torch.zeros(3, 2, device="meta")
    calls: list[tuple[object, ...]] = []

    def kernel(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
        calls.append((x, gate_up, down, expert_ids, weights))
        return x

    def loop(self: Experts, *args: torch.Tensor) -> torch.Tensor:
        calls.append(("loop",))
        return args[0]

    monkeypatch.setattr(Experts, "per_expert", loop)
    with_kernel = dataclasses.replace(torch_kernels(), moe_experts=kernel)
    monkeypatch.setattr(layers, "kernels_for", lambda device: with_kernel)
    experts(x, ids, w)
    assert len(calls) == 1 and all(got is want for got, want in
                                   zip(calls[0], (x, experts.gate_up_proj, experts.down_proj, ids, w), strict=True))
    monkeypatch.setattr(layers, "kernels_for", lambda device: torch_kernels())  # no kernel: the loop
    experts(x, ids, w)
    assert calls[-1] == ("loop",)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_experts_on_cuda_run_a_grouped_gemm_never_the_loop(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")

    def no_loop(*args: object) -> None:
        raise AssertionError("the per-expert loop ran on CUDA")

    monkeypatch.setattr(Experts, "per_expert", no_loop)
    moe = make_moe(37, 8, 2, 48, 40, dtype, seed=5)
    experts = Experts(8, 48, 40).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(moe.gate_up)
        experts.down_proj.copy_(moe.down)
        dev = torch.device("cuda")
        got = experts.to(dev)(moe.x.to(dev), moe.expert_ids.to(dev), moe.weights.to(dev))
    want = moe_gemm.moe_experts_reference(*moe)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --- compiled for the GPU, without one -----------------------------------------------------------------

def compile_for_hopper() -> dict[str, int]:
    """Compile (never launch) both kernels for sm_90 through the wrapper at Qwen3-30B-A3B's sizes (E=128,
    K=8, H=2048, I=768; tests/hopper_compile.py's way): decode (T=1, blocks of 16) and a prefill chunk
    (T=512, blocks of 64) in bf16, and the prefill in fp32 (IEEE dots, the most shared memory). Returns
    each compiled kernel's shared memory in bytes."""
    from kernels import triton_moe_gemm, triton_support

    compiled = compile_only_for_hopper(triton_moe_gemm, triton_support)
    setattr(triton_moe_gemm, "_multiprocessors", lambda device: 132)  # an H200's
    e, k, hidden, inter = 128, 8, 2048, 768
    for t, dtype in ((1, torch.bfloat16), (512, torch.bfloat16), (512, torch.float32)):
        gate_up = torch.empty(e, 2 * inter, hidden, dtype=dtype)  # never touched: nothing runs
        down = torch.empty(e, hidden, inter, dtype=dtype)
        ids = torch.arange(t * k).remainder(e).view(t, k)
        triton_moe_gemm.moe_experts(torch.zeros(t, hidden, dtype=dtype), gate_up, down, ids,
                                    torch.zeros(t, k, dtype=dtype))
    return compiled


@parent_only
def test_the_kernels_compile_for_hopper_within_their_shared_memory() -> None:
    pytest.importorskip("triton")
    shared = compiled_in_a_child("test_moe_gemm")
    assert len(shared) == 6 and {name.split("/")[0] for name in shared} == {"_gate_up_kernel", "_down_kernel"}, shared
