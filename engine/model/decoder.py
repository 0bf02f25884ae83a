"""The decoder-only causal LM shared by all supported families.

Parameter names match Hugging Face checkpoints (model.layers.N.self_attn.q_proj...),
so a safetensors state dict loads onto it directly.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kv.device_cache import DeviceCache
from engine.model.attention import Attention
from engine.model.batch import BatchMedia, ForwardBatch
from engine.model.config import LINEAR_ATTENTION, ModelConfig
from engine.model.gated_deltanet import GatedDeltaNet
from engine.model.layers import MLP, MRope, RMSNorm, Rotary, SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer)
        else:
            self.self_attn = Attention(config, layer)
        self.mlp: nn.Module = (
            SparseMoE(config)
            if config.is_moe_layer(layer)
            else MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        )
        zc = config.zero_centered_norm
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zc)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zc)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: DeviceCache,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, batch, cache)
        else:
            h = self.self_attn(h, batch, cache, rotary, cos_sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, cache: DeviceCache, rotary: Rotary,
                 cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Only what forward leaves in the cache (an attention layer's K/V), its output unread."""
        if self.is_linear:
            raise ValueError("a linear-attention layer's state is its output's: run forward")
        self.self_attn.write_kv(self.input_layernorm(x), batch, cache, rotary, cos_sin)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)


class CausalLM(nn.Module):
    """Runs one step: a flat run of tokens from many sequences -> logits for the rows asked."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: Rotary | None = None  # set by the loader once weights are on their device
        # M-RoPE (a checkpoint with a vision tower): the angles of image rows, whose h and w positions differ
        # from t. Text rows' three positions are equal, where M-RoPE is `rotary` itself.
        self.mrope: MRope | None = None
        # The last forward's final normed hidden state of every row [T, H], when the caller asked for it
        # (an MTP drafter reads it: engine/speculative/mtp_drafter.py); its caller takes it at once.
        self.hidden: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: DeviceCache, keep_hidden: bool = False) -> torch.Tensor:
        """Returns logits [R, vocab] in fp32 for batch.logits_rows; `keep_hidden`: every row's final normed
        hidden state is left in `hidden`."""
        if self.rotary is None:
            raise RuntimeError("model has no rotary tables: it was not built by the loader (this is a bug)")
        media = batch.media
        if media is None:
            x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
            cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        else:
            x, cos_sin = self._with_images(batch, media)
        for layer in self.model.layers:
            x = layer(x, batch, cache, self.rotary, cos_sin)
        if keep_hidden:
            self.hidden = x = self.model.norm(x)
            if batch.logits_rows.numel() == 0:
                return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=x.device)
            return self.lm_head(x[batch.logits_rows]).float()
        if batch.logits_rows.numel() == 0:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=x.device)
        x = self.model.norm(x[batch.logits_rows])
        return self.lm_head(x).float()

    def _with_images(self, batch: ForwardBatch, media: BatchMedia
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Embeddings and cos/sin of a step with image rows: theirs are the vision tower's output (their
        ids are key ids, never embedded) and M-RoPE's angles."""
        assert self.rotary is not None
        if self.mrope is None:
            raise RuntimeError("a step with image rows on a model without M-RoPE (this is a bug)")
        x = self.model.embed_tokens(batch.input_ids.index_fill(0, media.rows, 0))
        x[media.rows] = media.embeds.to(x.dtype)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        image_cos, image_sin = self.mrope.cos_sin(media.positions, x.dtype)
        cos[media.rows] = image_cos
        sin[media.rows] = image_sin
        return x, (cos, sin)
