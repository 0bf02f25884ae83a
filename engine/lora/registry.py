"""The adapters an engine serves: their names, which slot of the LoRA sites each one runs from,
and their identity for the reuse namespace.

Loads and unloads change the slots' weights, which a step reads: they run on the step thread,
between steps (EngineCore.change_adapters). A name unloaded stops taking requests at once; its
slot is written again only once no request that was admitted with it is still live (`in_use`),
and a request whose adapter's slot changed before it reached the step thread fails instead of
running on other weights (`current`). An adapter loaded twice under two names (the same digest)
shares one slot and one state namespace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.lora.adapter import AdapterError, LoraAdapter
from engine.lora.sites import LoraSites


class AdapterExists(AdapterError):
    """The name is taken (ALREADY_EXISTS)."""


class NoAdapterSlot(ValueError):
    """Every slot holds an adapter still in use (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    name: str
    path: str
    digest: bytes  # the adapter's identity: joins the reuse namespace (h0)
    slot: int
    rank: int
    created: int  # Unix seconds


class AdapterRegistry:
    def __init__(self, sites: LoraSites) -> None:
        self.sites = sites
        self._by_name: dict[str, ServedAdapter] = {}

    def get(self, name: str) -> ServedAdapter | None:
        """Any thread (a dict read)."""
        return self._by_name.get(name)

    def served(self) -> list[ServedAdapter]:
        return sorted(self._by_name.values(), key=lambda a: a.name)

    def current(self, adapter: ServedAdapter) -> bool:
        """Whether `adapter`'s slot still holds its weights (step thread)."""
        held = self.sites.slot_adapters[adapter.slot]
        return held is not None and held.digest == adapter.digest

    def add(self, name: str, adapter: LoraAdapter, in_use: Callable[[int], bool]) -> ServedAdapter:
        """Serve `adapter` as `name` (step thread): in the slot already holding the same weights, else in
        a slot no name and no live request uses. AdapterExists, NoAdapterSlot."""
        if name in self._by_name:
            raise AdapterExists(f"an adapter named {name!r} is already loaded (unload it first)")
        named = {a.slot for a in self._by_name.values()}
        slots = self.sites.slot_adapters
        same = next((s for s in named if (held := slots[s]) is not None and held.digest == adapter.digest), None)
        slot = same if same is not None else \
            next((s for s in range(len(slots)) if s not in named and not in_use(s)), None)
        if slot is None:
            raise NoAdapterSlot(f"all {len(slots)} adapter slots (lora.max_adapters) hold adapters in use: unload one")
        if same is None:
            self.sites.place(slot, adapter)
        served = ServedAdapter(name, str(adapter.path), adapter.digest, slot, adapter.rank, int(time.time()))
        self._by_name[name] = served
        return served

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving `name` (step thread); KeyError when no adapter has it."""
        return self._by_name.pop(name)
