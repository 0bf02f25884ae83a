"""The profile benchmark (bench/profile.py), ignis side only, at a tiny geometry: its breakdown adds up,
its rates are there, and the profiler scopes it wraps the engine in are undone afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import profile as bench_profile
from bench import step_scopes
from bench.geometry import ensure_geometry
from engine.model.loader import load_model

KINDS = ("dense", "hybrid")


def originals() -> list[Any]:
    return [vars(owner)[name] for owner, name, _ in step_scopes.CLASS_SCOPES]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("profile")
    before, threads = originals(), torch.get_num_threads()
    # 4 layers: a hybrid's one full-attention layer in four is the 4th.
    assert bench_profile.main(["--kind", ",".join(KINDS), "--hidden", "128", "--layers", "4", "--prompt", "64",
                               "--decode", "4", "--batch", "2", "--peer", "none", "--out", str(root / "out"),
                               "--models", str(root / "models")]) == 0
    after = originals()
    assert all(a is b for a, b in zip(before, after)), "a profiler scope was left patched in"
    assert torch.get_num_threads() == threads
    out = {}
    for kind in KINDS:
        assert (root / "out" / f"profile-{kind}.md").read_text().startswith(f"# Profile, {kind}:")
        out[kind] = json.loads((root / "out" / f"profile-{kind}.json").read_text())
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_rates_are_measured(results: dict[str, dict[str, Any]], kind: str) -> None:
    ignis = results[kind]["ignis"]
    assert ignis["prefill"]["tokens"] == 64 and ignis["prefill"]["tok_s"] > 0
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
    assert rows["—— MLP"]["ms"] > 0 and rows["—— LM head (logits)"]["ms"] > 0
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
