"""The Triton kernels (kernels/triton_*.py) against their torch references.

On a CPU the kernels run in Triton's interpreter (the `interpret` cases). Triton must be
imported with TRITON_INTERPRET=1 already set (its own standard library is decorated then),
so those cases run in a child pytest with the variable set (test_interpreted_cases), and
nothing else in the session sees the variable or an interpreted kernel. Run them directly
with `TRITON_INTERPRET=1 pytest tests/test_triton_kernels.py`. On CUDA the `cuda` cases run
the compiled kernels in this process (make gpu-check). Shapes are small: the interpreter
pays per element and per program.

Tolerances (max abs and rel error against the reference on the same inputs upcast to fp32;
the attention and conv references then compute in fp32, the delta rule in float64):
fp32 2e-5, fp16 2e-3, bf16 1.6e-2: the last two are the output's rounding (half an ulp at
|x| ~ 2-4) plus, on CUDA, probabilities rounded to the cache dtype before P V.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from engine.kv.device_cache import CacheGeometry, DeviceCache
from engine.model.batch import ForwardBatch, LogitsWanted, SequenceChunk
from engine.model.loader import load_model
from kernels import causal_conv, gated_delta, paged_attention, state_copy
from kernels.select import kernels_for, triton_kernels
from triton_harness import (INTERPRETED, Target, compile_only_for_hopper, compiled_in_a_child,  # noqa: F401
                            run_interpreted_child, target)

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
PAGE = 16


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_interpreted_cases() -> None:
    """Every `interpret` case, in a child pytest that imports Triton under TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


def make_kv(pages: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device, seed: int,
            layers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of attention layer 1 as strided views of a DeviceCache-like [pages, L, 2, P, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(pages, layers, 2, PAGE, kv_heads, dim, generator=g).to(dtype).to(device)
    return kv[:, 1, 0], kv[:, 1, 1]


# --- paged attention ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", [(70, 70, None), (70, 23, None), (70, 1, None), (70, 30, 20)],
                         ids=["fresh-prefill", "chunk-after-prefix", "one-token", "sliding-window"])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_the_reference(target: Target, dtype: torch.dtype, dim: int,
                                               case: tuple[int, int, int | None]) -> None:
    context, tq, window = case
    heads, kv_heads = 8, 2  # four query heads per KV head
    k_cache, v_cache = make_kv(12, kv_heads, dim, dtype, target.device, seed=dim + tq)
    table = torch.tensor([9, 2, 11, 5, 0], device=target.device)  # 70 tokens in 5 pages, out of order
    q = torch.randn(tq, heads, dim, generator=torch.Generator().manual_seed(tq)).to(dtype).to(target.device)
    scale = 1.3 * dim**-0.5  # not the default: a kernel dropping `scale` fails
    got = target.ops.paged_attention(q, k_cache, v_cache, table, context, scale, window)
    want = paged_attention.paged_attention(q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(),
                                           table.cpu(), context, scale, window)
    assert got.shape == (tq, heads, dim) and got.dtype == dtype
    close(got, want, dtype)


def decode_gather(lengths: list[int], tables: list[list[int]], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pages/offsets/valid [B, L], built as engine.model.batch.DecodeGather does."""
    longest = max(lengths)
    padded = torch.zeros(len(lengths), -(-longest // PAGE), dtype=torch.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t)
    positions = torch.arange(longest)
    pages = padded[:, positions // PAGE]
    offsets = (positions % PAGE).expand(len(lengths), -1)
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    return pages.to(device), offsets.to(device), valid.to(device)


@pytest.mark.parametrize("splits", [None, 3], ids=["splits-auto", "splits-3"])
@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_matches_the_reference(target: Target, dtype: torch.dtype, dim: int,
                                                      window: int | None, splits: int | None) -> None:
    lengths = [1, 75, 33, 160]
    tables = [[3], [10, 0, 7, 12, 1], [4, 8, 15], [2, 5, 6, 9, 11, 13, 14, 16, 17, 18]]
    heads, kv_heads = 8, 2
    k_cache, v_cache = make_kv(19, kv_heads, dim, dtype, target.device, seed=dim)
    pages, offsets, valid = decode_gather(lengths, tables, target.device)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(5)).to(dtype).to(target.device)
    decode = target.ops.paged_decode_attention  # the Triton one also takes num_splits (forced here)
    got = decode(q, k_cache, v_cache, pages, offsets, valid, 0.3, window, num_splits=splits)  # type: ignore[call-arg]
    want = paged_attention.paged_decode_attention(q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(),
                                                  pages.cpu(), offsets.cpu(), valid.cpu(), 0.3, window)
    assert got.shape == (len(lengths), heads, dim) and got.dtype == dtype
    close(got, want, dtype)


# --- the gated delta rule -----------------------------------------------------------------------

def make_gdn(b: int, t: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device,
             seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the engine passes them: strided head views of one [B, T, C] conv output."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(b, t, 2 * hk * dk + hv * dv, generator=g).to(dtype).to(device)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    log_decay = (-torch.rand(b, t, hv, generator=g) * 0.5).to(device)  # fp32, as the layer computes it
    beta = torch.rand(b, t, hv, generator=g).to(dtype).to(device)
    return q.view(b, t, hk, dk), k.view(b, t, hk, dk), v.view(b, t, hv, dv), log_decay, beta


GDN_CASES = [(2, 37, 2, 4, 16, 16, 16), (1, 130, 1, 2, 32, 64, 64), (1, 70, 2, 2, 128, 128, 64)]


@pytest.mark.parametrize("with_state", [True, False], ids=["initial-state", "zero-state"])
@pytest.mark.parametrize("case", GDN_CASES, ids=["grouped-chunk16", "T130-chunk64", "d128"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_chunked_gated_delta_rule_matches_the_reference(target: Target, dtype: torch.dtype,
                                                        case: tuple[int, ...], with_state: bool) -> None:
    b, t, hk, hv, dk, dv, chunk = case
    q, k, v, g, beta = make_gdn(b, t, hk, hv, dk, dv, dtype, target.device, seed=t)
    state = torch.randn(b, hv, dk, dv, generator=torch.Generator().manual_seed(1)).to(target.device)
    start = state.clone() if with_state else None
    got, final = target.ops.chunk_gated_delta_rule(q, k, v, g, beta, start, chunk_size=chunk)
    want, want_final = gated_delta.chunk_gated_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                                          None if start is None else state.cpu(),
                                                          chunk_size=chunk, acc=torch.float64)
    assert got.shape == (b, t, hv, dv) and got.dtype == dtype and final.dtype == torch.float32
    close(got, want, dtype)
    close(final, want_final, torch.float32)  # states go out fp32 whatever the inputs
    if start is not None:
        assert torch.equal(start, state)  # read, never written


@pytest.mark.parametrize("dims", [(16, 32), (128, 128)], ids=["d16x32", "d128"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_decode_step_updates_each_state_slot_in_place(target: Target, dtype: torch.dtype,
                                                      dims: tuple[int, int]) -> None:
    dk, dv = dims
    hk, hv = 2, 4
    q, k, v, g, beta = make_gdn(3, 1, hk, hv, dk, dv, dtype, target.device, seed=dk)
    # a state pool like DeviceCache.recurrent [slots, L_lin, Hv, Dk, Dv]; the sequences sit in slots 4, 0, 2 of layer 1
    pool = torch.randn(5, 2, hv, dk, dv, generator=torch.Generator().manual_seed(2)).to(target.device)
    before = pool.clone()
    slots = [4, 0, 2]
    got = target.ops.gated_delta_decode_step_(q, k, v, g, beta, [pool[s, 1] for s in slots])
    want_states = [before[s, 1].cpu().clone() for s in slots]
    want = gated_delta.gated_delta_decode_step_(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), want_states)
    assert got.shape == (3, 1, hv, dv) and got.dtype == dtype
    close(got, want, dtype)
    for s, w in zip(slots, want_states):
        close(pool[s, 1], w, torch.float32)
    untouched = torch.ones(5, 2, dtype=torch.bool)
    untouched[slots, 1] = False
    assert torch.equal(pool[untouched], before[untouched])


# --- the causal conv ----------------------------------------------------------------------------

@pytest.mark.parametrize("with_state", [True, False], ids=["carried-taps", "fresh"])
@pytest.mark.parametrize("shape", [(1, 160, 37, 4), (3, 96, 1, 4), (2, 40, 2, 4), (1, 24, 5, 3)],
                         ids=["prefill", "decode", "shorter-than-taps", "kernel3"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_causal_conv_matches_the_reference(target: Target, dtype: torch.dtype, shape: tuple[int, int, int, int],
                                           with_state: bool) -> None:
    b, c, t, kernel = shape
    g = torch.Generator().manual_seed(t)
    x = torch.randn(b, t, c, generator=g).to(dtype).to(target.device).transpose(1, 2)  # [B, C, T], as the layer's
    weight = torch.randn(c, kernel, generator=g).to(dtype).to(target.device)
    state = torch.randn(b, c, kernel - 1, generator=g).to(dtype).to(target.device) if with_state else None
    got, new_state = target.ops.causal_conv1d(x, weight, state)
    want, want_state = causal_conv.causal_conv1d(x.float().cpu(), weight.float().cpu(),
                                                 None if state is None else state.float().cpu())
    assert got.shape == (b, c, t) and got.dtype == dtype and new_state.shape == (b, c, kernel - 1)
    close(got, want, dtype)
    assert torch.equal(new_state.float().cpu(), want_state)  # the taps are copied, not computed


# --- state clone --------------------------------------------------------------------------------

def test_copy_rows_clones_slots_and_pages_bit_exact(target: Target) -> None:
    g = torch.Generator().manual_seed(0)
    recurrent = torch.randn(6, 3, 4, 16, 16, generator=g).to(target.device)  # [slots, L_lin, Hv, Dk, Dv] fp32
    conv = torch.randn(6, 3, 40, 3, generator=g).to(torch.bfloat16).to(target.device)  # [slots, L_lin, C, K-1]
    kv = torch.randn(7, 2, 2, PAGE, 2, 16, generator=g).to(torch.bfloat16).to(target.device)  # pages
    odd = torch.randint(0, 255, (5, 7), generator=g, dtype=torch.uint8).to(target.device)  # 7-byte rows
    for pool, src, dst in ((recurrent, [5, 1], [0, 3]), (conv, [5], [2]), (kv, [6, 2, 0], [1, 4, 5]),
                           (odd, [0], [4])):
        want = pool.cpu().clone()
        state_copy.copy_rows_(want, torch.tensor(src), torch.tensor(dst))
        target.ops.copy_rows_(pool, torch.tensor(src, device=target.device), torch.tensor(dst, device=target.device))
        assert torch.equal(pool.cpu().view(torch.uint8), want.view(torch.uint8))


def test_the_device_cache_clones_states_with_the_row_copy(target: Target, checkpoint_dir: Callable[[str], Path]
                                                          ) -> None:
    """DeviceCache.copy_slot / copy_page through the kernel the builder gives it on CUDA
    (engine/model/state_copy.py) equal plain tensor copies, bit for bit."""
    config = load_model(checkpoint_dir("Qwen3_5ForCausalLM")).config
    geometry = CacheGeometry(PAGE, 6, 4, torch.bfloat16)
    plain = DeviceCache(config.state_shape(), geometry, target.device)
    kernel = DeviceCache(config.state_shape(), geometry, target.device, copy_rows=target.ops.copy_rows_)
    g = torch.Generator().manual_seed(3)
    for t in ("kv", "recurrent", "conv"):
        filled = torch.randn(getattr(plain, t).shape, generator=g).to(getattr(plain, t).dtype).to(target.device)
        getattr(plain, t).copy_(filled)
        getattr(kernel, t).copy_(filled)
    for cache in (plain, kernel):
        cache.copy_slot(3, 0)
        cache.copy_page(5, 1)
    for t in ("kv", "recurrent", "conv"):
        assert torch.equal(getattr(plain, t).cpu().view(torch.uint8), getattr(kernel, t).cpu().view(torch.uint8))
    assert torch.equal(kernel.recurrent[0], kernel.recurrent[3]) and torch.equal(kernel.kv[1], kernel.kv[5])


# --- the models on the Triton kernels -----------------------------------------------------------

@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "MistralForCausalLM"])
def test_model_on_the_triton_kernels_equals_the_torch_path(target: Target, arch: str,
                                                           checkpoint_dir: Callable[[str], Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own tensors (strided cache views, conv outputs, state slots) through the Triton
    kernels: a chunked prefill with a prefix, then a batched decode, against the torch kernels."""
    import engine.model.attention as attention
    import engine.model.gated_deltanet as gated_deltanet

    loaded = load_model(checkpoint_dir(arch), dtype="float32", device=target.device)
    prompts = [list(range(3, 3 + n)) for n in (60, 23, 9)]  # Mistral's window is 48: 60 tokens cross it
    tables = [[7, 2, 5, 0], [3, 6], [1]]

    def run() -> torch.Tensor:
        cache = DeviceCache(loaded.config.state_shape(), CacheGeometry(PAGE, 8, 4, torch.float32), target.device)
        out = []
        first = [SequenceChunk(p[:37] if i == 0 else p[:-1], 0, t, i, LogitsWanted.ALL)
                 for i, (p, t) in enumerate(zip(prompts, tables))]
        out.append(loaded.model(ForwardBatch.build(first, PAGE, target.device), cache))
        rest = [SequenceChunk(prompts[0][37:-1], 37, tables[0], 0, LogitsWanted.ALL)]
        out.append(loaded.model(ForwardBatch.build(rest, PAGE, target.device), cache))
        last = [SequenceChunk(p[-1:], len(p) - 1, t, i) for i, (p, t) in enumerate(zip(prompts, tables))]
        batch = ForwardBatch.build(last, PAGE, target.device)
        assert batch.decode is not None  # the padded decode path
        out.append(loaded.model(batch, cache))
        return torch.cat(out).float().cpu()

    reference = run() if target.device.type == "cpu" else None
    for module in (attention, gated_deltanet):
        monkeypatch.setattr(module, "kernels_for", lambda device: target.ops)
    got = run()
    if reference is None:  # on CUDA: the torch kernels on the same device are the reference
        torch_ops = kernels_for(torch.device("cpu"))
        for module in (attention, gated_deltanet):
            monkeypatch.setattr(module, "kernels_for", lambda device: torch_ops)
        reference = run()
    assert (got - reference).abs().max().item() < 1e-4


# --- compiled for the GPU, without one -----------------------------------------------------------

def compile_for_hopper() -> dict[str, int]:
    """Compile (never launch) every kernel for sm_90 through its real wrapper at the served shapes, on a
    CPU (tests/hopper_compile.py). Returns each compiled kernel's shared memory in bytes. Run in a
    process of its own."""
    import triton

    from kernels import (triton_causal_conv, triton_gated_delta, triton_paged_attention, triton_state_copy,
                         triton_support)

    compiled = compile_only_for_hopper(triton_causal_conv, triton_gated_delta, triton_paged_attention,
                                       triton_state_copy, triton_support)
    ops = triton_kernels()
    bf16 = torch.bfloat16
    for dim in (128, 256):  # fp32 caches compile the same code with IEEE dots (115 KB at dim 128)
        kv = torch.zeros(16, 2, 2, PAGE, 2, dim, dtype=bf16)
        q = torch.zeros(40, 8, dim, dtype=bf16)
        ops.paged_attention(q, kv[:, 1, 0], kv[:, 1, 1], torch.arange(4), 60, 0.1, None)
        pages, offsets, valid = decode_gather([200, 9], [list(range(13)), [13]], torch.device("cpu"))
        triton_paged_attention.paged_decode_attention(q[:2], kv[:, 1, 0], kv[:, 1, 1], pages, offsets, valid, 0.1,
                                                      24, num_splits=2)
    q, k, v, g, beta = make_gdn(1, 100, 2, 4, 128, 128, bf16, torch.device("cpu"), seed=0)
    ops.chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros(1, 4, 128, 128))
    pool = torch.zeros(3, 2, 4, 128, 128)
    ops.gated_delta_decode_step_(q[:, :1].expand(2, 1, 2, 128), k[:, :1].expand(2, 1, 2, 128),
                                 v[:, :1].expand(2, 1, 4, 128), g[:, :1].expand(2, 1, 4), beta[:, :1].expand(2, 1, 4),
                                 [pool[2, 1], pool[0, 1]])
    x = torch.zeros(1, 37, 1024, dtype=bf16).transpose(1, 2)
    ops.causal_conv1d(x, torch.zeros(1024, 4, dtype=bf16), torch.zeros(1, 1024, 3, dtype=bf16))
    ops.copy_rows_(pool, torch.tensor([0]), torch.tensor([1]))
    assert triton.__version__  # compiled with this Triton
    return compiled


@pytest.mark.skipif(INTERPRETED, reason="the parent run checks this")
def test_every_kernel_compiles_for_hopper_within_its_shared_memory() -> None:
    pytest.importorskip("triton")
    shared = compiled_in_a_child("test_triton_kernels")
    names = {name.split("/")[0] for name in shared}
    assert names == {"_prefill_kernel", "_decode_kernel", "_merge_kernel", "_chunk_prepare", "_chunk_scan",
                     "_decode_step", "_conv_kernel", "_copy_kernel"}, names


# --- the one place that picks --------------------------------------------------------------------

@pytest.mark.skipif(INTERPRETED, reason="the parent run checks this")
def test_cpu_runs_the_references_and_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from kernels.select import kernels_for\n"
        "import engine.model.attention, engine.model.gated_deltanet\n"
        "ops = kernels_for(torch.device('cpu'))\n"
        "from kernels import paged_attention, gated_delta, causal_conv, state_copy\n"
        "assert ops.name in ('torch', 'cpu') and ops.paged_attention is paged_attention.paged_attention\n"
        "assert ops.chunk_gated_delta_rule is gated_delta.chunk_gated_delta_rule\n"
        "assert ops.copy_rows_ is state_copy.copy_rows_\n"
        "assert ops.causal_conv1d is causal_conv.causal_conv1d or ops.name == 'cpu'  # the C prefill conv\n"
        "assert 'triton' not in sys.modules, 'triton was imported on a CPU'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.cuda
def test_cuda_runs_the_triton_kernels() -> None:
    pytest.importorskip("triton")
    assert kernels_for(torch.device("cuda")).name == "triton"
