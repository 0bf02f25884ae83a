"""Factories for LoRA adapters in PEFT's own format, written by PEFT itself over a tiny checkpoint,
and their oracle: PEFT's merged model in transformers."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from checkpoints import load_hf

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def make_adapter(base: Path, out: Path, rank: int, targets: list[str], seed: int, alpha: int | None = None,
                 rslora: bool = False, std: float = 0.05) -> Path:
    """A random LoRA adapter over checkpoint `base`, saved by PEFT's save_pretrained into `out`: both A and
    B random (PEFT's own init leaves B zero, an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model

    model = load_hf(base)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                        use_rslora=rslora, init_lora_weights=False)
    with peft_quiet():
        peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    with peft_quiet():
        peft_model.save_pretrained(str(out))
    return out


def merged_model(base: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers' model with the adapter merged into its weights by PEFT (the base alone for None)."""
    model = load_hf(base)
    if adapter is None:
        return model
    from peft import PeftModel

    with peft_quiet():
        return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@contextlib.contextmanager
def peft_quiet() -> Iterator[None]:
    """PEFT's warnings, which the suite raises: it asks transformers for `is_gradient_checkpointing`
    (deprecated in transformers 5)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing")
        # an adapter on lm_head of a model with tied embeddings (one ignis refuses: its test makes it)
        warnings.filterwarnings("ignore", category=UserWarning, message=".*tie_word_embeddings")
        warnings.filterwarnings("ignore", category=UserWarning, message=".*save_embedding_layers")
        yield


@torch.inference_mode()
def greedy_with_logprobs(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The oracle's greedy tokens and each one's logprob, recomputing the whole sequence each step."""
    ids = list(prompt)
    out, logprobs = [], []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        out.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return out, logprobs
