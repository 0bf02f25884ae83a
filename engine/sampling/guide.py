"""Guided decoding as the sampler sees it: per row, a bitmask of the tokens allowed next.

The sampler knows guides only through `TokenGuide` (engine/guided implements it with
xgrammar), so sampling stays a leaf of the engine. Masked tokens get -inf before any
sampling mode runs: greedy, temperature, top-k/p, min-p and penalties all see the masked
logits, and logprobs report the masked distribution (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import xgrammar as xgr


class TokenGuide(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, token_id: int) -> None: ...
    def fork(self) -> TokenGuide: ...
    @property
    def is_terminated(self) -> bool: ...


def apply_guides(logits: torch.Tensor, rows: list[int], guides: Sequence[TokenGuide]) -> None:
    """In place: logits[rows[j]] keeps only what guides[j] allows next; one bitmask for the batch."""
    # logits: [B, V]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)  # [B, ceil(V/32)] int32, CPU, all allowed
    for row, guide in zip(rows, guides):
        guide.fill_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab,
                                    indices=rows)
