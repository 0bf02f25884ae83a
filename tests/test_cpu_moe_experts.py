"""The CPU's MoE experts (kernels/cpu/moe_experts.c) against kernels/moe_gemm.py's
moe_experts_reference (its oracle) and engine/model/layers.py's Experts.grouped (what the CPU runs
otherwise, where its torch._grouped_mm takes the sizes): decode and prefill-sized steps, odd and
aligned sizes, experts with all the tokens or none, a strided x; what it refuses or leaves to torch; then that Experts.forward on the CPU takes it
for a decode-sized step and grouped() for a large one, with the same result."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import engine.model.layers as layers
from engine.model.layers import CPU_KERNEL_MAX_PAIRS, Experts
from kernels.cpu import moe_experts
from kernels.moe_gemm import moe_experts_reference
from kernels.select import MoeExperts, kernels_for
from cpu_kernels import built_kernel
from test_moe_gemm import Moe
from test_moe_gemm import make_moe as make_any_moe

# Both sides in fp32 with outputs ~1-3; only the summation order differs (seen: ~2e-6).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kernel() -> MoeExperts:
    return built_kernel(moe_experts.load)


def make_moe(t: int, e: int, k: int, hidden: int, inter: int, seed: int,
             expert_ids: torch.Tensor | None = None) -> Moe:
    """test_moe_gemm's random experts and top-k routing, in fp32 (what the C kernel takes)."""
    return make_any_moe(t, e, k, hidden, inter, torch.float32, seed, expert_ids)


def experts_of(moe: Moe) -> Experts:
    e, hidden, inter = moe.down.shape
    experts = Experts(e, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(moe.gate_up)
        experts.down_proj.copy_(moe.down)
    return experts


def check(kernel: MoeExperts, moe: Moe) -> torch.Tensor:
    got = kernel(*moe)
    assert got is not None and got.shape == moe.x.shape and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, moe_experts_reference(*moe), rtol=TOLERANCE, atol=TOLERANCE)
    hidden, inter = moe.down.shape[1:]
    # torch's CPU _grouped_mm takes rows of whole 16-byte units only (it refuses H=33, I=17)
    if moe.x.shape[0] and hidden % 4 == 0 and inter % 4 == 0:
        with torch.no_grad():
            grouped = experts_of(moe).grouped(moe.x, moe.expert_ids, moe.weights)
        torch.testing.assert_close(got, grouped, rtol=TOLERANCE, atol=TOLERANCE)
    return got


@pytest.mark.parametrize("hidden, inter", [(48, 40), (33, 17), (64, 32)], ids=["H48-I40", "H33-I17", "H64-I32"])
@pytest.mark.parametrize("e, k", [(4, 1), (4, 2), (16, 1), (16, 2), (16, 8), (128, 1), (128, 2), (128, 8)])
@pytest.mark.parametrize("t", [1, 3, 8, 37])
def test_matches_the_reference_and_grouped(kernel: MoeExperts, t: int, e: int, k: int,
                                           hidden: int, inter: int) -> None:
    check(kernel, make_moe(t, e, k, hidden, inter, seed=t * 1000 + e * 10 + k))


@pytest.mark.parametrize("t", [1, 8, 64])
def test_a_model_sized_layer(kernel: MoeExperts, t: int) -> None:
    """Qwen3-MoE's routing (E=128, top-8) at H=1024, I=128: decode and the threshold's step."""
    check(kernel, make_moe(t, 128, 8, 1024, 128, seed=t))


@pytest.mark.parametrize("k", [1, 2])
def test_all_tokens_on_one_expert(kernel: MoeExperts, k: int) -> None:
    """37 tokens on expert 2 (and 3): runs of four pairs and a remainder, the other experts empty."""
    ids = torch.tensor([2, 3][:k]).repeat(37, 1)
    check(kernel, make_moe(37, 16, k, 48, 40, seed=k, expert_ids=ids))


def test_experts_with_no_tokens(kernel: MoeExperts) -> None:
    ids = torch.tensor([[0, 127], [127, 5], [5, 0]])  # three of 128 experts hit
    got = check(kernel, make_moe(3, 128, 2, 48, 40, seed=3, expert_ids=ids))
    assert got.abs().min() > 0  # every row written from its experts


def test_one_expert_twice_for_a_token(kernel: MoeExperts) -> None:
    """A routing that repeats an expert within a token (not top-k's, but the operands allow it)."""
    ids = torch.tensor([[1, 1, 2], [2, 0, 2], [1, 1, 1], [3, 1, 1], [1, 2, 3]])
    check(kernel, make_moe(5, 4, 3, 48, 40, seed=4, expert_ids=ids))


@pytest.mark.parametrize("view", ["columns", "rows"])
def test_a_strided_x(kernel: MoeExperts, view: str) -> None:
    """x read in place: the first H columns of a wider row, or every other row."""
    moe = make_moe(7, 16, 2, 48, 40, seed=7)
    wide = torch.randn(7 * 2, 48 + 5)
    x = wide[:7, :48] if view == "columns" else wide[::2, :48]
    assert not x.is_contiguous() and x.stride(-1) == 1
    check(kernel, moe._replace(x=x))


def test_no_tokens(kernel: MoeExperts) -> None:
    moe = make_moe(3, 4, 2, 48, 40, seed=0)
    got = kernel(moe.x[:0], moe.gate_up, moe.down, moe.expert_ids[:0], moe.weights[:0])
    assert got is not None and got.shape == (0, 48)


@pytest.mark.parametrize("bad", [4, -1, 1 << 40])
def test_an_expert_id_out_of_range_is_refused(kernel: MoeExperts, bad: int) -> None:
    moe = make_moe(3, 4, 2, 48, 40, seed=1)
    ids = moe.expert_ids.clone()
    ids[1, 1] = bad
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\)"):
        kernel(*moe._replace(expert_ids=ids))


def test_what_it_does_not_take_is_left_to_torch(kernel: MoeExperts) -> None:
    moe = make_moe(3, 4, 2, 48, 40, seed=2)
    for dtype in (torch.bfloat16, torch.float64):
        assert kernel(*Moe(moe.x.to(dtype), moe.gate_up.to(dtype), moe.down.to(dtype), moe.expert_ids,
                           moe.weights.to(dtype))) is None
    assert kernel(*moe._replace(x=moe.x.to(torch.bfloat16))) is None  # x alone in another dtype
    assert kernel(*moe._replace(x=moe.x.t().contiguous().t())) is None  # columns strided
    strided = moe.gate_up.transpose(1, 2).contiguous().transpose(1, 2)  # right shape, not contiguous
    assert kernel(*moe._replace(gate_up=strided)) is None
    assert kernel(*moe._replace(down=moe.down.transpose(1, 2).contiguous().transpose(1, 2))) is None


def test_int32_ids_and_other_weights_are_taken(kernel: MoeExperts) -> None:
    moe = make_moe(5, 8, 2, 48, 40, seed=5)
    got = kernel(*moe._replace(expert_ids=moe.expert_ids.to(torch.int32), weights=moe.weights.double()))
    torch.testing.assert_close(got, moe_experts_reference(*moe), rtol=TOLERANCE, atol=TOLERANCE)


def test_a_missing_library_loads_as_none(tmp_path: Path) -> None:
    assert moe_experts.load(tmp_path / "absent.so") is None


# --- the layer's choice of path on the CPU -------------------------------------------------------------

@pytest.mark.parametrize("tokens, path", [(1, "kernel"), (CPU_KERNEL_MAX_PAIRS // 8, "kernel"),
                                          (CPU_KERNEL_MAX_PAIRS // 8 + 1, "grouped")])
def test_the_cpu_runs_the_kernel_for_decode_and_grouped_for_a_large_step(
        kernel: MoeExperts, monkeypatch: pytest.MonkeyPatch, tokens: int, path: str) -> None:
    table = kernels_for(torch.device("cpu"))
    assert table.moe_experts is not None  # the CPU's kernel table carries it once built
    moe = make_moe(tokens, 16, 8, 48, 40, seed=tokens)
    experts = experts_of(moe)
    calls: list[str] = []

    def counted(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor | None:
        calls.append("kernel")
        return kernel(x, gate_up, down, expert_ids, weights)
    grouped = Experts.grouped

    def counted_grouped(self: Experts, *args: torch.Tensor) -> torch.Tensor:
        calls.append("grouped")
        return grouped(self, *args)
    monkeypatch.setattr(layers, "kernels_for", lambda device: dataclasses.replace(table, moe_experts=counted))
    monkeypatch.setattr(Experts, "grouped", counted_grouped)
    with torch.no_grad():
        got = experts(moe.x, moe.expert_ids, moe.weights)
        assert calls == [path]
        torch.testing.assert_close(got, grouped(experts, moe.x, moe.expert_ids, moe.weights),
                                   rtol=TOLERANCE, atol=TOLERANCE)


def test_a_large_step_of_unaligned_experts_runs_the_kernel(kernel: MoeExperts) -> None:
    """torch's CPU _grouped_mm refuses rows that are not 16-byte multiples (H=33, I=17 here): such experts
    run the C kernel at any step size rather than fail."""
    moe = make_moe(CPU_KERNEL_MAX_PAIRS // 8 + 1, 16, 8, 33, 17, seed=9)
    with torch.no_grad():
        got = experts_of(moe)(moe.x, moe.expert_ids, moe.weights)
    torch.testing.assert_close(got, moe_experts_reference(*moe), rtol=TOLERANCE, atol=TOLERANCE)


def test_without_the_kernel_the_cpu_runs_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    """IGNIS_CPU_KERNELS=reference or no build: no moe_experts in the table, grouped() as before; the
    loop only for a step of no tokens."""
    table = dataclasses.replace(kernels_for(torch.device("cpu")), moe_experts=None)
    monkeypatch.setattr(layers, "kernels_for", lambda device: table)
    moe = make_moe(2, 8, 2, 48, 40, seed=9)
    experts = experts_of(moe)
    calls: list[str] = []
    grouped, loop = Experts.grouped, Experts.per_expert

    def counted_grouped(self: Experts, *args: torch.Tensor) -> torch.Tensor:
        calls.append("grouped")
        return grouped(self, *args)

    def counted_loop(self: Experts, *args: torch.Tensor) -> torch.Tensor:
        calls.append("loop")
        return loop(self, *args)
    monkeypatch.setattr(Experts, "grouped", counted_grouped)
    monkeypatch.setattr(Experts, "per_expert", counted_loop)
    with torch.no_grad():
        experts(moe.x, moe.expert_ids, moe.weights)
        empty = experts(moe.x[:0], moe.expert_ids[:0], moe.weights[:0])
    assert calls == ["grouped", "loop"] and empty.shape == (0, 48)


def test_a_bf16_step_on_the_cpu_runs_grouped(kernel: MoeExperts,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel returns None for bf16 and forward falls back to grouped()."""
    moe = make_moe(2, 8, 2, 48, 40, seed=11)
    experts = experts_of(moe).to(torch.bfloat16)
    calls: list[str] = []
    grouped = Experts.grouped

    def counted_grouped(self: Experts, *args: torch.Tensor) -> torch.Tensor:
        calls.append("grouped")
        return grouped(self, *args)
    monkeypatch.setattr(Experts, "grouped", counted_grouped)
    with torch.no_grad():
        got = experts(moe.x.bfloat16(), moe.expert_ids, moe.weights.bfloat16())
    assert calls == ["grouped"] and got.dtype == torch.bfloat16
