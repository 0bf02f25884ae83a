"""Retained states for models with recurrent layers: prompt checkpoints and retained prefixes.

A retained state is the whole sequence state at one position: the recurrent
state and conv taps, and the KV pages up to that position. It is immutable: a
claim copies it into the claimant's own slot and pages. This is the policy half:
which held state a prompt matches, where a prefill is cut to capture one (the
publish point and the generation opener), which conversation (lineage) a checkpoint
belongs to, and when an admission should wait for a state being computed. Where a
state lives and every move of it (device and host slots, the staging ring, writes
ahead, eviction by the one order, spills) is the residency layer's
(engine/residency/retained_states.py).

With a tierstore, a lookup also asks the store; a lower-tier state is used only if
it beats the device match by more than `restore_floor` tokens (ties go up).
"""

from __future__ import annotations

import itertools

import torch

from engine.cache.reuse import Claim, HeldState
from engine.cache.tier_claims import LowerTierClaims, TieredReuse
from engine.facts import ReuseKind
from engine.kv.chain_hash import extend_page_hashes, state_matches, state_name
from engine.request import CommitPolicy, EngineSequence
from engine.residency.retained_state import RetainedState
from engine.residency.retained_states import RetainedStates
from engine.tiers.link import TierLink


class RetainedStateReuse(TieredReuse):
    states: RetainedStates  # always there: they are what this strategy reuses

    def __init__(self, states: RetainedStates, tiers: TierLink | None = None, restore_floor: int = 32) -> None:
        super().__init__(states.counters)
        self.states = states
        self.page_size = states.page_size
        self._lineage_ids = itertools.count(1)
        self.lower = LowerTierClaims(tiers, states.pages, self.page_size, restore_floor) if tiers is not None else None
        if self.lower is not None:
            lower = self.lower  # a state written below: a claimant held for it asks the store again
            states.on_written_below = lambda hashes: lower.forget()

    # --- lookup -------------------------------------------------------------
    def match(self, seq: EngineSequence) -> Claim | None:
        if not seq.request.claims_state:
            return None
        device = self._match_device(seq)
        lower = self.lower.claim(seq, device.num_tokens if device else 0) if self.lower is not None else None
        return lower or device

    def _match_device(self, seq: EngineSequence) -> Claim | None:
        if not self.states:
            return None
        n = len(seq.token_ids)
        # Longest first: walk page boundaries from the end; states anchored at boundary i end in [iP, (i+1)P).
        for i in range(min(len(seq.page_hashes), n // self.page_size), -1, -1):
            anchor = seq.page_hashes[i - 1] if i else seq.namespace
            best: RetainedState | None = None
            for state in self.states.anchored(anchor):
                m = state.num_tokens
                usable = state.ready and (m < n or (m == n and state.logits is not None))
                if usable and (best is None or m > best.num_tokens) and \
                        state_matches(state.name, m, seq.namespace, seq.page_hashes, seq.token_ids, self.page_size):
                    best = state
            if best is not None:
                return Claim(best.num_tokens, best.kind, HeldState(best))
        return None

    def apply_device(self, seq: EngineSequence, claim: Claim) -> None:
        assert isinstance(claim.source, HeldState) and seq.slot is not None
        state = claim.source.state
        self.states.copy_into(seq, state)
        if state.kind is ReuseKind.CHECKPOINT and state.lineage is not None:
            seq.join_lineage(state.lineage)

    def in_flight(self, seq: EngineSequence, claim: Claim | None, running: list[EngineSequence]) -> bool:
        if not seq.request.claims_state:
            return False
        claimed = claim.num_tokens if claim else 0
        n = len(seq.token_ids)
        for state in self.states.pending:  # captured, still being copied: claimable in a step or two
            m = state.num_tokens
            if m - claimed >= self.page_size and (m < n or (m == n and state.logits is not None)) and \
                    state_matches(state.name, m, seq.namespace, seq.page_hashes, seq.token_ids, self.page_size):
                return True
        for other in running:
            if not other.request.publishes:
                continue
            for point in self._pending_captures(other):
                # A prefix is usable inside a longer prompt; a whole-prompt checkpoint also as
                # the whole prompt (it keeps its next-token logits).
                usable = point < n or (point == n == other.num_prompt)
                if usable and point - claimed >= self.page_size and self._shares(seq, other, point):
                    return True
        return False

    def publish_point(self, seq: EngineSequence) -> int:
        """Where the retained prefix is captured: the stable head rounded down to whole pages."""
        return seq.request.head_tokens // self.page_size * self.page_size

    def _pending_captures(self, seq: EngineSequence) -> list[int]:
        """Positions at which `seq` will still capture a retained state (see after_compute)."""
        points = []
        publish = self.publish_point(seq)
        if seq.num_computed < publish < seq.num_prompt:
            points.append(publish)
        if seq.num_computed < seq.num_prompt and seq.num_output == 0:
            points.append(seq.num_prompt)
        return points

    def _shares(self, seq: EngineSequence, other: EngineSequence, point: int) -> bool:
        """Whether the first `point` tokens of both are the same (same namespace, same tokens)."""
        if seq.namespace != other.namespace:
            return False
        theirs = state_name(other.namespace, other.page_hashes, other.token_ids, point, self.page_size)
        return state_matches(theirs, point, seq.namespace, seq.page_hashes, seq.token_ids, self.page_size)

    # --- capture ------------------------------------------------------------
    def cut_point(self, seq: EngineSequence) -> int | None:
        if not seq.request.publishes:
            return None
        return min((p for p in self._pending_captures(seq) if p < len(seq.token_ids)), default=None)

    def after_compute(self, seq: EngineSequence, next_logits: torch.Tensor | None) -> None:
        if not seq.request.publishes:
            return
        m = seq.num_computed
        if m == self.publish_point(seq) and 0 < m < seq.num_prompt:
            self._capture(seq, m, ReuseKind.PREFIX, None)
        elif m == seq.num_prompt and seq.num_output == 0:
            self._capture(seq, m, ReuseKind.CHECKPOINT, next_logits)

    def after_decodes(self, seqs: list[EngineSequence]) -> None:
        """Nothing: captures are made inside the prompt and at its end, and a decode-only step's sequences
        are each past their prompt's end (each has a generated token), so after_compute would make none."""

    def on_finish(self, seq: EngineSequence) -> None:
        if seq.request.publishes and seq.request.commit is CommitPolicy.INCLUDING_GENERATED_TOKENS \
                and seq.num_computed > seq.num_prompt:
            self._capture(seq, seq.num_computed, ReuseKind.CHECKPOINT, None)

    def _capture(self, seq: EngineSequence, m: int, kind: ReuseKind, logits: torch.Tensor | None) -> None:
        extend_page_hashes(seq.namespace, seq.page_hashes, seq.token_ids, m, self.page_size)
        name = state_name(seq.namespace, seq.page_hashes, seq.token_ids, m, self.page_size)
        lineage = self._lineage_for(seq, kind) if self.states.index.get(name) is None else None
        self.states.keep(seq, name, m, kind, logits, lineage)

    def _lineage_for(self, seq: EngineSequence, kind: ReuseKind) -> int | None:
        if kind is not ReuseKind.CHECKPOINT:
            return None
        if seq.lineage is None:
            seq.join_lineage(next(self._lineage_ids))
        return seq.lineage

