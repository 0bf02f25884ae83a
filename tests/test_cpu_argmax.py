"""The CPU's argmax over rows (kernels/cpu/argmax.c) against torch.argmax, its oracle: the same
index on random rows, ties (the lowest index), -inf rows, NaNs (the first NaN), odd widths and
strided rows; then that greedy sampling takes it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import sampler
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler, sample
from kernels.cpu import argmax
from kernels.select import kernels_for
from cpu_kernels import built_kernel


@pytest.fixture(scope="module")
def kernel() -> argmax.ArgmaxRows:
    return built_kernel(argmax.load)


def _check(kernel: argmax.ArgmaxRows, x: torch.Tensor) -> None:
    got = kernel(x)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1)), (got, torch.argmax(x, dim=-1))


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 70), cols=st.integers(1, 300), seed=st.integers(0, 2**31),
       levels=st.sampled_from([None, 2, 5]), specials=st.lists(st.sampled_from(["-inf", "inf", "nan", "-0"]),
                                                                max_size=4))
def test_the_same_index_as_torch(kernel: argmax.ArgmaxRows, rows: int, cols: int, seed: int, levels: int | None,
                                 specials: list[str]) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if levels is not None:  # few distinct values: ties everywhere
        x = torch.randint(0, levels, (rows, cols), generator=g).float()
    for name in specials:
        if rows:
            r, c = int(torch.randint(0, rows, (1,), generator=g)), int(torch.randint(0, cols, (1,), generator=g))
            x[r, c] = float(name) if name != "-0" else -0.0
    _check(kernel, x)


def test_rows_of_minus_infinity_and_a_decode_steps_logits(kernel: argmax.ArgmaxRows) -> None:
    x = torch.full((3, 4096), float("-inf"))
    x[1, 4095] = -1e30
    x[2, 7] = x[2, 4000] = 5.0
    _check(kernel, x)
    _check(kernel, torch.randn(256, 4096))


def test_strided_rows_and_what_it_does_not_take(kernel: argmax.ArgmaxRows) -> None:
    wide = torch.randn(9, 50)
    _check(kernel, wide[:, 3:40])  # rows further apart than they are long
    _check(kernel, wide[::2])
    assert kernel(wide.t()) is None  # columns not contiguous
    assert kernel(wide.double()) is None
    assert kernel(wide[0]) is None


def test_greedy_sampling_takes_it(kernel: argmax.ArgmaxRows, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels_for(torch.device("cpu")).argmax_rows is not None
    calls = []

    def counted(x: torch.Tensor) -> torch.Tensor | None:
        calls.append(x.shape)
        return kernel(x)

    table = kernels_for(torch.device("cpu"))
    monkeypatch.setattr(sampler, "kernels_for", lambda device: dataclasses.replace(table, argmax_rows=counted))
    logits = torch.randn(5, 97)
    params = SamplingParams(temperature=0, max_tokens=4)
    out = sample(logits, [RequestSampler(params) for _ in range(5)], frozenset(), [0] * 5)
    assert calls == [(5, 97)] and out.token_ids == torch.argmax(logits, dim=-1).tolist()
