"""The tensors that hold sequence state on the device.

- KV pages, page-major: kv[page] holds every attention layer's K and V for P
  positions, so one page (and one retained state) is a contiguous block to copy.
- State slots, slot-major: one byte row per slot holds every linear-attention layer's
  recurrent state and conv taps of one sequence (`recurrent` and `conv` are views into
  it), so cloning a slot is one contiguous copy, not one per layer or per kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv.host_copy import host_row_copier

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """engine.kv_dtype: "auto" is the model's compute dtype."""
    if name == "auto":
        return compute
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"kv_dtype must be auto, {', '.join(KV_DTYPES)}, got {name!r}") from None


def namespace_dtype(kv: torch.dtype, compute: torch.dtype) -> str:
    """The dtype named in the reuse namespace (chain_hash.Namespace.kv_dtype): the KV pages' dtype,
    and the compute dtype too when it differs (it made the K/V and the state), so state written
    under one pair is never claimed by an engine under another, here or through the tierstore."""
    name = str(kv).removeprefix("torch.")
    return name if kv == compute else f"{name}/compute={str(compute).removeprefix('torch.')}"


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    page_size: int
    num_pages: int
    num_slots: int
    dtype: torch.dtype  # the compute dtype: conv taps (the recurrent state is always fp32)
    kv_dtype: torch.dtype | None = None  # the KV pages' (engine.kv_dtype); None: `dtype`

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.num_pages <= 0 or self.num_slots < 0:
            raise ValueError(f"invalid cache geometry {self}")

    @property
    def page_dtype(self) -> torch.dtype:
        """The KV pages' dtype."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype


@dataclass(frozen=True, slots=True)
class StateShape:
    """A model's per-sequence state, in the terms the cache needs (the model config builds it)."""

    attention_layers: tuple[int, ...]  # model layer indices with KV
    num_kv_heads: int
    head_dim: int
    linear_layers: tuple[int, ...] = ()  # model layer indices with recurrent state (Gated DeltaNet)
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_dim: int = 0
    conv_kernel: int = 0

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.linear_layers)

    def kv_bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim
        return per_token * page_size * _element_size(dtype)

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        n = len(self.linear_layers)
        recurrent = n * self.linear_value_heads * self.linear_key_dim * self.linear_value_dim * 4  # fp32
        conv = n * self.conv_dim * max(self.conv_kernel - 1, 0) * _element_size(dtype)
        return recurrent + conv


def _aligned(n: int, to: int = 64) -> int:
    """Sections of a state row start on cache lines (and any dtype's alignment)."""
    return -(-n // to) * to


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


RowCopier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (pool, src rows, dst rows)


class DeviceCache:
    def __init__(self, shape: StateShape, geometry: CacheGeometry, device: torch.device,
                 copy_rows: RowCopier | None = None) -> None:
        """`copy_rows(pool, src, dst)`: the row-copy kernel state clones use (the Triton one on CUDA,
        chosen by engine/model/state_copy.py); None: the cache's own copies (by address on the CPU,
        else plain tensor copies)."""
        self.copy_rows = copy_rows
        self.shape = shape
        self.geometry = geometry
        self.page_size = geometry.page_size
        n_attn = len(shape.attention_layers)
        # kv: [num_pages, L_attn, 2, P, Hkv, D]
        self.kv = torch.zeros(
            geometry.num_pages, n_attn, 2, geometry.page_size, shape.num_kv_heads, shape.head_dim,
            dtype=geometry.page_dtype, device=device,
        )
        n_lin = len(shape.linear_layers)
        slots = geometry.num_slots if n_lin else 0
        recurrent_shape = (n_lin, shape.linear_value_heads, shape.linear_key_dim, shape.linear_value_dim)
        conv_shape = (n_lin, shape.conv_dim, max(shape.conv_kernel - 1, 0))
        recurrent_bytes = math.prod(recurrent_shape) * 4
        conv_at = _aligned(recurrent_bytes)
        row_bytes = max(_aligned(conv_at + math.prod(conv_shape) * _element_size(geometry.dtype)), 64)
        # One byte row per slot holds the whole sequence state, [recurrent | conv], so cloning a
        # slot is one contiguous copy; the two are views into it.
        self.state_rows = torch.zeros(slots, row_bytes, dtype=torch.uint8, device=device)
        # recurrent: [slots, L_lin, Hv, Dk, Dv] kept in fp32 (the delta rule accumulates in it)
        self.recurrent = self.state_rows[:, :recurrent_bytes].view(torch.float32).view(slots, *recurrent_shape)
        # conv: [slots, L_lin, conv_dim, K-1]
        conv_bytes = math.prod(conv_shape) * _element_size(geometry.dtype)
        self.conv = self.state_rows[:, conv_at:conv_at + conv_bytes].view(geometry.dtype).view(slots, *conv_shape)
        self._attn_index = {layer: i for i, layer in enumerate(shape.attention_layers)}
        # Made once: a view costs three torch calls, and every attention layer asks for two each step.
        self._k_views = {layer: self.kv[:, i, 0] for layer, i in self._attn_index.items()}
        self._v_views = {layer: self.kv[:, i, 1] for layer, i in self._attn_index.items()}
        self._linear_index = {layer: i for i, layer in enumerate(shape.linear_layers)}
        # Given no row-copy kernel, a page or slot row of at most 2 MiB on the CPU is cloned by one memmove
        # (engine/kv/host_copy.py); a kernel given is always the one used (tests run Triton's on the CPU).
        by_address = copy_rows is None
        self._page_copy = host_row_copier(self.kv) if by_address else None
        self._slot_copy = host_row_copier(self.state_rows) if by_address else None

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._k_views[layer]  # [num_pages, P, Hkv, D] (strided view)

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._v_views[layer]

    def linear_index(self, layer: int) -> int:
        return self._linear_index[layer]

    def copy_slot(self, src: int, dst: int) -> None:
        """Clone one sequence's recurrent state and conv taps: one copy of its row, all layers."""
        if self._slot_copy is not None:
            self._slot_copy(src, dst)
        elif self.copy_rows is not None:
            self.copy_rows(self.state_rows, *self._rows(src, dst))
        else:
            self.state_rows[dst].copy_(self.state_rows[src])

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page (all attention layers): a partial last page a fork or a claim makes private."""
        if self._page_copy is not None:
            self._page_copy(src, dst)
        elif self.copy_rows is not None:
            self.copy_rows(self.kv, *self._rows(src, dst))
        else:
            self.kv[dst].copy_(self.kv[src])

    def _rows(self, src: int, dst: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([src, dst], dtype=torch.int64).to(self.kv.device, non_blocking=True)
        return ids[:1], ids[1:]
