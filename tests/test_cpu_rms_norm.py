"""The CPU's RMSNorm (kernels/cpu/rms_norm.c) against the torch forms of engine/model/layers.py's
RMSNorm (its oracle: F.rms_norm, and the zero-centered Qwen3.5/Next chain), on plain rows and on
q/k heads viewed inside a fused projection's output; then that the model's norms take it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.model import layers
from engine.model.layers import RMSNorm
from kernels.cpu import rms_norm
from kernels.select import kernels_for
from cpu_kernels import built_kernel

# Both sides in fp32; the sum of squares differs in order only.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kernel() -> rms_norm.RmsNorm:
    return built_kernel(rms_norm.load)


def reference(x: torch.Tensor, norm: RMSNorm, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    table = kernels_for(torch.device("cpu"))
    with monkeypatch.context() as m:
        m.setattr(layers, "kernels_for", lambda device: dataclasses.replace(table, rms_norm=None))
        return norm(x)


def made(dim: int, zero_centered: bool, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, zero_centered)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return norm


@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero-centered"])
@pytest.mark.parametrize("shape", [(1, 1024), (7, 64), (2048, 256), (64,)])
def test_rows_match_the_torch_forms(kernel: rms_norm.RmsNorm, monkeypatch: pytest.MonkeyPatch,
                                    zero_centered: bool, shape: tuple[int, ...]) -> None:
    norm = made(shape[-1], zero_centered, seed=len(shape))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3
    got = kernel(x, norm.weight.detach(), norm.eps, zero_centered)
    assert got is not None and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, reference(x, norm, monkeypatch), rtol=TOLERANCE, atol=TOLERANCE)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.integers(0, 9), heads=st.integers(1, 5), dim=st.integers(1, 70), extra=st.integers(0, 40),
       zero_centered=st.booleans(), seed=st.integers(0, 2**16))
def test_heads_inside_a_wider_row(kernel: rms_norm.RmsNorm, monkeypatch: pytest.MonkeyPatch, t: int, heads: int,
                                  dim: int, extra: int, zero_centered: bool, seed: int) -> None:
    """q viewed as [T, H, D] inside a fused q|k|v output [T, H*D + extra]: strided rows, read in place."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(t, heads * dim + extra, generator=g)
    q = fused[:, :heads * dim].view(t, heads, dim)
    norm = made(dim, zero_centered, seed)
    got = kernel(q, norm.weight.detach(), norm.eps, zero_centered)
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got, reference(q, norm, monkeypatch), rtol=TOLERANCE, atol=TOLERANCE)


def test_what_it_does_not_take_is_left_to_torch(kernel: rms_norm.RmsNorm) -> None:
    w = torch.ones(8)
    assert kernel(torch.randn(4, 8, dtype=torch.float64), w, 1e-6, False) is None  # another dtype
    assert kernel(torch.randn(8, 4).t(), w, 1e-6, False) is None  # last dim strided
    assert kernel(torch.randn(2, 2, 2, 8), w, 1e-6, False) is None  # 4-D
    assert kernel(torch.randn(4, 8), torch.ones(6), 1e-6, False) is None  # a weight of another width


def test_a_missing_library_loads_as_none(tmp_path: Path) -> None:
    assert rms_norm.load(tmp_path / "absent.so") is None


def test_the_model_norms_run_it(kernel: rms_norm.RmsNorm, monkeypatch: pytest.MonkeyPatch) -> None:
    table = kernels_for(torch.device("cpu"))
    assert table.rms_norm is not None  # the CPU's kernel table carries it once built
    calls: list[bool] = []

    def counted(x: torch.Tensor, w: torch.Tensor, eps: float, zc: bool) -> torch.Tensor | None:
        calls.append(zc)
        return kernel(x, w, eps, zc)
    monkeypatch.setattr(layers, "kernels_for", lambda device: dataclasses.replace(table, rms_norm=counted))
    for zc in (False, True):
        x = torch.randn(3, 32)
        made(32, zc, 0)(x)
    assert calls == [False, True]
