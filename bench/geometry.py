"""Benchmark checkpoints: random weights at a mid-size geometry, dense (Qwen3), hybrid (Qwen3.5) and
MoE (Qwen3-MoE).

Written with the same generator as ignis-tiny (deterministic, no download) and
the ignis-tiny tokenizer, so every benchmark and the peer server read one file.

The MoE geometry scales Qwen3-30B-A3B (hidden 2048, 48 layers, 128 experts of moe_intermediate 768,
top-8: 144 hidden² of expert weights per layer, 9 hidden² of them routed to a token, ~9% of a layer's
weights active) to hidden 1024 and 16 layers within a checkpoint this machine holds twice (ignis' and
llama.cpp's copies, 3.4 GB each in fp32): it keeps the 128 experts and the top-8, so a batch of B
touches the same share of the experts, and narrows each expert to moe_intermediate hidden / 8 (128),
which keeps the active share: 3 of 48 hidden² of expert weights routed, with attention (2.5 hidden²)
~11% of a layer's weights (16.8% with 64 experts of 256, the other way to fit the size).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model.tiny import default_cache_dir, random_weights
from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

KINDS = ("dense", "hybrid", "moe")
_PACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def geometry_config(kind: str, hidden: int = 1024, layers: int = 16) -> dict[str, Any]:
    heads = max(hidden // 128, 2)
    base: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE, "hidden_size": hidden, "intermediate_size": hidden * 3,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1),
        "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
        "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": None, "dtype": "float32",
    }
    if kind == "dense":
        return {**base, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    if kind == "hybrid":
        return {**base, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
                "linear_num_key_heads": heads, "linear_num_value_heads": heads * 2, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
    if kind == "moe":  # every layer routed, no shared expert (the module docstring gives the scaling)
        return {**base, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": max(hidden // 8, 8),
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def per_expert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ignis' stacked expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) as a
    published Qwen3-MoE checkpoint stores them, `mlp.experts.N.{gate,up,down}_proj.weight`, which is
    what llama.cpp's converter and ignis' loader read from a download. Consumes `weights`."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(weights):
        tensor = weights.pop(name)
        match = _PACKED_EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix = match["prefix"]
        if match["proj"] == "down_proj":
            for e, down in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = down.clone()
        else:
            for e, gate_up in enumerate(tensor):
                gate, up = gate_up.chunk(2, dim=0)  # the loader concatenates gate then up
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
    return out


def ensure_geometry(kind: str, hidden: int = 1024, layers: int = 16, root: Path | None = None) -> Path:
    target = (root or default_cache_dir()) / f"bench-{kind}-h{hidden}-l{layers}"
    if (target / "model.safetensors").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    config = geometry_config(kind, hidden, layers)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    write_tiny_tokenizer(target)
    weights = per_expert(random_weights(config, seed=7))
    partial = target / "model.safetensors.partial"  # the MoE file is GBs: only a whole one takes the name
    save_file(weights, str(partial), metadata={"format": "pt"})
    partial.rename(target / "model.safetensors")
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write a benchmark checkpoint and print its path")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    a = parser.parse_args()
    print(ensure_geometry(a.kind, a.hidden, a.layers))
