"""Each CPU linear path at a decode step's row counts, per the bench model's shapes (issue 50): how fast
MKL (torch's F.linear), oneDNN on a packed weight and ignis' own C kernel (kernels/cpu/linear_rows.c)
stream a decode step's weights on this CPU, against a plain streaming read of as many bytes.

    python -m bench.linear_paths [--kind dense|hybrid] [--hidden 1024 --layers 16] [--threads 2]
        [--rows 1,2,4,8,16] [--repeats 7] [--dtypes auto|fp32|bf16|fp32,bf16] [--library PATH] [--out DIR]

MKL and oneDNN choose their code by CPU vendor and ISA, so which path is fastest differs from one
machine to the next: this is the one command to run there. The shapes are one decoder layer's linears
of each layer type (bench/geometry.py; a fused group such as q|k|v or gate|up as the one call ignis
makes), each in as many random fp32 copies as the model has layers of that type, so a pass reads as
many bytes as a real decode step's linears (the lm_head aside), far beyond the caches.

Paths: torch (F.linear, fp32: MKL's sgemm), onednn (the fp32 weight packed at load, as the engine runs
it), c (linear_rows.c on the [out, in] fp32 weight; past 8 rows it makes passes of 8) and, in bf16,
onednn-bf16 and c-bf16; `--dtypes auto` adds bf16 where oneDNN runs bf16 (as engine.weight_dtype
needs). A path that cannot run here is skipped, and the report says why. Every path's output is
checked against F.linear in float64 before any timing: a fast wrong kernel fails the run.

Timing: one pass over all layers' linears at each row count; 2 warm-up passes, then the median of
`--repeats`, the paths (and the streaming read) interleaved in an order that rotates each repeat, so a
load spike lands on one repeat of every path rather than on one path.

Another CPU's code paths, on this one: `--library /tmp/lib_avx2.so` times another build of the C
kernels, e.g. `gcc -O3 -march=x86-64-v3 -fopenmp -shared -fPIC -o /tmp/lib_avx2.so kernels/cpu/*.c`
(AVX2 only); `ONEDNN_MAX_CPU_ISA=AVX2` in the environment makes oneDNN run as on an AVX2-only CPU (no
bf16 then) and `MKL_ENABLE_INSTRUCTIONS=AVX2` does the same for MKL. The report's name says so
(linear-paths-dense-lib-lib_avx2-onednn-avx2-mkl-avx2.md), as it does a non-default geometry.

Memory: about 4x the fp32 weights' bytes (fp32, the packed copies, bf16, the read's buffer): ~3 GB for
the default dense geometry, where a run takes some 30-60 s (2 threads).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench import table
from bench.geometry import geometry_config
from engine.cpu_host import describe
from engine.model.config import parse_config
from engine.model.cpu_linear import onednn_available, onednn_bf16_available, pack_weight, run_packed
from engine.model.decoder import DecoderLayer
from kernels.cpu import linear_rows
from kernels.cpu.library import LIBRARY

KINDS = ("dense", "hybrid")  # moe's experts are not nn.Linear (kernels/cpu/moe_experts.py has its own table)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WARMUP = 2
READ = "read"  # the baseline's column: a streaming read of the fp32 weights' bytes
# The error a path may have against F.linear in float64, relative to the largest output: fp32 differs
# by summation order; bf16 against the bf16-rounded weights, where oneDNN also rounds the rows to bf16.
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}
ISA_VARIABLES = {"ONEDNN_MAX_CPU_ISA": "onednn", "DNNL_MAX_CPU_ISA": "onednn", "MKL_ENABLE_INSTRUCTIONS": "mkl"}


@dataclass(frozen=True, slots=True)
class Shape:
    """One linear call of a layer: a fused group's members' outputs side by side, over one input."""

    name: str
    segments: tuple[int, ...]  # each member's out_features
    in_features: int
    copies: int  # layers that make this call

    @property
    def out_features(self) -> int:
        return sum(self.segments)

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.out_features * self.in_features * self.copies * dtype.itemsize


@dataclass(frozen=True, slots=True)
class LinearPath:
    """A way to run a linear: `prepare` makes what it reads from an fp32 [out, in] weight and its
    segments' sizes (once, as a load would); `run` is one call on fp32 rows, fp32 out."""

    name: str
    dtype: str  # a DTYPES key: the weights' dtype
    prepare: Callable[[torch.Tensor, tuple[int, ...]], Any]
    run: Callable[[torch.Tensor, Any], torch.Tensor]


@dataclass(slots=True)
class Timing:
    path: str
    rows: int
    nbytes: int  # the weights one pass reads
    samples_ms: list[float] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def gb_s(self) -> float:
        return self.nbytes / self.ms / 1e6


def layer_shapes(kind: str, hidden: int, layers: int) -> list[Shape]:
    """The linear calls of one decoder layer of each layer type (built on the meta device), a fusible
    group as one call as cpu_linear.py fuses it, counted over the layers of that type."""
    config = parse_config(geometry_config(kind, hidden, layers))
    shapes: dict[tuple[str, tuple[int, ...], int], int] = {}
    for layer_type in dict.fromkeys(config.layer_types):
        index = config.layer_types.index(layer_type)
        with torch.device("meta"):
            layer = DecoderLayer(config, index)
        fused: set[int] = set()
        calls: list[tuple[str, tuple[int, ...], int]] = []
        for prefix, module in layer.named_modules():  # a module before its children: layer order
            for names in getattr(module, "fusible_linears", {}).values():
                members = [getattr(module, n) for n in names]
                fused.update(id(m) for m in members)
                calls.append((f"{prefix}.{'|'.join(names)}", tuple(m.out_features for m in members),
                              members[0].in_features))
            if isinstance(module, nn.Linear) and id(module) not in fused:
                calls.append((prefix, (module.out_features,), module.in_features))
        for call in calls:  # the same call in two layer types (the MLP of a hybrid) is one shape
            shapes[call] = shapes.get(call, 0) + config.layer_types.count(layer_type)
    return [Shape(name, segments, inp, copies) for (name, segments, inp), copies in shapes.items()]


# --- the paths (module functions, looked up when the paths are made: a test can swap one) ---------------

def prepare_torch(weight: torch.Tensor, segments: tuple[int, ...]) -> torch.Tensor:
    return weight


def run_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def prepare_onednn(weight: torch.Tensor, segments: tuple[int, ...]) -> torch.Tensor:
    return pack_weight(weight, None, torch.float32)[0]


def run_onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return run_packed(x, packed, None, torch.float32)


def prepare_onednn_bf16(weight: torch.Tensor, segments: tuple[int, ...]) -> torch.Tensor:
    return pack_weight(weight, None, torch.bfloat16)[0]


def run_onednn_bf16(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return run_packed(x, packed, None, torch.bfloat16)


def prepare_c(weight: torch.Tensor, segments: tuple[int, ...]) -> linear_rows.RowWeights:
    # the members as separate [out_s, in] weights, as the engine hands them (row slices: no copy)
    return linear_rows.RowWeights.of(list(weight.split(segments)), [None] * len(segments))


def prepare_c_bf16(weight: torch.Tensor, segments: tuple[int, ...]) -> linear_rows.RowWeights:
    return prepare_c(weight.to(torch.bfloat16), segments)


def make_paths(dtypes: list[str], kernel: linear_rows.LinearRows | None, library: Path
               ) -> tuple[list[LinearPath], dict[str, str]]:
    """The paths that run here in `dtypes`, in the table's order, and each other one's reason not to."""
    onednn = onednn_available()
    no_c = f"the C kernels did not load from {library} (`make kernels` builds them)"
    # (name, dtype, prepare, run, why it cannot run here or None)
    candidates: list[tuple[str, str, Any, Any, str | None]] = [
        ("torch", "fp32", prepare_torch, run_torch, None),
        ("onednn", "fp32", prepare_onednn, run_onednn,
         None if onednn else "this torch has no oneDNN (torch.backends.mkldnn)"),
        ("c", "fp32", prepare_c, kernel, None if kernel is not None else no_c),
        ("onednn-bf16", "bf16", prepare_onednn_bf16, run_onednn_bf16,
         None if onednn and onednn_bf16_available() else "oneDNN runs no bf16 inner product on this CPU (it needs "
         "AVX512 BW/VL/DQ or AVX-NE-CONVERT; ONEDNN_MAX_CPU_ISA may hide them)"),
        ("c-bf16", "bf16", prepare_c_bf16, kernel, None if kernel is not None else no_c),
    ]
    paths = [LinearPath(name, dtype, prepare, run) for name, dtype, prepare, run, why in candidates
             if dtype in dtypes and why is None]
    return paths, {name: why for name, dtype, _, _, why in candidates if dtype in dtypes and why is not None}


# --- checking and timing -------------------------------------------------------------------------------

def check(paths: list[LinearPath], shapes: list[Shape], weights: list[list[torch.Tensor]],
          prepared: dict[str, list[list[Any]]], rows: list[int]) -> dict[str, float]:
    """Each path's output at every row count on each shape's first copy against F.linear in float64 (bf16
    paths: on the bf16-rounded weights); raises on a wrong one. Returns each path's worst relative error."""
    g = torch.Generator().manual_seed(1)
    worst: dict[str, float] = {}
    for s, shape in enumerate(shapes):
        w = weights[s][0]
        for n in rows:
            x = torch.randn(n, shape.in_features, generator=g)
            for path in paths:
                exact = F.linear(x.double(), w.to(DTYPES[path.dtype]).double())
                with torch.inference_mode():
                    y = path.run(x, prepared[path.name][s][0])
                if y.shape != exact.shape:
                    raise RuntimeError(f"path {path.name} returned {tuple(y.shape)} for {n} rows of {shape.name}, "
                                       f"expected {tuple(exact.shape)}: this is a bug")
                error = ((y.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()
                if not error <= TOLERANCE[path.dtype]:  # also catches a NaN
                    raise RuntimeError(f"path {path.name} is wrong at {n} rows of {shape.name} "
                                       f"({shape.out_features}x{shape.in_features}): relative error {error:.3g} "
                                       f"> {TOLERANCE[path.dtype]:g} against F.linear in float64; "
                                       "its timings would mean nothing")
                worst[path.name] = max(worst.get(path.name, 0.0), error)
    return worst


def layer_order(inputs: list[torch.Tensor], prepared: list[list[Any]]) -> list[tuple[torch.Tensor, Any]]:
    """A pass's calls, (rows, weight), layer after layer: each shape's copy i in the i-th layer having it."""
    depth = max(len(copies) for copies in prepared)
    return [(x, copies[i]) for i in range(depth) for x, copies in zip(inputs, prepared) if i < len(copies)]


def one_pass(path: LinearPath, calls: list[tuple[torch.Tensor, Any]]) -> float:
    """ms for one call on every copy of every shape: a decode step's linears."""
    run = path.run
    start = time.perf_counter()
    for x, weight in calls:
        run(x, weight)
    return (time.perf_counter() - start) * 1000


def measure(paths: list[LinearPath], shapes: list[Shape], prepared: dict[str, list[list[Any]]],
            rows: list[int], repeats: int) -> list[Timing]:
    """Per row count: every path's passes and a streaming read of the fp32 bytes, interleaved, rotating."""
    fp32_bytes = sum(s.nbytes(torch.float32) for s in shapes)
    buffer = torch.ones(fp32_bytes // 4)  # the read baseline: one sum over as many bytes
    g = torch.Generator().manual_seed(2)
    timings: list[Timing] = []
    names = [p.name for p in paths] + [READ]
    for n in rows:
        inputs = [torch.randn(n, s.in_features, generator=g) for s in shapes]
        runs: dict[str, Callable[[], float]] = {
            p.name: functools.partial(one_pass, p, layer_order(inputs, prepared[p.name])) for p in paths}
        runs[READ] = functools.partial(_timed_read, buffer)
        found = {p.name: Timing(p.name, n, sum(s.nbytes(DTYPES[p.dtype]) for s in shapes)) for p in paths}
        found[READ] = Timing(READ, n, fp32_bytes)
        with torch.inference_mode():
            for name in names:
                for _ in range(WARMUP):
                    runs[name]()
            for r in range(repeats):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    found[name].samples_ms.append(runs[name]())
        timings += found.values()
    return timings


def _timed_read(buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    buffer.sum()
    return (time.perf_counter() - start) * 1000


# --- the report ----------------------------------------------------------------------------------------

def result_name(kind: str, hidden: int, layers: int, threads: int, dtypes: str, library: Path | None) -> str:
    """linear-paths-<kind>, then whatever else changes what is measured (geometry, threads, the dtypes
    asked for, another C library, an ISA cap on oneDNN or MKL in the environment)."""
    parts = ["linear-paths", kind]
    parts += [f"h{hidden}"] if hidden != 1024 else []
    parts += [f"l{layers}"] if layers != 16 else []
    parts += [f"t{threads}"] if threads != 2 else []
    parts += [dtypes.replace(",", "-")] if dtypes != "auto" else []
    parts += [f"lib-{library.stem}"] if library is not None else []
    caps = {short: os.environ[var] for var, short in reversed(ISA_VARIABLES.items()) if os.environ.get(var)}
    parts += [f"{short}-{cap}" for short, cap in sorted(caps.items(), key=lambda c: c[0] != "onednn")]
    return re.sub(r"[^a-z0-9_]+", "-", "-".join(parts).lower()).strip("-")


def _cell(t: Timing, best: bool) -> str:
    text = f"{t.ms:.3g} ms, {t.gb_s:.3g} GB/s"
    return f"**{text}**" if best else text


def render(setup: dict[str, Any], host: str, shapes: list[Shape], paths: list[LinearPath],
           skipped: dict[str, str], timings: list[Timing], errors: dict[str, float],
           loads: dict[str, list[float]]) -> str:
    dtypes = [d for d in DTYPES if any(p.dtype == d for p in paths)]
    layout = ", ".join(f"{s.name} {s.out_features}x{s.in_features} x{s.copies}" for s in shapes)
    mb = {d: sum(s.nbytes(DTYPES[d]) for s in shapes) / 1e6 for d in DTYPES}
    lines = [host, "",
             f"Linear paths at a decode step's row counts, {setup['kind']} h{setup['hidden']} geometry, "
             f"{setup['layers']} layers: a pass is one call per layer on each of {layout} "
             f"({mb['fp32']:.4g} MB of fp32 weights, {mb['bf16']:.4g} MB in bf16; no lm_head). "
             f"{setup['threads']} threads; C kernels from `{setup['library']}`; medians of {setup['repeats']} "
             f"interleaved repeats after {WARMUP} warm-up passes. Load average (1 min) before "
             f"{loads['before'][0]:.2f}, after {loads['after'][0]:.2f}.", ""]
    by = {(t.path, t.rows): t for t in timings}
    headers = ["rows", *[p.name for p in paths], "read (fp32 bytes)", *[f"best {d} / read" for d in dtypes]]
    body = []
    for n in setup["rows"]:
        best = {d: min((p for p in paths if p.dtype == d), key=lambda p: by[(p.name, n)].ms) for d in dtypes}
        read = by[(READ, n)]
        body.append([n, *[_cell(by[(p.name, n)], best[p.dtype] is p) for p in paths], _cell(read, False),
                     *[f"{by[(best[d].name, n)].gb_s / read.gb_s:.2f} ({best[d].name})" for d in dtypes]])
    lines.append(table.markdown(headers, body))
    lines += ["", "Cells: median ms per pass, and the weights' bytes over it (bf16 paths read half the bytes); "
              "bold: the fastest path of its weight dtype at that row count. read: one sum over as many bytes "
              "as the fp32 weights, on the same threads, timed in the same interleaving: the memory's limit. "
              "best / read: the fastest path's GB/s over the read's. torch is F.linear (MKL's sgemm), onednn the "
              "engine's packed weight, c kernels/cpu/linear_rows.c (the engine runs it at 1-8 rows where faster)."]
    lines.append("Checked before timing against F.linear in float64, worst relative error: "
                 + ", ".join(f"{name} {e:.1e}" for name, e in errors.items()) + ".")
    if skipped:
        lines.append("Not run here: " + "; ".join(f"{name}: {why}" for name, why in skipped.items()) + ".")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=KINDS, default="dense")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=_ints, default=[1, 2, 4, 8, 16], help="row counts, e.g. 1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", default="auto",
                        help="auto (fp32, and bf16 where oneDNN runs bf16), fp32, bf16 or fp32,bf16")
    parser.add_argument("--library", type=Path, default=None, help="another build of the C kernels to time")
    parser.add_argument("--out", type=Path, default=table.RESULTS)
    args = parser.parse_args(argv)
    if args.dtypes == "auto":
        dtypes = ["fp32", "bf16"] if onednn_bf16_available() else ["fp32"]
    else:
        dtypes = [d.strip() for d in args.dtypes.split(",")]
        if not dtypes or not set(dtypes) <= DTYPES.keys():
            parser.error(f"--dtypes: auto or a list of {', '.join(DTYPES)}, got {args.dtypes!r}")
    library = args.library.resolve() if args.library is not None else LIBRARY
    kernel = linear_rows.load(library)
    if kernel is None and args.library is not None:
        parser.error(f"--library {args.library}: no linear_rows in it (see the warning above)")
    torch.set_num_threads(args.threads)
    host = describe().summary()  # after set_num_threads: it names the threads the paths run on

    shapes = layer_shapes(args.kind, args.hidden, args.layers)
    paths, skipped = make_paths(dtypes, kernel, library)
    g = torch.Generator().manual_seed(0)
    # weights: [shape][copy] fp32 [out, in], scaled so that outputs of random rows are ~1
    weights = [[torch.randn(s.out_features, s.in_features, generator=g) / s.in_features**0.5
                for _ in range(s.copies)] for s in shapes]
    prepared = {p.name: [[p.prepare(w, s.segments) for w in ws] for s, ws in zip(shapes, weights)] for p in paths}
    errors = check(paths, shapes, weights, prepared, sorted(set(args.rows)))
    loads = {"before": list(os.getloadavg())}
    timings = measure(paths, shapes, prepared, args.rows, args.repeats)
    loads["after"] = list(os.getloadavg())

    setup = {"kind": args.kind, "hidden": args.hidden, "layers": args.layers, "threads": args.threads,
             "rows": args.rows, "repeats": args.repeats, "dtypes": dtypes, "library": str(library)}
    text = render(setup, host, shapes, paths, skipped, timings, errors, loads)
    print(text)
    name = result_name(args.kind, args.hidden, args.layers, args.threads, args.dtypes, args.library)
    payload = {"setup": setup, "host": host, "shapes": [asdict(s) for s in shapes], "skipped": skipped,
               "errors": errors, "load_average": loads,
               "timings": [{**asdict(t), "ms": t.ms, "gb_s": t.gb_s} for t in timings]}
    print(f"wrote {table.save(name, payload, text, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
