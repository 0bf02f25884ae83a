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
                                     onednn_available, onednn_bf16_available, use_onednn_linears)
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


@pytest.mark.skipif(not onednn_bf16_available(),
                    reason="this CPU has no oneDNN bf16 inner product (AVX512 BW/VL/DQ or AVX-NE-CONVERT)")
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


_ROW_COUNTS_SCRIPT = """
import os, sys, torch
from engine.model.cpu_linear import FusedLinears, OneDnnLinear
from engine.model.loader import load_model

def rss_mib():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) / 1024

model = load_model(sys.argv[1], onednn_linears=True).model
linears = [m for m in model.modules() if isinstance(m, (FusedLinears, OneDnnLinear))]
inputs = {m: m.in_features if isinstance(m, OneDnnLinear) else m.packed_weight.shape[-1] for m in linears}
with torch.no_grad():
    for rows in (1, 2, 3):  # the shapes every step has: warm
        for m in linears:
            m(torch.randn(rows, inputs[m]))
    before = rss_mib()
    for rows in range(4, 404):  # prefill chunks of 400 lengths
        for m in linears:
            m(torch.randn(rows, inputs[m]))
print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), os.environ.get('LRU_CACHE_CAPACITY'), rss_mib() - before)
"""


@pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")
def test_loading_bounds_onednns_per_shape_caches_unless_the_environment_sizes_them(
        checkpoint_dir: Callable[[str], Path]) -> None:
    """Each in a fresh process (the caches are sized when the first primitive is made): linears called at
    400 row counts grow the process by a fraction of what the library's own 1024-entry caches take."""
    def run(preset: dict[str, str]) -> tuple[str, str, float]:
        env = {k: v for k, v in os.environ.items()
               if k not in {n for name, aliases in SHAPE_CACHE_VARIABLES.items() for n in (name, *aliases)}}
        out = subprocess.run([sys.executable, "-c", _ROW_COUNTS_SCRIPT, str(checkpoint_dir(ARCHITECTURES[0]))],
                             env={**env, **preset}, capture_output=True, text=True, timeout=300, check=True)
        onednn, lru, grown = out.stdout.split()
        return onednn, lru, float(grown)

    bounded = run({})
    library = run({"DNNL_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"})
    assert bounded[:2] == (str(SHAPE_CACHE_ENTRIES), str(SHAPE_CACHE_ENTRIES))
    assert library[:2] == ("None", "1024")  # the environment's sizes stand, under either of oneDNN's names
    assert bounded[2] * 3 < library[2], (bounded, library)
