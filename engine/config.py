"""The engine core's configuration record: what `ignis-engine` builds from its settings
(`EngineConfig.from_settings`), and what tests and benchmarks build by hand.

A field read from a setting is declared with `from_setting(key)`: its default is that setting's own
(common/settings.py holds each default once), and `from_settings` copies every such field. The rest
are knobs with no setting (benchmarks and tests turn them)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from common.settings import Settings, default_value


def from_setting(key: str, **default: Any) -> Any:
    """A field read from setting `key`; its default is the setting's unless `default=` gives another."""
    return field(default=default.get("default", default_value(key)), metadata={"setting": key})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    page_size: int = from_setting("engine.page_size")
    kv_dtype: str = from_setting("engine.kv_dtype")  # the KV pages' dtype; auto: the model's compute dtype
    kv_cache_bytes: int = from_setting("engine.kv_cache_bytes")
    max_num_seqs: int = from_setting("engine.max_num_seqs")
    prefill_chunk_tokens: int = from_setting("engine.prefill_chunk_tokens")  # tokens per step: decodes and chunks
    step_time_target_ms: float = from_setting("engine.step_time_target_ms")  # 0: auto; inf: off (step_pacing.py)
    max_queue: int = from_setting("engine.max_queue")
    max_model_len: int = from_setting("engine.max_model_len")  # 0: from the model config (and the cache's capacity)
    reuse_prompt: bool = from_setting("reuse.prompt")
    encoder_cache_bytes: int = from_setting("reuse.encoder_cache_bytes")  # the vision tower's outputs, by image
    retained_device: int = from_setting("reuse.retained_device")  # retained slots (hybrid); kept prompt ends (dense)
    retained_host: int = from_setting("reuse.retained_host")  # retained-state slots in one host block
    retained_host_tokens: int = from_setting("reuse.retained_host_tokens")  # the longest a host slot holds; 0: context
    retained_interactive_ttl: float = from_setting("reuse.retained_interactive_ttl")
    speculative_method: str = from_setting("speculative.method")  # none | ngram | mtp (engine/speculative/)
    speculative_num_tokens: int = from_setting("speculative.num_tokens")  # k: drafted tokens per step
    speculative_disable_batch_size: int = from_setting("speculative.disable_batch_size")  # -1: by model
    lora_enabled: bool = from_setting("lora.enabled")  # the model's linears get adapter slots (engine/lora/)
    lora_max_adapters: int = from_setting("lora.max_adapters")
    lora_max_rank: int = from_setting("lora.max_rank")
    lora_dtype: str = from_setting("lora.dtype")  # auto: the model's
    tierstore_address: str = from_setting("tierstore.address")  # unix:/path or host:port; empty: device-only reuse
    tierstore_secret_file: str = from_setting("tierstore.secret_file")  # the shared secret of a TCP tierstore
    spill_window_pages: int = from_setting("engine.spill_window_pages")  # a live sequence's pages moved per step
    # The key of the tag on spilled state. Built by hand, a config gets a key of its own process (""):
    # a test or a benchmark never writes a key file into the user's home.
    integrity_key_file: str = from_setting("engine.integrity_key_file", default="")
    # Cut each step's drafts to what pays by the step costs this engine measures and the sequences'
    # acceptance (engine/speculative/draft_sizing.py); False: every draft verified whole, the same on
    # every run whatever the machine's load (tests that compare what was drafted across runs).
    speculative_measured: bool = True
    staging_ring: bool = True  # host captures copy their pages off the step (False: synchronously, for comparison)
    # States the device gives up next are written to KV-RAM off the step, once fewer pages than this
    # are free (blank pages, attention-only models); 0: an eighth of the pool; -1: never (on the step).
    spill_ahead_pages: int = 0
    tier_restore_floor: int = -1  # a lower-tier match must beat the device match by more tokens; -1: two pages
    tier_timeout: float = 2.0  # deadline of each tierstore call (seconds)
    tier_retry_seconds: float = 5.0  # after the store fails, device-only this long before trying again

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.kv_cache_bytes <= 0 or self.max_queue <= 0:
            raise ValueError(f"invalid engine config {self}")

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """Every field declared `from_setting`, read from `settings`; the rest keep their defaults."""
        return cls(**{f.name: settings.value(f.metadata["setting"]) for f in fields(cls) if "setting" in f.metadata})

    @property
    def restore_floor(self) -> int:
        return 2 * self.page_size if self.tier_restore_floor < 0 else self.tier_restore_floor
