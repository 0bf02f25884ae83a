"""engine.weight_dtype=bfloat16: an fp32 CPU model whose linear layers keep bf16 weights (oneDNN).

The oracle is transformers on the same checkpoint doing what oneDNN's bf16 inner product does:
each nn.Linear's weight rounded to bf16 (untied: the embedding stays fp32 on both sides), its
input rounded to bf16, the products summed in fp32 and the result rounded to bf16; everything
between the linears in fp32. What is left is the order of the sums (and a rounding it flips)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from checkpoints import ARCHITECTURES, ROUTED_ARCHITECTURES, load_hf
from engine.model import loader
from engine import cpu_host
from engine.model.cpu_linear import OneDnnLinear, onednn_available, onednn_bf16_available
from engine.model.loader import load_model
from test_model import hf_logits, make_cache, make_prompt, run_chunks

pytestmark = pytest.mark.skipif(not onednn_available(), reason="needs oneDNN")
needs_bf16 = pytest.mark.skipif(not onednn_bf16_available(),
                                reason="this CPU has no oneDNN bf16 inner product (AVX512 BW/VL/DQ or AVX-NE-CONVERT)")

# Max |logit difference| allowed against the bf16 oracle. The logits come out of the LM head
# rounded to bf16 on both sides (2^-7 apart near 2, these checkpoints' largest), so two ulps:
# measured 0 on five of the architectures, one ulp on Qwen2. Qwen3-Next routes tokens to its
# top-k experts, and a near tie the sum order flips moves a token to another expert: 4 ulps
# measured. Against the plain fp32 oracle the same logits differ by 2e-2 to 1.4e-1 (the bf16
# rounding itself), which these bounds would not pass but for Qwen3-Next's.
# Qwen3_5ForConditionalGeneration: 3 ulps measured. Its transformers class runs the same text model as
# Qwen3_5ForCausalLM (fp32 logits within 7e-6 of ours, as the text class's are) in another op order, and
# rounding every linear's input to bf16 turns a last-bit fp32 difference into ulps; ours against the text
# class is 0.
BF16_TOLERANCE = 2 * 2**-7
OTHER_ORDER_TOLERANCE = 4 * 2**-7
ROUTED_TOLERANCE = 8 * 2**-7
# On a CPU with AMX, oneDNN's bf16 inner product runs on its tiles (TDPBF16PS), which sum in
# another order than the AVX-512 kernels: measured on a Sapphire Rapids VM, 2.5 ulps on Qwen3,
# 2 on Llama and Qwen2, 0 on Mistral, against exactly 0 with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16.
AMX_TOLERANCE = 4 * 2**-7


def _amx_bf16() -> bool:
    """Whether oneDNN may use AMX here: the CPU has it and ONEDNN_MAX_CPU_ISA does not cap it below."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    if cap and "AMX" not in cap.upper() and cap.upper() != "ALL":
        return False
    return "amx_bf16" in cpu_host.describe().isa


def rounded_oracle(path: Path, ids: list[int]) -> torch.Tensor:
    hf = load_hf(path, torch.float32).eval()
    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    for module in hf.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(bf16(module.weight.detach()))
            if module.bias is not None:
                module.bias = nn.Parameter(bf16(module.bias.detach()))
            module.register_forward_pre_hook(lambda _m, args: (bf16(args[0]), *args[1:]))
            module.register_forward_hook(lambda _m, _args, out: bf16(out))
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@needs_bf16
@pytest.mark.parametrize("decode_linear", ["onednn", "c"])
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "Qwen3NextForCausalLM-moe"])
def test_bf16_weights_match_the_rounded_oracle(arch: str, decode_linear: str,
                                               checkpoint_dir: Callable[[str], Path]) -> None:
    """c: the chunks of 1-3 rows run kernels/cpu/linear_rows.c on a bf16 copy of the weights, rounding
    rows and outputs as oneDNN's bf16 inner product does: the same oracle, the same bounds."""
    path = checkpoint_dir(arch)
    loaded = load_model(path, onednn_linears=True, weight_dtype="bfloat16", decode_linear=decode_linear)
    linears = [m for m in loaded.model.modules() if isinstance(m, OneDnnLinear)]
    assert linears and all(m.packed_weight.dtype == torch.bfloat16 for m in linears)
    assert all((m.c_rows is not None) == (decode_linear == "c") for m in linears)
    ids = make_prompt(60)
    ours = run_chunks(loaded, make_cache(loaded), ids, [40, 14, 3, 1, 1, 1], list(range(5)))
    assert ours.dtype == torch.float32
    diff = (ours - rounded_oracle(path, ids)).abs().max().item()
    plain = (ours - hf_logits(path, ids)).abs().max().item()
    print(f"{arch}: bf16 weights, max |logit diff| vs the bf16 oracle = {diff:.3e}, vs fp32 = {plain:.3e}")
    dense_bound = AMX_TOLERANCE if _amx_bf16() else BF16_TOLERANCE
    if arch == "Qwen3NextForCausalLM" or arch in ROUTED_ARCHITECTURES:
        dense_bound = ROUTED_TOLERANCE
    elif arch == "Qwen3_5ForConditionalGeneration":
        dense_bound = max(OTHER_ORDER_TOLERANCE, dense_bound)
    assert diff <= dense_bound


@needs_bf16
def test_bf16_weights_are_another_namespace(checkpoint_dir: Callable[[str], Path]) -> None:
    """KV made with other weights is other state: the digest the reuse namespace is built on differs."""
    path = checkpoint_dir("Qwen3ForCausalLM")
    fp32 = load_model(path, onednn_linears=True)
    assert load_model(path, onednn_linears=True, weight_dtype="float32").weights_digest == fp32.weights_digest
    assert load_model(path, onednn_linears=True, weight_dtype="bfloat16").weights_digest != fp32.weights_digest


def test_bf16_weights_need_the_onednn_linears(checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir("Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="engine.cpu_linear=onednn"):
        load_model(path, onednn_linears=False, weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="weight_dtype must be"):
        load_model(path, onednn_linears=True, weight_dtype="int4")


def test_bf16_weights_on_a_cpu_without_them_are_a_clear_error(checkpoint_dir: Callable[[str], Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no bf16 inner product, the load says so and what to set (the engine logs it and
    exits 2), instead of oneDNN's RuntimeError from deep inside the packing."""
    monkeypatch.setattr(loader, "onednn_bf16_available", lambda: False)
    with pytest.raises(ValueError, match="engine.weight_dtype=float32"):
        load_model(checkpoint_dir("Qwen3ForCausalLM"), onednn_linears=True, weight_dtype="bfloat16")
