"""The checkpoint's multi-token-prediction (MTP) layers, loaded into their own module (issue 42).

Published Qwen3.5 (dense and MoE) and Qwen3-Next checkpoints carry `mtp.*`: a drafter that
predicts the token after next from the target's last hidden state and the next token's
embedding. Its shape, as those checkpoints store it and as vLLM and SGLang run it:

    x = fc(cat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)))   # 2H -> H
                              # hidden: the target's final normed hidden state (what lm_head reads)
    x = layers[i](x)          # one full-attention decoder layer (the family's own: gated
                              # attention, an MLP or the MoE block), with a KV cache of its own
    logits = lm_head(norm(x)) # embed_tokens and lm_head are the target's, shared

The layers are the decoder's own `DecoderLayer`, numbered after the target's layers (layer
`num_layers + i`), so the device cache can give their attention its pages like any other layer.
Here the weights are loaded and checked by name and shape (a missing or misshaped tensor fails
at load, naming it); engine/speculative/mtp_drafter.py runs them. A checkpoint without `mtp.*`
loads as before, with no module.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from engine.model.config import FULL_ATTENTION, ModelConfig
from engine.model.decoder import DecoderLayer
from engine.model.errors import CheckpointError, check_tensors
from engine.model.layers import RMSNorm

PREFIX = "mtp."
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_layer_count(names: set[str] | list[str], config: ModelConfig) -> int:
    """How many MTP layers the checkpoint's `mtp.*` tensors hold (config's `mtp_num_hidden_layers`
    or `num_nextn_predict_layers` where it says; else counted from the names)."""
    counted = 1 + max((int(m[1]) for m in map(_LAYER.match, names) if m), default=-1)
    settings = {**config.raw, **(config.raw.get("text_config") or {})}  # a multimodal class nests it
    stated = settings.get("mtp_num_hidden_layers", settings.get("num_nextn_predict_layers"))
    if stated is not None and int(stated) != counted:
        raise CheckpointError(f"config.json says {stated} MTP layers but the checkpoint's mtp.* tensors hold {counted}")
    return counted


def layer_config(config: ModelConfig, mtp_layers: int) -> ModelConfig:
    """The target's config with the MTP layers appended as full-attention layers, so each builds as
    `DecoderLayer(config, num_layers + i)` (its attention's cache layer, its MoE-or-MLP choice)."""
    return dataclasses.replace(config, num_layers=config.num_layers + mtp_layers,
                               layer_types=config.layer_types + (FULL_ATTENTION,) * mtp_layers)


class MtpPredictor(nn.Module):
    """`mtp.*` as a module: parameter names are the checkpoint's without the `mtp.` prefix."""

    def __init__(self, config: ModelConfig, mtp_layers: int) -> None:
        super().__init__()
        hidden, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered_norm
        self.first_layer = config.num_layers  # the cache layer index of layers[0]
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zc)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        extended = layer_config(config, mtp_layers)
        self.layers = nn.ModuleList(DecoderLayer(extended, config.num_layers + i) for i in range(mtp_layers))
        self.norm = RMSNorm(hidden, eps, zc)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's input: the next token's embedding and the target's final normed hidden state at
        the token before it, each normed again, concatenated [embedding, hidden] and projected to H."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))


def load_mtp(tensors: dict[str, torch.Tensor], config: ModelConfig, device: torch.device,
             dtype: torch.dtype, where: str) -> MtpPredictor | None:
    """The MTP module from the checkpoint's `mtp.*` tensors (per-expert MoE tensors already stacked by
    the loader's name normalisation), or None when there are none. Strict: every parameter present
    with its shape, no tensor left over."""
    if not tensors:
        return None
    with torch.device("meta"):
        module = MtpPredictor(config, mtp_layer_count(list(tensors), config))
    expected = {PREFIX + name: tuple(p.shape) for name, p in module.state_dict().items()}
    check_tensors(expected, tensors, where, "the MTP layer")
    state = {name.removeprefix(PREFIX): tensors[name].to(device=device, dtype=dtype) for name in expected}
    module.load_state_dict(state, assign=True, strict=True)
    return module.eval()
