"""Gated DeltaNet linear-attention layer (Qwen3.5 and Qwen3-Next) over per-sequence state slots.

A chunk runs the chunked delta rule (kernels/gated_delta.py), except, where the CPU's fused decode
kernel runs, a short chunk that continues a sequence (a speculative verify's pending token and
drafts, a paced prefill's piece, a short turn): its tokens step through the recurrence one after
another in that kernel, all such chunks of the step in one call. The chunked form pads to its chunk
of 64 and pays a dozen batched matmuls a layer however few the tokens (measured below).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv.device_cache import DeviceCache
from engine.model.batch import ForwardBatch, SeqView
from engine.model.config import ModelConfig
from engine.model.layers import GatedRMSNorm, Projections
from kernels.cpu import gdn_decode
from kernels.select import Kernels, kernels_for

# The longest continuation chunk stepped through the recurrence (the CPU's fused kernel) rather than
# run chunked. One layer of the bench hybrid geometry (h1024, 16 value heads of 128x128), 2 threads:
# 1 sequence of T tokens, stepped vs chunked: T=2 0.85 vs 7.6 ms, T=16 2.9 vs 8.8, T=64 11 vs 15,
# T=128 30 vs 32, T=192 42 vs 37; 8 sequences of 5 tokens 6.4 vs 165 ms.
STEPPED_CHUNK_TOKENS = 64


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.hk = config.linear_num_key_heads
        self.hv = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.key_dim = config.gdn_key_dim
        self.value_dim = config.gdn_value_dim
        self.fused = config.fused_gdn_projections
        hidden = config.hidden_size
        conv_dim = config.gdn_conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel, groups=conv_dim, bias=False)
        if self.fused:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.hv, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.hv, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        inputs = ("in_proj_qkvz", "in_proj_ba") if self.fused else \
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.fusible_linears = {"fused_inputs": inputs}
        self.fused_inputs: Projections | None = None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> mixed qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        t = x.shape[0]
        if not self.fused:
            if self.fused_inputs is not None:
                mixed, z, b, a = self.fused_inputs(x)
            else:
                mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
            return mixed, z.view(t, self.hv, self.dv), b, a
        # Qwen3-Next packs the projections per key-head group: [q, k, v-group, z-group] and [b-group, a-group].
        ratio = self.hv // self.hk
        if self.fused_inputs is not None:
            qkvz, ba = self.fused_inputs(x)
        else:
            qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        qkvz = qkvz.view(t, self.hk, 2 * self.dk + 2 * ratio * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, ratio * self.dv, ratio * self.dv], dim=-1)
        ba = ba.view(t, self.hk, 2 * ratio)
        b, a = ba.split([ratio, ratio], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: DeviceCache) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        li = cache.linear_index(self.layer)
        normed = torch.empty(t, self.value_dim, dtype=x.dtype, device=x.device)  # the output projection's input
        ops = kernels_for(x.device)  # Triton on CUDA, the torch references elsewhere

        kept = batch.kept_inputs
        if kept is not None:
            for seq in batch.others:
                if seq.state_slot in kept.slots:
                    rows = slice(seq.offset, seq.offset + seq.length)
                    kept.keep(seq.state_slot, self.layer, (mixed[rows], z[rows], b[rows], a[rows]))
        if batch.decodes:
            self._decode(ops, batch, batch.decodes, mixed, z, b, a, weight, cache, li, normed)
        if batch.others:
            self._continue(ops, batch.others, mixed, z, b, a, weight, cache, li, normed)
        return self.out_proj(normed)

    @torch.inference_mode()
    def replay(self, runs: Sequence[tuple[int, tuple[torch.Tensor, ...]]], cache: DeviceCache) -> None:
        """Each (slot, kept inputs) run through the recurrence from the state in its slot, as the forward ran
        them (the same path, the same inputs): the slot ends where the forward was after those tokens."""
        mixed, z, b, a = (torch.cat([inputs[i] for _, inputs in runs]) for i in range(4))
        views, at = [], 0
        for slot, inputs in runs:
            length = inputs[0].shape[0]
            # start 1: a continuation of the state in its slot (no pages: a recurrent layer reads none)
            views.append(SeqView(at, length, 1, mixed.new_empty(0, dtype=torch.int64), 0, 0, slot))
            at += length
        weight = self.conv1d.weight.squeeze(1)
        li = cache.linear_index(self.layer)
        normed = torch.empty(at, self.value_dim, dtype=mixed.dtype, device=mixed.device)  # not read
        self._continue(kernels_for(mixed.device), views, mixed, z, b, a, weight, cache, li, normed)

    def _continue(
        self, ops: Kernels, seqs: Sequence[SeqView], mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
        a: torch.Tensor, weight: torch.Tensor, cache: DeviceCache, li: int, normed: torch.Tensor,
    ) -> None:
        """Chunks that are not single-token decodes: a short continuation is stepped through the fused
        kernel (all of them in one call), anything else runs the chunked rule."""
        steps = ops.gdn_decode_fused is not None and gdn_decode.supports(cache.conv, cache.recurrent, self.dk, self.dv)
        stepped = []
        for seq in seqs:
            if steps and 0 < seq.start and seq.length <= STEPPED_CHUNK_TOKENS:
                stepped.append(seq)
            else:
                self._prefill(ops, seq, mixed, z, b, a, weight, cache, li, normed)
        if stepped:
            self._step_through(ops, stepped, mixed, z, b, a, weight, cache, li, normed)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The write strength beta and the log decay g (<= 0) of these rows."""
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core, z: [R, Hv, Dv] -> [R, value_dim]"""
        return self.norm(core.reshape(-1, self.dv), z.reshape(-1, self.dv)).view(core.shape[0], -1)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # mixed: [B, T, conv_dim] -> q, k [B, T, Hk, Dk], v [B, T, Hv, Dv]
        bsz, t, _ = mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return q.view(bsz, t, self.hk, self.dk), k.view(bsz, t, self.hk, self.dk), v.view(bsz, t, self.hv, self.dv)

    def _prefill(
        self, ops: Kernels, seq: SeqView, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        weight: torch.Tensor, cache: DeviceCache, li: int, normed: torch.Tensor,
    ) -> None:
        slot = _slot(seq)
        rows = slice(seq.offset, seq.offset + seq.length)
        fresh = seq.start == 0  # a fresh sequence starts from zeros, whatever the slot held
        beta, g = self._gates(b[rows], a[rows])
        conv_in = mixed[rows].T.unsqueeze(0)  # [1, C, T]
        conv_state = None if fresh else cache.conv[slot, li].unsqueeze(0)
        conv_out, new_conv = ops.causal_conv1d(conv_in, weight, conv_state)
        q, k, v = self._split_heads(conv_out.transpose(1, 2))
        state = None if fresh else cache.recurrent[slot, li].unsqueeze(0)
        out, new_state = ops.chunk_gated_delta_rule(q, k, v, g.unsqueeze(0), beta.unsqueeze(0), state)
        normed[rows] = self._gated_norm(out[0], z[rows]).to(normed.dtype)
        cache.conv[slot, li] = new_conv[0]
        cache.recurrent[slot, li] = new_state[0]

    def _decode(
        self, ops: Kernels, batch: ForwardBatch, seqs: Sequence[SeqView], mixed: torch.Tensor, z: torch.Tensor,
        b: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, cache: DeviceCache, li: int, normed: torch.Tensor,
    ) -> None:
        """All single-token decodes of the step: projections and conv batched, each recurrent
        state updated in its own slot (gathering them would copy 1 MiB a layer at hidden 1024)."""
        gather = batch.decode  # a decode-only step (its rows are all the step's rows): no rows to pick
        every_row = gather is not None and gather.every_row
        # The gather holds the decodes' rows (once a step); without one, their offsets say them.
        rows = slice(None) if every_row else gather.rows if gather is not None else \
            torch.tensor([s.offset for s in seqs], dtype=torch.int64, device=mixed.device)
        slot_ids = list(batch.decode_slots)  # read once for the step, not once a sequence in every layer
        if None in slot_ids:
            raise ValueError("a hybrid model needs a state slot for every sequence")
        fused = ops.gdn_decode_fused
        if fused is not None and gdn_decode.supports(cache.conv, cache.recurrent, self.dk, self.dv):
            # One C call: gates, conv taps, head split, q/k norms, the delta rule (states in place), gated norm.
            into = normed if every_row and normed.dtype == torch.float32 else None
            out = fused(mixed[rows], a[rows], b[rows], z[rows], self.A_log, self.dt_bias, self.norm.weight,
                        self.norm.eps, weight, cache.conv, cache.recurrent, li, slot_ids, self.hk, self.dk, self.dv,
                        into)
            if into is None:
                normed[rows] = out.to(normed.dtype)
            return
        beta, g = self._gates(b[rows], a[rows])
        slots = torch.tensor(slot_ids, dtype=torch.int64, device=mixed.device)
        conv_out, new_conv = ops.causal_conv1d(mixed[rows].unsqueeze(-1), weight, cache.conv[slots, li])
        q, k, v = self._split_heads(conv_out.transpose(1, 2))  # [B, 1, ...]
        states = [cache.recurrent[slot, li] for slot in slot_ids]  # views, updated in place
        out = ops.gated_delta_decode_step_(q, k, v, g.unsqueeze(1), beta.unsqueeze(1), states)
        normed[rows] = self._gated_norm(out[:, 0], z[rows]).to(normed.dtype)
        cache.conv[slots, li] = new_conv

    def _step_through(
        self, ops: Kernels, seqs: Sequence[SeqView], mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
        a: torch.Tensor, weight: torch.Tensor, cache: DeviceCache, li: int, normed: torch.Tensor,
    ) -> None:
        """Short continuation chunks through the recurrence, token by token, each state in its slot: one
        call of the fused kernel for all of them, each state read from memory once for its tokens."""
        assert ops.gdn_decode_fused is not None
        tokens = [seq.length for seq in seqs]
        adjacent = all(s.offset + s.length == t.offset for s, t in zip(seqs, seqs[1:]))
        rows: slice | torch.Tensor = slice(seqs[0].offset, seqs[-1].offset + seqs[-1].length) if adjacent else \
            torch.cat([torch.arange(seq.offset, seq.offset + seq.length, device=mixed.device) for seq in seqs])
        out = ops.gdn_decode_fused(mixed[rows], a[rows], b[rows], z[rows], self.A_log, self.dt_bias, self.norm.weight,
                                   self.norm.eps, weight, cache.conv, cache.recurrent, li, [_slot(s) for s in seqs],
                                   self.hk, self.dk, self.dv, None, tokens)
        normed[rows] = out.to(normed.dtype)


def _slot(seq: SeqView) -> int:
    if seq.state_slot is None:
        raise ValueError("a hybrid model needs a state slot for every sequence")
    return seq.state_slot
