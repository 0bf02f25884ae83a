"""Softmax attention layer over the paged KV cache (Llama, Mistral, Qwen2/3, Qwen3.5/Next)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kv.device_cache import DeviceCache
from engine.model.batch import DecodeGather, ForwardBatch
from engine.model.config import SLIDING_ATTENTION, ModelConfig
from engine.model.layers import Projections, RMSNorm, Rotary
from kernels.select import Kernels, kernels_for


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.gated = config.gated_attention
        self.scale = config.head_dim**-0.5
        self.window = config.sliding_window if config.layer_types[layer] == SLIDING_ATTENTION else None
        q_out = config.num_heads * config.head_dim * (2 if self.gated else 1)
        kv_out = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_out, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias)
        # engine/model/cpu_linear.py may run q, k and v as one call (set at load; None: three calls)
        self.fusible_linears = {"fused_qkv": ("q_proj", "k_proj", "v_proj")}
        self.fused_qkv: Projections | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.zero_centered_norm)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.zero_centered_norm)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: DeviceCache,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        # x: [T, hidden]
        if self.fused_qkv is not None:
            q, k, v = self.fused_qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, -1)
        gate = None
        if self.gated:
            # Per head: first head_dim is the query, next head_dim the output gate.
            q, gate = q.split(self.head_dim, dim=-1)
            gate = gate.reshape(t, -1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = cos_sin
        k_cache, v_cache = cache.k_cache(self.layer), cache.v_cache(self.layer)
        ops = kernels_for(x.device)  # Triton on CUDA, the C decode attention + torch references on the CPU
        # The CPU's one C call for the rope and the cache writes (kernels/cpu/rope_cache.py), where it takes them.
        rotated = None if ops.rope_and_cache is None else \
            ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, batch.kv_pages, batch.kv_offsets)
        if rotated is not None:
            q = rotated
        else:
            q = rotary.apply(q, cos, sin)
            _store(k_cache, v_cache, rotary.apply(k, cos, sin), v, batch)

        gather = batch.decode
        # All single-token decodes in one call (K/V may be in another dtype, engine.kv_dtype: the kernels
        # read it as it is and return q's dtype). On the CPU it reads the pages in place (kernels/cpu/).
        if gather is not None and gather.every_row:  # a decode-only step: its output is the layer's
            out = self._decode(ops, q, k_cache, v_cache, gather)
            return self.o_proj(self._gated(out.to(q.dtype).reshape(t, -1), gate))
        out = torch.empty_like(q)  # [T, H, D]
        if gather is not None:  # the decodes beside prefills: their rows picked out, in one call
            out[gather.rows] = self._decode(ops, q[gather.rows], k_cache, v_cache, gather).to(out.dtype)
        for seq in (batch.others if gather is not None else batch.seqs):  # the decodes ran above
            rows = slice(seq.offset, seq.offset + seq.length)
            out[rows] = ops.paged_attention(
                q[rows], k_cache, v_cache, seq.page_table, seq.end, self.scale, self.window
            ).to(out.dtype)
        return self.o_proj(self._gated(out.reshape(t, -1), gate))

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, cache: DeviceCache, rotary: Rotary,
                 cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Only the rows' K/V into the cache, as forward writes them, for rows whose attention output
        nobody reads (the MTP drafter's window where no draft is made from it): no q, no attention."""
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        _store(cache.k_cache(self.layer), cache.v_cache(self.layer), rotary.apply(k, *cos_sin), v, batch)

    def _decode(self, ops: Kernels, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                gather: DecodeGather) -> torch.Tensor:
        """Single-token decodes' attention, q [B, H, D]: over their page tables where the kernel reads them
        (and the gather holds them), else over the gather's [B, L] positions."""
        from_table = ops.paged_decode_from_table
        if gather.table is not None and from_table is not None:
            return from_table(q, k_cache, v_cache, gather.table, gather.lengths, gather.page_size, self.scale,
                              self.window)
        return ops.paged_decode_attention(q, k_cache, v_cache, *gather.positional(), self.scale, self.window)

    @staticmethod
    def _gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention output [T, H*D] through its output gate (gated attention: Qwen3.5/Next)."""
        return out if gate is None else out * torch.sigmoid(gate)


def _store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    """The rows' rotated K and V into their pages' slots (in the cache's dtype)."""
    k_cache[batch.kv_pages, batch.kv_offsets] = k.to(k_cache.dtype)
    v_cache[batch.kv_pages, batch.kv_offsets] = v.to(v_cache.dtype)
