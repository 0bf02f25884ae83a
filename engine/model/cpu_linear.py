"""Linear layers on oneDNN for fp32 CPU inference.

torch's fp32 `F.linear` goes to MKL's sgemm, which on this AMD EPYC runs at half the
core's peak and, at the few rows of a decode step, far below the memory's bandwidth.
oneDNN's inner product on a weight reordered once at load into its blocked layout
(`mkldnn::_reorder_linear_weight` / `_linear_pointwise`, the pair inductor's CPU backend
freezes linears into) is faster at every row count (measured, 2 threads, 48 distinct
3072x1024 weights: 29.4 -> 14.2 ms at 1 row, 46.3 -> 15.5 ms at 8, i.e. 39-43 GB/s
against a 48 GB/s streaming read; at 2048 rows 192 -> 428 GFLOPS). It also beats the older
`to_mkldnn` path (dense <-> mkldnn conversions on every call): 17.7 and 25.0 ms there.
Results differ from MKL's by summation order only (fp32 rounding, ~1e-6 relative).

`engine.weight_dtype=bfloat16` packs the weights in bf16 instead, half the bytes a decode step
streams, and each call rounds its input rows to bf16 and returns fp32: oneDNN's AVX512-BF16
dot products accumulate in fp32, as llama.cpp does with a bf16 GGUF (it converts activations
to bf16 for its bf16 dot product too).

Calls of at most DECODE_ROWS rows (a decode step's) may run kernels/cpu/linear_rows.c instead, on
nn.Linear's own [out, in] weights (a bf16 copy with bf16 weights): which path runs each row count is
measured at load (engine/model/linear_calibration.py), since how fast a library's path is depends on
the CPU (issue 50: MKL and oneDNN pick their code by vendor and ISA). A module's `c_rows` says where C runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu.linear_rows import LinearRows, RowWeights

# linear_rows.c's ROWS_MAX: a call of at most this many rows may run the C kernel.
DECODE_ROWS = 8


# oneDNN keeps its primitives, and torch's ideep layer its computations, per shape, and a linear's shape
# includes its row count: prefill chunks of every length fill both caches (1024 entries each by default).
# Prompts of random lengths grew ignis-tiny's engine from 513 to 1,311 MiB over 600 requests, still
# rising; at 64 entries each it stays at ~600 MiB, and a decode step (fixed shapes) still hits.
SHAPE_CACHE_ENTRIES = 64
# Each cache's variable, with the other names it is read under (oneDNN also reads its older DNNL_ one).
SHAPE_CACHE_VARIABLES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": ("DNNL_PRIMITIVE_CACHE_CAPACITY",),
                         "LRU_CACHE_CAPACITY": ()}


def bound_shape_caches() -> None:
    """Bound both per-shape caches, each unless the environment sizes it. They are read when the first
    primitive is made, so this runs before any linear is packed (in a process that made one before, it
    changes nothing)."""
    for name, aliases in SHAPE_CACHE_VARIABLES.items():
        if not any(n in os.environ for n in (name, *aliases)):
            os.environ[name] = str(SHAPE_CACHE_ENTRIES)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16_available() -> bool:
    """Whether oneDNN runs bf16 inner products on this CPU: it needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses to pack a bf16 weight without them (an AVX2-only EPYC has neither)."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight [out, in] in oneDNN's blocked layout (in `weight_dtype`), and its bias in that dtype."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(weight_dtype))
    return packed, None if bias is None else bias.detach().to(weight_dtype)


def run_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, weight_dtype: torch.dtype) -> torch.Tensor:
    """fp32 rows through a packed weight: fp32 out (bf16 weights: the rows rounded to bf16 first)."""
    rows = x.contiguous() if weight_dtype == torch.float32 else x.to(weight_dtype)
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out if out.dtype == torch.float32 else out.float()


@dataclass(slots=True)
class CRows:
    """Where a packed linear runs the C kernel: its weights as C reads them, and the row counts."""

    kernel: LinearRows
    weights: RowWeights
    rows: frozenset[int]


def row_weights(weights: list[torch.Tensor], biases: list[torch.Tensor | None], weight_dtype: torch.dtype
                ) -> RowWeights:
    """The weights as linear_rows.c reads them: fp32 as they are (the checkpoint's mapped tensors, no
    copy), bf16 as a contiguous copy (half the fp32 bytes); biases in fp32, rounded to the weights'
    dtype first as pack_weight rounds them."""
    return RowWeights.of([w.detach().to(weight_dtype).contiguous() for w in weights],
                         [None if b is None else b.detach().to(weight_dtype).float().contiguous() for b in biases])


class PackedLinear(nn.Module):
    """What OneDnnLinear and FusedLinears share: an fp32 call runs oneDNN on the packed weight, or the
    C kernel when `c_rows` names its row count."""

    packed_weight: torch.Tensor
    packed_bias: torch.Tensor | None
    in_features: int
    weight_dtype: torch.dtype
    c_rows: CRows | None

    def c_weights(self) -> RowWeights:
        """The weights as the C kernel reads them (made on each call: the caller keeps them)."""
        raise NotImplementedError

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c_rows
        if c is not None and x.numel() // self.in_features in c.rows:
            return c.kernel(x, c.weights)
        return run_packed(x, self.packed_weight, self.packed_bias, self.weight_dtype)


class OneDnnLinear(PackedLinear):
    """nn.Linear whose weight is also kept in oneDNN's blocked layout (in `weight_dtype`), which
    every fp32 call uses (or the C kernel, at the row counts `c_rows` names)."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight_dtype = weight_dtype
        self.weight = linear.weight  # the original (memory-mapped) tensor: state_dict, tied weights
        self.bias = linear.bias
        packed, bias = pack_weight(linear.weight, linear.bias, weight_dtype)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("packed_bias", bias, persistent=False)
        self.c_rows = None

    def c_weights(self) -> RowWeights:
        return row_weights([self.weight], [self.bias], self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # only fp32 models are packed; anything else is a caller's choice
            return F.linear(x, self.weight, self.bias)
        return self._linear(x)


class FusedLinears(PackedLinear):
    """Linears that read the same input (q|k|v, gate|up, a GDN layer's input projections) run as
    one oneDNN call over their weights stacked by rows; returns each one's output, as views.

    At a decode step's few rows every call pays a fixed cost, and in bf16 a rounding of its
    input, that one call pays once. The members stay on their module as plain nn.Linear (their
    memory-mapped weights are the state_dict); only this module's packed copy is read.
    """

    packed_weight: torch.Tensor
    packed_bias: torch.Tensor | None

    def __init__(self, linears: list[nn.Linear], weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.sizes = [linear.out_features for linear in linears]
        self.in_features = linears[0].in_features
        self.weight_dtype = weight_dtype
        self.members = [(linear.weight, linear.bias) for linear in linears]  # not registered: the members' own
        self.c_rows = None
        biases = [linear.bias for linear in linears]
        weight = torch.cat([linear.weight.detach() for linear in linears])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        packed, packed_bias = pack_weight(weight, bias, weight_dtype)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("packed_bias", packed_bias, persistent=False)

    def c_weights(self) -> RowWeights:
        return row_weights([w for w, _ in self.members], [b for _, b in self.members], self.weight_dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._linear(x).split(self.sizes, dim=-1)


def _packable(linear: nn.Module) -> bool:
    return isinstance(linear, nn.Linear) and linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32


def _fuse_groups(model: nn.Module, weight_dtype: torch.dtype) -> set[int]:
    """Give each module that names fusible groups (its `fusible_linears`: attribute -> member
    names) a FusedLinears per group; returns the ids of the linears fused."""
    fused: set[int] = set()
    for module in list(model.modules()):
        for attribute, names in getattr(module, "fusible_linears", {}).items():
            members = [getattr(module, name) for name in names]
            if not all(_packable(m) for m in members) or len({m.in_features for m in members}) != 1 \
                    or len({m.bias is None for m in members}) != 1:
                continue
            setattr(module, attribute, FusedLinears(members, weight_dtype))
            fused.update(id(m) for m in members)
    return fused


def packed_linears(model: nn.Module) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def use_onednn_linears(model: nn.Module, weight_dtype: torch.dtype = torch.float32) -> None:
    """Run every fp32 CPU nn.Linear of `model` on oneDNN: the fusible groups as one FusedLinears
    each, the others swapped for an OneDnnLinear (other linears stay as they are). Which row counts
    run the C kernel instead is engine/model/linear_calibration.py's to set."""
    if not onednn_available():
        if weight_dtype != torch.float32:
            raise RuntimeError("engine.weight_dtype needs oneDNN (torch.backends.mkldnn), which this torch lacks")
        return
    bound_shape_caches()
    fused = _fuse_groups(model, weight_dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _packable(child) and id(child) not in fused:
                assert isinstance(child, nn.Linear)
                setattr(parent, name, OneDnnLinear(child, weight_dtype))
