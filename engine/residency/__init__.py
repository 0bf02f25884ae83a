"""Residency: where the engine's state lives and every move of it (docs/architecture.md, "Residency").

The engine's counterpart of the tierstore's `TierStore`: device retained slots, the
host block, the staging ring, the copy worker, writes ahead, spills, promotions,
eviction by the one order, and live sequences moved down a tier and back. The reuse
policy (engine/cache/) decides what matches and what to capture; this layer decides
where it lives and moves it there.
"""
