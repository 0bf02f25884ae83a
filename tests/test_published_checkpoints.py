"""Checkpoints as the Qwen3.5/3.6 family and Qwen3-MoE are published (issue 42).

Their logits, chunking, batching and greedy generation against transformers are in
tests/test_model.py (the classes are in checkpoints.ARCHITECTURES), and reuse against
cold prefills in tests/test_reuse.py. Here: what the loader keeps beside the text
model and says about it, an MTP layer's weights, the load errors a broken download
gets, and state of an MoE model moved through the tierstore and back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.geometry import per_expert
from checkpoints import load_hf, make_checkpoint
from engine.model.config import SUPPORTED_ARCHITECTURES
from engine.model.errors import CheckpointError
from engine.model.loader import load_model
from engine.model.mtp import MtpPredictor
from test_model import make_cache, make_prompt, run_chunks

MiB = 1 << 20


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_5_cg"), "Qwen3_5ForConditionalGeneration", seed=4)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def add_shard(path: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write one more safetensors shard and name its tensors in the index, as a checkpoint that ships it would."""
    save_file(tensors, str(path / name))
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: name for k in tensors})
    index_path.write_text(json.dumps(index))


def test_the_published_class_is_served_text_only_and_its_vision_tower_is_kept_and_named(
        published: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = json.loads((published / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in config
    assert len(list(published.glob("*.safetensors"))) > 1  # sharded, with an index, as published
    with caplog.at_level(logging.INFO, logger="ignis.engine"):
        loaded = load_model(published)
    assert loaded.config.architecture == "Qwen3_5ForConditionalGeneration"
    assert loaded.config.text_architecture == "Qwen3_5ForCausalLM" and loaded.config.is_hybrid
    vision = loaded.side_weights["vision tower"]
    hf = load_hf(published)
    assert set(vision) == {k for k in hf.state_dict() if k.startswith("model.visual.")}
    for name, tensor in vision.items():
        assert torch.equal(tensor, hf.state_dict()[name])  # kept as stored, not dropped
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"loaded {published.name}"))
    assert "the text model of Qwen3_5ForConditionalGeneration" in line
    assert f"vision tower ({len(vision)} tensors" in line and "mtp" not in line


def mtp_tensors(checkpoint: Path, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer as published checkpoints store it: `mtp.*`, routed experts one tensor per
    expert and projection (the decoder's config decides its shapes)."""
    config = load_model(checkpoint).config
    torch.manual_seed(seed)
    module = MtpPredictor(config, 1)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return per_expert({f"mtp.{name}": tensor.clone() for name, tensor in module.state_dict().items()})


@pytest.mark.parametrize("arch", ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"])
def test_the_mtp_layer_loads_into_its_own_module_and_changes_nothing_else(
        arch: str, published: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Published Qwen3.5 checkpoints carry a multi-token-prediction layer (`mtp.*`): it loads into its own
    module (every tensor where it belongs, MoE experts stacked), the log says so, and the decoder's
    logits are those without it."""
    base = published if arch == "Qwen3_5ForConditionalGeneration" else \
        make_checkpoint(tmp_path / "moe", arch, seed=5)
    with_mtp = copy_checkpoint(base, tmp_path / "with_mtp")
    mtp = mtp_tensors(base, seed=0)
    add_shard(with_mtp, "model-mtp.safetensors", mtp)
    with caplog.at_level(logging.INFO, logger="ignis.engine"):
        loaded = load_model(with_mtp)
    assert load_model(base).mtp is None  # a checkpoint without it loads as before
    assert loaded.mtp is not None and len(loaded.mtp.layers) == 1 and "mtp" not in loaded.side_weights
    params = loaded.mtp.state_dict()
    assert torch.equal(params["fc.weight"], mtp["mtp.fc.weight"])
    assert torch.equal(params["norm.weight"], mtp["mtp.norm.weight"])
    layer = loaded.mtp.layers[0]
    assert layer.self_attn.layer == loaded.config.num_layers  # its attention gets a cache layer of its own
    if arch == "Qwen3_5MoeForConditionalGeneration":
        gate_up = params["layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(gate_up[3], torch.cat([mtp["mtp.layers.0.mlp.experts.3.gate_proj.weight"],
                                                   mtp["mtp.layers.0.mlp.experts.3.up_proj.weight"]]))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"loaded {with_mtp.name}"))
    assert "mtp: 1 layer(s) loaded into their module" in line
    ids = make_prompt(40, seed=3)
    plain = load_model(base)
    want = run_chunks(plain, make_cache(plain), ids, [40], list(range(3)))
    assert torch.equal(run_chunks(loaded, make_cache(loaded), ids, [40], list(range(3))), want)


def test_the_mtp_input_is_the_normed_embedding_and_hidden_state_projected(published: Path, tmp_path: Path) -> None:
    """fuse(): fc(cat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h))), with the family's own norm (transformers'
    Qwen3.5 RMSNorm, zero-centred) as the oracle."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    with_mtp = copy_checkpoint(published, tmp_path / "with_mtp")
    mtp = mtp_tensors(published, seed=1)
    add_shard(with_mtp, "model-mtp.safetensors", mtp)
    loaded = load_model(with_mtp)
    assert loaded.mtp is not None
    hidden = loaded.config.hidden_size
    norms = {}
    for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        norms[part] = Qwen3_5RMSNorm(hidden, eps=loaded.config.rms_norm_eps)
        norms[part].weight.data.copy_(mtp[f"mtp.{part}.weight"])
    g = torch.Generator().manual_seed(2)
    e, h = torch.randn(5, hidden, generator=g), torch.randn(5, hidden, generator=g)
    want = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)], dim=-1) @ mtp["mtp.fc.weight"].T
    torch.testing.assert_close(loaded.mtp.fuse(e, h), want, rtol=1e-5, atol=1e-5)


def test_a_broken_mtp_layer_fails_at_load_naming_the_tensor(published: Path, tmp_path: Path) -> None:
    mtp = mtp_tensors(published, seed=2)
    missing = copy_checkpoint(published, tmp_path / "missing")
    add_shard(missing, "model-mtp.safetensors", {k: v for k, v in mtp.items() if k != "mtp.layers.0.self_attn.k_proj.weight"})
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.self_attn\.k_proj\.weight.*missing"):
        load_model(missing)
    wrong = copy_checkpoint(published, tmp_path / "wrong")
    add_shard(wrong, "model-mtp.safetensors", {**mtp, "mtp.fc.weight": mtp["mtp.fc.weight"][:, :-1].contiguous()})
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight.*has shape"):
        load_model(wrong)
    extra = copy_checkpoint(published, tmp_path / "extra")
    add_shard(extra, "model-mtp.safetensors", {**mtp, "mtp.layers.0.bogus.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.bogus\.weight"):
        load_model(extra)
    stated = copy_checkpoint(published, tmp_path / "stated")  # the config's count and the tensors disagree
    add_shard(stated, "model-mtp.safetensors", mtp)
    config = json.loads((stated / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 2
    (stated / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="says 2 MTP layers but the checkpoint's mtp.* tensors hold 1"):
        load_model(stated)


def test_a_broken_download_fails_at_load_naming_the_tensor(published: Path, tmp_path: Path) -> None:
    index = json.loads((published / "model.safetensors.index.json").read_text())["weight_map"]
    # A shard that is missing: the tensors it held are named.
    missing = copy_checkpoint(published, tmp_path / "missing")
    shard = index["model.language_model.layers.1.self_attn.q_proj.weight"]
    (missing / shard).unlink()
    with pytest.raises(CheckpointError, match=shard.replace(".", r"\.") + r" is listed but missing \(it holds '"):
        load_model(missing)
    # A tensor no part of the model has.
    unknown = copy_checkpoint(published, tmp_path / "unknown")
    add_shard(unknown, "model-extra.safetensors", {"model.language_model.layers.0.bogus.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.bogus\.weight"):
        load_model(unknown)
    # A text_config that does not match the weights.
    wrong = copy_checkpoint(published, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight.*has shape"):
        load_model(wrong)


def test_an_unserved_class_names_itself_and_what_is_served(tmp_path: Path, published: Path) -> None:
    other = copy_checkpoint(published, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["Qwen3VLForConditionalGeneration"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as raised:
        load_model(other)
    message = str(raised.value)
    assert "Qwen3VLForConditionalGeneration" in message
    for served in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Qwen3MoeForCausalLM"):
        assert served in SUPPORTED_ARCHITECTURES and served in message


def test_an_moe_model_s_states_spill_to_ram_and_come_back_equal_to_cold(tmp_path: Path) -> None:
    """Qwen3.5-MoE as published, served through the engine with a tierstore: 2 device retained slots,
    so each conversation's states spill to KV-RAM as the next arrives; asked again, each is restored
    from RAM and answers as a cold prefill does."""
    from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer
    from engine.text.tokenizer import Tokenizer
    from test_engine_tiers import TOPICS, Engine, same, tierstore

    path = make_checkpoint(tmp_path / "moe", "Qwen3_5MoeForConditionalGeneration", seed=6,
                           vocab_size=TINY_VOCAB_SIZE, hidden_size=128)
    write_tiny_tokenizer(path)
    model = (load_model(path), Tokenizer.from_dir(path))
    assert model[0].config.num_experts == 4 and model[0].config.is_hybrid
    cold = Engine(*model, reuse=False)
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    warm = Engine(*model, tierstore=store.address)
    try:
        want = {topic: cold.run(topic) for topic in TOPICS}
        for topic in TOPICS:
            same(warm.run(topic), want[topic])
        assert warm.core.tiers is not None and warm.core.tiers.spills >= 2 * (len(TOPICS) - 1)
        for topic in TOPICS[:3]:
            got = warm.run(topic)
            same(got, want[topic])
            assert got.tier == "ram" and got.cached == len(warm.request(topic).prompt_ids)
        warm.check()
    finally:
        warm.close()
        cold.close()
        store.stop()


def test_a_quantized_checkpoint_names_its_quantization(tmp_path: Path, published: Path) -> None:
    """A quantization not served (GPTQ here; block-scaled fp8 is: tests/test_fp8_checkpoint.py): one
    line says so at load."""
    gptq = copy_checkpoint(published, tmp_path / "gptq")
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"quantization 'gptq' is not supported"):
        load_model(gptq)
