"""Qwen3.5's vision tower in ignis' own torch: patches of pixels -> one embedding per merged image token.

The same computation as transformers' `Qwen3_5VisionModel.forward` (models/qwen3_5/modeling_qwen3_5.py):
- patch embed: a Conv3d whose kernel equals its stride, i.e. one matmul over each flattened patch;
- a learned square table of position embeddings, resampled bilinearly (align_corners=True) to each image's
  grid of patches and added once, before the blocks;
- a 2-D axial rotary embedding of (row, column) on q and k in every block;
- full bidirectional attention within each frame of each image, never across images;
- the patch merger: LayerNorm, then each m x m block of patches concatenated, MLP -> the text hidden size.
Qwen3.5 has no deepstack mergers (Qwen3-VL had them): the merger's output is the tower's only output.

Patches arrive in the image processor's order: m x m merge blocks row-major, row-major inside a block
(m: spatial_merge_size), so each merged token's m*m patches are adjacent; positions follow the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.errors import check_tensors
from engine.model.layers import rotate_half

PREFIXES = ("model.visual.", "visual.")  # how checkpoints name the tower's tensors
_DERIVED = ("rotary_pos_emb.inv_freq",)  # recomputed from the config if a checkpoint carries it
_NORM_EPS = 1e-6  # transformers hard-codes it for the blocks' and the merger's LayerNorms

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # transformers' ACT2FN names
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}

Grid = tuple[int, int, int]  # (t, h, w) in patches, before merging


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """config.json's `vision_config`; defaults are transformers' `Qwen3_5VisionConfig`'s."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")
        if self.head_dim % 4:  # axial rope: a quarter of each head's dims per axis, cos and sin halves
            raise ValueError(f"vision_config: head dim {self.head_dim} is not a multiple of 4")
        if self.grid_side ** 2 != self.num_position_embeddings:
            raise ValueError(f"vision_config: num_position_embeddings {self.num_position_embeddings} "
                             "is not a square (the learned positions are a square grid)")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config: hidden_act {self.hidden_act!r} is not supported; "
                             f"supported: {', '.join(_ACTIVATIONS)}")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> VisionConfig:
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config: rope_type {rope['rope_type']!r} is not supported (axial only)")
        known = {f: cfg[f] for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                     "spatial_merge_size", "out_hidden_size", "num_position_embeddings",
                                     "hidden_act") if f in cfg}
        return cls(**known, patch_size=_one_size(cfg, "patch_size", 16),
                   temporal_patch_size=_one_size(cfg, "temporal_patch_size", 2),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)

    @property
    def patch_dim(self) -> int:
        """Values per patch in `pixel_values`: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def _one_size(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, (list, tuple)):  # transformers' config allows a pair; its conv takes one size
        if len(set(value)) != 1:
            raise ValueError(f"vision_config: {key} {value} is not square; only square patches are supported")
        value = value[0]
    return int(value)


class VisionTower(nn.Module):
    """`tower(pixel_values [N_patches, patch_dim], grid_thw [n_images, 3]) -> [N_merged, out_hidden_size]`,
    each image's merged tokens in the order of `grid_thw` (t*h*w / m**2 of them per image)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _Merger(config)
        # Not a buffer: the tower is built on the meta device and its state is only the checkpoint's.
        spatial = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float,
                                                                  device="cpu") / spatial))

    @classmethod
    def from_weights(cls, config: VisionConfig | Mapping[str, Any], weights: Mapping[str, torch.Tensor], *,
                     device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> VisionTower:
        """Built on the meta device, its tensors assigned from `weights` (the checkpoint's, named
        `model.visual.*` or `visual.*`, e.g. `LoadedModel.side_weights["vision tower"]`): a missing,
        misshapen or unused tensor is a ValueError naming it. Only a dtype or device change copies."""
        cfg = config if isinstance(config, VisionConfig) else VisionConfig.from_dict(config)
        tensors = _strip_prefix(weights)
        with torch.device("meta"):
            tower = cls(cfg)
        expected = {name: tuple(p.shape) for name, p in tower.state_dict().items()}
        check_tensors(expected, tensors, "vision tower weights", "the Qwen3.5 vision tower")
        state = {name: tensors[name].to(device=device, dtype=dtype) for name in expected}
        tower.load_state_dict(state, assign=True, strict=True)
        tower.inv_freq = tower.inv_freq.to(device)
        return tower.requires_grad_(False).eval()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        grids = _grids(grid_thw, cfg.spatial_merge_size)
        patches = sum(t * h * w for t, h, w in grids)
        if tuple(pixel_values.shape) != (patches, cfg.patch_dim):
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)} but grid_thw {grids} needs "
                             f"[{patches}, {cfg.patch_dim}]")
        weight = self.pos_embed.weight
        x = self.patch_embed(pixel_values.to(device=weight.device, dtype=weight.dtype))  # x: [N, D]
        x = x + self._positions(grids).to(x.dtype)
        cos, sin = self._rotary(grids)  # [N, head_dim], fp32
        frames = [h * w for t, h, w in grids for _ in range(t)]  # each frame attends within itself
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)  # [N / m**2, out_hidden_size]

    def _positions(self, grids: Sequence[Grid]) -> torch.Tensor:
        """The learned table resampled to each grid: 4 bilinear taps per patch, weights in fp32."""
        side, m = self.config.grid_side, self.config.spatial_merge_size
        table = self.pos_embed.weight  # [side*side, D]
        out = []
        for t, h, w in grids:
            h_taps, h_weights = _bilinear_taps(h, side, table.device)  # [h, 2] each
            w_taps, w_weights = _bilinear_taps(w, side, table.device)
            rows, cols = _merge_block_order(h, w, m, table.device)  # [h*w] each
            taps = (h_taps[rows][:, :, None] * side + w_taps[cols][:, None, :]).reshape(-1, 4)
            weights = (h_weights[rows][:, :, None] * w_weights[cols][:, None, :]).reshape(-1, 4)
            frame = (F.embedding(taps, table) * weights[:, :, None]).sum(1)  # [h*w, D]
            out.append(frame.repeat(t, 1))
        return torch.cat(out)

    def _rotary(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """Axial rope: the first half of each head's rotary angles follow the row, the second the column."""
        m = self.config.spatial_merge_size
        device = self.inv_freq.device
        ids = torch.cat([torch.stack(_merge_block_order(h, w, m, device), dim=-1).repeat(t, 1)
                         for t, h, w in grids])  # [N, 2]: row, column
        freqs = ids[..., None].float() * self.inv_freq  # [N, 2, head_dim/4]
        cos, sin = freqs.cos(), freqs.sin()
        return _axial(cos), _axial(sin)


def _axial(x: torch.Tensor) -> torch.Tensor:
    # x: [N, 2, F] -> [N, 4F] = (row, column, row, column): half-rotation layout over the whole head
    rows_cols = torch.cat([x[:, 0], x[:, 1]], dim=-1)
    return torch.cat([rows_cols, rows_cols], dim=-1)


def _merge_block_order(h: int, w: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid, in the processor's merge-block order."""
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    shape = (h // m, m, w // m, m)
    return rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()


def _bilinear_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per index along an axis of `size` patches: the 2 table rows it reads and their weights, as
    F.interpolate(mode="bilinear", align_corners=True) from `side` rows (ends map to ends)."""
    index = torch.arange(size, device=device, dtype=torch.float32)
    src = index * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _strip_prefix(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"vision tower weights: tensor {name!r} is not under {' or '.join(PREFIXES)}")
        short = name[len(prefix):]
        if short in _DERIVED:
            continue
        if short in out:
            raise ValueError(f"vision tower weights: tensor {short!r} is given under both {' and '.join(PREFIXES)}")
        out[short] = tensor
    return out


def _grids(grid_thw: torch.Tensor, m: int) -> list[Grid]:
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [n_images, 3], got {list(grid_thw.shape)}")
    grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
    for t, h, w in grids:
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"grid_thw entry {(t, h, w)}: t must be >= 1 and h, w positive multiples of "
                             f"spatial_merge_size {m}")
    return grids


class _PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        # Kept in the checkpoint's Conv3d layout [D, C, T, P, P]; kernel == stride, so it is one linear.
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, C*T*P*P] -> [N, D]
        weight = self.proj.weight
        return F.linear(x, weight.reshape(weight.shape[0], -1), self.proj.bias)


class _Attention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # [N, H, hd]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, hd]
        out = torch.cat([F.scaled_dot_product_attention(qs[None], ks[None], vs[None])[0]
                         for qs, ks, vs in zip(q.split(frames, 1), k.split(frames, 1), v.split(frames, 1))],
                        dim=1)  # [H, N, hd]
        return self.proj(out.transpose(0, 1).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, H, hd]; cos/sin: [N, hd]; in fp32 whatever the tower's dtype, as transformers does
    return rotate_half(x.float(), cos, sin).to(x.dtype)


class _Mlp(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=_NORM_EPS)
        self.attn = _Attention(config)
        self.mlp = _Mlp(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(config.hidden_size, eps=_NORM_EPS)  # per patch, before the blocks merge
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> [N / m**2, D * m**2] -> [N / m**2, out_hidden_size]
        x = self.norm(x).reshape(-1, self.linear_fc1.in_features)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))
