"""The profile benchmark (bench/profile.py), ignis side only, at a tiny geometry: its breakdown adds up,
its rates are there, and the profiler scopes it wraps the engine in are undone afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from bench import profile as bench_profile
from bench import step_scopes
from bench.geometry import ensure_geometry
from engine.model.loader import load_model
from engine.model.tiny import random_weights

KINDS = ("dense", "hybrid", "moe")
# 4 layers: a hybrid's one full-attention layer in four is the 4th. 2 for the MoE: its CPU grouped GEMM
# is one matmul per expert (128 of them) per projection, the slowest step of the three at this size.
LAYERS = {"dense": 4, "hybrid": 4, "moe": 2}


def originals() -> list[Any]:
    return [vars(owner)[name] for owner, name, _ in step_scopes.CLASS_SCOPES]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("profile")
    before, threads = originals(), torch.get_num_threads()
    for layers in sorted(set(LAYERS.values())):
        kinds = ",".join(kind for kind in KINDS if LAYERS[kind] == layers)
        assert bench_profile.main(["--kind", kinds, "--hidden", "128", "--layers", str(layers), "--prompt", "64",
                                   "--decode", "4", "--batch", "2", "--peer", "none", "--out", str(root / "out"),
                                   "--models", str(root / "models")]) == 0
    after = originals()
    assert all(a is b for a, b in zip(before, after)), "a profiler scope was left patched in"
    assert torch.get_num_threads() == threads
    out = {}
    for kind in KINDS:
        assert (root / "out" / f"profile-{kind}.md").read_text().startswith(f"# Profile, {kind}:")
        out[kind] = {**json.loads((root / "out" / f"profile-{kind}.json").read_text()), "out": str(root / "out")}
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_rates_are_measured(results: dict[str, dict[str, Any]], kind: str) -> None:
    ignis = results[kind]["ignis"]
    assert ignis["prefill"]["tokens"] == 64 and ignis["prefill"]["tok_s"] > 0
    assert ignis["prefill"]["steps"] == 1  # the whole prompt in one step: the profile pins step pacing off
    assert ignis["decode_1"]["tokens"] == 3 and ignis["decode_1"]["steps"] == 3  # decode - 1: no first token
    assert ignis["decode_b"]["tokens"] == 2 * 3 and ignis["decode_b"]["steps"] == 3  # both decode every step
    assert ignis["decode_1"]["ms_step"] > 0 and ignis["decode_b"]["tok_s"] > 0
    assert results[kind]["peer"] == {"unavailable": "not run (--peer none)"}
    for phase in ("prefill", "decode_1", "decode_b"):  # the figure is the median round's
        rounds = ignis[phase]["rounds"]
        assert len(rounds) == bench_profile.ROUNDS and ignis[phase]["wall_s"] == sorted(rounds)[len(rounds) // 2]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("phase", ["profile_prefill", "profile_decode_b"])
def test_breakdown_adds_up(results: dict[str, dict[str, Any]], kind: str, phase: str) -> None:
    prof = results[kind]["ignis"][phase]
    rows = {r["category"]: r for r in prof["breakdown"]}
    assert prof["wall_ms"] > 0 and prof["unprofiled_wall_ms"] > 0
    assert all(r["pct"] <= 100.0 + 1e-6 for r in rows.values())
    assert rows["— model forward (CausalLM.forward)"]["ms"] > 0
    assert rows["—— LM head (logits)"]["ms"] > 0
    # Qwen3-MoE routes every layer: its feed-forward time is the MoE rows', no dense MLP runs.
    moe = ["—— MoE: routed experts (sort by expert, grouped GEMMs, scatter-add)",
           "—— MoE: router (gate, softmax, top-k), rest of the block"]
    if kind == "moe":
        assert "—— MLP" not in rows and all(rows[name]["ms"] > 0 for name in moe)
    else:
        assert rows["—— MLP"]["ms"] > 0 and not any(name in rows for name in moe)
    # The leaves partition the profiled wall: nothing counted twice, nothing lost.
    assert sum(r["ms"] for r in rows.values() if r["leaf"]) == pytest.approx(prof["wall_ms"], rel=1e-6)
    forward = [r for name, r in rows.items() if name.startswith("—— ") and r["leaf"]]
    assert sum(r["pct"] for r in forward) <= 100.0 + 1e-6
    gdn = [name for name in rows if name.startswith("—— GDN")]
    assert bool(gdn) == (kind == "hybrid")
    kernel = "—— GDN: chunked delta rule (prefill kernel)" if phase == "profile_prefill" else \
        "—— GDN: recurrent delta rule (decode kernel)"
    assert (kernel in rows) == (kind == "hybrid")
    assert 0 < len(prof["top_ops"]) <= 15 and all(o["op"].startswith("aten::") for o in prof["top_ops"])


def test_scopes_patch_instances_and_undo(tmp_path: Path) -> None:
    loaded = load_model(ensure_geometry("hybrid", 128, 4, root=tmp_path))
    model = loaded.model
    before = originals()
    with step_scopes.scopes(model):
        assert "forward" in vars(model.lm_head)
        assert vars(step_scopes.CausalLM)["forward"] is not before[4]
    assert all(a is b for a, b in zip(before, originals()))
    assert not [m for m in model.modules() if "forward" in vars(m)]


def test_all_decoding_window() -> None:
    # Slot 0 starts first and is 2 tokens ahead; the window runs from slot 1's first token (t=2)
    # to slot 0's last (t=5): slot 0 decodes 3 -> 6, slot 1 decodes 1 -> 4.
    slot0 = [(0.0, 1), (1.0, 2), (2.0, 3), (3.0, 4), (4.0, 5), (5.0, 6)]
    slot1 = [(1.5, 0), (2.0, 1), (3.0, 2), (4.0, 3), (5.0, 4), (6.0, 5), (7.0, 6)]
    assert bench_profile.all_decoding_window([slot0, slot1]) == (3.0, 6)


def test_moe_checkpoint_is_published_layout(results: dict[str, dict[str, Any]]) -> None:
    """The experts are on disk per expert, as a downloaded Qwen3-MoE (llama.cpp's converter reads that),
    and ignis loads them into its stacked layout exactly as the generator made them."""
    checkpoint = Path(results["moe"]["checkpoint"])
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 128
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert {f"model.layers.1.mlp.experts.127.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert "model.layers.0.mlp.gate.weight" in names
    stacked = random_weights(config, seed=7)
    state = load_model(checkpoint).model.state_dict()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(state[name], stacked[name])


def test_moe_report_floors_read_the_routed_experts(results: dict[str, dict[str, Any]]) -> None:
    # 2 layers of 128 experts (hidden 128, moe_intermediate 16): top-8 of 128 at batch 1 reads 1/16 of them.
    bw = results["moe"]["ignis"]["bandwidth"]
    experts = 2 * 3 * 128 * 128 * 16 * 4
    assert bw["bytes_b"] - bw["bytes"] == round(experts * (1 - (15 / 16) ** 2)) - round(experts / 16)
    assert bw["floor_ms_b"] > bw["floor_ms"]
    dense = results["dense"]["ignis"]["bandwidth"]
    assert dense["bytes_b"] == dense["bytes"]
    text = (Path(results["moe"]["out"]) / "profile-moe.md").read_text()
    assert "An MoE decode step reads all weights but the experts" in text


def test_moe_refuses_bf16_linears() -> None:
    with pytest.raises(ValueError, match="MoE experts in fp32"):
        bench_profile.Setup("moe", 128, 2, 1, 8, 2, 1, weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="kind must be one of"):
        bench_profile.Setup("sparse", 128, 2, 1, 8, 2, 1)
