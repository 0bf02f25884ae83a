"""The models against Hugging Face transformers on the same random-weight checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from checkpoints import ARCHITECTURES, load_hf
from engine.kv.device_cache import CacheGeometry, DeviceCache
from engine.model.batch import CPU_PADDED_DECODE_MAX_CONTEXT, ForwardBatch, LogitsWanted, SequenceChunk
from engine.model.cpu_linear import OneDnnLinear, PackedLinear
from engine.model.gated_deltanet import STEPPED_CHUNK_TOKENS
from engine.model.loader import LoadedModel, load_model
from engine.offline import greedy_generate
from kernels.select import kernels_for

PAGE = 16
CPU = torch.device("cpu")


def make_prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def make_cache(loaded: LoadedModel, pages: int = 64, slots: int = 8) -> DeviceCache:
    """A cache on the model's device, in its dtype (test_cuda.py shares these helpers)."""
    geometry = CacheGeometry(PAGE, pages, slots, loaded.model.dtype)
    return DeviceCache(loaded.config.state_shape(), geometry, loaded.model.device)


def run_chunks(loaded: LoadedModel, cache: DeviceCache, ids: list[int], sizes: list[int],
               pages: list[int], slot: int = 0) -> torch.Tensor:
    """Feed `ids` in chunks of `sizes`; return fp32 logits on the CPU for every position, [len(ids), vocab]."""
    out, start = [], 0
    for size in sizes:
        chunk = SequenceChunk(ids[start : start + size], start, pages, slot, LogitsWanted.ALL)
        out.append(loaded.model(ForwardBatch.build([chunk], PAGE, loaded.model.device), cache).float().cpu())
        start += size
    return torch.cat(out)


def hf_logits(path: Path, ids: list[int], dtype: torch.dtype = torch.float32, device: torch.device = CPU
              ) -> torch.Tensor:
    hf = load_hf(path, dtype).to(device).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids], device=device)).logits[0].float().cpu()


def prefilled_decode_batch(loaded: LoadedModel, lengths: tuple[int, ...]
                           ) -> tuple[list[list[int]], list[list[int]], int, DeviceCache, ForwardBatch]:
    """Prompts of `lengths` prefilled but for their last token, on scattered (reversed) pages, and
    the one decode batch of all their last tokens: (prompts, page tables, pages used, cache, batch)."""
    device = loaded.model.device
    prompts = [make_prompt(n, seed=n) for n in lengths]
    tables, first = [], 0
    for n in lengths:
        tables.append(list(range(first, first + -(-n // PAGE)))[::-1])
        first += len(tables[-1])
    cache = make_cache(loaded, pages=first)
    for i, (ids, t) in enumerate(zip(prompts, tables)):
        loaded.model(ForwardBatch.build([SequenceChunk(ids[:-1], 0, t, i)], PAGE, device), cache)
    batch = ForwardBatch.build([SequenceChunk(ids[-1:], len(ids) - 1, t, i)
                                for i, (ids, t) in enumerate(zip(prompts, tables))], PAGE, device)
    return prompts, tables, first, cache, batch


MAX_DIFF: dict[str, float] = {}
GDN_CUT_TOLERANCE = 1e-4  # logits of a hybrid prefill cut elsewhere (fp32 chunked delta rule)


@pytest.mark.parametrize("linear", ["torch", "onednn", "c"], ids=["torch-linear", "onednn-linear", "c-linear"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(arch: str, linear: str, checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir(arch)
    onednn = linear != "torch"
    # c: oneDNN for the chunks of many rows, the C kernel (kernels/cpu/linear_rows.c) for those of 1-8
    loaded = load_model(path, onednn_linears=onednn, decode_linear="onednn" if linear == "torch" else linear)
    assert any(isinstance(m, OneDnnLinear) for m in loaded.model.modules()) == onednn
    packed = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert all((m.c_rows is not None) == (linear == "c") for m in packed)
    assert loaded.config.architecture == arch.removesuffix("-moe")
    ids = make_prompt(100)
    # One chunk of many rows, then decode-sized ones: oneDNN's blocked kernels differ by row count.
    sizes = [64, 28, 5, 1, 1, 1] if onednn else [100]
    ours = run_chunks(loaded, make_cache(loaded), ids, sizes, list(range(7)))
    ref = hf_logits(path, ids)
    diff = (ours - ref).abs().max().item()
    MAX_DIFF[arch] = diff
    print(f"{arch}: max |logit diff| vs transformers = {diff:.3e}")
    assert diff < 1e-4


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_and_decode_agree(arch: str, checkpoint_dir: Callable[[str], Path]) -> None:
    loaded = load_model(checkpoint_dir(arch))
    ids = make_prompt(100, seed=1)
    pages = list(range(7))
    whole = run_chunks(loaded, make_cache(loaded), ids, [100], pages)
    chunked = run_chunks(loaded, make_cache(loaded), ids, [37, 63], pages)
    stepwise = run_chunks(loaded, make_cache(loaded), ids, [60] + [1] * 40, pages)
    # Continuations of at most STEPPED_CHUNK_TOKENS step through the recurrence (a verify's shape).
    short = run_chunks(loaded, make_cache(loaded), ids, [100 - 8 - STEPPED_CHUNK_TOKENS, 5, 3, STEPPED_CHUNK_TOKENS], pages)
    # The routed-expert sum runs over a different number of rows per step (gemm vs gemv
    # order), which lifts fp32 noise from ~2e-6 to ~1e-5 at one position of this prompt.
    # The chunked gated delta rule's chunk grid follows where each prefill starts, and it
    # accumulates in fp32: 3.7e-5 measured for Qwen3.5 (kernels/gated_delta.py says why not fp64).
    # A short continuation steps through the recurrence where a chunk runs the chunked form: another
    # order of the same fp32 sums (3.1e-5 measured for Qwen3.5-MoE).
    hybrid = bool(loaded.config.state_shape().linear_layers)
    tolerance = GDN_CUT_TOLERANCE if hybrid else 2e-5 if arch.endswith("-moe") else 1e-5
    assert (whole - chunked).abs().max().item() < tolerance
    assert (whole - stepwise).abs().max().item() < tolerance
    assert (whole - short).abs().max().item() < tolerance


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batch_equals_each_sequence_alone(arch: str, checkpoint_dir: Callable[[str], Path]) -> None:
    loaded = load_model(checkpoint_dir(arch))
    prompts = [make_prompt(n, seed=n) for n in (5, 40, 17, 64)]
    # Scattered, non-contiguous pages per sequence and distinct slots: nothing may leak across sequences.
    tables = [[60, 3], [10, 50, 2, 33], [7, 40], [1, 20, 30, 41, 5]]
    alone = []
    for ids, table in zip(prompts, tables):
        cache = make_cache(loaded)
        alone.append(run_chunks(loaded, cache, ids, [len(ids)], table, slot=3))
    # Together: two of them prefill in one step, then all decode together with two more tokens each.
    cache = make_cache(loaded)
    cut = [3, 30, 17, 50]
    chunks = [SequenceChunk(ids[:c], 0, t, i, LogitsWanted.ALL) for i, (ids, t, c) in enumerate(zip(prompts, tables, cut))]
    first = loaded.model(ForwardBatch.build(chunks, PAGE, CPU), cache)
    rest = [SequenceChunk(ids[c:], c, t, i, LogitsWanted.ALL)
            for i, (ids, t, c) in enumerate(zip(prompts, tables, cut)) if c < len(ids)]
    second = loaded.model(ForwardBatch.build(rest, PAGE, CPU), cache)
    offset1 = offset2 = 0
    for ids, c, expected in zip(prompts, cut, alone):
        got = [first[offset1 : offset1 + c]]
        offset1 += c
        if c < len(ids):
            got.append(second[offset2 : offset2 + len(ids) - c])
            offset2 += len(ids) - c
        assert (torch.cat(got) - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("lengths", [(9, 21, 33), (530, 600, 17)], ids=["short-padded", "long-per-sequence"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "MistralForCausalLM"])
def test_decode_batch_of_many_sequences(arch: str, lengths: tuple[int, ...], checkpoint_dir: Callable[[str], Path]
                                        ) -> None:
    """One decode step for several sequences at once equals one at a time: the batched recurrent
    path, and attention both as one padded call (short contexts) and one call per sequence."""
    loaded = load_model(checkpoint_dir(arch))
    prompts, tables, first, cache, batch = prefilled_decode_batch(loaded, lengths)
    # The CPU's in-place decode kernel (kernels/cpu/) batches every length; the references only short ones.
    in_place = kernels_for(loaded.model.device).decode_in_place
    per_sequence = not in_place and max(lengths) >= CPU_PADDED_DECODE_MAX_CONTEXT
    assert (batch.decode is None) == per_sequence
    together = loaded.model(batch, cache)
    for i, (ids, t) in enumerate(zip(prompts, tables)):
        alone = run_chunks(loaded, make_cache(loaded, pages=first), ids, [len(ids)], t, slot=0)[-1]
        assert (together[i] - alone).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generation_matches_transformers(arch: str, checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir(arch)
    loaded = load_model(path, onednn_linears=True)  # as the engine service loads it
    ids = make_prompt(24, seed=7)
    ours = greedy_generate(loaded, ids, 32, PAGE, stop_token_ids=frozenset({2}))
    hf = load_hf(path, torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert ours.token_ids == ref[0, len(ids):].tolist()
    assert len(ours.token_ids) > 1


@pytest.mark.parametrize(
    "arch, rope",
    [
        ("LlamaForCausalLM", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        ("Qwen3ForCausalLM", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                              "original_max_position_embeddings": 64}),
        ("Qwen2ForCausalLM", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ],
)
def test_rope_scaling_matches_transformers(arch: str, rope: dict[str, object], tmp_path: Path) -> None:
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "ckpt", arch, seed=2, rope_parameters=rope)
    ids = make_prompt(150, seed=3)  # beyond original_max_position_embeddings: the scaling matters
    ours = run_chunks(load_model(path), make_cache(load_model(path)), ids, [150], list(range(10)))
    assert (ours - hf_logits(path, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_equal_the_per_expert_loop(tokens: int, dtype: torch.dtype) -> None:
    """The CPU's grouped GEMM over (token, expert) pairs sorted by expert gives what one GEMM per expert
    hit gives, experts with no token included (8 experts, top 2: most are idle for one token)."""
    from engine.model.layers import Experts

    torch.manual_seed(tokens)
    experts = Experts(8, 32, 24).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(tokens, 32).to(dtype)
        ids = torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2).to(dtype)
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(experts.grouped(x, ids, weights), experts.per_expert(x, ids, weights),
                                   atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
@pytest.mark.parametrize("onednn", [False, True])
def test_write_kv_leaves_the_cache_as_forward_does(arch: str, onednn: bool, checkpoint_dir: Callable[[str], Path]
                                                   ) -> None:
    """An attention layer's K/V alone (the MTP window where no draft reads the layer's output) equals
    what its whole forward writes: a prefill chunk and a decode batch, q/k norms and a gated q."""
    loaded = load_model(checkpoint_dir(arch), onednn_linears=onednn)
    model = loaded.model
    index = next(i for i, layer in enumerate(model.model.layers) if not layer.is_linear)
    layer = model.model.layers[index]
    _, _, pages, _, decodes = prefilled_decode_batch(loaded, (9, 21, 33))
    prefill = ForwardBatch.build([SequenceChunk(make_prompt(40, seed=5), 0, [pages, pages + 1, pages + 2], 7)],
                                 PAGE, CPU)
    for batch in (prefill, decodes):
        x = torch.randn(batch.input_ids.shape[0], loaded.config.hidden_size, generator=torch.Generator().manual_seed(1))
        caches = make_cache(loaded, pages=pages + 3), make_cache(loaded, pages=pages + 3)
        assert model.rotary is not None
        cos_sin = model.rotary.cos_sin(batch.positions, x.dtype)
        with torch.inference_mode():
            layer(x, batch, caches[0], model.rotary, cos_sin)
            layer.write_kv(x, batch, caches[1], model.rotary, cos_sin)
        for kv in ("k_cache", "v_cache"):
            whole, alone = (getattr(c, kv)(index) for c in caches)
            assert whole.abs().sum() > 0
            assert (whole - alone).abs().max().item() < 1e-5
