"""Which drafted tokens stand: the target's logits at the drafted positions against the draft.

Row i of the logits is the target's next-token distribution after the sequence's pending token and
drafts 0..i-1. Walking the rows in order:

- greedy: the row's token is its argmax (as plain decoding takes it); the draft stands while it equals
  that token, and the first row where it does not gives the target's token instead;
- sampled: a draft from a point-mass drafter (prompt lookup, a greedy MTP head) stands with
  probability p(d) under the row's sampling distribution p (temperature, top-k/p, min-p applied);
  rejected, the token is drawn from p with d removed, renormalised. Then each token is distributed
  exactly as p (P(d) = p(d); P(x != d) = (1 - p(d)) p(x) / (1 - p(d))): the output distribution is
  the target's. Draws use the sequence's own generator.

Either way the row after the last standing draft gives one more token (the correction, or the bonus
when every draft stands), so a verify step yields between 1 and k+1 tokens. The logits are processed
as plain sampling processes them (bias, min_tokens), each row with the output length it would have had;
requests whose processing depends on the tokens before (penalties, a grammar) are not drafted for
(engine/speculative/speculator.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.sampler import (RequestSampler, SampleOutput, argmax_lowest, chosen_logprobs, draw_probs,
                                     process_logits)


@dataclass(frozen=True, slots=True)
class Verified:
    tokens: SampleOutput  # the tokens that stand, in order: the accepted drafts, then the target's own
    accepted: int  # drafts that stood (len(tokens.token_ids) - 1)


def verify_drafts(logits: torch.Tensor, draft: tuple[int, ...], sampler: RequestSampler,
                  eos_token_ids: frozenset[int], num_output: int) -> Verified:
    """logits: [len(draft) + 1, V], row i the target's after the pending token and draft[:i]."""
    rows = len(draft) + 1
    if logits.shape[0] != rows:
        raise ValueError(f"{logits.shape[0]} logits rows for a draft of {len(draft)} tokens")
    samplers = [sampler] * rows
    x = process_logits(logits, samplers, eos_token_ids, [num_output + i for i in range(rows)])  # [rows, V]
    if sampler.greedy:
        picked = argmax_lowest(x).tolist()
        tokens = _walk_greedy(picked, draft)
    else:
        tokens = _walk_sampled(x, draft, sampler)
    logprobs, top = chosen_logprobs(x[: len(tokens)], samplers[: len(tokens)], tokens)
    return Verified(SampleOutput(tokens, logprobs, top), len(tokens) - 1)


def _walk_greedy(picked: list[int], draft: tuple[int, ...]) -> list[int]:
    for i, d in enumerate(draft):
        if picked[i] != d:
            return picked[: i + 1]
    return picked


def _walk_sampled(x: torch.Tensor, draft: tuple[int, ...], sampler: RequestSampler) -> list[int]:
    rows = x.shape[0]
    probs = draw_probs(x, [sampler.params] * rows)
    generator = sampler.generator
    tokens: list[int] = []
    for i, d in enumerate(draft):
        row = probs[i]
        u = torch.rand((), generator=generator, device=x.device)
        if bool(u < row[d]):
            tokens.append(d)
            continue
        rest = row.clone()
        rest[d] = 0.0  # p(d) < 1 here (u < 1 = p(d) always accepts), so mass remains
        tokens.append(int(torch.multinomial(rest, 1, generator=generator)))
        return tokens
    tokens.append(int(torch.multinomial(probs[rows - 1], 1, generator=generator)))
    return tokens
