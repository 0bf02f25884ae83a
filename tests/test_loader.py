"""Checkpoint loading: errors a user can act on, sharded weights, tied embeddings, ignis-tiny."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_hf_model
from engine.model.errors import CheckpointError
from engine.model.loader import load_model
from engine.model.tiny import TINY_CONFIG, ensure_tiny_checkpoint
from engine.offline import greedy_generate
from engine.text.tokenizer import Tokenizer


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json: not found"):
        load_model(tmp_path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nope")


def test_unknown_architecture(tmp_path: Path, checkpoint_dir: Callable[[str], Path]) -> None:
    path = copy_checkpoint(checkpoint_dir("LlamaForCausalLM"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"architectures \['GPT2LMHeadModel'\] is not supported"):
        load_model(path)


def test_missing_key_in_config(tmp_path: Path, checkpoint_dir: Callable[[str], Path]) -> None:
    path = copy_checkpoint(checkpoint_dir("LlamaForCausalLM"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'hidden_size' is missing"):
        load_model(path)


def test_missing_tensor(tmp_path: Path, checkpoint_dir: Callable[[str], Path]) -> None:
    path = copy_checkpoint(checkpoint_dir("Qwen3ForCausalLM"), tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        load_model(path)


def test_wrong_shape(tmp_path: Path, checkpoint_dir: Callable[[str], Path]) -> None:
    path = copy_checkpoint(checkpoint_dir("Qwen3_5ForCausalLM"), tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.linear_attn.out_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"out_proj.weight' has shape \[3, 3\] but config.json implies"):
        load_model(path)


def test_unexpected_tensor(tmp_path: Path, checkpoint_dir: Callable[[str], Path]) -> None:
    path = copy_checkpoint(checkpoint_dir("LlamaForCausalLM"), tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.surprise.weight"] = torch.zeros(2)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="surprise.weight' is not used"):
        load_model(path)


def test_sharded_checkpoint_and_tied_embeddings(tmp_path: Path) -> None:
    model = make_hf_model("Qwen2ForCausalLM", seed=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path)
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()
    ids = list(range(5, 40))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    ours = greedy_generate(loaded, ids, 1).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_weights_are_memory_mapped_without_copy(checkpoint_dir: Callable[[str], Path]) -> None:
    loaded = load_model(checkpoint_dir("LlamaForCausalLM"))
    weight = loaded.model.model.layers[0].mlp.up_proj.weight
    mapped = loaded.files[0].tensors["model.layers.0.mlp.up_proj.weight"]
    assert weight.data_ptr() == mapped.data_ptr()


def test_tiny_model_is_generated_once_and_loads(tmp_path: Path) -> None:
    path = ensure_tiny_checkpoint(tmp_path)
    first_bytes = (path / "model.safetensors").read_bytes()
    assert ensure_tiny_checkpoint(tmp_path) == path
    loaded = load_model(path)
    assert loaded.config.architecture == "Qwen3_5ForCausalLM"
    assert loaded.config.num_layers == TINY_CONFIG["num_hidden_layers"]
    assert len(loaded.config.attention_layers) == 2
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == loaded.config.vocab_size
    prompt = tokenizer.render_chat([{"role": "user", "content": "hello"}])[1]
    out = greedy_generate(loaded, prompt, 8)
    assert len(out.token_ids) >= 1
    # Deterministic: a second generation in a fresh directory writes identical weights.
    again = ensure_tiny_checkpoint(tmp_path / "other")
    assert (again / "model.safetensors").read_bytes() == first_bytes
