"""Benchmark checkpoints: random weights at a mid-size geometry, dense (Qwen3) and hybrid (Qwen3.5).

Written with the same generator as ignis-tiny (deterministic, no download) and
the ignis-tiny tokenizer, so every benchmark and the peer server read one file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from engine.model.tiny import default_cache_dir, random_weights
from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer


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
    raise ValueError(f"kind must be dense or hybrid, got {kind!r}")


def ensure_geometry(kind: str, hidden: int = 1024, layers: int = 16, root: Path | None = None) -> Path:
    target = (root or default_cache_dir()) / f"bench-{kind}-h{hidden}-l{layers}"
    if (target / "model.safetensors").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    config = geometry_config(kind, hidden, layers)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    write_tiny_tokenizer(target)
    save_file(random_weights(config, seed=7), str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write a benchmark checkpoint and print its path")
    parser.add_argument("kind", choices=["dense", "hybrid"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    a = parser.parse_args()
    print(ensure_geometry(a.kind, a.hidden, a.layers))
