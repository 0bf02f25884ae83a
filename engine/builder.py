"""Wiring: from an EngineConfig and a loaded model to the device cache, its pools,
the residency layer (and the tier link below it) and the reuse policy on top of it.
Nothing here runs per step."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cache.page_reuse import PageReuse
from engine.cache.retained import RetainedStateReuse
from engine.cache.reuse import NoReuse, PromptReuse
from engine.config import EngineConfig
from engine.kv.device_cache import CacheGeometry, DeviceCache, resolve_kv_dtype
from engine.kv.host_slots import HostSlots
from engine.kv.page_pool import PagePool, SlotPool
from engine.model.loader import LoadedModel
from engine.model.state_copy import row_copier
from engine.residency.copy_worker import CopyWorker
from engine.residency.counters import ReuseCounters
from engine.residency.layer import Residency
from engine.residency.live_moves import LiveMoves
from engine.residency.page_chains import PageChains
from engine.residency.retained_states import RetainedStates
from engine.residency.staging import StagingRing
from engine.tiers.client import TierClient
from engine.tiers.codec import StateCodec
from engine.tiers.integrity import IntegrityKey
from engine.tiers.link import TierLink

if TYPE_CHECKING:
    from engine.vision.encoder import ImageEncoder
    from engine.vision.media import VisionInput

log = logging.getLogger("ignis.engine")


@dataclass(frozen=True, slots=True)
class EngineParts:
    cache: DeviceCache
    pages: PagePool
    slots: SlotPool | None  # live sequences' state slots (models with recurrent layers)
    reuse: PromptReuse
    residency: Residency
    max_model_len: int


def build_parts(loaded: LoadedModel, config: EngineConfig) -> EngineParts:
    model_cfg = loaded.config
    shape = model_cfg.state_shape()
    if config.speculative_method == "mtp" and loaded.mtp is not None:
        # The MTP layers' K/V live in the sequence's pages beside the target's (the drafter's window
        # travels with the state: engine/speculative/mtp_drafter.py); they are cache layers L, L+1 ...
        extra = tuple(range(model_cfg.num_layers, model_cfg.num_layers + len(loaded.mtp.layers)))
        shape = dataclasses.replace(shape, attention_layers=shape.attention_layers + extra)
    dtype = loaded.model.dtype
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)  # pages hold K/V in it; a page's bytes follow it
    page_bytes = shape.kv_bytes_per_page(config.page_size, kv_dtype)
    recurrent = shape.has_recurrent_state
    # A drafting sequence copies its state to a spare slot for the step (engine/verify_step.py).
    spare_slots = config.max_num_seqs if config.speculative_method != "none" else 0
    live_slots = config.max_num_seqs + 1 + spare_slots if recurrent else 0
    retained_slots = config.retained_device if recurrent and config.reuse_prompt else 0
    num_slots = live_slots + retained_slots
    if page_bytes:
        num_pages = max(1, config.kv_cache_bytes // page_bytes)
    else:
        # Every layer is linear attention: pages hold no bytes, only positions. Enough of them
        # for every live and retained sequence to reach the model's full context.
        context_pages = -(-model_cfg.max_position_embeddings // config.page_size)
        num_pages = context_pages * max(1, num_slots)
    geometry = CacheGeometry(config.page_size, num_pages, num_slots, dtype, kv_dtype)
    cache = DeviceCache(shape, geometry, loaded.model.device, copy_rows=row_copier(loaded.model.device))
    pages = PagePool(num_pages)
    tiers = _tier_link(loaded, config, cache)  # retained state spills there; live sequences move there
    reuse: PromptReuse
    ahead_pages = _ahead_pages(config, num_pages) if tiers is not None else 0
    moves = LiveMoves(tiers, config.page_size, config.spill_window_pages)
    counters = ReuseCounters()
    if not config.reuse_prompt:
        reuse = NoReuse()
        residency = Residency(moves, tiers=tiers)
    elif recurrent:
        states, worker = _retained_states(loaded, config, cache, pages, live_slots, retained_slots, tiers, counters,
                                          ahead_pages)
        residency = Residency(moves, worker, states=states, tiers=tiers)
        reuse = RetainedStateReuse(states, tiers=tiers, restore_floor=config.restore_floor)
    else:
        # Kept prompt ends (retained states of kind `pages`): `reuse.retained_device` of them on the device.
        kept = None
        worker = None
        if config.retained_device > 0 or config.retained_host > 0:
            kept, worker = _retained_states(loaded, config, cache, pages, 0, config.retained_device, tiers,
                                            counters, ahead_pages)
        worker = worker or (CopyWorker() if ahead_pages else None)  # also writes finished chains ahead of need
        chains = PageChains(pages, tiers, config.page_size, worker=worker, ahead_pages=ahead_pages,
                            counters=counters) if tiers is not None else None
        if kept is not None and chains is not None:
            kept.on_written_below = chains.covered
        residency = Residency(moves, worker, states=kept, chains=chains, tiers=tiers)
        reuse = PageReuse(pages, config.page_size, tiers=tiers, restore_floor=config.restore_floor, chains=chains,
                          counters=counters, states=kept)
    capacity = num_pages * config.page_size
    limit = config.max_model_len or model_cfg.max_position_embeddings
    max_model_len = min(limit, model_cfg.max_position_embeddings, capacity)
    log.info(
        "cache: %d pages x %d tokens (%.1f MiB, %s), %d state slots (%.1f MiB); max_model_len %d",
        num_pages, config.page_size, num_pages * page_bytes / 2**20, str(kv_dtype).removeprefix("torch."),
        num_slots, num_slots * shape.state_bytes_per_slot(dtype) / 2**20, max_model_len,
    )
    return EngineParts(cache, pages, SlotPool(live_slots) if recurrent else None, reuse, residency, max_model_len)


def build_vision(loaded: LoadedModel, config: EngineConfig) -> tuple[VisionInput, ImageEncoder] | None:
    """A checkpoint with a vision tower: what takes its images (processor, special tokens) and the tower
    with its output cache; None for a text-only one."""
    weights = loaded.side_weights.get("vision tower")
    if weights is None:
        return None
    # Imported here: the image processor comes with transformers, which a text-only engine never loads.
    from engine.vision.encoder import ImageEncoder
    from engine.vision.media import VisionInput
    from engine.vision.tower import VisionTower
    raw = loaded.config.raw
    tower = VisionTower.from_weights(raw.get("vision_config") or {}, weights, device=loaded.model.device,
                                     dtype=loaded.model.dtype)
    vision = VisionInput.of_checkpoint(loaded.path, raw)
    log.info("vision tower: %d blocks; images %d..%d pixels; encoder cache %.0f MiB", tower.config.depth,
             vision.settings.min_pixels, vision.settings.max_pixels, config.encoder_cache_bytes / 2**20)
    return vision, ImageEncoder(tower, config.encoder_cache_bytes, loaded.model.dtype)


def next_row_size(loaded: LoadedModel, config: EngineConfig) -> int:
    """The floats of the row a state keeps with it for its next token: the logits, and with an MTP drafter
    the target's hidden state at the last position after them (its first draft needs it)."""
    drafter = config.speculative_method == "mtp" and loaded.mtp is not None
    return loaded.config.vocab_size + (loaded.config.hidden_size if drafter else 0)


def _retained_states(loaded: LoadedModel, config: EngineConfig, cache: DeviceCache, pages: PagePool,
                     first_slot: int, num_slots: int, tiers: TierLink | None, counters: ReuseCounters,
                     ahead_pages: int) -> tuple[RetainedStates, CopyWorker | None]:
    """Retained states in `num_slots` device slots from `first_slot` (an attention-only model's slots
    are only a count), the host block and the staging ring as configured, and the copy worker."""
    codec = StateCodec(cache, next_row_size(loaded, config))
    host = _host_slots(config, codec, min(loaded.config.max_position_embeddings, pages.num_pages * config.page_size),
                       pin=cache.kv.device.type == "cuda")
    staged = config.staging_ring and (host is not None or tiers is not None)
    # One worker thread copies off the step: staged captures and states written ahead.
    worker = CopyWorker() if staged or ahead_pages else None
    # The ring stages the slot and one page; the worker copies the rest into the host slot or the arena.
    ring = StagingRing(codec.sections(config.page_size).logits, pin=cache.kv.device.type == "cuda",
                       worker=worker) if staged else None
    states = RetainedStates(cache, pages, first_slot, num_slots, config.retained_interactive_ttl, counters,
                            tiers=tiers, host=host, codec=codec, ring=ring, worker=worker, ahead_pages=ahead_pages)
    return states, worker


def _ahead_pages(config: EngineConfig, num_pages: int) -> int:
    """Free pages below which the states the device gives up next are written below ahead of need."""
    if config.spill_ahead_pages < 0:
        return 0
    return config.spill_ahead_pages or max(1, num_pages // 8)


def _host_slots(config: EngineConfig, codec: StateCodec, context: int, pin: bool) -> HostSlots | None:
    """`reuse.retained_host` slots, each sized for a state of `reuse.retained_host_tokens` (the context)."""
    if config.retained_host <= 0:
        return None
    tokens = min(config.retained_host_tokens or context, context)
    host = HostSlots(config.retained_host, codec.nbytes(tokens, with_logits=True), pin=pin)
    log.info("retained states: %d host slots of up to %d tokens (%.1f MiB each, %.1f MiB in all)",
             host.num_slots, tokens, host.slot_bytes / 2**20, host.num_slots * host.slot_bytes / 2**20)
    return host


def _tier_link(loaded: LoadedModel, config: EngineConfig, cache: DeviceCache) -> TierLink | None:
    """The tierstore below the device, if one is configured."""
    if not config.tierstore_address:
        return None
    codec = StateCodec(cache, next_row_size(loaded, config))
    client = TierClient(
        config.tierstore_address, model=loaded.config.model_type, page_size=config.page_size,
        layout=codec.layout(), kv_bytes_per_token=codec.kv_bytes_per_token,
        fixed_state_bytes=codec.fixed_state_bytes, timeout=config.tier_timeout,
        retry_seconds=config.tier_retry_seconds, pin=cache.kv.device.type == "cuda",
        # tierstore.secret_file, for a TCP address; EngineConfig.tierstore_secret_file once the config carries it
        secret_file=config.tierstore_secret_file)
    log.info("retained states spill to the tierstore at %s (restore floor %d tokens)",
             config.tierstore_address, config.restore_floor)
    key = IntegrityKey.from_file(config.integrity_key_file) if config.integrity_key_file else IntegrityKey.ephemeral()
    return TierLink(client, codec, key)
