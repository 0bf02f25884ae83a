"""The CUDA path end to end: every test here is marked `cuda` and skips without a GPU.

`make gpu-check` (scripts/gpu_check.sh) runs them with the Triton kernel cases of
tests/test_triton_kernels.py: the models against transformers on the GPU in fp32 and bf16,
chunked prefill and batched decode (split-K) on the Triton kernels, the reuse paths (device
retained states, dense pages, host slots), and retained states spilled to and restored from
the tierstore's arena registered with cudaHostRegister.

Tolerances: fp32 logits within 1e-3 of transformers in fp32 on the same GPU (1e-4 on the
CPU; cuBLAS sums in another order); bf16 logits within max(4x transformers' own bf16 error,
3e-2) of transformers in fp32; reused against cold runs, identical greedy tokens and
logprobs within 1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from checkpoints import ARCHITECTURES, load_hf
from engine.model.loader import LoadedModel, load_model
from engine.offline import greedy_generate
from engine.text.tokenizer import Tokenizer
from kernels.select import kernels_for
from test_model import PAGE, hf_logits, make_cache, make_prompt, prefilled_decode_batch, run_chunks

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
MiB = 1 << 20


def test_cuda_runs_the_triton_kernels() -> None:
    assert kernels_for(CUDA).name == "triton"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers_on_cuda(arch: str, dtype: str, checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir(arch)
    loaded = load_model(path, dtype=dtype, device=CUDA)
    ids = make_prompt(100)
    ours = run_chunks(loaded, make_cache(loaded), ids, [37, 63], list(range(7)))  # a chunk after a prefix
    want = hf_logits(path, ids, torch.float32, CUDA)
    diff = (ours - want).abs().max().item()
    if dtype == "float32":
        assert diff < 1e-3, diff
    else:
        own = (hf_logits(path, ids, torch.bfloat16, CUDA) - want).abs().max().item()
        assert diff <= max(4 * own, 3e-2), (diff, own)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "MistralForCausalLM"])
def test_greedy_generation_matches_transformers_on_cuda(arch: str, checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir(arch)
    loaded = load_model(path, dtype="float32", device=CUDA)
    ids = make_prompt(24, seed=7)
    ours = greedy_generate(loaded, ids, 32, PAGE, stop_token_ids=frozenset({2}), prefill_chunk=10)
    hf = load_hf(path, torch.float32).to(CUDA).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device=CUDA), max_new_tokens=32, do_sample=False, eos_token_id=2,
                          pad_token_id=0)
    assert ours.token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("lengths", [(9, 21, 33), (530, 600, 17), (2100, 40)],
                         ids=["short", "long", "split-k"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "MistralForCausalLM"])
def test_batched_decode_equals_each_sequence_alone_on_cuda(arch: str, lengths: tuple[int, ...],
                                                           checkpoint_dir: Callable[[str], Path]) -> None:
    loaded = load_model(checkpoint_dir(arch), dtype="float32", device=CUDA)
    prompts, tables, first, cache, batch = prefilled_decode_batch(loaded, lengths)
    assert batch.decode is not None  # on CUDA every multi-sequence decode is one padded call
    together = loaded.model(batch, cache).float().cpu()
    for i, (ids, t) in enumerate(zip(prompts, tables)):
        alone = run_chunks(loaded, make_cache(loaded, pages=first), ids, [len(ids)], t)[-1]
        assert (together[i] - alone).abs().max().item() < 1e-4


# --- reuse and tiers on the GPU --------------------------------------------------------------------

def agree(got: object, want: object) -> None:
    assert got.tokens == want.tokens  # type: ignore[attr-defined]
    pairs = zip(got.logprobs, want.logprobs)  # type: ignore[attr-defined]
    assert max(abs((x or 0.0) - (y or 0.0)) for x, y in pairs) < 1e-4


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def cuda_model(request: pytest.FixtureRequest, tiny_model_dir: Path, dense_chat_model_dir: Path
               ) -> tuple[str, LoadedModel, Tokenizer]:
    path = tiny_model_dir if request.param == "hybrid" else dense_chat_model_dir
    return request.param, load_model(path, dtype="float32", device=CUDA), Tokenizer.from_dir(path)


def test_reused_state_equals_a_cold_run_on_cuda(cuda_model: tuple[str, LoadedModel, Tokenizer]) -> None:
    from test_reuse import TOOLS, Harness, conversation

    name, loaded, tokenizer = cuda_model
    warm, cold = Harness(loaded, tokenizer, reuse=True), Harness(loaded, tokenizer, reuse=False)
    try:
        task = conversation("Summarise the incident report in three lines.")
        first = warm.run(warm.request(task, tools=TOOLS))[0]
        agree(first, cold.run(cold.request(task, tools=TOOLS))[0])
        again = warm.run(warm.request(task, tools=TOOLS))[0]  # an exact retry
        agree(again, cold.run(cold.request(task, tools=TOOLS))[0])
        assert again.tier == "device" and again.cached > 0
        assert again.kind == ("checkpoint" if name == "hybrid" else "pages")
        other = conversation("Read the changelog.")  # shares the system prompt and tools
        sub = warm.run(warm.request(other, tools=TOOLS))[0]
        agree(sub, cold.run(cold.request(other, tools=TOOLS))[0])
        assert sub.cached > 0
        warm.check()
        cold.check()
    finally:
        warm.close()
        cold.close()


def test_host_slots_on_cuda(tiny_model_dir: Path) -> None:
    from test_reuse import TOOLS, Harness, conversation

    loaded, tokenizer = load_model(tiny_model_dir, dtype="float32", device=CUDA), Tokenizer.from_dir(tiny_model_dir)
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=0, retained_host=4)
    cold = Harness(loaded, tokenizer, reuse=False)
    try:
        task = conversation("Find the flaky test.")
        agree(warm.run(warm.request(task, tools=TOOLS))[0], cold.run(cold.request(task, tools=TOOLS))[0])
        again = warm.run(warm.request(task, tools=TOOLS))[0]
        agree(again, cold.run(cold.request(task, tools=TOOLS))[0])
        assert (again.kind, again.tier) == ("checkpoint", "host")
        warm.core.check_integrity()
    finally:
        warm.close()
        cold.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[str]:
    from test_engine_tiers import tierstore

    service = tierstore(tmp_path, arena=64 * MiB, disk=0)
    yield service.address
    service.stop()


def test_states_spill_to_the_registered_arena_and_restore_on_cuda(tiny_model_dir: Path, store: str) -> None:
    from test_engine_tiers import TOPICS, Engine

    loaded, tokenizer = load_model(tiny_model_dir, dtype="float32", device=CUDA), Tokenizer.from_dir(tiny_model_dir)
    cold = Engine(loaded, tokenizer, reuse=False)
    warm = Engine(loaded, tokenizer, tierstore=store)
    try:
        want = {topic: cold.run(topic) for topic in TOPICS}
        for topic in TOPICS:  # 2 device slots: each conversation evicts the one before, to KV-RAM
            agree(warm.run(topic), want[topic])
        link = warm.core.reuse.tiers  # type: ignore[attr-defined]
        assert link.spills >= 2 * (len(TOPICS) - 1)
        assert link.client._pinned_ptr is not None, "the arena was not registered with cudaHostRegister"
        for topic in TOPICS[:3]:
            got = warm.run(topic)
            agree(got, want[topic])
            assert got.tier == "ram" and got.cached == len(warm.request(topic).prompt_ids)
        warm.check()
        cold.check()
    finally:
        warm.close()
        cold.close()
