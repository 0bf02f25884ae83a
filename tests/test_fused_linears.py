"""FusedLinears: the linears that read one input (q|k|v, gate|up, a GDN layer's inputs) as one
oneDNN call. The oracle is each member on its own (F.linear on its fp32 weight, or in bf16 the
member's own OneDnnLinear); the whole model's logits are checked against transformers by
test_model.py and test_weight_dtype.py, which load the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checkpoints import ARCHITECTURES
from engine.model.cpu_linear import (SHAPE_CACHE_ENTRIES, SHAPE_CACHE_VARIABLES, FusedLinears, OneDnnLinear,
                                     onednn_available, use_onednn_linears)
from engine.model.loader import load_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="needs oneDNN")


def fusing_modules(model: nn.Module) -> list[tuple[nn.Module, str, tuple[str, ...]]]:
    return [(m, attr, names) for m in model.modules() for attr, names in getattr(m, "fusible_linears", {}).items()]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_group_is_fused_and_matches_its_members(arch: str, checkpoint_dir: Callable[[str], Path]) -> None:
    loaded = load_model(checkpoint_dir(arch), onednn_linears=True)
    groups = fusing_modules(loaded.model)
    assert groups  # attention or GDN inputs and the MLPs (Qwen3-Next's shared expert) on every family
    g = torch.Generator().manual_seed(0)
    for module, attr, names in groups:
        fused = getattr(module, attr)
        assert isinstance(fused, FusedLinears), f"{type(module).__name__}.{attr} was not fused"
        members = [getattr(module, name) for name in names]
        assert all(type(m) is nn.Linear for m in members)  # left unpacked: only the fused copy is read
        for rows in (1, 3, 64):  # oneDNN's kernels differ by row count
            x = torch.randn(rows, members[0].in_features, generator=g)
            outs = fused(x)
            assert [o.shape for o in outs] == [(rows, m.out_features) for m in members]
            for out, member in zip(outs, members):
                torch.testing.assert_close(out, F.linear(x, member.weight, member.bias), rtol=1e-5, atol=1e-5)


def test_bf16_groups_round_as_their_members_would(checkpoint_dir: Callable[[str], Path]) -> None:
    loaded = load_model(checkpoint_dir("Qwen3_5ForCausalLM"), onednn_linears=True, weight_dtype="bfloat16")
    g = torch.Generator().manual_seed(1)
    for module, attr, names in fusing_modules(loaded.model):
        fused = getattr(module, attr)
        assert fused.packed_weight.dtype == torch.bfloat16
        x = torch.randn(2, getattr(module, names[0]).in_features, generator=g)
        for out, name in zip(fused(x), names):
            alone = OneDnnLinear(getattr(module, name), torch.bfloat16)(x)
            assert out.dtype == torch.float32
            # Same bf16 input and weights, fp32 sums in another order: a bf16 rounding at most apart.
            torch.testing.assert_close(out, alone, rtol=2**-7, atol=1e-3)


class TwoReaders(nn.Module):
    def __init__(self, bias: tuple[bool, bool], widths: tuple[int, int] = (8, 8)) -> None:
        super().__init__()
        self.a = nn.Linear(widths[0], 4, bias=bias[0])
        self.b = nn.Linear(widths[1], 6, bias=bias[1])
        self.fusible_linears = {"fused_ab": ("a", "b")}
        self.fused_ab: FusedLinears | None = None


@pytest.mark.parametrize("bias, widths", [((True, False), (8, 8)), ((False, False), (8, 16))],
                         ids=["one-bias", "two-inputs"])
def test_a_group_that_cannot_be_one_call_stays_separate(bias: tuple[bool, bool], widths: tuple[int, int]) -> None:
    module = TwoReaders(bias, widths)
    use_onednn_linears(module)
    assert module.fused_ab is None
    assert isinstance(module.a, OneDnnLinear) and isinstance(module.b, OneDnnLinear)


def test_a_fused_group_keeps_its_biases() -> None:
    module = TwoReaders((True, True))
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    use_onednn_linears(module)
    assert isinstance(module.fused_ab, FusedLinears)
    assert set(module.state_dict()) == set(weights)  # the packed copy is not state
    x = torch.randn(5, 8)
    a, b = module.fused_ab(x)
    torch.testing.assert_close(a, F.linear(x, weights["a.weight"], weights["a.bias"]))
    torch.testing.assert_close(b, F.linear(x, weights["b.weight"], weights["b.bias"]))


@pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("preset", [None, "300"])
def test_loading_bounds_onednns_per_shape_caches_unless_the_environment_does(
        preset: str | None, checkpoint_dir: Callable[[str], Path]) -> None:
    """Both caches are read when the first primitive is made, so a fresh process shows what the load set
    (the RSS they save is measured by bench.chaos's engine RSS row, not asserted here)."""
    env = {k: v for k, v in os.environ.items() if k not in SHAPE_CACHE_VARIABLES}
    if preset is not None:
        env["LRU_CACHE_CAPACITY"] = preset
    script = ("import os, sys; from engine.model.loader import load_model; "
              "load_model(sys.argv[1], onednn_linears=True); "
              "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    out = subprocess.run([sys.executable, "-c", script, str(checkpoint_dir(ARCHITECTURES[0]))], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    assert out == [str(SHAPE_CACHE_ENTRIES), preset or str(SHAPE_CACHE_ENTRIES)]
