"""The tensors that hold sequence state on the device.

- KV pages, page-major: kv[page] holds every attention layer's K and V for P
  positions, so one page (and one retained state) is a contiguous block to copy.
- State slots, slot-major: recurrent[slot] and conv[slot] hold every linear-attention
  layer's state of one sequence, so cloning a slot is two strided copies, not one per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    page_size: int
    num_pages: int
    num_slots: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.num_pages <= 0 or self.num_slots < 0:
            raise ValueError(f"invalid cache geometry {self}")


def kv_bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * len(config.attention_layers) * config.num_kv_heads * config.head_dim
    return per_token * page_size * torch.empty((), dtype=dtype).element_size()


def state_bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    if not config.is_hybrid:
        return 0
    n = len(config.linear_layers)
    recurrent = n * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    conv = n * config.gdn_conv_dim * (config.linear_conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
    return recurrent + conv


class DeviceCache:
    def __init__(self, config: ModelConfig, geometry: CacheGeometry, device: torch.device) -> None:
        self.config = config
        self.geometry = geometry
        self.page_size = geometry.page_size
        n_attn = len(config.attention_layers)
        # kv: [num_pages, L_attn, 2, P, Hkv, D]
        self.kv = torch.zeros(
            geometry.num_pages, n_attn, 2, geometry.page_size, config.num_kv_heads, config.head_dim,
            dtype=geometry.dtype, device=device,
        )
        n_lin = len(config.linear_layers)
        slots = geometry.num_slots if n_lin else 0
        # recurrent: [slots, L_lin, Hv, Dk, Dv] kept in fp32 (the delta rule accumulates in it)
        self.recurrent = torch.zeros(
            slots, n_lin, config.linear_num_value_heads, config.linear_key_head_dim,
            config.linear_value_head_dim, dtype=torch.float32, device=device,
        )
        # conv: [slots, L_lin, conv_dim, K-1]
        self.conv = torch.zeros(
            slots, n_lin, config.gdn_conv_dim, max(config.linear_conv_kernel - 1, 0),
            dtype=geometry.dtype, device=device,
        )
        self._attn_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self._linear_index = {layer: i for i, layer in enumerate(config.linear_layers)}

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.kv[:, self._attn_index[layer], 0]  # [num_pages, P, Hkv, D] (strided view)

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.kv[:, self._attn_index[layer], 1]

    def linear_index(self, layer: int) -> int:
        return self._linear_index[layer]

    def copy_slot(self, src: int, dst: int) -> None:
        """Clone one sequence's recurrent state and conv taps: two copies for all layers."""
        self.recurrent[dst].copy_(self.recurrent[src])
        self.conv[dst].copy_(self.conv[src])
