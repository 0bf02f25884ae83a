"""A model whose every layer is linear attention (issue 15): it serves its full context, matches
transformers, and reuses prompt checkpoints as a hybrid does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import make_checkpoint
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer

CONTEXT = 4096  # the checkpoints' max_position_embeddings


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

    path = make_checkpoint(tmp_path_factory.mktemp("recurrent"), "Qwen3_5ForCausalLM", seed=5,
                           layer_types=["linear_attention"] * 4, vocab_size=TINY_VOCAB_SIZE)
    write_tiny_tokenizer(path)
    return path, load_model(path)


def test_it_has_no_attention_layers_and_matches_transformers(recurrent: tuple[Path, LoadedModel]) -> None:
    import transformers

    path, loaded = recurrent
    assert loaded.config.attention_layers == () and loaded.config.is_hybrid
    ids = torch.randint(10, 4000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    core = EngineCore(loaded, Tokenizer.from_dir(path), EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=2))
    assert core.max_model_len == CONTEXT  # not one page
    try:
        request = EngineRequest("r", tuple(ids), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        first, again = (run_to_completion(core, request, start=i == 0, timeout=120)[0]
                        for i, request in enumerate([request, EngineRequest("r2", tuple(ids), request.params)]))
        ours = [t for u in first for d in u.deltas for t in d.token_ids]
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref = list(ids)
        with torch.no_grad():  # transformers' cache cannot count positions without attention layers
            for _ in range(16):
                ref.append(int(hf(torch.tensor([ref]), use_cache=False).logits[0, -1].argmax()))
        assert ours == ref[len(ids):]
        # The opener checkpoint carries its logits: the repeat prefills nothing and says the same.
        assert [t for u in again for d in u.deltas for t in d.token_ids] == ours
        usage = again[-1].usage
        assert usage is not None and usage.cached_tokens == len(ids) and usage.reuse.kind.value == "checkpoint"
        core.check_integrity()
    finally:
        core.stop()


def test_a_long_prompt_runs_past_a_page(recurrent: tuple[Path, LoadedModel]) -> None:
    path, loaded = recurrent
    core = EngineCore(loaded, Tokenizer.from_dir(path), EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=2,
                                                            prefill_chunk_tokens=256))
    try:
        ids = tuple(torch.randint(10, 4000, (1500,), generator=torch.Generator().manual_seed(2)).tolist())
        updates = run_to_completion(core, EngineRequest("long", ids, SamplingParams(temperature=0, max_tokens=4,
                                                                                    ignore_eos=True)),
                                    start=True, timeout=120)[0]
        assert updates[-1].error is None and sum(len(d.token_ids) for u in updates for d in u.deltas) == 4
        core.check_integrity()
    finally:
        core.stop()
