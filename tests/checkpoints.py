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
    # As the Qwen3.5/3.6 family and Qwen3-MoE are published: the text model nested in a multimodal one.
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3MoeForCausalLM",
)
# Models that route each token to its top-k experts: a rounding that moves a router's score across a
# near tie sends a token to another expert, a step change in its logits (tests with rounding bound it).
ROUTED_ARCHITECTURES = frozenset({"Qwen3NextForCausalLM-moe", "Qwen3_5MoeForConditionalGeneration",
                                  "Qwen3MoeForCausalLM"})
# A tiny vision tower for the multimodal classes (its out_hidden_size is the text model's hidden size).
_VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                               temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
# M-RoPE as the Qwen3.5 checkpoints publish it; over a text prompt its three axes share one position.
_MROPE: dict[str, Any] = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                              mrope_section=[1, 1, 0], mrope_interleaved=True)
# Written in many small shards with an index, as these classes are published.
PUBLISHED_SHARDED = frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                               "Qwen3MoeForCausalLM"})
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)

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
    elif name in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        text = {**_HYBRID, **kwargs, "rope_parameters": _MROPE}
        tie = text.pop("tie_word_embeddings")
        if name == "Qwen3_5ForConditionalGeneration":
            config = tf.Qwen3_5Config(text_config=text, vision_config={**_VISION, "out_hidden_size": text["hidden_size"]},
                                      tie_word_embeddings=tie)
            cls = tf.Qwen3_5ForConditionalGeneration
        else:
            text.pop("intermediate_size")
            config = tf.Qwen3_5MoeConfig(text_config={**text, **_MOE, "shared_expert_intermediate_size": 64},
                                         vision_config={**_VISION, "out_hidden_size": text["hidden_size"]},
                                         tie_word_embeddings=tie)
            cls = tf.Qwen3_5MoeForConditionalGeneration
    elif name == "Qwen3MoeForCausalLM":
        # Layer 1 is a dense MLP (mlp_only_layers), the others routed; top-k weights not renormalised.
        config = tf.Qwen3MoeConfig(**kwargs, **_MOE, mlp_only_layers=[1], norm_topk_prob=False)
        cls = tf.Qwen3MoeForCausalLM
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


def make_checkpoint(directory: Path, arch: str, seed: int = 0, max_shard_size: str | None = None,
                    **overrides: Any) -> Path:
    """Save a tiny random checkpoint with save_pretrained; returns its directory. The published
    multimodal and MoE classes are sharded (many small files and an index) as they ship."""
    model = make_hf_model(arch, seed, **overrides)
    directory.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None and arch in PUBLISHED_SHARDED:
        max_shard_size = "100KB"
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory


def load_hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers oracle for a checkpoint: the class its config.json names (a multimodal class
    is called with input_ids alone, as a text request is)."""
    import json

    import transformers as tf

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(tf, arch).from_pretrained(path, dtype=dtype).eval()


def with_mtp_layer(src: Path, dst: Path, seed: int = 0, std: float = 0.1) -> Path:
    """A copy of checkpoint `src` with a random multi-token-prediction layer (`mtp.*`, one layer) in a
    shard of its own, stored as published checkpoints store it (routed experts one tensor per expert)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from bench.geometry import per_expert
    from engine.model.loader import load_model
    from engine.model.mtp import MtpPredictor

    config = load_model(src).config
    torch.manual_seed(seed)
    module = MtpPredictor(config, 1)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    tensors = per_expert({f"mtp.{name}": t.clone() for name, t in module.state_dict().items()})
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model-mtp.safetensors"))
    index_path = dst / "model.safetensors.index.json"
    if index_path.is_file():  # a sharded checkpoint names the new shard's tensors in its index
        index = json.loads(index_path.read_text())
        index["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        index_path.write_text(json.dumps(index))
    return dst
