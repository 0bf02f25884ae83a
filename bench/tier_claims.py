"""Claim latency through the engine: one ~150 MiB state served from the device, KV-RAM and
KV-disk, against re-prefilling the same tokens, in one run (part of `python -m bench.tiers`).

A dense checkpoint (attention-only: the state is its KV pages, so its size is set by
the prompt length) under in-process EngineCores and a real tierstore process:

1. engine 1: prompt A cold (the baseline), A again (device hit); then B and C, each
   as long as A, push A off the device into KV-RAM and on to KV-disk (the arena holds
   about one and a half states);
2. engine 2 (fresh device, same store): A is restored from disk (page cache dropped);
3. engine 3 (fresh device, same store): A is restored from RAM (the disk restore put it back there).

The disk restore needs room in the full arena, where B is: with copies ahead of need
(`kv_disk.copy_ahead`, the default) B already has its disk copy and leaves RAM at once;
the same steps against a tierstore with them off (B written and fsynced in the restore's
path, as before they were built) are the same run's baseline of that claim.

The three engines share one integrity key file (as one engine across restarts does), so
each can read the states the first one tagged.

Each figure is the request's time to first token with max_tokens=1, as the engine reports it. A claim
from a lower tier also shows the engine's own restore (its `ignis.request.restored` event: the copy into
its pages and the integrity check of what it copied, engine/tiers/link.py) beside a numpy memcpy of the
same bytes and that memcpy plus the AES-GMAC tag of the copy, measured right after it: the restore as
the engine makes it, not as bench.tiers' rows model it. Each fresh engine claims once its mapping of the
arena has its pages mapped in (common/prefault.py; the step thread maps it at start), as a served engine
does seconds after it starts: a claim in the middle of that ran 52-71 ms against 28 ms.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.drive import random_prompt, run
from bench.geometry import ensure_geometry, geometry_config
from bench.tier_baselines import MiB, drop_cache
from common.launch import Service, launch_tierstore
from common.logs import event_of
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.config import parse_config
from engine.model.loader import LoadedModel, load_model
from engine.model.openmp import on_own_thread
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from engine.tiers.integrity import IntegrityKey

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
    prompts = {name: random_prompt(tokens, seed) for seed, name in enumerate("ABC", start=11)}
    ms: dict[str, float] = {}
    cached: dict[str, int] = {}
    tiers: dict[str, str] = {}
    scenario = Scenario(loaded, tokenizer, prompts, pages, state_bytes, ms, cached, tiers)
    scenario.baseline = SameBytes(state_bytes)
    scenario.run(folder / "claims-no-copy-ahead", copy_ahead=False, keys=("claim_disk_no_copy_ahead",))
    scenario.run(folder / "claims", copy_ahead=True, keys=("claim_disk", "claim_ram"), device=True)
    want = {"cold_prefill": "none", "claim_device": "device", "claim_disk": "disk", "claim_ram": "ram",
            "claim_disk_no_copy_ahead": "disk"}
    for key, tier in want.items():
        if tiers[key] != tier:
            raise RuntimeError(f"{key}: expected a {tier} hit, the engine reported {tiers[key]} "
                               f"({cached[key]} cached tokens); see the tierstore log under {folder}")
    return {"tokens": tokens, "state_bytes": state_bytes, "hidden": hidden, "layers": layers,
            "ms": ms, "cached": cached, "tiers": tiers, "restore_ms": scenario.restore_ms,
            "memcpy_ms": scenario.memcpy_ms, "memcpy_hash_ms": scenario.memcpy_hash_ms}


class SameBytes:
    """A numpy memcpy of a state's bytes, and that memcpy plus the AES-GMAC tag of the copy (the
    engine's integrity check on a CPU cache), into buffers written beforehand (no first-touch faults)."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.ones(nbytes, dtype=np.uint8)
        self.key = IntegrityKey.ephemeral()

    def memcpy_ms(self) -> float:
        t = time.perf_counter()
        np.copyto(self.dst, self.src)
        return (time.perf_counter() - t) * 1000

    def memcpy_hash_ms(self) -> float:
        t = time.perf_counter()
        np.copyto(self.dst, self.src)
        hashed = self.key.hasher(b"n" * 16, b"s" * 16, 1, len(self.dst))
        hashed.update(self.dst.data)
        hashed.digest()
        return (time.perf_counter() - t) * 1000


class _Restores(logging.Handler):
    """The `ignis.request.restored` events' ms while it listens."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ms: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        event = event_of(record)
        if event is not None and event[0] == "ignis.request.restored":
            self.ms.append(float(event[1]["ms"]))


@contextmanager
def restores() -> Iterator[_Restores]:
    handler, logger = _Restores(), logging.getLogger("ignis.request")  # engine/tiers/link.py logs there
    level = logger.level
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@dataclass
class Scenario:
    """The steps of the module docstring against one tierstore, the figures into `ms`, `cached`, `tiers`."""

    loaded: LoadedModel
    tokenizer: Tokenizer
    prompts: dict[str, tuple[int, ...]]
    pages: int
    state_bytes: int
    ms: dict[str, float]
    cached: dict[str, int]
    tiers: dict[str, str]
    baseline: SameBytes | None = None
    restore_ms: dict[str, float] = field(default_factory=dict)  # the engine's own restore, claims from a tier
    memcpy_ms: dict[str, float] = field(default_factory=dict)  # the same bytes, right after that claim
    memcpy_hash_ms: dict[str, float] = field(default_factory=dict)

    def once(self, core: EngineCore, key: str, prompt: str) -> None:
        req = EngineRequest(f"{key}-{prompt}", self.prompts[prompt],
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        with restores() as restored:
            (_, usage), = run(core, req)
        self.ms[key], self.cached[key], self.tiers[key] = (usage.time_to_first_token_ms, usage.cached_tokens,
                                                           usage.reuse.tier.value)
        if restored.ms and self.baseline is not None:
            self.restore_ms[key] = sum(restored.ms)
            self.memcpy_ms[key] = self.baseline.memcpy_ms()
            self.memcpy_hash_ms[key] = self.baseline.memcpy_hash_ms()

    def run(self, workdir: Path, copy_ahead: bool, keys: tuple[str, ...], device: bool = False) -> None:
        """Engine 1 computes A (cold, then a device hit with `device`), B and C; then one fresh engine per
        key claims A (the first from disk, the next from RAM, where the disk restore left it)."""
        store = launch_tierstore(workdir, self.state_bytes * 3 // 2 + MiB, 8 * self.state_bytes + 64 * MiB,
                                 env={"IGNIS_LOG_LEVEL": "WARNING",
                                      "IGNIS_KV_DISK__COPY_AHEAD": "true" if copy_ahead else "false"})
        try:
            key_file = workdir / "integrity.key"  # one engine key for all: each reads what the first wrote
            first = engine(self.loaded, self.tokenizer, store, self.pages + 8, key_file)
            try:
                run(first, EngineRequest("warm", random_prompt(64, 0), SamplingParams(temperature=0, max_tokens=1)))
                self.once(first, "cold_prefill" if device else "cold_prefill_again", "A")
                if device:
                    self.once(first, "claim_device", "A")
                self.once(first, "push_b", "B")  # A leaves the device for KV-RAM
                self.once(first, "push_c", "C")  # B follows it, pushing A on to KV-disk
            finally:
                first.stop()
            for blob in (workdir / "kv-disk").rglob("*"):
                if blob.is_file():
                    drop_cache(blob)
            for key in keys:
                core = engine(self.loaded, self.tokenizer, store, self.pages + 8, key_file)
                try:
                    # A served engine claims seconds after its start, once its mapping of the arena has its
                    # pages (the step thread maps it first thing): not in the middle of mapping them in.
                    assert core.tiers is not None and _mapped(core.tiers.client), "the engine did not map the arena"
                    self.once(core, key, "A")
                finally:
                    core.stop()
        finally:
            store.stop()


def _mapped(client: Any, timeout: float = 60.0) -> bool:
    """Waits for the engine's step thread to map the arena and for its pages to be mapped in."""
    deadline = time.monotonic() + timeout
    while client.arena is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(client.wait_mapped(max(0.0, deadline - time.monotonic())))


def engine(loaded: LoadedModel, tokenizer: Tokenizer, store: Service, pages: int, key_file: Path) -> EngineCore:
    page_bytes = loaded.config.state_shape().kv_bytes_per_page(P, loaded.model.dtype)
    core = on_own_thread(lambda: EngineCore(loaded, tokenizer, EngineConfig(
        page_size=P, kv_cache_bytes=pages * page_bytes, max_num_seqs=2, prefill_chunk_tokens=2048,
        tierstore_address=store.address, tier_timeout=30.0, integrity_key_file=str(key_file))))
    core.start()
    return core


def rows(res: dict[str, Any]) -> list[list[Any]]:
    ms, cold = res["ms"], res["ms"]["cold_prefill"]
    restore, memcpy, hashed = res.get("restore_ms", {}), res.get("memcpy_ms", {}), res.get("memcpy_hash_ms", {})
    out = [["re-prefill", f"cold prefill of the same {res['tokens']} tokens", round(cold, 1), "-", "-",
            "-", "-", "-"]]
    for key, what in (("claim_device", "device: pages shared by reference"),
                      ("claim_ram", "KV-RAM: found in the store's published table (no Match, no lease) + copy "
                                    "into pages"),
                      ("claim_disk", "KV-disk: Match + AcquireStream(restore, cold), copied as it lands; the "
                                     "resident state it displaces already has its disk copy (kv_disk.copy_ahead)"),
                      ("claim_disk_no_copy_ahead", "KV-disk, copies ahead of need off: the restore first writes "
                                                   "and fsyncs the resident state it displaces")):
        if key not in ms:
            continue
        path = f"claim from {res['tiers'][key]}" + (", copy ahead off" if key.endswith("no_copy_ahead") else "")
        out.append([path, what, round(ms[key], 1), res["cached"][key],
                    f"{cold / ms[key]:.0f}x faster" if ms[key] else "-",
                    round(restore[key], 1) if key in restore else "-",
                    round(memcpy[key], 1) if key in memcpy else "-",
                    round(hashed[key], 1) if key in hashed else "-"])
    return out


CLAIM_HEADERS = ["path", "what", "TTFT ms", "cached tokens", "vs re-prefill",
                 "engine's restore ms (copy + check)", "memcpy, same bytes ms", "memcpy + AES-GMAC ms"]
