"""The engine core's configuration record (built from the settings by engine/__main__.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    page_size: int = 16
    kv_dtype: str = "auto"  # engine.kv_dtype: the KV pages' dtype; auto: the model's compute dtype
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    prefill_chunk_tokens: int = 2048  # engine.prefill_chunk_tokens: tokens per step, decodes and prefill chunks
    max_queue: int = 256
    max_model_len: int = 0  # 0: from the model config (and the cache's capacity)
    reuse_prompt: bool = True  # reuse.prompt
    retained_device: int = 8  # reuse.retained_device: retained-state slots reserved at load (hybrid models)
    retained_host: int = 0  # reuse.retained_host: retained-state slots in one host block (hybrid models)
    retained_host_tokens: int = 0  # reuse.retained_host_tokens: the longest state a host slot holds; 0: the context
    staging_ring: bool = True  # host captures copy their pages off the step (False: synchronously, for comparison)
    # States the device gives up next are written to KV-RAM off the step, once fewer pages than this
    # are free (blank pages, attention-only models); 0: an eighth of the pool; -1: never (on the step).
    spill_ahead_pages: int = 0
    retained_interactive_ttl: float = 300.0  # reuse.retained_interactive_ttl
    tierstore_address: str = ""  # tierstore.address (unix:/path or host:port); empty = device-only reuse
    tierstore_secret_file: str = ""  # tierstore.secret_file: the shared secret of a TCP tierstore
    tier_restore_floor: int = -1  # a lower-tier match must beat the device match by more tokens; -1: two pages
    tier_timeout: float = 2.0  # deadline of each tierstore call (seconds)
    tier_retry_seconds: float = 5.0  # after the store fails, device-only this long before trying again
    spill_window_pages: int = 16  # engine.spill_window_pages: pages of a live sequence moved down per step
    integrity_key_file: str = ""  # engine.integrity_key_file: the key of the tag on spilled state; "": per process

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.kv_cache_bytes <= 0 or self.max_queue <= 0:
            raise ValueError(f"invalid engine config {self}")

    @property
    def restore_floor(self) -> int:
        return 2 * self.page_size if self.tier_restore_floor < 0 else self.tier_restore_floor
