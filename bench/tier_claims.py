"""Claim latency through the engine: one ~150 MiB state served from the device, KV-RAM and
KV-disk, against re-prefilling the same tokens, in one run (part of `python -m bench.tiers`).

A dense checkpoint (attention-only: the state is its KV pages, so its size is set by
the prompt length) under in-process EngineCores and a real tierstore process:

1. engine 1: prompt A cold (the baseline), A again (device hit); then B and C, each
   as long as A, push A off the device into KV-RAM and on to KV-disk (the arena holds
   about one and a half states);
2. engine 2 (fresh device, same store): A is restored from disk (page cache dropped);
3. engine 3 (fresh device, same store): A is restored from RAM (the disk restore put it back there).

The three engines share one integrity key file (as one engine across restarts does), so
each can read the states the first one tagged.

Each figure is the request's time to first token with max_tokens=1, as the engine reports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.drive import random_prompt, run
from bench.geometry import ensure_geometry, geometry_config
from bench.launch import Service, launch_tierstore
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.config import parse_config
from engine.model.loader import LoadedModel, load_model
from engine.model.openmp import on_own_thread
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer

MiB = 1 << 20
P = 16


def measure(mib: int, folder: Path, hidden: int = 1024, layers: int = 16) -> dict[str, Any]:
    path = ensure_geometry("dense", hidden, layers)
    config = parse_config(geometry_config("dense", hidden, layers))
    page_bytes = config.state_shape().kv_bytes_per_page(P, torch.float32)  # the bench checkpoints are fp32
    pages = max(4, mib * MiB // page_bytes)
    tokens = pages * P
    state_bytes = pages * page_bytes
    # As the engine service loads it, on a thread that ends with it (engine/model/openmp.py).
    loaded = on_own_thread(lambda: load_model(path, onednn_linears=True))
    tokenizer = Tokenizer.from_dir(path)
    workdir = folder / "claims"
    store = launch_tierstore(workdir, state_bytes * 3 // 2 + MiB, 8 * state_bytes + 64 * MiB,
                             env={"IGNIS_LOG_LEVEL": "WARNING"})
    prompts = {name: random_prompt(tokens, seed) for seed, name in enumerate("ABC", start=11)}
    ms: dict[str, float] = {}
    cached: dict[str, int] = {}
    tiers: dict[str, str] = {}
    try:
        def once(core: EngineCore, key: str, prompt: str) -> None:
            req = EngineRequest(f"{key}-{prompt}", prompts[prompt],
                                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            (_, usage), = run(core, req)
            ms[key], cached[key], tiers[key] = usage.time_to_first_token_ms, usage.cached_tokens, usage.reuse.tier.value

        key_file = workdir / "integrity.key"  # one engine key for the three: each reads what the first wrote
        first = engine(loaded, tokenizer, store, pages + 8, key_file)
        try:
            run(first, EngineRequest("warm", random_prompt(64, 0), SamplingParams(temperature=0, max_tokens=1)))
            once(first, "cold_prefill", "A")
            once(first, "claim_device", "A")
            once(first, "push_b", "B")  # A leaves the device for KV-RAM
            once(first, "push_c", "C")  # B follows it, pushing A on to KV-disk
        finally:
            first.stop()
        from bench.tiers import drop_cache  # (bench.tiers imports this module)

        for blob in (workdir / "kv-disk").rglob("*"):
            if blob.is_file():
                drop_cache(blob)
        for key in ("claim_disk", "claim_ram"):  # the disk restore leaves A in RAM for the next
            core = engine(loaded, tokenizer, store, pages + 8, key_file)
            try:
                once(core, key, "A")
            finally:
                core.stop()
    finally:
        store.stop()
    want = {"cold_prefill": "none", "claim_device": "device", "claim_disk": "disk", "claim_ram": "ram"}
    for key, tier in want.items():
        if tiers[key] != tier:
            raise RuntimeError(f"{key}: expected a {tier} hit, the engine reported {tiers[key]} "
                               f"({cached[key]} cached tokens); see {store.log_path}")
    return {"tokens": tokens, "state_bytes": state_bytes, "hidden": hidden, "layers": layers,
            "ms": ms, "cached": cached, "tiers": tiers}


def engine(loaded: LoadedModel, tokenizer: Tokenizer, store: Service, pages: int, key_file: Path) -> EngineCore:
    page_bytes = loaded.config.state_shape().kv_bytes_per_page(P, loaded.model.dtype)
    core = on_own_thread(lambda: EngineCore(loaded, tokenizer, EngineConfig(
        page_size=P, kv_cache_bytes=pages * page_bytes, max_num_seqs=2, prefill_chunk_tokens=2048,
        tierstore_address=store.address, tier_timeout=30.0, integrity_key_file=str(key_file))))
    core.start()
    return core


def rows(res: dict[str, Any]) -> list[list[Any]]:
    ms, cold = res["ms"], res["ms"]["cold_prefill"]
    out = [["re-prefill", f"cold prefill of the same {res['tokens']} tokens", round(cold, 1), "-", "-"]]
    for key, what in (("claim_device", "device: pages shared by reference"),
                      ("claim_ram", "KV-RAM: Match (leases it) + copy into pages"),
                      ("claim_disk", "KV-disk: Match + AcquireStream(restore, cold), copied as it lands")):
        out.append([f"claim from {res['tiers'][key]}", what, round(ms[key], 1), res["cached"][key],
                    f"{cold / ms[key]:.0f}x faster" if ms[key] else "-"])
    return out


CLAIM_HEADERS = ["path", "what", "TTFT ms", "cached tokens", "vs re-prefill"]
