"""A compiled grammar (shared, immutable) and the per-sequence matcher that walks it.

`GrammarGuide` is the `TokenGuide` the sampler asks for a bitmask and tells each accepted
token. It is plain Python state of its sequence: a sequence moved down a tier, preempted or
recomputed keeps it, and carries on where its grammar was. n>1 choices each fork their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr


@dataclass(frozen=True, slots=True)
class CompiledGuide:
    """One request's grammar, compiled against the engine's vocabulary."""

    grammar: xgr.CompiledGrammar
    stop_token_ids: tuple[int, ...]  # what may end the output once the grammar is complete
    description: str  # e.g. "json_schema", for logs

    def new_guide(self) -> GrammarGuide:
        matcher = xgr.GrammarMatcher(self.grammar, override_stop_tokens=list(self.stop_token_ids))
        return GrammarGuide(matcher)


class GrammarGuide:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` ([B, ceil(V/32)] int32, CPU): 1 bits for the tokens allowed next."""
        if self._matcher.is_terminated():
            raise RuntimeError("asked for the next tokens of a finished grammar: this is a bug")
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} was sampled outside its grammar: this is a bug")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the output is over."""
        return bool(self._matcher.is_terminated())

    @property
    def is_completed(self) -> bool:
        """The output so far is a whole sentence of the grammar (only a stop token may follow)."""
        return bool(self._matcher.is_completed())

    def fork(self) -> GrammarGuide:
        return GrammarGuide(self._matcher.fork())
