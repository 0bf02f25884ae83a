"""Factories for tiny random-weight Hugging Face checkpoints, written by transformers itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3NextForCausalLM-moe",
)

_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.08,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
_HYBRID: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-weight transformers model of `arch`, with 1-D weights perturbed so norms are not identity."""
    import transformers as tf

    kwargs = {**_COMMON, **overrides}
    overrides = {}
    name = arch.removesuffix("-moe")
    if name == "LlamaForCausalLM":
        config = tf.LlamaConfig(**kwargs, **overrides)
        cls = tf.LlamaForCausalLM
    elif name == "MistralForCausalLM":
        config = tf.MistralConfig(**kwargs, sliding_window=48, **overrides)
        cls = tf.MistralForCausalLM
    elif name == "Qwen2ForCausalLM":
        config = tf.Qwen2Config(**kwargs, **overrides)
        cls = tf.Qwen2ForCausalLM
    elif name == "Qwen3ForCausalLM":
        config = tf.Qwen3Config(**kwargs, **overrides)
        cls = tf.Qwen3ForCausalLM
    elif name == "Qwen3_5ForCausalLM":
        config = tf.Qwen3_5TextConfig(**{**_HYBRID, **kwargs})  # the caller's layer_types win
        cls = tf.Qwen3_5ForCausalLM
    elif name == "Qwen3NextForCausalLM":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                   shared_expert_intermediate_size=64, decoder_sparse_step=1)
        if not arch.endswith("-moe"):
            moe = dict(num_experts=0)
        config = tf.Qwen3NextConfig(**{**_HYBRID, **kwargs}, **moe)
        cls = tf.Qwen3NextForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def make_checkpoint(directory: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random checkpoint with save_pretrained; returns its directory."""
    model = make_hf_model(arch, seed, **overrides)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory
