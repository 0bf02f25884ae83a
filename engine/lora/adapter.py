"""A LoRA adapter in PEFT's format, read and checked against the model it will run on.

PEFT saves `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, rank_pattern,
alpha_pattern) and `adapter_model.safetensors` with, per adapted linear,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The linear's
output becomes W x + scaling * B A x, scaling = alpha / r (alpha / sqrt(r) with rsLoRA).

What ignis refuses, each with a message naming it: a module ignis does not adapt (the
embeddings, lm_head, the MoE router and routed experts), a shape the base model's linear does
not have (an adapter trained on another base), a rank over `lora.max_rank`, and PEFT's variants
that are not plain LoRA (DoRA, trained biases, modules_to_save, fan_in_fan_out).

The adapter's identity (its digest) covers the weights as they run (each linear's A and B with
the scaling folded in, rounded to lora.dtype: a bf16-served adapter's state is not its fp32 one's)
and the targets, not the file's name or its path: the same adapter loaded
under another name finds the same state, a changed file finds none (engine/kv/chain_hash.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why (a caller mistake: 400)."""


@dataclass(frozen=True, slots=True)
class LinearShape:
    """A linear the model lets an adapter change: its input and output widths."""

    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class AdaptedLinear:
    """One linear's low-rank update: delta(x) = b @ (a @ x), the scaling already in b."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], times the scaling

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """An adapter read from its folder, its linears named by the model's module paths."""

    path: Path
    linears: dict[str, AdaptedLinear]  # "model.layers.3.self_attn.q_proj" -> its update
    digest: bytes  # 16 bytes: the weights as they run, and where

    @property
    def rank(self) -> int:
        return max(linear.rank for linear in self.linears.values())


def read_adapter(path: str | Path, targets: dict[str, LinearShape], max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read a PEFT LoRA adapter from its folder for a model whose adaptable linears are `targets`
    (module path -> shape), its weights as they will run (scaled, in `dtype`); AdapterError when it
    cannot be served here."""
    folder = Path(path).expanduser()
    config = _read_config(folder)
    tensors = _read_weights(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others: list[str] = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            others.append(key)
            continue
        module = _module_name(match["module"])
        if module not in targets:
            kinds = {name.rsplit(".", 1)[-1] for name in targets}
            if module.rsplit(".", 1)[-1] in kinds:
                raise AdapterError(f"{folder.name}: this model has no module {module!r} (an adapter for another "
                                   "base model?)")
            raise AdapterError(f"{folder.name}: module {module!r} is not one ignis adapts "
                               f"(q/k/v/o, gate/up/down and the GDN projections; this model's: {', '.join(sorted(kinds))})")
        pairs.setdefault(module, {})[match["part"]] = tensor
    if others:  # after the LoRA pairs: a module ignis does not adapt is the clearer answer
        raise AdapterError(f"{folder.name}/{WEIGHTS_FILE}: tensor {others[0]!r} is not a LoRA A or B weight "
                           "(ignis serves plain LoRA adapters: no trained biases, no modules_to_save)")
    if not pairs:
        raise AdapterError(f"{folder.name}/{WEIGHTS_FILE}: holds no LoRA weights")
    linears = {module: _adapted(folder.name, module, found, targets[module], config, max_rank, dtype)
               for module, found in sorted(pairs.items())}
    return LoraAdapter(folder, linears, _digest(linears))


def _read_config(folder: Path) -> dict[str, object]:
    file = folder / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no {CONFIG_FILE} (a PEFT LoRA adapter folder has {CONFIG_FILE} and "
                           f"{WEIGHTS_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: not a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{file}: peft_type {kind} is not LORA")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights")):
        if config.get(flag):
            raise AdapterError(f"{file}: {what} is not served (plain LoRA only)")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"{file}: trained biases (bias={config['bias']!r}) are not served")
    if config.get("modules_to_save"):
        raise AdapterError(f"{file}: modules_to_save ({config['modules_to_save']}) are not served")
    return config


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE}")
    try:
        return load_file(str(file))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{file}: cannot read it: {exc}") from None


def _module_name(peft_name: str) -> str:
    """A PEFT module path as the model names it (the text model of a multimodal checkpoint included)."""
    if peft_name.startswith("model.language_model."):
        return "model." + peft_name[len("model.language_model."):]
    return peft_name


def _number(config: dict[str, object], key: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AdapterError(f"{CONFIG_FILE}: {key} must be a number, got {value!r}")
    return float(value)


def _pattern_value(patterns: object, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module's name (a regex
    matched at the end of the name, or the name's last parts), else the default."""
    if not isinstance(patterns, dict):
        return default
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return float(value)
    return default


def _adapted(adapter: str, module: str, found: dict[str, torch.Tensor], shape: LinearShape,
             config: dict[str, object], max_rank: int, dtype: torch.dtype) -> AdaptedLinear:
    if set(found) != {"A", "B"}:
        missing = "B" if "A" in found else "A"
        raise AdapterError(f"{adapter}: {module} has no lora_{missing} weight")
    a, b = found["A"], found["B"]
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape.in_features or b.shape != (shape.out_features, rank):
        raise AdapterError(f"{adapter}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but this "
                           f"model's linear is {shape.in_features} -> {shape.out_features} (an adapter for "
                           "another base model?)")
    if rank > max_rank:
        raise AdapterError(f"{adapter}: {module} has rank {rank}, over lora.max_rank={max_rank}")
    if rank == 0:
        raise AdapterError(f"{adapter}: {module} has rank 0")
    r = _pattern_value(config.get("rank_pattern"), module, _number(config, "r", rank))
    alpha = _pattern_value(config.get("alpha_pattern"), module, _number(config, "lora_alpha", 8))  # PEFT's default
    if int(r) != rank:
        raise AdapterError(f"{adapter}: {module}'s weights have rank {rank}, its config says r={int(r)}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdaptedLinear(a.float().to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())


def _digest(linears: dict[str, AdaptedLinear]) -> bytes:
    h = hashlib.sha256()
    for module, linear in sorted(linears.items()):
        h.update(module.encode() + b"\0")
        for tensor in (linear.a, linear.b):
            h.update(str(tuple(tensor.shape)).encode())
            h.update(tensor.float().numpy().tobytes())  # the values as run (fp32's bytes as they were)
    return h.digest()[:16]
