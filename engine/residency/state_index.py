"""How the engine finds its retained states: by name (a claim, a capture of a state already held), by
anchor (the last full page a prompt shares with a state, where a lookup starts), and by lineage (one
conversation's checkpoints, of which it keeps the newest few)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from engine.kv.chain_hash import StateHash
from engine.residency.retained_state import RetainedState


class StateIndex:
    def __init__(self, max_per_lineage: int) -> None:
        self.max_per_lineage = max_per_lineage
        self._by_name: dict[StateHash, RetainedState] = {}
        self._by_anchor: dict[StateHash, list[RetainedState]] = {}
        self._lineages: dict[int, deque[RetainedState]] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self) -> Iterator[RetainedState]:
        return iter(self._by_name.values())

    def get(self, name: StateHash) -> RetainedState | None:
        return self._by_name.get(name)

    def holds(self, state: RetainedState) -> bool:
        """Whether `state` itself (not only its name) is indexed."""
        return self._by_name.get(state.name) is state

    def anchored(self, anchor: StateHash) -> Iterable[RetainedState]:
        """The states whose last full page (or namespace, for none) is `anchor`."""
        return self._by_anchor.get(anchor, ())

    def add(self, state: RetainedState) -> list[RetainedState]:
        """Index `state`; returns the oldest of its lineage past the newest `max_per_lineage`, for the
        caller to drop (a conversation keeps its newest few)."""
        self._by_name[state.name] = state
        self._by_anchor.setdefault(state.anchor, []).append(state)
        if state.lineage is None:
            return []
        chain = self._lineages.setdefault(state.lineage, deque())
        chain.append(state)
        return [chain.popleft() for _ in range(len(chain) - self.max_per_lineage)]

    def replace(self, old: RetainedState, new: RetainedState) -> None:
        """`new` (same name, anchor and lineage) takes `old`'s place everywhere (a state moved up)."""
        self._by_name[old.name] = new
        group = self._by_anchor[old.anchor]
        group[group.index(old)] = new
        chain = self._lineages.get(old.lineage) if old.lineage is not None else None
        if chain is not None and old in chain:
            chain[chain.index(old)] = new

    def remove(self, state: RetainedState) -> bool:
        """Forget `state`; False if no state of its name was indexed."""
        if self._by_name.pop(state.name, None) is None:
            return False
        group = self._by_anchor[state.anchor]
        group.remove(state)
        if not group:
            del self._by_anchor[state.anchor]
        chain = self._lineages.get(state.lineage) if state.lineage is not None else None
        if chain is not None and state in chain:
            chain.remove(state)
            if not chain:
                del self._lineages[state.lineage]  # type: ignore[arg-type]
        return True

    def check_integrity(self) -> None:
        if sum(len(v) for v in self._by_anchor.values()) != len(self._by_name):
            raise AssertionError("anchor index out of step with the name index")
