"""FP8 checkpoints with fine-grained block scales (issue 42): `quantization_config` fp8 with
`weight_block_size`, each quantized linear weight in `float8_e4m3fn` beside its `weight_scale_inv`, as
the Qwen FP8 releases ship. On the CPU they are dequantized at load: the engine must equal transformers
running the dequantized weights. The checkpoints are quantized here, block by block, with torch's
float8_e4m3fn, in blocks that do not divide every weight (the last block of a row or column partial)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint
from engine.model.errors import CheckpointError
from engine.model.loader import load_model
from test_model import hf_logits, make_cache, make_prompt, run_chunks

BLOCK = (32, 24)  # rows, cols: 64 = 2 x 32, 48 = 1.5 x 32 (MoE experts), 64 = 2.67 x 24 (partial columns)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale per block): each block scaled so its largest magnitude is FP8_MAX (the
    FP8 releases' way; e4m3fn saturates at 448, so no NaN code is ever written)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = weight[r, c].abs().max().clamp(min=1e-12) / FP8_MAX
            q[r, c] = (weight[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The oracle's weights, block by block (not the loader's code)."""
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] *= scale[i, j]
    return out


def write_pair(work: Path, arch: str) -> tuple[Path, Path]:
    """(the fp8 checkpoint, the same weights dequantized as a plain checkpoint for transformers)."""
    source = make_checkpoint(work / "source", arch, max_shard_size="10GB")
    tensors = {k: v for f in sorted(source.glob("*.safetensors")) for k, v in load_file(f).items()}
    fp8: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    quantized = 0
    for name, tensor in tensors.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight") and tensor.ndim == 2:
            q, scale = quantize(tensor.float())
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            plain[name] = dequantized(q, scale).to(tensor.dtype)
            quantized += 1
        else:  # embeddings, norms, lm_head and the routers stay as they are, as in the published releases
            fp8[name] = plain[name] = tensor
    assert quantized > 0
    config = json.loads((source / "config.json").read_text())
    out = {}
    for kind, weights in (("fp8", fp8), ("plain", plain)):
        folder = work / kind
        folder.mkdir()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        written = dict(config)
        if kind == "fp8":
            written["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                              "fmt": "e4m3", "weight_block_size": list(BLOCK)}
        (folder / "config.json").write_text(json.dumps(written))
        out[kind] = folder
    return out["fp8"], out["plain"]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM"])
def test_an_fp8_checkpoint_equals_transformers_on_its_dequantized_weights(tmp_path: Path, arch: str) -> None:
    fp8, plain = write_pair(tmp_path, arch)
    loaded = load_model(fp8)
    assert loaded.config.fp8 is not None and (loaded.config.fp8.rows, loaded.config.fp8.cols) == BLOCK
    ids = make_prompt(40)
    ours = run_chunks(loaded, make_cache(loaded), ids, [40], list(range(4)))
    reference = hf_logits(plain, ids)
    assert (ours - reference).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_fp8_errors_name_what_is_wrong(tmp_path: Path) -> None:
    fp8, _ = write_pair(tmp_path, "Qwen3ForCausalLM")
    config = json.loads((fp8 / "config.json").read_text())
    for quantization, words in ((dict(config["quantization_config"], weight_block_size=None), "weight_block_size"),
                                (dict(config["quantization_config"], activation_scheme="static"), "static"),
                                ({"quant_method": "awq"}, "'awq' is not supported")):
        (fp8 / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization)))
        with pytest.raises(CheckpointError, match=words):
            load_model(fp8)
    (fp8 / "config.json").write_text(json.dumps(config))
    weights = load_file(fp8 / "model.safetensors")
    name = next(n for n in weights if n.endswith("_scale_inv"))
    weights[name] = weights[name][:1]  # a scale grid that does not cover its weight
    save_file(weights, fp8 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name):
        load_model(fp8)
    del weights[name]  # an fp8 weight with no scale at all
    save_file(weights, fp8 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no .*_scale_inv"):
        load_model(fp8)
