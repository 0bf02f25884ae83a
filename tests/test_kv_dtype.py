"""engine.kv_dtype: KV pages in fp32, bf16 or fp16 under an fp32 model.

The model against Hugging Face transformers in each KV dtype, at a tolerance per dtype; reuse
against a cold prefill in the same dtype (same greedy tokens); state slots stay as they were;
the KV dtype is in the reuse namespace and sizes the page bytes the pool and the tiers use;
and the setting reaches a real engine process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import grpc
import pytest
import torch

from checkpoints import ARCHITECTURES, ROUTED_ARCHITECTURES
from common.settings import SettingsError, load_settings
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.device_cache import CacheGeometry, DeviceCache, namespace_dtype, resolve_kv_dtype
from engine.model.loader import LoadedModel, load_model
from engine.tiers.codec import StateCodec
from engine.text.tokenizer import Tokenizer
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import start_engine
from test_engine_tiers import MiB, TOPICS, Engine, tierstore
from test_model import PAGE, hf_logits, make_prompt, run_chunks
from test_reuse import TOOLS, Harness, Result, conversation

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Max |logit diff| against transformers (fp32), logits of size ~3: the K/V rounding of each dtype
# (bf16 keeps 8 bits of mantissa, fp16 11). Measured on these checkpoints: fp32 <= 5e-6,
# bf16 <= 1.1e-2, fp16 <= 1.5e-3.
ORACLE_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
# Chosen-token logprobs, reused vs cold in the same dtype. Both read the same rounded K/V; a
# prefill cut elsewhere sums in another order, which can move a value across a rounding boundary.
REUSE_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


def make_cache(loaded: LoadedModel, kv: torch.dtype, pages: int = 64, slots: int = 8) -> DeviceCache:
    geometry = CacheGeometry(PAGE, pages, slots, loaded.model.dtype, kv)
    return DeviceCache(loaded.config.state_shape(), geometry, loaded.model.device)


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers_in_each_kv_dtype(arch: str, kv_dtype: str,
                                                    checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir(arch)
    loaded = load_model(path, onednn_linears=True)  # as the engine service loads it
    cache = make_cache(loaded, KV_DTYPES[kv_dtype])
    assert cache.kv.dtype == KV_DTYPES[kv_dtype]
    assert cache.recurrent.dtype == torch.float32 and cache.conv.dtype == loaded.model.dtype  # state keeps its own
    ids = make_prompt(100)
    # A prefill (gathered K/V, converted for SDPA), chunks, then decodes (the in-place kernel).
    ours = run_chunks(loaded, cache, ids, [64, 33, 1, 1, 1], list(range(7)))
    per_position = (ours - hf_logits(path, ids)).abs().amax(dim=-1)
    diff = per_position.max().item()
    print(f"{arch} kv {kv_dtype}: max |logit diff| vs transformers = {diff:.3e}")
    if arch in ROUTED_ARCHITECTURES and kv_dtype == "bfloat16":
        # bf16 K/V can move a router's score across a near tie: Qwen3.5-MoE's layer 2 sends position 19
        # to another expert (checked against the routes of the fp32 run), which moves that position's
        # logits by 0.4 and a later one's by 0.04. Every other position stays within the bound.
        assert (per_position >= ORACLE_TOLERANCE[kv_dtype]).sum().item() <= 2
    else:
        assert diff < ORACLE_TOLERANCE[kv_dtype]


@pytest.fixture(scope="module")
def dense(dense_chat_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir)


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def agree(a: Result, b: Result, kv_dtype: str) -> None:
    assert a.tokens == b.tokens
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < REUSE_TOLERANCE[kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_turn_two_reuses_turn_one_in_the_same_dtype(kind: str, kv_dtype: str, request: pytest.FixtureRequest) -> None:
    loaded, tokenizer = request.getfixturevalue(kind)
    warm = Harness(loaded, tokenizer, reuse=True, kv_dtype=kv_dtype)
    cold = Harness(loaded, tokenizer, reuse=False, kv_dtype=kv_dtype)
    try:
        assert warm.core.cache.kv.dtype == cold.core.cache.kv.dtype == KV_DTYPES[kv_dtype]
        turn1 = conversation("Plan the migration of the billing service.")
        r1 = warm.run(warm.request(turn1, max_tokens=10, tools=TOOLS))[0]
        agree(r1, cold.run(cold.request(turn1, max_tokens=10, tools=TOOLS))[0], kv_dtype)
        turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Now list the risks."}]
        r2 = warm.run(warm.request(turn2, max_tokens=6, tools=TOOLS))[0]
        assert r2.cached >= P_MIN_REUSED
        agree(r2, cold.run(cold.request(turn2, max_tokens=6, tools=TOOLS))[0], kv_dtype)
        warm.check()
        cold.check()
    finally:
        warm.close()
        cold.close()


P_MIN_REUSED = 4 * PAGE  # turn 2 claims at least turn 1's system + tools head


def test_the_kv_dtype_is_in_the_namespace_and_the_page_bytes(hybrid: tuple[LoadedModel, Tokenizer]) -> None:
    """KV written in one dtype is never claimed by an engine in another: the chain's h0 differs,
    and so do the page bytes and the layout the tierstore compares on register."""
    loaded, tokenizer = hybrid
    cores = {name: EngineCore(loaded, tokenizer, EngineConfig(kv_dtype=name, kv_cache_bytes=4 << 20))
             for name in ("auto", "float32", "bfloat16", "float16")}
    h0 = {name: core.namespace_hash("") for name, core in cores.items()}
    assert h0["auto"] == h0["float32"]  # auto is the model's dtype, fp32 here: the same KV
    assert len({h0["float32"], h0["bfloat16"], h0["float16"]}) == 3
    codecs = {name: StateCodec(core.cache, loaded.config.vocab_size) for name, core in cores.items()}
    assert codecs["bfloat16"].page_bytes * 2 == codecs["float16"].page_bytes * 2 == codecs["float32"].page_bytes
    assert codecs["bfloat16"].fixed_state_bytes == codecs["float32"].fixed_state_bytes  # state slots unchanged
    assert codecs["bfloat16"].layout() != codecs["float32"].layout()
    # The same KV byte budget holds twice the pages in 16 bits.
    assert cores["bfloat16"].pages.num_pages == 2 * cores["float32"].pages.num_pages


class KvEngine(Engine):
    """test_engine_tiers' engine (2 retained device slots, nothing protected) in a KV dtype, with a
    shared integrity key, so another engine in this process may read back what it spilled."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, kv_dtype: str, store: str, key: Path) -> None:
        self.tokenizer = tokenizer
        self.core = EngineCore(loaded, tokenizer, EngineConfig(
            page_size=PAGE, kv_dtype=kv_dtype, kv_cache_bytes=16 * MiB, max_num_seqs=4, retained_device=2,
            retained_interactive_ttl=0.0, tierstore_address=store, tier_timeout=2.0, tier_retry_seconds=0.3,
            integrity_key_file=str(key)))
        self.core.start()
        self.n = 0


def test_states_spilled_in_one_kv_dtype_are_claimed_only_in_it(tmp_path: Path,
                                                               hybrid: tuple[LoadedModel, Tokenizer]) -> None:
    """An fp16-KV engine's states displaced to KV-RAM: a later fp16 engine on the same tierstore
    restores one from RAM; an fp32 one (another h0, so another namespace there) finds nothing."""
    store = tierstore(tmp_path, arena=16 * MiB, disk=0)
    key = tmp_path / "integrity.key"
    try:
        writer = KvEngine(*hybrid, "float16", store.address, key)
        try:
            for topic in TOPICS:
                assert writer.run(topic).error is None
            writer.settle()
            assert writer.core.reuse.counters.evictions >= 1  # states left the device for KV-RAM
        finally:
            writer.close()
        for kv_dtype, claimed in (("float32", False), ("float16", True)):
            reader = KvEngine(*hybrid, kv_dtype, store.address, key)
            try:
                got = reader.run(TOPICS[0])
                assert got.error is None
                if claimed:
                    assert (got.tier, got.cached) == ("ram", len(reader.request(TOPICS[0]).prompt_ids))
                else:
                    assert (got.tier, got.cached) == ("none", 0)
                reader.check()
            finally:
                reader.close()
    finally:
        store.stop()


def test_namespace_names_both_dtypes_when_they_differ() -> None:
    assert namespace_dtype(torch.float32, torch.float32) == "float32"
    assert namespace_dtype(torch.bfloat16, torch.bfloat16) == "bfloat16"
    assert namespace_dtype(torch.bfloat16, torch.float32) == "bfloat16/compute=float32"
    assert namespace_dtype(torch.float16, torch.float32) != namespace_dtype(torch.float16, torch.bfloat16)


def test_setting_values() -> None:
    assert load_settings(None, {}, {}).engine.kv_dtype == "auto"
    assert load_settings(None, {"IGNIS_ENGINE__KV_DTYPE": "BFloat16"}, {}).engine.kv_dtype == "bfloat16"
    with pytest.raises(SettingsError, match="KV_DTYPE: expected one of auto, float32, bfloat16, float16"):
        load_settings(None, {"IGNIS_ENGINE__KV_DTYPE": "int8"}, {})
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="kv_dtype must be"):
        resolve_kv_dtype("fp8", torch.float32)


def test_an_engine_process_serves_with_bf16_kv(tmp_path: Path) -> None:
    engine = start_engine(tmp_path, env={"IGNIS_ENGINE__KV_DTYPE": "bfloat16"})
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            reply = stub.Generate(engine_pb2.GenerateRequest(
                request_id="kv-bf16", token_ids=engine_pb2.TokenIds(ids=make_prompt(40)),
                sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)), timeout=60)
            tokens = [t for update in reply for t in update.token_ids]
        assert len(tokens) == 4
        assert "bfloat16" in engine.log()  # the cache line names the KV dtype
    finally:
        engine.stop()
