"""The block-scaled FP8 linear (issue 42): the torch reference (kernels/fp8_gemm.py) against an
independent block-by-block oracle, the Triton kernel (kernels/triton_fp8_gemm.py) against the
reference, and the FP8-serving linear (engine/model/fp8.py's Fp8Linear, what the loader builds on
CUDA) against the dequantized model.

As in tests/test_triton_kernels.py, the Triton cases run on a CPU in Triton's interpreter, in a
child pytest that imports Triton under TRITON_INTERPRET=1 (test_interpreted_cases); on CUDA the
`cuda` cases run the compiled kernel in this process. Run the child's cases directly with
`TRITON_INTERPRET=1 pytest tests/test_fp8_gemm.py`. Shapes are small: the interpreter pays per
program. Blocks of 128 that do not divide N or K (N=200, K=300: the last block partial) and a
block that is not a power of two (24 columns) are in every kernel case.

Tolerances: the kernel computes the reference's arithmetic (exact fp8 weights, fp32 accumulation,
each K-block's scale on its partial sum) in another summation order, so fp32 agrees to 2e-5; in
bf16/fp16 the output's rounding (half an ulp at |y| ~ 1-4) sets 1.6e-2 / 2e-3, as for the other kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine.model.fp8 as fp8
import engine.model.loader as loader
from engine.model.errors import CheckpointError
from engine.model.loader import LoadedModel, load_model
from kernels import fp8_gemm
from kernels.select import kernels_for
from triton_harness import (INTERPRETED, Target, compile_only_for_hopper, compiled_in_a_child,  # noqa: F401
                            run_interpreted_child, target)
from test_fp8_checkpoint import quantize, write_pair
from test_model import make_cache, make_prompt, run_chunks

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
# (N, K, block rows, block cols)
SHAPES = [pytest.param((200, 300, 128, 128), id="N200-K300-partial-blocks"),
          pytest.param((256, 256, 128, 128), id="N256-K256-whole-blocks"),
          pytest.param((64, 72, 32, 24), id="N64-K72-block32x24")]
parent_only = pytest.mark.skipif(INTERPRETED, reason="the parent run checks this")


def make_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized weight whose blocks span different ranges (so a scale applied to the wrong block shows)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(n, 1, generator=g) * torch.rand(1, k, generator=g) * 4 + 0.1
    return quantize(torch.randn(n, k, generator=g) * spread * k**-0.5, block)


def oracle(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequant(W).T + bias in float64, dequantized block by block (not the reference's code)."""
    w = q.double()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j].double()
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


# --- the reference --------------------------------------------------------------------------------

@parent_only
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_reference_is_the_dequantized_matmul(shape: tuple[int, int, int, int], with_bias: bool) -> None:
    n, k, rows, cols = shape
    q, scale = make_weight(n, k, (rows, cols), seed=n + k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, k, generator=g)  # leading dimensions pass through
    bias = torch.randn(n, generator=g) if with_bias else None
    got = fp8_gemm.fp8_block_linear(x, q, scale, (rows, cols), bias)
    assert got.shape == (2, 5, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), oracle(x, q, scale, (rows, cols), bias), atol=1e-5, rtol=1e-5)
    # bf16 in, bf16 out: the fp32 result rounded once
    x16 = x.to(torch.bfloat16)
    want16 = fp8_gemm.fp8_block_linear(x16.float(), q, scale, (rows, cols), bias).to(torch.bfloat16)
    assert torch.equal(fp8_gemm.fp8_block_linear(x16, q, scale, (rows, cols), bias), want16)


@parent_only
def test_wrong_operands_are_named() -> None:
    q, scale = make_weight(200, 300, (128, 128), seed=0)
    x = torch.randn(3, 300)
    for args, words in (((x, q, scale[:1], (128, 128)), "scale_inv must be float32 \\[2, 3\\]"),
                        ((x, q, scale.double(), (128, 128)), "scale_inv must be float32"),
                        ((x, q.float(), scale, (128, 128)), "weight must be a 2-D"),
                        ((x[:, :299], q, scale, (128, 128)), "takes 300"),
                        ((x, q, scale, (128, 128), torch.zeros(3)), "bias must be \\[200\\]")):
        with pytest.raises(ValueError, match=words):
            fp8_gemm.fp8_block_linear(*args)


# --- the Triton kernel ----------------------------------------------------------------------------

@parent_only
def test_interpreted_cases() -> None:
    """Every `interpret` case, in a child pytest that imports Triton under TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_matches_the_reference(target: Target, dtype: torch.dtype, shape: tuple[int, int, int, int],
                                          m: int) -> None:
    n, k, rows, cols = shape
    q, scale = make_weight(n, k, (rows, cols), seed=n + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if m == 7 else None  # the bias path once per shape
    dev = target.device
    got = target.ops.fp8_block_linear(x.to(dev), q.to(dev), scale.to(dev), (rows, cols),
                                      None if bias is None else bias.to(dev))
    want = fp8_gemm.fp8_block_linear(x.float(), q, scale, (rows, cols), None if bias is None else bias.float())
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_the_kernel_takes_the_rows_the_engine_passes(target: Target) -> None:
    """Leading dimensions, rows picked out of a wider tensor (strided), and no rows at all."""
    q, scale = make_weight(200, 300, (128, 128), seed=3)
    wide = torch.randn(9, 2, 300, generator=torch.Generator().manual_seed(2)).to(target.device)
    x = wide[:, 1]  # [9, 300], rows 600 apart
    dev = target.device
    got = target.ops.fp8_block_linear(x, q.to(dev), scale.to(dev), (128, 128))
    torch.testing.assert_close(got.cpu(), fp8_gemm.fp8_block_linear(x.cpu(), q, scale, (128, 128)),
                               atol=2e-5, rtol=2e-5)
    batched = target.ops.fp8_block_linear(x.reshape(3, 3, 300), q.to(dev), scale.to(dev), (128, 128))
    torch.testing.assert_close(batched.reshape(9, 200), got, atol=0, rtol=0)
    assert target.ops.fp8_block_linear(x[:0], q.to(dev), scale.to(dev), (128, 128)).shape == (0, 200)


@pytest.mark.parametrize("m", [1, 40])
def test_the_kernel_on_the_tiles_the_gpu_takes(target: Target, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's tiles cover each case with one or two programs; these are the GPU's (16 x 32 at
    decode, 64 x 64 here): many programs, each with its own rows, columns and scale rows."""
    from kernels import triton_fp8_gemm

    monkeypatch.setattr(triton_fp8_gemm, "interpreting", lambda device: False)  # the tiles only: dots stay upcast
    monkeypatch.setattr(triton_fp8_gemm, "_multiprocessors", lambda device: 132)
    q, scale = make_weight(200, 300, (128, 128), seed=4)
    x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    dev = target.device
    assert triton_fp8_gemm.tiles(m, 200, 128, x.to(dev))[:2] == ((16, 32) if m == 1 else (64, 64))
    got = target.ops.fp8_block_linear(x.to(dev), q.to(dev), scale.to(dev), (128, 128))
    want = fp8_gemm.fp8_block_linear(x.float(), q, scale, (128, 128))
    torch.testing.assert_close(got.float().cpu(), want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


# --- the FP8-serving linear and the loader --------------------------------------------------------

def make_fp8_linear(n: int, k: int, blocks: fp8.Fp8Blocks, bias: bool, seed: int) -> tuple[fp8.Fp8Linear, nn.Linear]:
    """An Fp8Linear and the nn.Linear of the same weights dequantized (fp32)."""
    q, scale = make_weight(n, k, (blocks.rows, blocks.cols), seed)
    layer = fp8.Fp8Linear(k, n, bias, blocks)
    plain = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale_inv.copy_(scale)
        plain.weight.copy_(fp8.dequantize(q, scale, blocks, "w"))
        if bias:
            b = torch.randn(n, generator=torch.Generator().manual_seed(seed))
            layer.bias.copy_(b)
            plain.bias.copy_(b)
    return layer, plain


@parent_only
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_fp8_linear_equals_the_dequantized_linear(bias: bool) -> None:
    """On the CPU the Fp8Linear runs the reference GEMM: the same layer as nn.Linear on the dequantized
    weight (fp32), and in bf16 closer to the fp32 result than a linear on bf16-dequantized weights."""
    layer, plain = make_fp8_linear(200, 300, fp8.Fp8Blocks(128, 128), bias, seed=7)
    assert kernels_for(torch.device("cpu")).fp8_block_linear is fp8_gemm.fp8_block_linear
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        exact = plain(x)
        torch.testing.assert_close(layer(x), exact, atol=1e-5, rtol=1e-5)
        x16 = x.to(torch.bfloat16)
        ours = layer(x16)
        assert ours.dtype == torch.bfloat16
        wanted = plain(x16.float())
        bias16 = None if plain.bias is None else plain.bias.to(torch.bfloat16)
        dequantized_bf16 = F.linear(x16, plain.weight.to(torch.bfloat16), bias16)  # what CUDA served before
    assert (ours.float() - wanted).abs().max() <= (dequantized_bf16.float() - wanted).abs().max()
    assert (ours.float() - wanted).abs().max() < 1.6e-2 * wanted.abs().max()


def load_fp8_served(path: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch,
                    gemm: Callable[..., torch.Tensor] | None = None) -> LoadedModel:
    """The checkpoint loaded as on CUDA (its linears kept fp8) on `device`, through `gemm` if given."""
    monkeypatch.setattr(loader, "fp8_gemm_absent", lambda dev: None)
    if gemm is not None:
        ops = dataclasses.replace(kernels_for(device), fp8_block_linear=gemm)
        monkeypatch.setattr(fp8, "kernels_for", lambda dev: ops)
    return load_model(path, dtype="float32", device=device)


def logits(loaded: LoadedModel) -> torch.Tensor:
    """A chunked prefill then one decode step (M = 1 through every linear)."""
    ids = make_prompt(30)
    return run_chunks(loaded, make_cache(loaded), ids, [17, 12, 1], list(range(2)))


@parent_only
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3MoeForCausalLM"])
def test_a_model_served_on_fp8_linears_equals_the_dequantized_model(tmp_path: Path, arch: str,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The loader's CUDA branch, run on the CPU (the reference GEMM): every quantized linear an
    Fp8Linear holding the checkpoint's fp8 weight and scales, the MoE experts dequantized, and the
    logits those of the same checkpoint dequantized (blocks of 32x24: partial ones everywhere)."""
    fp8_dir, plain_dir = write_pair(tmp_path, arch)
    with caplog.at_level(logging.INFO, logger="ignis.engine"):
        cpu = load_model(fp8_dir, dtype="float32")
    assert "dequantized at load to torch.float32 (no FP8 GEMM on cpu)" in caplog.text
    assert not any(isinstance(m, fp8.Fp8Linear) for m in cpu.model.modules())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ignis.engine"):
        served = load_fp8_served(fp8_dir, torch.device("cpu"), monkeypatch)
    layers = [m for m in served.model.modules() if isinstance(m, fp8.Fp8Linear)]
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
                          for m in layers)
    assert f"{len(layers)} fp8 linear weights (blocks of 32x24) served as fp8 through the block-scaled GEMM" \
        in caplog.text
    assert isinstance(served.model.lm_head, nn.Linear) and served.model.dtype == torch.float32
    if arch == "Qwen3MoeForCausalLM":
        assert served.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32
    assert served.weights_digest != cpu.weights_digest  # other weights, other reuse namespace
    want = logits(load_model(plain_dir, dtype="float32"))
    assert (logits(served) - want).abs().max().item() < 1e-4
    assert (logits(cpu) - want).abs().max().item() < 1e-4


def test_a_model_on_the_triton_fp8_gemm_equals_the_dequantized_model(target: Target, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear of a hybrid model through the Triton kernel (in the interpreter on a CPU, compiled on
    CUDA), prefill and decode, against the same checkpoint dequantized on the same device."""
    fp8_dir, plain_dir = write_pair(tmp_path, "Qwen3_5ForCausalLM")
    calls: list[int] = []

    def counted(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return target.ops.fp8_block_linear(x, *args, **kwargs)  # type: ignore[arg-type]

    served = load_fp8_served(fp8_dir, target.device, monkeypatch, gemm=counted)
    got = logits(served)
    assert calls and 1 in calls  # the decode step's single row went through the kernel
    want = logits(load_model(plain_dir, dtype="float32", device=target.device))
    assert (got - want).abs().max().item() < 1e-4


@parent_only
def test_a_bad_scale_names_its_tensor_when_kept_fp8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file, save_file

    fp8_dir, _ = write_pair(tmp_path, "Qwen3ForCausalLM")
    weights = load_file(fp8_dir / "model.safetensors")
    name = next(n for n in weights if n.endswith("q_proj.weight_scale_inv"))
    weights[name] = weights[name][:1]
    save_file(weights, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name):
        load_fp8_served(fp8_dir, torch.device("cpu"), monkeypatch)


# --- compiled for the GPU, without one -------------------------------------------------------------

def compile_for_hopper() -> dict[str, int]:
    """Compile (never launch) the kernel for sm_90 through its wrapper at served shapes (decode, a
    prefill chunk; bf16 and fp32; blocks of 128 and of 32x24), on a CPU (tests/hopper_compile.py): the
    fp8e4nv loads and conversions must compile for Hopper and fit its shared memory. Returns each
    compiled kernel's shared memory in bytes."""
    from kernels import triton_fp8_gemm, triton_support

    compiled = compile_only_for_hopper(triton_fp8_gemm, triton_support)
    setattr(triton_fp8_gemm, "_multiprocessors", lambda device: 132)  # an H200's
    for (n, k, block), dtype, m in (((4096, 4096, (128, 128)), torch.bfloat16, 1),
                                    ((14336, 4096, (128, 128)), torch.bfloat16, 1),
                                    ((4096, 4096, (128, 128)), torch.bfloat16, 512),
                                    ((4096, 4096, (128, 128)), torch.float32, 512),
                                    ((200, 300, (128, 128)), torch.float32, 7),
                                    ((64, 72, (32, 24)), torch.bfloat16, 64)):
        q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        scale = torch.zeros(fp8_gemm.scale_grid((n, k), block))
        triton_fp8_gemm.fp8_block_linear(torch.zeros(m, k, dtype=dtype), q, scale, block, torch.zeros(n, dtype=dtype))
    return compiled


@parent_only
def test_the_kernel_compiles_for_hopper_within_its_shared_memory() -> None:
    pytest.importorskip("triton")
    shared = compiled_in_a_child("test_fp8_gemm")
    assert len(shared) == 6 and {name.split("/")[0] for name in shared} == {"_fp8_gemm_kernel"}, shared


@pytest.mark.cuda
def test_cuda_serves_fp8_checkpoints_as_fp8() -> None:
    assert fp8.fp8_gemm_absent(torch.device("cuda")) is None or torch.cuda.get_device_capability() < (8, 9)
