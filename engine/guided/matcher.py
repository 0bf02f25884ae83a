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
class ReasoningTokens:
    """A reasoning model's block markers: the grammar holds only once the block is over."""

    start: int  # <think>
    end: int  # </think>
    starts_inside: bool  # the prompt opened the block (deepseek_r1)


@dataclass(frozen=True, slots=True)
class CompiledGuide:
    """One request's grammar, compiled against the engine's vocabulary."""

    grammar: xgr.CompiledGrammar
    stop_token_ids: tuple[int, ...]  # what may end the output once the grammar is complete
    description: str  # e.g. "json_schema", for logs
    reasoning: ReasoningTokens | None = None

    def new_guide(self) -> GrammarGuide | AfterReasoning:
        matcher = xgr.GrammarMatcher(self.grammar, override_stop_tokens=list(self.stop_token_ids))
        guide = GrammarGuide(matcher)
        return guide if self.reasoning is None else AfterReasoning(guide, self.reasoning)


class GrammarDeadEnd(RuntimeError):
    """The grammar allows no token where the output stands and is not complete: it cannot be finished.
    Its message is for the client (the request fails with it); the engine is fine."""


class GrammarGuide:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` ([B, ceil(V/32)] int32, CPU): 1 bits for the tokens allowed next."""
        if self._matcher.is_terminated():
            raise RuntimeError("asked for the next tokens of a finished grammar: this is a bug")
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            raise GrammarDeadEnd("the grammar allows no token at this point of the output and is not complete: "
                                 "no output can satisfy it (is a rule only ever defined through itself?)")

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


class AfterReasoning:
    """A reasoning model thinks freely, then answers in the grammar (vLLM does the same): no mask
    while the output is inside its reasoning block, the grammar from the token after `</think>`.
    Without a block (qwen3: the first token is not `<think>`) the grammar holds from the start."""

    def __init__(self, guide: GrammarGuide, tokens: ReasoningTokens, state: str | None = None) -> None:
        self._guide = guide
        self._tokens = tokens
        self._state = state or ("thinking" if tokens.starts_inside else "opening")  # opening | thinking | answer

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == "answer":
            self._guide.fill_bitmask(bitmask, row)
            return
        # Free while thinking (the row stays all ones); at the opening, the block or the grammar's first token.
        if self._state == "opening":
            self._guide.fill_bitmask(bitmask, row)
            bitmask[row, self._tokens.start // 32] |= _bit(self._tokens.start % 32)

    def accept(self, token_id: int) -> None:
        if self._state == "answer":
            self._guide.accept(token_id)
        elif self._state == "opening":
            if token_id == self._tokens.start:
                self._state = "thinking"
            else:
                self._state = "answer"
                self._guide.accept(token_id)
        elif token_id == self._tokens.end:
            self._state = "answer"

    @property
    def is_terminated(self) -> bool:
        return self._state == "answer" and self._guide.is_terminated

    def fork(self) -> AfterReasoning:
        return AfterReasoning(self._guide.fork(), self._tokens, self._state)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch holds."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
