"""Which implementation of each kernel a device runs: the one place that decides.

CUDA runs the Triton kernels (kernels/triton_*.py); the CPU runs the torch references
(kernels/paged_attention.py, gated_delta.py, causal_conv.py, state_copy.py, fp8_gemm.py) but for decode
attention (reading K/V pages in place), the GDN decode step (fused) and the GDN prefill conv,
which are the C/OpenMP kernels of kernels/cpu/ (built by `make kernels`; without them, or with
IGNIS_CPU_KERNELS=reference, the references run, logged once);
other devices run the references. The MoE experts have a kernel on CUDA (kernels/triton_moe_gemm.py) and,
for decode-sized steps, on the CPU (kernels/cpu/moe_experts.py); elsewhere engine/model/layers.py's
Experts runs its torch forms. Triton is imported only when a CUDA device asks, so CPU serving never
loads it; on CUDA without a working Triton the references run and a warning says so, once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

log = logging.getLogger("ignis.engine")


class PagedAttention(Protocol):
    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 context_len: int, scale: float, sliding_window: int | None = None) -> torch.Tensor: ...


class PagedDecodeAttention(Protocol):
    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                 offsets: torch.Tensor, valid: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor: ...


class ChunkGatedDeltaRule(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, chunk_size: int = 64,
                 acc: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]: ...


class GatedDeltaDecodeStep(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: list[torch.Tensor]) -> torch.Tensor: ...


class CausalConv(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


class CopyRows(Protocol):
    def __call__(self, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None: ...


class MoeExperts(Protocol):
    # None: the kernel does not take these operands (the CPU's C kernel, on anything but fp32).
    def __call__(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor | None: ...


class Fp8BlockLinear(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Kernels:
    """One implementation of every kernel, all behind the torch references' signatures."""

    name: str  # "torch", "cpu" (the references but for decode attention) or "triton"
    paged_attention: PagedAttention
    paged_decode_attention: PagedDecodeAttention
    chunk_gated_delta_rule: ChunkGatedDeltaRule
    gated_delta_decode_step_: GatedDeltaDecodeStep
    causal_conv1d: CausalConv
    copy_rows_: CopyRows
    fp8_block_linear: Fp8BlockLinear  # a linear on FP8 weights with block scales (engine/model/fp8.py's Fp8Linear)
    # paged_decode_attention reads pages in place, so one batched call costs nothing per padded
    # position and wins at any context length (engine/model/batch.py asks, to batch the decodes).
    decode_in_place: bool = False
    # paged_decode_attention over each sequence's page table [B, W] and context length [B] instead of
    # pages/offsets/valid [B, L] (kernels/cpu/paged_decode.py: q, k, v, table, lengths, page_size, scale,
    # window); None: the [B, L] form runs. The decode-only batch then builds no [B, L] tensors.
    paged_decode_from_table: Callable[..., torch.Tensor] | None = None
    # The CPU's fused GDN decode step (conv taps + delta rule in one C call per layer,
    # kernels/cpu/gdn_decode.py); None: causal_conv1d and gated_delta_decode_step_ run.
    gdn_decode_fused: Callable[..., torch.Tensor] | None = None
    # The CPU's RMSNorm (kernels/cpu/rms_norm.py: x, weight, eps, zero_centered -> out, or None
    # where it does not take x); None: engine/model/layers.py's torch forms run.
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor | None] | None = None
    # The CPU's rotary embedding + KV-cache write of an attention layer (kernels/cpu/rope_cache.py:
    # returns rope(q), or None where it does not take the shapes); None: the torch ops run.
    rope_and_cache: Callable[..., torch.Tensor | None] | None = None
    # The CPU's argmax over rows for greedy sampling (kernels/cpu/argmax.py: [B, V] -> int64 [B], or
    # None where it does not take x); None: torch.argmax runs.
    argmax_rows: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    # The same over raw logits as sampling processes them (NaN -> -inf, capped at a ceiling), for a
    # batch that nothing else changes: (x, ceiling) -> int64 [B], or None; None: the copy is processed.
    argmax_rows_capped: Callable[[torch.Tensor, float], torch.Tensor | None] | None = None
    # The routed experts of an MoE layer (kernels/moe_gemm.py's signature and reference): on CUDA one
    # grouped GEMM per projection (Triton), on the CPU the C kernel reading only the experts hit, which
    # Experts runs for decode-sized steps; None: engine/model/layers.py's Experts runs its torch forms.
    moe_experts: MoeExperts | None = None
    # The CPU's linear layer at a decode step's row counts (kernels/cpu/linear_rows.py), which
    # engine/model/linear_calibration.py may choose over oneDNN per row count; None: oneDNN runs.
    linear_rows: Callable[..., torch.Tensor] | None = None
    # The batched LoRA product (kernels/lora.py's signature): on CUDA kernels/triton_lora.py, on the CPU
    # kernels/cpu/lora_rows.c (kernels/cpu/lora_rows.py: fp32 with b the view bt.permute(2, 0, 1) of a
    # contiguous bt [S, R, out], else it returns None); None (or a None result): engine/lora runs it in torch.
    lora_delta: Callable[..., torch.Tensor | None] | None = None
    # The CPU's product for several linears of one input, prepared once for their weights (sites ->
    # a call (x, outs, slots) -> bool adding each delta into its output in place, or None where C does not
    # take them; kernels/cpu/lora_rows.py's load_add); None elsewhere.
    lora_add: Callable[..., Callable[..., bool] | None] | None = None


def torch_kernels() -> Kernels:
    from kernels import causal_conv, fp8_gemm, gated_delta, paged_attention, state_copy

    return Kernels("torch", paged_attention.paged_attention, paged_attention.paged_decode_attention,
                   gated_delta.chunk_gated_delta_rule, gated_delta.gated_delta_decode_step_,
                   causal_conv.causal_conv1d, state_copy.copy_rows_, fp8_gemm.fp8_block_linear)


def cpu_kernels() -> Kernels:
    """The references, with the in-place C decode attention when its library loads (else logged)."""
    references = torch_kernels()
    if os.environ.get("IGNIS_CPU_KERNELS", "native") == "reference":
        log.info("IGNIS_CPU_KERNELS=reference: the CPU runs the torch reference kernels")
        return references
    from kernels.cpu import (argmax, causal_conv, gdn_decode, linear_rows, lora_rows, moe_experts, paged_decode,
                             rms_norm, rope_cache)

    decode = paged_decode.load()
    if decode is None:
        return references
    return dataclasses.replace(references, name="cpu", paged_decode_attention=decode, decode_in_place=True,
                               paged_decode_from_table=paged_decode.load_from_table(),
                               gdn_decode_fused=gdn_decode.load(), rms_norm=rms_norm.load(),
                               rope_and_cache=rope_cache.load(), argmax_rows=argmax.load(),
                               argmax_rows_capped=argmax.load_capped(), moe_experts=moe_experts.load(),
                               linear_rows=linear_rows.load(), lora_delta=lora_rows.load(),
                               lora_add=lora_rows.load_add(),
                               causal_conv1d=causal_conv.load() or references.causal_conv1d)


def triton_kernels() -> Kernels:
    """The Triton kernels; raises ImportError without Triton."""
    from kernels import (triton_causal_conv, triton_fp8_gemm, triton_gated_delta, triton_lora, triton_moe_gemm,
                         triton_paged_attention, triton_state_copy)

    return Kernels("triton", triton_paged_attention.paged_attention, triton_paged_attention.paged_decode_attention,
                   triton_gated_delta.chunk_gated_delta_rule, triton_gated_delta.gated_delta_decode_step_,
                   triton_causal_conv.causal_conv1d, triton_state_copy.copy_rows_, triton_fp8_gemm.fp8_block_linear,
                   moe_experts=triton_moe_gemm.moe_experts, lora_delta=triton_lora.lora_delta)


@functools.cache
def _references() -> Kernels:
    return torch_kernels()


@functools.cache
def _cuda_kernels() -> Kernels:
    try:
        return triton_kernels()
    except ImportError as e:  # a CUDA torch without (a working) triton: slower, still correct
        log.warning("Triton is not available (%s): CUDA runs the torch reference kernels", e)
        return _references()


@functools.cache
def _cpu() -> Kernels:
    return cpu_kernels()


def kernels_for(device: torch.device) -> Kernels:
    """The kernels `device` runs: Triton on CUDA, the C decode attention and torch references on
    the CPU, the torch references elsewhere."""
    if device.type == "cuda":
        return _cuda_kernels()
    return _cpu() if device.type == "cpu" else _references()
