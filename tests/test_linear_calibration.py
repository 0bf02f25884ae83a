"""engine.cpu_linear: which of oneDNN and the C kernel (kernels/cpu/linear_rows.c) runs a linear
call of a decode step's few rows (engine/model/linear_calibration.py). The choice from measured
times (a clock the test controls), the modes, the tiny-model rule, and that either path gives the
same outputs: the C path against oneDNN on every packed linear of a model, fp32 and bf16 weights.
The whole model with the C path against transformers is tests/test_model.py's c-linear case."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import pytest
import torch

from checkpoints import ARCHITECTURES
from cpu_kernels import built_kernel
from engine.model import linear_calibration
from engine.model.cpu_linear import DECODE_ROWS, PackedLinear, onednn_available, onednn_bf16_available, packed_linears
from engine.model.linear_calibration import CALIBRATED_ROWS, MARGIN, RowsTiming, measure, plan_linears
from engine.model.loader import load_model
from kernels.cpu import linear_rows

pytestmark = pytest.mark.skipif(not onednn_available(), reason="needs oneDNN")


@pytest.fixture(scope="module")
def kernel() -> linear_rows.LinearRows:
    return built_kernel(linear_rows.load)


def linears_of(checkpoint_dir: Callable[[str], Path], arch: str = "Qwen3ForCausalLM",
               weight_dtype: str = "auto") -> list[PackedLinear]:
    return packed_linears(load_model(checkpoint_dir(arch), onednn_linears=True, weight_dtype=weight_dtype,
                                     decode_linear="onednn").model)


def test_a_row_count_takes_its_buckets_choice() -> None:
    def timings(c_faster_at: set[int]) -> list[RowsTiming]:
        return [RowsTiming(r, 10.0, 5.0 if r in c_faster_at else 12.0) for r in CALIBRATED_ROWS]

    assert linear_calibration._rows_from(timings(set())) == frozenset()
    assert linear_calibration._rows_from(timings({8})) == frozenset({5, 6, 7, 8})
    assert linear_calibration._rows_from(timings({1, 4})) == frozenset({1, 3, 4})
    assert linear_calibration._rows_from(timings(set(CALIBRATED_ROWS))) == frozenset(range(1, DECODE_ROWS + 1))
    # within the margin is a tie, and a tie keeps oneDNN
    close = [RowsTiming(r, 10.0, 10.0 * (1 - MARGIN / 2)) for r in CALIBRATED_ROWS]
    assert linear_calibration._rows_from(close) == frozenset()


def test_measured_choice_follows_the_clock(kernel: linear_rows.LinearRows,
                                           checkpoint_dir: Callable[[str], Path]) -> None:
    """A clock on which C is faster at 4 rows only: the plan runs C at 3-4 rows, and every linear is left
    as the plan says (measuring leaves no C path switched on by accident)."""
    linears = linears_of(checkpoint_dir)
    seen: list[tuple[int, str]] = []

    def clock(ms: Sequence[PackedLinear], inputs: Sequence[torch.Tensor]) -> float:
        rows = inputs[0].shape[0]
        path = "onednn" if ms[0].c_rows is None else "c"
        assert all((m.c_rows is None) == (path == "onednn") for m in ms)
        seen.append((rows, path))
        return 1.0 if path == "c" and rows == 4 else 2.0

    timings = measure(linears, kernel, rounds=2, clock=clock)
    assert [t.rows for t in timings] == list(CALIBRATED_ROWS)
    assert {(r, p) for r, p in seen} == {(r, p) for r in CALIBRATED_ROWS for p in ("onednn", "c")}
    assert all(m.c_rows is None for m in linears)
    assert linear_calibration._rows_from(timings) == frozenset({3, 4})


def test_a_failure_while_measuring_leaves_every_linear_as_it_was(kernel: linear_rows.LinearRows,
                                                                  checkpoint_dir: Callable[[str], Path]) -> None:
    linears = linears_of(checkpoint_dir)[:3]
    plan_linears(linears, "c", kernel)
    before = [m.c_rows for m in linears]
    calls = []

    def clock(ms: Sequence[PackedLinear], inputs: Sequence[torch.Tensor]) -> float:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a kernel failed")
        return 1.0

    with pytest.raises(RuntimeError, match="a kernel failed"):
        measure(linears, kernel, rounds=1, clock=clock)
    assert [m.c_rows for m in linears] == before


def test_modes(kernel: linear_rows.LinearRows, checkpoint_dir: Callable[[str], Path],
               monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    linears = linears_of(checkpoint_dir)
    with caplog.at_level(logging.INFO, logger="ignis.engine"):
        assert plan_linears(linears, "onednn", kernel).c_rows == frozenset()
        assert all(m.c_rows is None for m in linears)
        forced = plan_linears(linears, "c", kernel)
        assert forced.c_rows == frozenset(range(1, DECODE_ROWS + 1))
        assert all(m.c_rows is not None and m.c_rows.rows == forced.c_rows for m in linears)
        tiny = plan_linears(linears, "auto", kernel)  # a test checkpoint: under the size worth measuring
        assert tiny.c_rows == frozenset() and not tiny.timings and "worth measuring" in tiny.summary()
        assert all(m.c_rows is None for m in linears)
    assert "engine.cpu_linear=c): the C kernel at 1-8 rows" in caplog.text
    monkeypatch.setattr(linear_calibration, "CALIBRATE_MIN_BYTES", 0)
    measured = plan_linears(linears, "auto", kernel)  # real times: either answer is right, consistently applied
    assert [t.rows for t in measured.timings] == list(CALIBRATED_ROWS)
    assert measured.c_rows == linear_calibration._rows_from(measured.timings)
    assert all((m.c_rows.rows if m.c_rows else frozenset()) == measured.c_rows for m in linears)
    # a large model is measured on its first linears only, and the plan applies to all of them
    monkeypatch.setattr(linear_calibration, "CALIBRATE_SAMPLE_BYTES", 1)
    sampled = plan_linears(linears, "auto", kernel)
    assert sampled.linears == 1 and len(sampled.timings) == len(CALIBRATED_ROWS)
    assert all((m.c_rows.rows if m.c_rows else frozenset()) == sampled.c_rows for m in linears)
    with pytest.raises(ValueError, match="engine.cpu_linear must be one of"):
        plan_linears(linears, "fastest", kernel)
    with pytest.raises(ValueError, match="not built"):
        plan_linears(linears, "c", None)
    assert plan_linears(linears, "auto", None).c_rows == frozenset()


@pytest.mark.parametrize("weight_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen2ForCausalLM"])
def test_c_path_equals_onednn_on_every_linear(weight_dtype: str, arch: str, kernel: linear_rows.LinearRows,
                                             checkpoint_dir: Callable[[str], Path]) -> None:
    """Every packed linear (fused groups included; Qwen2 has biases) at 1-8 rows: the C path's outputs are
    oneDNN's but for summation order (bf16: the same rounding of rows and outputs, an ulp apart at most)."""
    if weight_dtype == "bfloat16" and not onednn_bf16_available():
        pytest.skip("this CPU has no oneDNN bf16 inner product")
    assert arch in ARCHITECTURES
    linears = linears_of(checkpoint_dir, arch, weight_dtype)
    g = torch.Generator().manual_seed(0)
    rtol = 2**-7 if weight_dtype == "bfloat16" else 1e-5
    for m in linears:
        x = torch.randn(DECODE_ROWS, m.in_features, generator=g)
        for rows in range(1, DECODE_ROWS + 1):
            m.c_rows = None
            want = m(x[:rows])
            plan_linears([m], "c", kernel)
            got = m(x[:rows])
            for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(a, b, rtol=rtol, atol=1e-4)
        # above the C kernel's row counts oneDNN runs, whatever the plan
        assert m.c_rows is not None
        big = torch.randn(DECODE_ROWS + 1, m.in_features, generator=g)
        with torch.no_grad():
            out = m(big)
        m.c_rows = None
        again = m(big)
        for a, b in zip(out if isinstance(out, tuple) else (out,), again if isinstance(again, tuple) else (again,)):
            assert torch.equal(a, b)
