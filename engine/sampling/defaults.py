"""The checkpoint's own sampling defaults: what `generation_config.json` says for a field a request
leaves unset (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens for max_tokens),
as vLLM applies them. Qwen's releases ship temperature 0.6-0.7, top_p 0.8-0.95 and top_k 20 there;
a request that sets a field keeps its own value."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

from engine.sampling.params import SamplingParams

log = logging.getLogger("ignis.engine")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # None: the rest of the context

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> SamplingDefaults:
        """The defaults `checkpoint`'s generation_config.json gives (logged); the built-in ones where it
        is missing or gives none. A value of the wrong type or range is ignored, with a warning: a
        checkpoint's hint must not stop the model from serving."""
        path = checkpoint / "generation_config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            log.warning("%s: not read (%s); built-in sampling defaults", path, exc)
            return cls()
        given = {"max_tokens" if key == "max_new_tokens" else key: value for key, value in raw.items()} \
            if isinstance(raw, dict) else {}
        taken: dict[str, float | int] = {}
        for f in fields(cls):
            value = given.get(f.name)
            if value is None:
                continue
            if _valid(f.name, value):
                taken[f.name] = int(value) if f.name in ("top_k", "max_tokens") else float(value)
            else:
                log.warning("%s: %s = %r ignored (out of range)", path, f.name, value)
        defaults = cls(**taken)  # type: ignore[arg-type]
        if taken:
            log.info("sampling defaults from %s for fields a request leaves unset: %s", path,
                     ", ".join(f"{k}={v}" for k, v in taken.items()))
        return defaults


def _valid(name: str, value: object) -> bool:
    """Whether a request could set `name` to `value` (SamplingParams' own bounds; integers where it
    counts, and a max_new_tokens of at least one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if name in ("top_k", "max_tokens") and not float(value).is_integer():
        return False
    try:
        SamplingParams(**{name: int(value) if name in ("top_k", "max_tokens") else float(value)})  # type: ignore[arg-type]
    except (ValueError, OverflowError):
        return False
    return name != "max_tokens" or value >= 1
