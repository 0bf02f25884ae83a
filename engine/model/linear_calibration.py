"""Which path runs a linear call of a decode step's few rows, measured at load on the CPU at hand.

oneDNN's inner product on a packed weight is ignis' CPU linear; kernels/cpu/linear_rows.c is the
alternative for calls of at most DECODE_ROWS rows. Which one streams the weights faster depends on
the CPU (issue 50: on one AMD EPYC ignis' batch-1 decode ran 1.5x llama.cpp's while on another it
matched it; the libraries choose their code by vendor and ISA), so `engine.cpu_linear=auto` times
both on the model's own linears and runs each row count on the faster.

How: for each of CALIBRATED_ROWS, one pass over every packed linear of the model with each path,
the two interleaved ROUNDS times, the fastest pass of each kept (noise only ever adds time). C is
chosen only when it beats oneDNN by MARGIN: a tie keeps oneDNN, whose results the oracle tests pin (at
5% two loads of one bf16 model on a noisy 2-core VM chose differently: this machine's passes vary ~10%).
A call of r rows uses the plan of the smallest calibrated count >= r. Models whose linears hold
less than CALIBRATE_MIN_BYTES (the tiny test checkpoints) are not measured: there a pass is
microseconds of call overhead, and a choice that flips between runs would only make outputs
differ in the last bits from one engine to the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.model.cpu_linear import DECODE_ROWS, CRows, PackedLinear
from kernels.cpu.linear_rows import LinearRows, RowWeights

log = logging.getLogger("ignis.engine")

CALIBRATED_ROWS = (1, 2, 4, 8)
ROUNDS = 3
MARGIN = 0.10
CALIBRATE_MIN_BYTES = 64 * 2**20
# The linears measured: the model's first ones (in module order: every shape of a layer) up to this many
# packed bytes, well past any L3 so a pass streams from memory as a step does. A large model is not
# measured whole: its load would pay seconds, and with bf16 weights a transient copy of all of them.
CALIBRATE_SAMPLE_BYTES = 512 * 2**20
MODES = ("auto", "onednn", "c")


@dataclass(frozen=True, slots=True)
class RowsTiming:
    rows: int
    onednn_ms: float
    c_ms: float

    @property
    def c_wins(self) -> bool:
        return self.c_ms < self.onednn_ms * (1 - MARGIN)


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """Which path runs each row count of 1..DECODE_ROWS (above: oneDNN), and why."""

    mode: str  # engine.cpu_linear: auto, onednn or c
    c_rows: frozenset[int]
    timings: tuple[RowsTiming, ...] = ()
    linears: int = 0
    weight_bytes: int = 0
    note: str = ""  # why nothing was measured, when nothing was

    def summary(self) -> str:
        """One line for the log and bench.profile's report."""
        small = sorted(self.c_rows)
        where = (f"the C kernel at {_rows_text(small)} rows, oneDNN at the others" if small
                 else "oneDNN at every row count")
        measured = "; ".join(f"{t.rows} row{'s' if t.rows > 1 else ''}: oneDNN {t.onednn_ms:.2f} ms, "
                             f"C {t.c_ms:.2f} ms" for t in self.timings)
        detail = (f" (measured per pass over {self.linears} linears, {self.weight_bytes / 2**20:.0f} MiB: {measured})"
                  if self.timings else f" ({self.note})" if self.note else "")
        return f"linear layers (engine.cpu_linear={self.mode}): {where}{detail}"


def _rows_text(rows: list[int]) -> str:
    return f"{rows[0]}-{rows[-1]}" if rows == list(range(rows[0], rows[-1] + 1)) and len(rows) > 1 \
        else ",".join(map(str, rows))


def _rows_from(timings: Sequence[RowsTiming]) -> frozenset[int]:
    """Every row count 1..DECODE_ROWS whose bucket (the smallest calibrated count >= it) chose C."""
    chosen = {t.rows for t in timings if t.c_wins}
    return frozenset(r for r in range(1, DECODE_ROWS + 1)
                     if min(b for b in CALIBRATED_ROWS if b >= r) in chosen)


def _pass_ms(linears: Sequence[PackedLinear], inputs: Sequence[torch.Tensor]) -> float:
    start = time.perf_counter()
    for linear, x in zip(linears, inputs):
        linear._linear(x)
    return (time.perf_counter() - start) * 1000


def measure(linears: Sequence[PackedLinear], kernel: LinearRows, rounds: int = ROUNDS,
            clock: Callable[[Sequence[PackedLinear], Sequence[torch.Tensor]], float] = _pass_ms
            ) -> tuple[RowsTiming, ...]:
    """Each calibrated row count's fastest pass over `linears` with each path (C weights in place)."""
    g = torch.Generator().manual_seed(0)
    weights = {id(m): m.c_weights() for m in linears}
    before = [m.c_rows for m in linears]
    try:
        return _time_paths(linears, kernel, weights, rounds, clock, g)
    finally:  # each linear as it was, whatever happened
        for m, plan in zip(linears, before):
            m.c_rows = plan


def _time_paths(linears: Sequence[PackedLinear], kernel: LinearRows, weights: dict[int, RowWeights], rounds: int,
                clock: Callable[[Sequence[PackedLinear], Sequence[torch.Tensor]], float], g: torch.Generator
                ) -> tuple[RowsTiming, ...]:
    timings = []
    with torch.no_grad():
        for rows in CALIBRATED_ROWS:
            inputs = [torch.randn(rows, m.in_features, generator=g) for m in linears]
            c_plan = [CRows(kernel, weights[id(m)], frozenset({rows})) for m in linears]
            best = {"onednn": float("inf"), "c": float("inf")}
            for r in range(rounds + 1):  # the first round warms both paths (oneDNN's primitives, the caches)
                for path in ("onednn", "c") if r % 2 == 0 else ("c", "onednn"):
                    for m, plan in zip(linears, c_plan):
                        m.c_rows = plan if path == "c" else None
                    ms = clock(linears, inputs)
                    if r:
                        best[path] = min(best[path], ms)
            timings.append(RowsTiming(rows, best["onednn"], best["c"]))
    return tuple(timings)


def _packed_bytes(linears: Sequence[PackedLinear]) -> int:
    return sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in linears)


def _sample(linears: Sequence[PackedLinear]) -> list[PackedLinear]:
    """The first linears holding CALIBRATE_SAMPLE_BYTES (all of them in a smaller model)."""
    sample: list[PackedLinear] = []
    total = 0
    for m in linears:
        if total >= CALIBRATE_SAMPLE_BYTES:
            break
        sample.append(m)
        total += _packed_bytes([m])
    return sample


def plan_linears(linears: Sequence[PackedLinear], mode: str, kernel: LinearRows | None) -> LinearPlan:
    """The plan for `mode` (measured for auto), applied to `linears`, and logged."""
    if mode not in MODES:
        raise ValueError(f"engine.cpu_linear must be one of {', '.join(MODES)} or torch, got {mode!r}")
    weight_bytes = _packed_bytes(linears)
    plan = LinearPlan(mode, frozenset(), linears=len(linears), weight_bytes=weight_bytes)
    if mode == "onednn" or not linears:
        pass
    elif kernel is None:
        plan = LinearPlan(mode, frozenset(), note="the C kernels are not built (`make kernels`) or are turned off")
        if mode == "c":
            raise ValueError("engine.cpu_linear=c needs the C kernels, which are not built (`make kernels`) "
                             "or are turned off (IGNIS_CPU_KERNELS=reference)")
    elif mode == "c":
        plan = LinearPlan(mode, frozenset(range(1, DECODE_ROWS + 1)), linears=len(linears), weight_bytes=weight_bytes)
    elif weight_bytes < CALIBRATE_MIN_BYTES:
        plan = LinearPlan(mode, frozenset(), note=f"{weight_bytes / 2**20:.1f} MiB of linear weights, "
                                                  f"under the {CALIBRATE_MIN_BYTES // 2**20} MiB worth measuring")
    else:
        sample = _sample(linears)
        timings = measure(sample, kernel)
        plan = LinearPlan(mode, _rows_from(timings), timings, len(sample), _packed_bytes(sample))
    apply(linears, plan, kernel)
    log.info("%s", plan.summary())
    return plan


def apply(linears: Sequence[PackedLinear], plan: LinearPlan, kernel: LinearRows | None) -> None:
    """Each linear runs C at the plan's row counts (its C weights made once here), oneDNN elsewhere."""
    for m in linears:
        m.c_rows = None if not plan.c_rows or kernel is None else CRows(kernel, m.c_weights(), plan.c_rows)
