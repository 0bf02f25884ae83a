"""The CPU's argmax over rows (kernels/cpu/argmax.c) against torch.argmax, its oracle: the same
index on random rows, ties (the lowest index), -inf rows, NaNs (the first NaN), odd widths and
strided rows; then that greedy sampling takes it. The capped argmax against torch.argmax of the
logits as sampling processes them, and that a plain greedy batch takes it on its raw logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import sampler
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler, SamplerRows, sample, sample_rows
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
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=True)  # processed: not the capped road
    out = sample(logits, [RequestSampler(params) for _ in range(5)], frozenset(), [0] * 5)
    assert calls == [(5, 97)] and out.token_ids == torch.argmax(logits, dim=-1).tolist()


@pytest.fixture(scope="module")
def capped() -> argmax.CappedArgmaxRows:
    return built_kernel(argmax.load_capped)


_SPECIALS = {"-inf": float("-inf"), "inf": float("inf"), "nan": float("nan"), "-0": -0.0, "huge": 3e38}


def _processed(x: torch.Tensor, ceiling: float) -> torch.Tensor:
    """What process_logits makes of a row nothing else changes: its oracle's input."""
    return x.nan_to_num(nan=float("-inf"), posinf=ceiling, neginf=float("-inf")).clamp(max=ceiling)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 40), cols=st.integers(1, 200), seed=st.integers(0, 2**31),
       levels=st.sampled_from([None, 2, 5]),
       specials=st.lists(st.sampled_from(["-inf", "inf", "nan", "-0", "huge"]), max_size=6))
def test_the_capped_argmax_is_torch_argmax_of_the_processed_logits(
        capped: argmax.CappedArgmaxRows, rows: int, cols: int, seed: int, levels: int | None,
        specials: list[str]) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if levels is not None:
        x = torch.randint(0, levels, (rows, cols), generator=g).float()
    for name in specials:
        if rows:
            r, c = int(torch.randint(0, rows, (1,), generator=g)), int(torch.randint(0, cols, (1,), generator=g))
            x[r, c] = _SPECIALS[name]
    got = capped(x, sampler.LOGIT_CEILING)
    assert got is not None and torch.equal(got, torch.argmax(_processed(x, sampler.LOGIT_CEILING), dim=-1))


def test_the_capped_argmax_on_rows_of_nan_and_minus_infinity(capped: argmax.CappedArgmaxRows) -> None:
    x = torch.full((4, 33), float("-inf"))
    x[0, 0] = float("nan")  # NaN counts as -inf: every value ties, the first wins
    x[1, :] = float("nan")
    x[2, 5], x[2, 9] = float("inf"), 2e30  # both above the ceiling: equal there, the first wins
    x[3, 20] = float("nan")
    x[3, 30] = -5.0
    got = capped(x, sampler.LOGIT_CEILING)
    assert got is not None and got.tolist() == [0, 0, 5, 30]
    assert torch.equal(got, torch.argmax(_processed(x, sampler.LOGIT_CEILING), dim=-1))
    assert capped(x.t(), 1.0) is None and capped(x.double(), 1.0) is None


def test_a_plain_greedy_batch_reads_the_raw_logits(capped: argmax.CappedArgmaxRows,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row plain greedy: the capped argmax, on the caller's own tensor (no copy), the general
    path's tokens; any row with something to process sends the whole batch down the general path."""
    calls: list[int] = []

    def counted(x: torch.Tensor, ceiling: float) -> torch.Tensor | None:
        calls.append(x.data_ptr())
        return capped(x, ceiling)

    table = kernels_for(torch.device("cpu"))
    monkeypatch.setattr(sampler, "kernels_for",
                        lambda device: dataclasses.replace(table, argmax_rows_capped=counted))
    logits = torch.randn(6, 101)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    plain = SamplingParams(temperature=0, max_tokens=4)
    out = sample(logits, [RequestSampler(plain) for _ in range(6)], frozenset(), [0] * 6)
    assert calls == [logits.data_ptr()]
    assert out.token_ids == torch.argmax(sampler.process_logits(logits, [RequestSampler(plain)] * 6, frozenset(),
                                                                [0] * 6), dim=-1).tolist()
    assert out.logprobs == [None] * 6 and out.top_logprobs == [[]] * 6
    for other in (SamplingParams(temperature=0, max_tokens=4, logit_bias={5: 50.0}),
                  SamplingParams(temperature=0, max_tokens=4, min_tokens=2),
                  SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3),
                  SamplingParams(temperature=0, max_tokens=4, logprobs=True),
                  SamplingParams(temperature=0.7, max_tokens=4, seed=1)):
        calls.clear()
        samplers = [RequestSampler(plain) for _ in range(5)] + [RequestSampler(other)]
        sample(logits, samplers, frozenset(), [0] * 6)
        assert calls == [], other


def test_sample_rows_is_sample_and_asks_for_step_counts_only_where_read(capped: argmax.CappedArgmaxRows) -> None:
    """SamplerRows made once for a batch: a plain greedy one takes the capped argmax without the step
    counts; any other, or one the kernel does not take, is sample() with them, token for token."""
    logits = torch.randn(4, 101)
    plain = SamplingParams(temperature=0, max_tokens=4)
    asked: list[int] = []

    def counts() -> list[int]:
        asked.append(1)
        return [1] * 4

    rows = SamplerRows.of([RequestSampler(plain) for _ in range(4)], torch.device("cpu"))
    assert rows.plain_greedy
    assert sample_rows(logits, rows, frozenset(), counts).token_ids == torch.argmax(logits, dim=-1).tolist()
    assert not asked
    assert sample_rows(logits.double(), rows, frozenset(), counts).token_ids == torch.argmax(logits, -1).tolist()
    assert asked == [1]  # float64 rows: the kernel declines, the general path reads the counts
    penalised = SamplingParams(temperature=0, max_tokens=4, min_tokens=3)
    rows = SamplerRows.of([RequestSampler(plain)] * 3 + [RequestSampler(penalised)], torch.device("cpu"))
    assert not rows.plain_greedy
    eos = frozenset({int(torch.argmax(logits[3]))})  # min_tokens masks it in the last row
    want = sample(logits, rows.samplers, eos, [1] * 4).token_ids
    assert sample_rows(logits, rows, eos, counts).token_ids == want and asked == [1, 1]
    with pytest.raises(ValueError, match="logits have 4 rows but got 3 samplers"):
        sample_rows(logits, SamplerRows.of([RequestSampler(plain)] * 3, torch.device("cpu")), frozenset(), counts)
