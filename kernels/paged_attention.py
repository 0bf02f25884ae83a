"""Attention over a paged KV cache: torch reference.

The pool holds whole pages; a sequence's page table lists its pages in order,
so token position p lives in page_table[p // P] at offset p % P.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


_workspace = threading.local()  # per step thread: its gather buffers, reused step after step


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, length: int, slot: int = 0) -> torch.Tensor:
    """cache: [num_pages, P, Hkv, D]; page_table: [n] page ids -> [length, Hkv, D].

    Into this thread's buffer `slot` (K and V each have theirs), grown (doubling, up to the pool's size)
    to the longest context gathered and then reused: a fresh [context, Hkv, D] tensor every layer of
    every chunk was a large block that malloc mapped and unmapped each time, its pages faulted in and
    zeroed again each step (at 24k tokens most of a small chunk's step). The result is valid until the
    next gather into the same slot."""
    pages_wanted = page_table.shape[0]
    buffers: dict[tuple[int, torch.device, torch.dtype, torch.Size], torch.Tensor] = \
        _workspace.__dict__.setdefault("buffers", {})
    key = (slot, cache.device, cache.dtype, cache.shape[1:])
    buffer = buffers.get(key)
    if buffer is None or buffer.shape[0] < pages_wanted:
        held = 0 if buffer is None else buffer.shape[0]
        size = max(pages_wanted, min(2 * held, cache.shape[0]))  # never more pages than the pool has
        buffer = buffers[key] = torch.empty((size, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    pages = torch.index_select(cache, 0, page_table, out=buffer[:pages_wanted])  # [n, P, Hkv, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions of a sequence over its cache.

    q: [Tq, H, D] for positions context_len-Tq .. context_len-1 (their K/V are
    already written); k_cache/v_cache: [num_pages, P, Hkv, D].
    Returns [Tq, H, D].
    """
    tq, heads, _ = q.shape
    # The KV dtype (engine.kv_dtype) may differ from q's: SDPA takes one dtype, so the gathered copy is q's.
    k = gather_pages(k_cache, page_table, context_len, 0).to(q.dtype)  # [Tk, Hkv, D]
    v = gather_pages(v_cache, page_table, context_len, 1).to(q.dtype)
    if sliding_window is None and tq == 1:  # a decode: no mask at all
        return single_query_attention(q[0], k, v, scale).unsqueeze(0)
    allowed: torch.Tensor | None = None
    if sliding_window is not None or tq != context_len:
        q_pos = torch.arange(context_len - tq, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    # Otherwise a fresh prefill: plain causal, which SDPA's flash path computes without a
    # mask and skipping the upper triangle (2x at 2k tokens on the CPU).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Tq, D]
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=allowed,
        is_causal=allowed is None,
        scale=scale,
        enable_gqa=heads != k.shape[1],
    )
    return out[0].transpose(0, 1)


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query position over a whole context, no mask: q [H, D], k/v [Tk, Hkv, D] -> [H, D].

    The query heads sharing a KV head are laid out as that head's query rows (head h
    reads KV head h // (H / Hkv), as in grouped-query attention), so no K/V is repeated.
    """
    heads, dim = q.shape
    kv_heads = k.shape[1]
    out = F.scaled_dot_product_attention(
        q.reshape(kv_heads, heads // kv_heads, dim), k.transpose(0, 1), v.transpose(0, 1), scale=scale
    )
    return out.reshape(heads, dim)


def positional(table: torch.Tensor, lengths: torch.Tensor, page_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """paged_decode_attention's pages/offsets/valid [B, L] from each sequence's page table [B, W]
    and context length [B] (L: the longest length; padding points where the table's padding does)."""
    positions = torch.arange(int(lengths.max()) if lengths.numel() else 0, device=table.device)
    pages = table[:, positions // page_size]
    offsets = (positions % page_size).expand(table.shape[0], -1)
    return pages, offsets, positions[None, :] < lengths[:, None]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One new token for each of B sequences, attention over each one's whole context at once.

    q: [B, H, D]; pages/offsets/valid: [B, L] (position -> page, offset; padding masked);
    returns [B, H, D].
    """
    heads = q.shape[1]
    k = k_cache[pages, offsets].to(q.dtype)  # [B, L, Hkv, D], in q's dtype (SDPA takes one)
    v = v_cache[pages, offsets].to(q.dtype)
    allowed = valid
    if sliding_window is not None:
        lengths = valid.sum(dim=1, keepdim=True)
        positions = torch.arange(valid.shape[1], device=q.device)[None, :]
        allowed = allowed & (positions >= lengths - sliding_window)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        k.transpose(1, 2),  # [B, Hkv, L, D]
        v.transpose(1, 2),
        attn_mask=allowed[:, None, None, :],
        scale=scale,
        enable_gqa=heads != k.shape[2],
    )
    return out[:, :, 0]
