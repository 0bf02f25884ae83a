"""Load a local Hugging Face checkpoint directory into a CausalLM.

The model is built on the meta device and the weights are assigned (not copied)
from memory-mapped safetensors; only a dtype or device change makes a copy.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.progress import Progress
from engine.model.config import ModelConfig, load_config
from engine.model.cpu_linear import onednn_bf16_available, packed_linears, use_onednn_linears
from engine.model.linear_calibration import LinearPlan, plan_linears
from engine.model.decoder import CausalLM
from engine.model.errors import CheckpointError, check_tensors
from engine.model.fp8 import dequantize_all, fp8_gemm_absent, fp8_linear_weights, load_note, use_fp8_linears
from engine.model.layers import MRope, Rotary
from engine.model.mtp import MtpPredictor, load_mtp
from engine.model.safetensors_mmap import SafetensorsFile, open_checkpoint_weights
from kernels.select import kernels_for

log = logging.getLogger("ignis.engine")

# The checkpoint's own parts a text decoder does not run: kept beside it, memory-mapped and not copied,
# for what will serve them (the vision tower for images), and named in the load log; never dropped
# silently. The MTP layers (`mtp.*`) are split off the same way, then loaded into their own module.
_SIDE_PARTS = (("vision tower", re.compile(r"^(model\.visual\.|visual\.)")), ("mtp", re.compile(r"^mtp\.")))
_DERIVED = re.compile(r"rotary_emb\.inv_freq$")  # recomputed from the config
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    path: Path
    weights_digest: bytes  # identity of the weights, for the reuse namespace
    files: tuple[SafetensorsFile, ...]  # keeps the memory maps alive
    # The checkpoint's parts text decoding does not run, by part ("vision tower"): name -> tensor.
    side_weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    mtp: MtpPredictor | None = None  # the checkpoint's MTP layers (engine/model/mtp.py), for speculative decoding
    linear_plan: LinearPlan | None = None  # which path runs the CPU linears per row count (None: not packed)


def resolve_dtype(name: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}") from None


def _normalise_names(tensors: dict[str, torch.Tensor], config: ModelConfig, side: dict[str, dict[str, torch.Tensor]]
                     ) -> dict[str, torch.Tensor]:
    """The decoder's tensors under its parameter names (per-expert tensors stacked); the checkpoint's
    other parts go into `side`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        name = _decoder_name(name)
        if _DERIVED.search(name) and not _side_part(name):
            continue
        match = _PER_EXPERT.match(name)
        if match:  # per-expert layout on disk -> the stacked layout the model uses (the MTP layer's too)
            experts.setdefault(match["prefix"], {}).setdefault(match["proj"], {})[int(match["e"])] = tensor
            continue
        out[name] = tensor
    for prefix, projections in experts.items():
        n = config.num_experts
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = projections.get(proj, {})
            missing = [e for e in range(n) if e not in have]
            if missing:
                raise CheckpointError(f"tensor {prefix}.{missing[0]}.{proj}.weight is missing")
        gate = torch.stack([projections["gate_proj"][e] for e in range(n)])
        up = torch.stack([projections["up_proj"][e] for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = torch.stack([projections["down_proj"][e] for e in range(n)])
    for name in list(out):
        part = _side_part(name)
        if part is not None:
            side.setdefault(part, {})[name] = out.pop(name)
    return out


def _side_part(name: str) -> str | None:
    return next((part for part, pattern in _SIDE_PARTS if pattern.search(name)), None)


def _decoder_name(name: str) -> str:
    """A checkpoint tensor's name as the decoder's parameters spell it."""
    if name.startswith("model.language_model."):  # the text model of a multimodal checkpoint
        return "model." + name[len("model.language_model."):]
    return name


WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(checkpoint: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
               onednn_linears: bool = False, weight_dtype: str = "auto", decode_linear: str = "auto") -> LoadedModel:
    """`onednn_linears`: on an fp32 CPU model, run the linear layers on oneDNN (engine.cpu_linear other
    than torch); `decode_linear` (engine.cpu_linear: auto, onednn or c) says which of oneDNN and the C
    kernel runs calls of a decode step's few rows (engine/model/linear_calibration.py).
    `weight_dtype` (engine.weight_dtype): "bfloat16" keeps those layers' weights in bf16 (an fp32
    CPU model on oneDNN only); "auto" or the compute dtype: as loaded."""
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    config = load_config(path)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev, config)
    tensors, digest, files = open_checkpoint_weights(path)
    with torch.device("meta"):
        model = CausalLM(config)
    kept: set[str] = set()  # fp8 weights and their scales, loaded in their own dtypes
    if config.fp8 is not None:  # on CUDA the linears' weights stay fp8, elsewhere all are dequantized (fp8.py)
        absent = fp8_gemm_absent(dev)
        linears = set() if absent else fp8_linear_weights(model)
        tensors, dequantized = dequantize_all(tensors, config.fp8, torch_dtype,
                                              keep=lambda name: _decoder_name(name) in linears)
    side: dict[str, dict[str, torch.Tensor]] = {}
    tensors = _normalise_names(tensors, config, side)
    if config.fp8 is not None:
        kept = use_fp8_linears(model, tensors, config.fp8)
        log.info("%s", load_note(path.name, config.fp8, len(kept) // 2, dequantized, torch_dtype, absent))
        if kept:  # other weights (fp8 through the GEMM, not dequantized) make other state
            digest = hashlib.sha256(digest + b"/fp8-linears=block-gemm").digest()
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if "lm_head.weight" not in tensors and config.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]

    state: dict[str, torch.Tensor] = {}
    converted: dict[int, torch.Tensor] = {}  # tied tensors stay one tensor after conversion
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
    bar = Progress(f"loading {path.name}", total, "B")
    check_tensors(expected, tensors, str(path), config.architecture)
    for name in expected:
        tensor = tensors[name]
        key = id(tensor)
        if key not in converted:
            converted[key] = tensor.to(device=dev, dtype=None if name in kept else torch_dtype)
            bar.advance(tensor.numel() * tensor.element_size())
        state[name] = converted[key]
    bar.close()
    model.load_state_dict(state, assign=True, strict=True)
    mtp = load_mtp(side.pop("mtp", {}), config, dev, torch_dtype, str(path))
    _log_parts(path, config, len(expected), side, mtp)
    model.rotary = Rotary(config, dev)
    if "vision tower" in side:  # images' tokens take M-RoPE's 3-D positions
        model.mrope = MRope.for_model(config, dev)
    model.eval()
    packed = torch_dtype if weight_dtype == "auto" else WEIGHT_DTYPES.get(weight_dtype)
    if packed is None:
        raise ValueError(f"weight_dtype must be auto, {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if packed != torch_dtype:
        if not (onednn_linears and dev.type == "cpu" and torch_dtype == torch.float32):
            raise ValueError(f"weight_dtype {weight_dtype} applies to an fp32 CPU model with engine.cpu_linear=onednn "
                             "(or auto, or c); "
                             "elsewhere set engine.dtype")
        if packed == torch.bfloat16 and not onednn_bf16_available():
            raise ValueError("weight_dtype bfloat16 needs oneDNN's bf16 inner product, which this CPU lacks "
                             "(it needs AVX512 BW/VL/DQ or AVX-NE-CONVERT): set engine.weight_dtype=float32")
        # Other weights make other state: the reuse namespace must tell them apart.
        digest = hashlib.sha256(digest + f"/linear-weights={weight_dtype}".encode()).digest()
    plan = None
    if onednn_linears:
        # copies the linear weights out of the mapped files (cpu_linear.py says why)
        use_onednn_linears(model, packed if packed != torch_dtype else torch.float32)
        if mtp is not None:  # the drafter's layer runs beside the target's every step: on the same linears
            use_onednn_linears(mtp, packed if packed != torch_dtype else torch.float32)
        on_cpu = packed_linears(model) + ([] if mtp is None else packed_linears(mtp))
        if on_cpu:  # none on another device, or in another dtype
            plan = plan_linears(on_cpu, decode_linear, kernels_for(torch.device("cpu")).linear_rows)
    return LoadedModel(model=model, config=config, path=path, weights_digest=digest, files=tuple(files),
                       side_weights=side, mtp=mtp, linear_plan=plan)


def _log_parts(path: Path, config: ModelConfig, decoder_tensors: int, side: dict[str, dict[str, torch.Tensor]],
               mtp: MtpPredictor | None) -> None:
    """One line: what was loaded for text decoding, and what the checkpoint carries that was not."""
    kept = [f"{part} ({len(ts)} tensors, {_mib(ts.values()):.1f} MiB)" for part, ts in sorted(side.items())]
    text = f" (the text model of {config.architecture})" if config.text_architecture != config.architecture else ""
    drafter = "" if mtp is None else (f"; mtp: {len(mtp.layers)} layer(s) loaded into their module "
                                      f"({_mib(mtp.state_dict().values()):.1f} MiB), for speculative decoding")
    log.info("loaded %s: %s%s, %d tensors%s; %s", path.name, config.text_architecture or config.architecture, text,
             decoder_tensors, drafter,
             "kept, not run by text decoding: " + ", ".join(kept) if kept else "nothing else in it")


def _mib(tensors: Iterable[torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20
