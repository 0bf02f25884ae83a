"""Building blocks shared by the decoder families: norms, rotary embedding, MLPs."""

from __future__ import annotations

import functools

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from kernels.select import kernels_for


# Several linears of one input run as one call (engine/model/cpu_linear.py's FusedLinears):
# input -> each member's output, in the order the module names them in its `fusible_linears`.
Projections = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


class RMSNorm(nn.Module):
    """RMSNorm; `zero_centered` is the Qwen3.5/Next form x*(1+w) computed in fp32."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = kernels_for(x.device).rms_norm  # the CPU's C norm (kernels/cpu/rms_norm.py), where built
        if native is not None:
            out = native(x, self.weight, self.eps, self.zero_centered)
            if out is not None:
                return out
        if not self.zero_centered and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op: decode runs ~65 a step
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.type_as(x)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm followed by a SiLU gate (output norm of GDN layers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' default when the config names none


class Rotary:
    """Rotary position embedding (half-rotation layout), with partial rotary and rope scaling.

    Not an nn.Module: it owns no weights, and keeping it off the module tree lets the
    model be built on the meta device and loaded with assign=True.
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        inv_freq, self.attention_scaling = _inv_freq(config, self.rotary_dim)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, rotary_dim]
        return cos_sin_of(positions.float()[:, None] * self.inv_freq[None, :], self.attention_scaling, dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; cos/sin: [T, R]
        r = self.rotary_dim
        rot, keep = x[..., :r], x[..., r:]
        out = rotate_half(rot, cos, sin)
        return torch.cat([out, keep], dim=-1) if keep.shape[-1] else out


def cos_sin_of(angles: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles [T, F] -> cos, sin [T, 2F] in the half-rotation layout (each frequency twice), scaled."""
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, R] rotated by cos/sin [T, R] in the half-rotation layout (the second half of each head's
    dims paired with the first)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _inv_freq(config: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind in ("linear", "dynamic"):
        # "dynamic" grows the base only past the trained length; within it, it equals default.
        return (inv_freq / factor if kind == "linear" else inv_freq), 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    old_len = float(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))
    mscale = float(scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low_dim: float = max(math.floor(correction_dim(beta_fast)), 0)
    high_dim: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low_dim == high_dim:
        high_dim += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low_dim) / (high_dim - low_dim)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv, mscale


def mrope_section_of(text_config: Mapping[str, Any]) -> tuple[int, int, int]:
    """The text config's `mrope_section` (rope_parameters or the older rope_scaling). Qwen3.5 interleaves
    the three axes over the rotary frequencies; transformers ignores `mrope_interleaved`, so a config
    saying false is refused rather than run differently from what it says."""
    params = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    if params.get("mrope_interleaved") is False:
        raise ValueError("text_config: mrope_interleaved is false; only Qwen3.5's interleaved M-RoPE is supported")
    section = tuple(int(s) for s in params.get("mrope_section", DEFAULT_MROPE_SECTION))
    if len(section) != 3:
        raise ValueError(f"text_config: mrope_section {list(section)} must have 3 entries (t, h, w)")
    return section[0], section[1], section[2]


class MRope:
    """Rotary cos/sin for [3, T] M-RoPE positions, [T, rotary_dim] in the half-rotation layout that
    `engine.model.layers.Rotary.apply` takes. Frequency i follows axis h where i % 3 == 1 and
    i < 3*section[1], axis w where i % 3 == 2 and i < 3*section[2], else t (interleaved M-RoPE).
    For three equal rows it equals `Rotary.cos_sin` of that row."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, mrope_section: Sequence[int]) -> None:
        n = inv_freq.shape[0]
        t, h, w = mrope_section
        if t + h + w != n or 3 * h - 2 >= n or 3 * w - 1 >= n:
            raise ValueError(f"mrope_section {list(mrope_section)} does not fit {n} rotary frequencies "
                             "(it must sum to them, h and w interleaved within them)")
        self.inv_freq = inv_freq
        self.attention_scaling = attention_scaling
        self.section = (t, h, w)

    @classmethod
    def for_model(cls, config: ModelConfig, device: torch.device) -> MRope:
        """The text model's frequencies (as ignis' Rotary computes them) and its config's mrope_section."""
        rotary = Rotary(config, device)
        text = config.raw.get("text_config") or config.raw
        return cls(rotary.inv_freq, rotary.attention_scaling, mrope_section_of(text))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [3, T] -> cos, sin: [T, rotary_dim]
        return cos_sin_of(self._interleave(positions.float()[..., None] * self.inv_freq), self.attention_scaling, dtype)

    def _interleave(self, angles: torch.Tensor) -> torch.Tensor:
        # angles: [3, T, F] -> [T, F]: the t row's, with the h and w rows' own frequencies put in
        _, h, w = self.section
        out = angles[0].clone()
        out[..., 1:3 * h:3] = angles[1, ..., 1:3 * h:3]
        out[..., 2:3 * w:3] = angles[2, ..., 2:3 * w:3]
        return out


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.fusible_linears = {"fused_gate_up": ("gate_proj", "up_proj")}
        self.fused_gate_up: Projections | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


# The most (token, expert) pairs a CPU step sends to the C kernel (64 tokens at top-8). Measured
# against grouped() at E=128, K=8 (kernels/cpu/moe_experts.py's table): the C kernel wins at every
# step of up to 64 tokens at both expert sizes (~2x at decode), and grouped() wins at 512 tokens with
# one thread (by ~17% at H=1024, I=128), where its GEMMs reuse each expert's weights over many tokens.
CPU_KERNEL_MAX_PAIRS = 512


class Experts(nn.Module):
    """Expert weights stacked as 3-D tensors (the transformers v5 layout)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; expert_ids, weights: [T, K]
        if x.device.type == "cpu":
            return self.on_cpu(x, expert_ids, weights)
        if _cuda_grouped_mm(x, self.down_proj):
            return self.grouped(x, expert_ids, weights)
        # Else on CUDA the grouped Triton GEMM (kernels/triton_moe_gemm.py). None where Triton is absent
        # (kernels/select.py then serves the torch references) and on other devices: the loop runs.
        grouped_gemm = kernels_for(x.device).moe_experts
        if grouped_gemm is not None:
            y = grouped_gemm(x, self.gate_up_proj, self.down_proj, expert_ids, weights)
            if y is not None:
                return y
        return self.per_expert(x, expert_ids, weights)

    def on_cpu(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A step of at most CPU_KERNEL_MAX_PAIRS (token, expert) pairs runs the C kernel, which reads
        only the experts hit (kernels/cpu/moe_experts.py, where built and given fp32); a larger one
        grouped(), whose GEMMs win once most experts are hit; a step of no tokens the loop (no GEMM)."""
        native = kernels_for(x.device).moe_experts
        # torch's CPU _grouped_mm refuses rows that are not 16-byte multiples: the C kernel takes those at any size
        unaligned = any(n * x.element_size() % 16 for n in self.down_proj.shape[1:])
        if native is not None and (expert_ids.numel() <= CPU_KERNEL_MAX_PAIRS or unaligned):
            y = native(x, self.gate_up_proj, self.down_proj, expert_ids, weights)
            if y is not None:
                return y
        if x.shape[0]:
            return self.grouped(x, expert_ids, weights)
        return self.per_expert(x, expert_ids, weights)

    def grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every (token, expert) pair sorted by expert, then one grouped GEMM per projection over all
        experts (torch._grouped_mm: each expert's rows against its weights): no Python loop and no host
        sync per step. A decode step of a 128-expert model was one loop turn per expert hit."""
        k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)  # [T*K]: pairs grouped by expert
        token = order // k
        # counted with index_add_, not bincount, which reads the ids' max back to the host on CUDA
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        ends = torch.cumsum(counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)), 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x.index_select(0, token), self.gate_up_proj.transpose(1, 2),
                                     offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def per_expert(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One loop turn per expert hit, with a host sync for the experts' list: only where no grouped
        GEMM runs (CUDA without Triton, devices other than the CPU and CUDA, and a CPU step of no tokens
        the C kernel does not take). The CPU runs its C kernel or grouped() (on_cpu), bf16 on Hopper
        grouped(), other CUDA cases the Triton kernel (kernels/triton_moe_gemm.py)."""
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():
            token_idx, slot = torch.where(expert_ids == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
        return out


def _cuda_grouped_mm(x: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch._grouped_mm (CUTLASS) runs these experts on CUDA: bf16 on Hopper and later, with
    16-byte aligned rows. Measured on an H200 at Qwen3-30B-A3B's expert sizes (E=128, top-8, H=2048,
    I=768): 0.44 / 0.73 / 0.79 ms at 1 / 8 / 512 tokens against the Triton kernel's 0.54-0.73 /
    0.58-1.08 / 0.80-0.88 ms and the per-expert loop's 2.9 / 17 / 28 ms. Elsewhere (fp32, fp16, older
    GPUs) the Triton kernel runs."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or x.shape[0] == 0:
        return False
    hidden, inter = down.shape[1], down.shape[2]
    return hidden % 8 == 0 and inter % 8 == 0 and _hopper_or_later(x.device)


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    """Asked once per device, not in every MoE layer of every step."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


class SparseMoE(nn.Module):
    """Top-k routed experts, plus a sigmoid-gated shared expert where the family has one (Qwen3-Next,
    Qwen3.5-MoE; Qwen3-MoE has none)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Router(config.num_experts, config.hidden_size)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(config.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        routed = self.experts(x, top_ids, top_w.to(x.dtype))
        if self.shared_expert is None or self.shared_expert_gate is None:
            return routed
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
