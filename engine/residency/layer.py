"""The residency layer: the one object the step loop calls about moving state.

It holds the copy worker that copies off the step, what lives in a place of its own
(retained states in device and host slots: a recurrent model's checkpoints and prefixes,
an attention-only model's kept prompt ends; and the finished page chains of an
attention-only model, tracked for the tierstore), the
link to the tierstore below, and the live sequences being moved down. The step
loop polls it at the start of each step and when a copy off the step wakes it; the
scheduler hands it the sequences it displaces; the Monitor reads what it holds.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.residency.copy_worker import CopyWorker
from engine.residency.live_moves import LiveMoves
from engine.residency.page_chains import PageChains
from engine.residency.retained_state import StateView
from engine.residency.retained_states import RetainedStates
from engine.tiers.link import TierLink


class Residency:
    def __init__(self, moves: LiveMoves, worker: CopyWorker | None = None, states: RetainedStates | None = None,
                 chains: PageChains | None = None, tiers: TierLink | None = None) -> None:
        self.moves = moves
        self.worker = worker
        self.states = states  # retained states (models with recurrent layers; an attention-only model's kept ends)
        self.chains = chains  # finished page chains (attention-only models with a tierstore)
        self.tiers = tiers

    def poll(self) -> None:
        """At the start of each step, and when idle after a copy woke the engine: finish what the
        worker is through with (captures become claimable, memory a copy read is freed), then
        start the next write ahead that is due."""
        if self.worker is not None:
            self.worker.collect()
        if self.states is not None:
            self.states.write_ahead()
        if self.chains is not None:
            self.chains.write_ahead()

    def notify_copies(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from the copy worker) whenever a copy off the step is through."""
        if self.worker is not None:
            self.worker.notify = wake

    @property
    def copying(self) -> bool:
        """Copies off the step are in flight (the engine polls them even when it has no work)."""
        return self.worker is not None and self.worker.in_flight > 0

    @property
    def copy_waits(self) -> int:
        """Times a step waited for a copy off the step to finish before reusing the memory it read."""
        return self.worker.waits if self.worker is not None else 0

    def held_pages(self) -> set[int]:
        """Device pages kept in use by retained state (not by any live sequence)."""
        return self.states.held_pages() if self.states is not None else set()

    @property
    def retained_slots(self) -> tuple[int, int]:
        """(total, used) retained-state slots on the device."""
        return self.states.retained_slots if self.states is not None else (0, 0)

    @property
    def host_slots(self) -> tuple[int, int]:
        """(total, used) retained-state slots on the host."""
        return self.states.host_slots if self.states is not None else (0, 0)

    def describe(self) -> list[StateView]:
        """A copy of what it holds, one row per state or page chain (engine thread; the Monitor)."""
        held = self.states.describe() if self.states is not None else []
        return held + (self.chains.views() if self.chains is not None else [])

    def close(self) -> None:
        """The engine stops: finish the copies in flight, then let go of the tierstore."""
        if self.states is not None and self.states.ring is not None:
            self.states.ring.close()
        if self.worker is not None:
            self.worker.close()
        if self.tiers is not None:
            self.tiers.close()

    def check_integrity(self) -> None:
        if self.states is not None:
            self.states.check_integrity()
        if self.chains is not None:
            self.chains.check_integrity()
