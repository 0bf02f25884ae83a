"""LoRA adapters in the engine core: outputs equal to PEFT's merged model in transformers, several
adapters and the base in one batch, the adapter in the reuse namespace, loads and unloads."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.lora.adapter import AdapterError, read_adapter
from engine.lora.registry import AdapterExists, NoAdapterSlot, ServedAdapter
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.outputs import RequestUpdate
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from lora_adapters import ATTENTION, GDN, MLP, greedy_with_logprobs, make_adapter, merged_model

MiB = 1 << 20
STEPS = 12
# Architecture -> what its adapters target: every kind of linear the family has.
MODELS = {
    "dense": ("Qwen3ForCausalLM", ATTENTION + MLP),
    "hybrid": ("Qwen3_5ForCausalLM", ATTENTION + MLP + GDN),
    "moe": ("Qwen3_5MoeForConditionalGeneration", ATTENTION + MLP + GDN),  # MLP: the shared expert's
}


def engine(model: tuple[LoadedModel, Tokenizer], slots: int = 4, max_rank: int = 16, **config: Any) -> EngineCore:
    loaded, tokenizer = model
    return EngineCore(loaded, tokenizer, EngineConfig(
        page_size=16, kv_cache_bytes=8 * MiB, max_num_seqs=8, lora_enabled=True, lora_max_adapters=slots,
        lora_max_rank=max_rank, **config))


def serve(core: EngineCore, name: str, path: Path) -> ServedAdapter:
    assert core.adapters is not None
    return core.load_adapter(name, core.adapters.sites.read(path)).result()


def greedy(rid: str, prompt: list[int], adapter: ServedAdapter | None, steps: int = STEPS, salt: str = "") -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=True)
    return EngineRequest(rid, tuple(prompt), params, cache_salt=salt, adapter=adapter)


def outputs(updates: list[RequestUpdate]) -> tuple[list[int], list[float]]:
    assert updates[-1].error is None, updates[-1].error
    deltas = [d for u in updates for d in u.deltas]
    return [t for d in deltas for t in d.token_ids], [lp.logprob or 0.0 for d in deltas for lp in d.logprobs]


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(MODELS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[Path]]:
    """A checkpoint with the tiny tokenizer, and three adapters over it of ranks 4, 8 and 16."""
    from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

    arch, targets = MODELS[request.param]
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = make_checkpoint(root / "base", arch, seed=3, vocab_size=TINY_VOCAB_SIZE)
    write_tiny_tokenizer(base)
    adapters = [make_adapter(base, root / f"r{rank}", rank, targets[i::2] if i == 1 else targets, seed=10 + i,
                             rslora=i == 2)
                for i, rank in enumerate((4, 8, 16))]
    return request.param, base, adapters


def test_adapters_and_the_base_in_one_batch_equal_peft_merged(family: tuple[str, Path, list[Path]]) -> None:
    """Three adapters of ranks 4, 8, 16 (one rsLoRA, one on half the linears) and the base model in the
    same batches: each request's greedy tokens and logprobs are those of PEFT's merged model."""
    name, base, adapters = family
    model = (load_model(base), Tokenizer.from_dir(base))
    vocab = model[0].config.vocab_size
    core = engine(model)
    served = [serve(core, f"a{i}", path) for i, path in enumerate(adapters)]
    prompts = [prompt(9 + 5 * i, seed=i, vocab=vocab) for i in range(4)]
    choices: list[ServedAdapter | None] = [*served, None]
    requests = [greedy(f"r{i}", p, choices[i]) for i, p in enumerate(prompts)]
    # the same prompt under two adapters and the base, beside them
    requests += [greedy(f"same{i}", prompts[0], choices[i]) for i in (1, 3)]
    got = [outputs(u) for u in run_to_completion(core, *requests, start=True, timeout=600)]
    core.stop()
    wanted_adapters = [*adapters, None]
    for request, (tokens, logprobs) in zip(requests, got):
        index = choices.index(request.adapter)
        oracle = merged_model(base, wanted_adapters[index])
        want_tokens, want_logprobs = greedy_with_logprobs(oracle, list(request.prompt_ids), STEPS)
        assert tokens == want_tokens, (name, request.request_id)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= 1e-4, (name, request.request_id)
    assert got[0] != got[-1]  # the adapter changes the output (else this test could not fail)


def test_a_request_alone_with_its_adapter_on_the_fused_onednn_linears(family: tuple[str, Path, list[Path]]) -> None:
    """The engine's default CPU linears (oneDNN, q|k|v and gate|up fused: the hooks sit on the fused call),
    and a step whose rows all have one adapter (its rank-r pair alone): PEFT's merged model's outputs."""
    name, base, adapters = family
    model = (load_model(base, onednn_linears=True), Tokenizer.from_dir(base))
    core = engine(model)
    served = serve(core, "only", adapters[1])
    p = prompt(21, seed=7, vocab=model[0].config.vocab_size)
    tokens, logprobs = outputs(run_to_completion(core, greedy("alone", p, served), start=True, timeout=600)[0])
    core.stop()
    want_tokens, want_logprobs = greedy_with_logprobs(merged_model(base, adapters[1]), p, STEPS)
    assert tokens == want_tokens, name
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= 1e-4, name


# ---------------------------------------------------------------- identity in the reuse namespace


def rounded_to_bfloat16(adapter: Path, out: Path) -> Path:
    """A copy of `adapter` with its A and B rounded to bf16 (kept as fp32 in the file)."""
    shutil.copytree(adapter, out)
    weights = out / "adapter_model.safetensors"
    save_file({k: v.bfloat16().float() for k, v in load_file(weights).items()}, weights)
    return out


def test_bfloat16_adapters_equal_peft_merged_with_their_weights_rounded(family: tuple[str, Path, list[Path]],
                                                                        tmp_path: Path) -> None:
    """lora.dtype=bfloat16 over an fp32 model (the fused oneDNN linears, the C product reading bf16): an
    adapter's outputs are PEFT's merged model's with that adapter's weights rounded to bf16 (scaling 2:
    the scaled B rounds as B does), a base request beside it is the base's, and the adapter's identity is
    its weights as they run: the rounded file's digest, not the fp32 one's."""
    name, base, adapters = family
    model = (load_model(base, onednn_linears=True), Tokenizer.from_dir(base))
    core = engine(model, lora_dtype="bfloat16")
    assert core.adapters is not None and core.adapters.sites.dtype == torch.bfloat16
    served = serve(core, "half", adapters[1])  # rank 8, alpha 16
    rounded = rounded_to_bfloat16(adapters[1], tmp_path / "rounded")
    sites = core.adapters.sites
    assert served.digest == sites.read(rounded).digest
    assert served.digest != read_adapter(adapters[1], sites.targets, 16).digest  # fp32 served: another state
    p = prompt(17, seed=9, vocab=model[0].config.vocab_size)
    got = [outputs(u) for u in run_to_completion(core, greedy("half", p, served), greedy("base", p, None),
                                                 start=True, timeout=600)]
    core.stop()
    for (tokens, logprobs), adapter in zip(got, (rounded, None)):
        want_tokens, want_logprobs = greedy_with_logprobs(merged_model(base, adapter), p, STEPS)
        assert tokens == want_tokens, name
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= 1e-4, name


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("tiny_lora")
    return [make_adapter(tiny_model_dir, root / f"a{i}", 8, ATTENTION + MLP + GDN, seed=20 + i) for i in range(2)]


class Conversations:
    """A started core with adapters, driven one request at a time from the test thread."""

    def __init__(self, model: tuple[LoadedModel, Tokenizer], adapters: dict[str, Path], reuse: bool = True,
                 **config: Any) -> None:
        self.core = engine(model, reuse_prompt=reuse, retained_interactive_ttl=0.0, **config)
        self.served = {name: serve(self.core, name, path) for name, path in adapters.items()}
        self.core.start()
        self.n = 0

    def run(self, p: list[int], adapter: str | None, salt: str = "") -> tuple[list[int], list[float], int, str]:
        """(tokens, logprobs, cached prompt tokens, the tier they came from)."""
        self.n += 1
        request = greedy(f"c{self.n}", p, self.served[adapter] if adapter else None, steps=6, salt=salt)
        updates = run_to_completion(self.core, request, timeout=600)[0]
        tokens, logprobs = outputs(updates)
        usage = updates[-1].usage
        assert usage is not None
        return tokens, logprobs, usage.cached_tokens, usage.reuse.tier.value

    def settle(self) -> None:
        deadline = time.monotonic() + 60
        while self.core.residency.copying:
            assert time.monotonic() < deadline, "copies off the step never finished"
            time.sleep(0.01)

    def close(self) -> None:
        self.core.stop()


def same(got: tuple[list[int], list[float], int, str], want: tuple[list[int], list[float], int, str]) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1])) <= 1e-5


def test_a_state_is_found_only_by_the_same_adapter(tiny_model_dir: Path, tiny_adapters: list[Path],
                                                   tmp_path: Path) -> None:
    """Turn 2 under an adapter claims turn 1's state; the same prompt under another adapter, the base, or
    another tenant's salt misses; the same adapter file under another name hits, a changed file misses.
    Every output equals a cold run under the same adapter."""
    changed = tmp_path / "changed"
    shutil.copytree(tiny_adapters[0], changed)
    weights = load_file(changed / "adapter_model.safetensors")
    key = sorted(weights)[0]
    weights[key] = weights[key] * 1.01
    save_file(weights, changed / "adapter_model.safetensors")

    model = (load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir))
    adapters = {"a0": tiny_adapters[0], "a1": tiny_adapters[1], "a0-again": tiny_adapters[0], "a0-changed": changed}
    cold = Conversations(model, adapters, reuse=False)
    warm = Conversations(model, adapters)
    try:
        assert warm.served["a0"].slot == warm.served["a0-again"].slot  # one digest, one slot
        vocab = model[0].config.vocab_size
        turn1 = prompt(70, seed=3, vocab=vocab)
        turn2 = turn1 + prompt(20, seed=4, vocab=vocab)
        first = warm.run(turn1, "a0")
        same(first, cold.run(turn1, "a0"))
        assert first[2] == 0
        second = warm.run(turn2, "a0")
        same(second, cold.run(turn2, "a0"))
        assert second[2] >= 64  # turn 1's pages at least
        for adapter, salt, hits in (("a1", "", False), (None, "", False), ("a0", "tenant-b", False),
                                    ("a0-again", "", True), ("a0-changed", "", False)):
            got = warm.run(turn2, adapter, salt)
            same(got, cold.run(turn2, adapter, salt))
            assert (got[2] > 0) == hits, (adapter, salt, got[2])
        assert warm.run(turn2, "a0")[0] != warm.run(turn2, None)[0]  # the adapter matters here
    finally:
        cold.close()
        warm.close()


def test_spilled_adapter_state_comes_back_only_to_its_adapter(tiny_model_dir: Path, tiny_adapters: list[Path],
                                                             tmp_path: Path) -> None:
    """A conversation under an adapter pushed down to KV-RAM by later ones (2 retained device slots) is
    restored from there for the same adapter, equal to cold; another adapter's request for the same
    tokens finds nothing below either."""
    from services import start_tierstore

    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(16 * MiB), "--kv-disk-path",
                                              str(tmp_path / "kv-disk"), "--kv-disk-bytes", str(64 * MiB)])
    model = (load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir))
    adapters = {"a0": tiny_adapters[0], "a1": tiny_adapters[1]}
    cold = Conversations(model, adapters, reuse=False)
    warm = Conversations(model, adapters, tierstore_address=store.address, retained_device=2,
                         tier_retry_seconds=0.3)
    try:
        vocab = model[0].config.vocab_size
        prompts = [prompt(50, seed=40 + i, vocab=vocab) for i in range(5)]
        for p in prompts:
            same(warm.run(p, "a0"), cold.run(p, "a0"))
        warm.settle()
        missed = warm.run(prompts[0], "a1")
        same(missed, cold.run(prompts[0], "a1"))
        assert missed[2] == 0
        got = warm.run(prompts[0], "a0")
        same(got, cold.run(prompts[0], "a0"))
        assert (got[3], got[2]) == ("ram", len(prompts[0]))
    finally:
        cold.close()
        warm.close()
        store.stop()


# ---------------------------------------------------------------- adapters that cannot be served


def test_bad_adapters_are_refused_saying_why(tiny_model_dir: Path, tiny_adapters: list[Path], tmp_path: Path,
                                            checkpoint_dir: Callable[[str], Path]) -> None:
    loaded = load_model(tiny_model_dir)
    from engine.lora.sites import adaptable_linears

    targets = {name: shape for name, (_, shape) in adaptable_linears(loaded.model).items()}

    def refused(path: Path, max_rank: int = 16) -> str:
        with pytest.raises(AdapterError) as info:
            read_adapter(path, targets, max_rank)
        return str(info.value)

    assert "no adapter_config.json" in refused(tmp_path / "missing")
    other = make_adapter(checkpoint_dir("Qwen3ForCausalLM"), tmp_path / "other", 4, ATTENTION, seed=1)
    assert "another base model" in refused(other)
    assert "over lora.max_rank=4" in refused(tiny_adapters[0], max_rank=4)
    head = make_adapter(checkpoint_dir("Qwen3ForCausalLM"), tmp_path / "head", 4, ["lm_head"], seed=2)  # untied
    assert "'lm_head' is not one ignis adapts" in refused(head)
    dora = tmp_path / "dora"
    shutil.copytree(tiny_adapters[0], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert "DoRA" in refused(dora)
    (dora / "adapter_config.json").write_text("{not json")
    assert "cannot read it" in refused(dora)
    torn = tmp_path / "torn"
    shutil.copytree(tiny_adapters[0], torn)
    data = (torn / "adapter_model.safetensors").read_bytes()
    (torn / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert "cannot read it" in refused(torn)


def test_slots_names_and_unloads(tiny_model_dir: Path, tiny_adapters: list[Path]) -> None:
    """A taken name, a full set of slots, and an unloaded adapter's slot kept until its last request ends."""
    model = (load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir))
    core = engine(model, slots=1)
    a0 = serve(core, "a0", tiny_adapters[0])
    with pytest.raises(AdapterExists):
        serve(core, "a0", tiny_adapters[1])
    assert serve(core, "a0-again", tiny_adapters[0]).slot == a0.slot  # the same weights: no new slot
    with pytest.raises(NoAdapterSlot):
        serve(core, "a1", tiny_adapters[1])
    core.unload_adapter("a0").result()
    core.unload_adapter("a0-again").result()
    with pytest.raises(KeyError):
        core.unload_adapter("a0").result()
    # a request admitted with a0 still holds its slot: a1 waits for it
    p = prompt(12, seed=9, vocab=model[0].config.vocab_size)
    core.submit(greedy("held", p, a0), lambda update: None)
    with pytest.raises(NoAdapterSlot):
        serve(core, "a1", tiny_adapters[1])
    core.abort("held")
    core.drain_inbox()
    assert serve(core, "a1", tiny_adapters[1]).slot == a0.slot
    # a request admitted with a0 before the slot changed fails instead of running on a1's weights
    updates = run_to_completion(core, greedy("stale", p, a0), start=True, timeout=600)[0]
    core.stop()
    assert updates[-1].error is not None and "unloaded" in updates[-1].error
