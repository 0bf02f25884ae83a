"""What a checkpoint's config.json says, normalised across the supported families."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.kv.device_cache import StateShape
from engine.model.errors import CheckpointError
from engine.model.fp8 import Fp8Blocks, parse_fp8

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"

# architecture name -> family traits that config.json does not spell out
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False, "gated": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False, "gated": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False, "gated": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True, "gated": False},
    "Qwen3_5ForCausalLM": {"qkv_bias": None, "qk_norm": True, "gated": True},
    "Qwen3NextForCausalLM": {"qkv_bias": None, "qk_norm": True, "gated": True},
    "Qwen3_5MoeForCausalLM": {"qkv_bias": None, "qk_norm": True, "gated": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": None, "qk_norm": True, "gated": False},
}
# The classes the Qwen3.5/3.6 family is published under: a multimodal model whose text model (config.json's
# `text_config`, weights under `model.language_model.`) is the family named here. Served text-only; the
# vision tower's weights are kept beside it (engine/model/loader.py).
_TEXT_MODEL_OF: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
SUPPORTED_ARCHITECTURES = (*_FAMILIES, *_TEXT_MODEL_OF)
_HYBRID = frozenset({"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"})
_MOE = frozenset({"Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3MoeForCausalLM"})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # as config.json names it (a published multimodal class, for one)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Qwen3.5/Qwen3-Next: sigmoid output gate on attention, RMSNorm as x*(1+w).
    gated_attention: bool = False
    zero_centered_norm: bool = False
    # Gated DeltaNet (linear attention) geometry.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    fused_gdn_projections: bool = False  # Qwen3-Next packs q,k,v,z and b,a per key-head group
    # Mixture of experts (Qwen3-Next).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    text_architecture: str = ""  # the text model's family when `architecture` nests one; else the same
    fp8: Fp8Blocks | None = None  # an fp8 checkpoint's block scales (engine/model/fp8.py); None: unquantized
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if len(self.layer_types) != self.num_layers:
            raise CheckpointError(
                f"config.json: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        for kind in self.layer_types:
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION):
                raise CheckpointError(f"config.json: layer_types entry {kind!r} is not supported")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != LINEAR_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def state_shape(self) -> StateShape:
        """What the cache holds per sequence for this model."""
        return StateShape(
            attention_layers=self.attention_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            linear_layers=self.linear_layers, linear_value_heads=self.linear_num_value_heads,
            linear_key_dim=self.linear_key_head_dim, linear_value_dim=self.linear_value_head_dim,
            conv_dim=self.gdn_conv_dim if self.is_hybrid else 0, conv_kernel=self.linear_conv_kernel,
        )

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def fingerprint_fields(self) -> dict[str, Any]:
        """The config as loaded, for the model fingerprint (reuse namespace)."""
        return {k: v for k, v in sorted(self.raw.items()) if not k.startswith("_")}


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise CheckpointError(f"config.json: required key {key!r} is missing")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling or None, partial factor) from either the v5 rope_parameters or the older keys."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    scaling = {**legacy, **{k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return theta, None, partial
    if kind not in ("linear", "llama3", "yarn", "dynamic"):
        raise CheckpointError(f"config.json: rope type {kind!r} is not supported")
    scaling["rope_type"] = kind
    return theta, scaling, partial


def _text_config(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The text model's settings: `cfg` itself, or the `text_config` a multimodal class nests (its
    top-level `tie_word_embeddings` and EOS ids, where given, are the model's)."""
    if arch not in _TEXT_MODEL_OF:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json: {arch} needs a text_config object (the text model's settings)")
    top = {k: cfg[k] for k in ("tie_word_embeddings", "eos_token_id") if cfg.get(k) is not None}
    return {**text, **top}


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    published = next((a for a in archs if a in _FAMILIES or a in _TEXT_MODEL_OF), None)
    if published is None:
        raise CheckpointError(
            f"config.json: architectures {archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = _TEXT_MODEL_OF.get(published, published)
    raw, cfg = cfg, _text_config(cfg, published)  # the file as written; the text model's settings
    fp8 = parse_fp8(raw.get("quantization_config") or cfg.get("quantization_config"))
    traits = _FAMILIES[arch]
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    layers = int(_require(cfg, "num_hidden_layers"))
    hybrid = arch in _HYBRID
    moe = arch in _MOE
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if hybrid:
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
        elif cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
            layer_types = [SLIDING_ATTENTION] * layers
        else:
            layer_types = [FULL_ATTENTION] * layers
    theta, scaling, partial = _rope(cfg)
    if not hybrid:
        partial = 1.0 if "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}) else partial
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = traits["qkv_bias"] if traits["qkv_bias"] is not None else attention_bias
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    window = cfg.get("sliding_window")
    return ModelConfig(
        architecture=published,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        # An MoE text model whose every layer is routed may have no dense MLP size.
        intermediate_size=int(cfg.get("intermediate_size") or 0) if moe else int(_require(cfg, "intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_types=tuple(layer_types),
        sliding_window=int(window) if window else None,
        qkv_bias=bool(qkv_bias),
        o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=traits["qk_norm"],
        gated_attention=traits["gated"],
        zero_centered_norm=hybrid,
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 0)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 0)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 0)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 0)),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 0)),
        fused_gdn_projections=arch == "Qwen3NextForCausalLM",
        # transformers writes Qwen3-MoE's expert count as num_local_experts; the published configs say num_experts.
        num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        # Qwen3.5's router always renormalises its top-k weights (it has no such setting).
        norm_topk_prob=True if arch == "Qwen3_5MoeForCausalLM" else bool(cfg.get("norm_topk_prob", True)),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype"),
        text_architecture=arch,
        fp8=fp8,
        raw=raw,
    )


def load_config(checkpoint: Path) -> ModelConfig:
    path = checkpoint / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {checkpoint} a Hugging Face checkpoint directory?)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return parse_config(cfg)
