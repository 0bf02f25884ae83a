"""The built-in model "ignis-tiny": a small random-weight hybrid checkpoint.

It is a Qwen3.5-layout model (Gated DeltaNet layers with a full-attention layer
every fourth) with a locally trained byte-level BPE tokenizer and a ChatML
template with tools. Its weights are random: it shows the machinery (paged KV,
state slots, reuse, tiers), not language. It is generated deterministically on
first use into a cache directory, so nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from common.progress import Progress
from engine.model.config import parse_config
from engine.model.decoder import CausalLM
from engine.model.hub_cache import cached_checkpoint, looks_like_repo_id
from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

TINY_NAME = "ignis-tiny"
TINY_VERSION = 1  # bump when the generated checkpoint changes, so caches regenerate
_SEED = 20261130

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}
# <|im_end|> ends an assistant turn; <|endoftext|> ends a plain completion.
TINY_GENERATION_CONFIG = {"eos_token_id": [2, 0], "pad_token_id": 0}


def default_cache_dir() -> Path:
    root = os.environ.get("IGNIS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ignis"
    )
    return Path(root) / "models"


def random_weights(config_json: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights for any supported config (ignis-tiny, benchmark geometries)."""
    config = parse_config(config_json)
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), k) for k, v in CausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    bar = Progress("generating weights", len(shapes), "tensors")
    for name, (shape, _) in sorted(shapes.items()):
        bar.advance()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("A_log"):
            value = torch.log(torch.rand(shape, generator=gen) * 15 + 1)
        elif name.endswith("dt_bias"):
            value = torch.ones(shape)
        elif len(shape) == 1:  # norms: zero-centered (x*(1+w)) except the GDN gated norm (x*w)
            plain = not config.zero_centered_norm or name.endswith("linear_attn.norm.weight")
            base = 1.0 if plain and "norm" in name else 0.0
            value = base + 0.1 * torch.randn(shape, generator=gen)
        else:
            value = 0.05 * torch.randn(shape, generator=gen)
        weights[name] = value.contiguous()
    bar.close()
    return weights


def write_tiny_checkpoint(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(TINY_GENERATION_CONFIG, indent=2) + "\n")
    write_tiny_tokenizer(directory)
    save_file(random_weights(TINY_CONFIG, _SEED), str(directory / "model.safetensors"), metadata={"format": "pt"})


def ensure_tiny_checkpoint(
    cache_dir: Path | None = None, progress: Callable[[str], None] | None = None
) -> Path:
    """The ignis-tiny checkpoint directory, generating it once (atomically) if missing."""
    root = cache_dir or default_cache_dir()
    target = root / f"{TINY_NAME}-v{TINY_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"generating {TINY_NAME} into {target} (first use only)")
    scratch = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=root))
    try:
        write_tiny_checkpoint(scratch)
        try:
            scratch.rename(target)  # atomic: a concurrent generator loses the race harmlessly
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def resolve_model_path(model: str, cache_dir: Path | None = None) -> Path:
    """`ignis-tiny` -> its generated checkpoint; a directory -> itself; a Hugging Face repo id that
    is not a directory here -> its snapshot in the local Hugging Face cache (ValueError if absent)."""
    if model == TINY_NAME:
        return ensure_tiny_checkpoint(cache_dir, progress=logging.getLogger("ignis.engine").info)
    path = Path(model).expanduser()
    if not path.exists() and looks_like_repo_id(model):
        return cached_checkpoint(model)
    return path
