"""Pure tensor steps of sampling: logit bias, stop-token masking, penalties, truncation.

Each takes per-row parameters as tensors (or index lists) and touches only the
rows it is given, so `sampler.sample` can apply a step to exactly the requests
that asked for it. All are elementwise or row-wise: a row's result never
depends on the other rows in the batch, which is what makes seeded sampling
independent of batch mates.
"""

from __future__ import annotations

import torch


def apply_logit_bias(
    logits: torch.Tensor, rows: list[int], cols: list[int], values: list[float]
) -> None:
    """In place: logits[rows[j], cols[j]] += values[j]."""
    # logits: [B, V]
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def mask_tokens(logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
    """In place: logits[rows[j], cols[j]] = -inf (used to hold back eos until min_tokens)."""
    # logits: [B, V]
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI) penalties; returns new logits.

    repetition: a token seen in the prompt or output has its logit divided by
      the penalty if positive, multiplied if not (so > 1 always discourages it).
    frequency/presence: logit -= frequency * count + presence * (count > 0),
      counting generated tokens only, as OpenAI defines them.
    """
    # logits: [P, V] fp32; output_counts: [P, V] int; seen: [P, V] bool; repetition/presence/frequency: [P]
    rep = repetition[:, None]  # [P, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    counts = output_counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def truncated_probs(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Temperature-scaled logits -> probabilities after top-k, top-p (nucleus) and min-p.

    Works in sorted order: a stable descending sort puts ties lowest id first,
    so top_k keeps exactly k tokens, breaking ties the way argmax does. Every
    filter keeps the most likely token, so no row is ever left empty.
    """
    # logits: [S, V]; top_k: [S] int64 (0 = off); top_p, min_p: [S] fp32
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [S, V] each
    rank = torch.arange(vocab, device=logits.device)  # [V]
    k = torch.where(top_k > 0, top_k, vocab)  # [S]
    keep = rank[None, :] < k[:, None]  # [S, V]

    # Nucleus: keep a token if the mass strictly before it is still < top_p: the
    # smallest prefix whose cumulative probability reaches top_p.
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < top_p[:, None]

    # min-p: relative to the most likely token, which truncation never removes and
    # whose ratio to the others does not change with renormalisation.
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs >= min_p[:, None] * probs[:, :1]

    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    # Back to vocabulary order, so the draw indexes token ids directly.
    return torch.empty_like(probs).scatter_(-1, order, probs)
