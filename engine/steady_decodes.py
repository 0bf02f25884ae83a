"""The steady state of decoding: the same sequences step after step, each one token on.

When a step's plan is every running sequence decoding its one pending token, past its first (nothing
prefills, waits for a page, joins, leaves or moves), the next step's plan is the same one, one position
further on, for as long as the running list stays the same list of sequences: each of them computed its
token and took the next (a sequence that ends leaves the list). The scheduler keeps that plan and plans
from it without visiting every sequence: the only per-sequence work left is a page for each sequence
whose next position starts one, and those are found by their position modulo the page size, which
every step moves on by one. The plan's list of sequences is the same list object from step to step, so
the runner knows its kept batch by it (engine/model/kept_decodes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import is_

from engine.request import EngineSequence


@dataclass(slots=True)
class SteadyDecodes:
    running: list[EngineSequence]  # the scheduler's running list as it was planned (a copy)
    seqs: list[EngineSequence]  # the plan's sequences in its order: the same list every step
    by_offset: list[list[EngineSequence]]  # [page_size]: sequences by position % page_size when it was made
    steps: int = 0  # steps planned from it since

    @classmethod
    def of(cls, running: list[EngineSequence], seqs: list[EngineSequence], page_size: int) -> SteadyDecodes:
        """From a plan of `seqs` decoding at their num_computed, made while planning it."""
        by_offset: list[list[EngineSequence]] = [[] for _ in range(page_size)]
        for seq in seqs:
            by_offset[seq.num_computed % page_size].append(seq)
        return cls(list(running), seqs, by_offset)

    def holds(self, running: list[EngineSequence]) -> bool:
        """Whether `running` is still the list of sequences it was made from, in the same order."""
        return len(running) == len(self.running) and all(map(is_, running, self.running))

    def next_step(self) -> list[EngineSequence]:
        """Move on one step; the sequences whose position in it is the first of a page (they may need one)."""
        self.steps += 1
        return self.by_offset[-self.steps % len(self.by_offset)]
