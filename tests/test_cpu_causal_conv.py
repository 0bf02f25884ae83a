"""The CPU's prefill causal conv (kernels/cpu/causal_conv.c) against its torch reference
(kernels/causal_conv.py: causal_conv1d, F.conv1d with groups=C), on inputs laid out as the GDN
layer passes them (a channels-last view of the projections' rows) and contiguous ones."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.causal_conv import causal_conv1d as reference
from kernels.cpu import causal_conv
from kernels.select import kernels_for
from cpu_kernels import built_kernel

TOLERANCE = 1e-5  # fp32 both sides; the sums' order differs


@pytest.fixture(scope="module")
def kernel() -> causal_conv.CausalConv:
    return built_kernel(causal_conv.load)


def check(kernel: causal_conv.CausalConv, channels: int, tokens: int, width: int, with_state: bool,
          channels_last: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    if channels_last:  # as GatedDeltaNet._prefill passes it: mixed[rows].T.unsqueeze(0)
        x = torch.randn(tokens + 3, channels, generator=g)[2:2 + tokens].T.unsqueeze(0)
    else:
        x = torch.randn(1, channels, tokens, generator=g)
    weight = torch.randn(channels, width, generator=g)
    state = torch.randn(1, channels, width - 1, generator=g) if with_state else None
    want, want_taps = reference(x, weight, state)
    got, got_taps = kernel(x, weight, state)
    assert got.shape == want.shape and got_taps.shape == want_taps.shape
    assert (got - want).abs().max().item() < TOLERANCE
    assert torch.equal(got_taps, want_taps)  # the taps are the inputs themselves


@pytest.mark.parametrize("tokens", [3, 4, 17, 300])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_matches_the_reference(kernel: causal_conv.CausalConv, tokens: int, with_state: bool,
                               channels_last: bool) -> None:
    check(kernel, 96, tokens, 4, with_state, channels_last, seed=tokens)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(channels=st.integers(1, 70), tokens=st.integers(2, 60), width=st.integers(2, 6), with_state=st.booleans(),
       channels_last=st.booleans(), seed=st.integers(0, 2**16))
def test_random_shapes(kernel: causal_conv.CausalConv, channels: int, tokens: int, width: int, with_state: bool,
                       channels_last: bool, seed: int) -> None:
    check(kernel, channels, max(tokens, width - 1), width, with_state, channels_last, seed)


def test_what_it_does_not_take_runs_the_reference(kernel: causal_conv.CausalConv) -> None:
    """A decode step, a chunk shorter than the taps, a batch of two: the reference's own results."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 4, generator=g)
    for x in (torch.randn(1, 8, 1, generator=g), torch.randn(1, 8, 2, generator=g), torch.randn(2, 8, 9, generator=g)):
        state = torch.randn(x.shape[0], 8, 3, generator=g)
        want, want_taps = reference(x, weight, state)
        got, got_taps = kernel(x, weight, state)
        assert torch.equal(got, want) and torch.equal(got_taps, want_taps)


def test_the_cpu_table_runs_it(kernel: causal_conv.CausalConv) -> None:
    ops = kernels_for(torch.device("cpu"))
    assert ops.causal_conv1d is not reference and ops.causal_conv1d.func is kernel.func  # type: ignore[attr-defined]
