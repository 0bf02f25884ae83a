"""A trained MTP layer for a benchmark checkpoint: the checkpoint plus `model-mtp.safetensors`, cached.

    python -m bench.mtp_training [--kind hybrid] [--hidden 1024] [--layers 16] [--seconds 90]

Benchmark checkpoints have random weights (bench/geometry.py), and a random MTP layer drafts tokens the
target never picks: speculative.method=mtp would accept nothing and measure only its cost. So the layer
is trained, for a bounded wall time, on what it will be asked in the benchmark: the target's own greedy
outputs. It is the layer engine/model/mtp.py defines (as vLLM and SGLang run it): at position j,
fc(cat(norm_e(embed(t[j+1])), norm_h(h[j]))) -> one full-attention decoder layer of the family ->
norm -> the target's lm_head gives t[j+2], with h the target's final normed hidden state. It is built
here from transformers' modules (as tests/test_mtp_drafter.py's float64 reference is); embed_tokens
and lm_head are the target's, frozen. The held-out top-1 accuracy of t[j+2] on generated positions
is the proxy for the acceptance of the first draft.

The result lives beside the base checkpoint in the model cache, `bench-{kind}-h{hidden}-l{layers}-mtp/`:
the base's files symlinked (they are GBs), the trained shard, and `mtp-training.json` (what was
trained, on what base); a directory whose json names the same base and seconds is reused as is.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from torch import nn

from bench.drive import random_prompt, run
from bench.geometry import ensure_geometry, per_expert
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import load_model
from engine.model.openmp import on_own_thread
from engine.model.tiny import default_cache_dir
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer

SHARD = "model-mtp.safetensors"
SUMMARY = "mtp-training.json"
VERSION = 1  # bump when the data, the layer or the training changes, so cached layers are trained again
PROMPT, OUTPUT = 64, 192  # tokens of each random prompt, greedy tokens generated after it
TRAIN, HELD_OUT = 32, 8  # sequences
BATCH, LR, WARMUP = 4, 3e-3, 10  # sequences a step, AdamW's rate, steps of linear warmup


@dataclass(frozen=True, slots=True)
class Summary:
    version: int
    seconds: float  # the training budget asked for (wall time)
    steps: int
    sequences: int
    final_train_loss: float  # mean squared error to the target's next hidden state, last 10 steps
    held_out_accuracy: float  # top-1 of t[j+2] at the held-out sequences' generated positions
    held_out_positions: int
    base: dict[str, list[int]]  # the base checkpoint's files: name -> [size, mtime_ns]


def base_identity(base: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(base.iterdir()) if p.is_file()}


def greedy_sequences(base: Path, count: int) -> torch.Tensor:
    """`count` random prompts and the target's greedy continuations, by ignis' engine (far faster than
    transformers' generate on a CPU): [count, PROMPT + OUTPUT]."""
    loaded = on_own_thread(lambda: load_model(base, onednn_linears=True))
    core = on_own_thread(lambda: EngineCore(loaded, Tokenizer.from_dir(base), EngineConfig(
        page_size=16, kv_cache_bytes=1 << 30, max_num_seqs=count, reuse_prompt=False)))  # one wave
    core.start()
    try:
        prompts = [random_prompt(PROMPT, 5000 + i) for i in range(count)]
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
        outs = run(core, *(EngineRequest(f"mtp-{i}", p, params, lookup=False) for i, p in enumerate(prompts)))
    finally:
        core.stop()
    return torch.tensor([[*p, *out] for p, (out, _) in zip(prompts, outs)])


class MtpLayer(nn.Module):
    """The MTP layer on transformers' modules; `hf` (the target) lends its embedding, rotary and lm_head."""

    def __init__(self, hf: Any) -> None:  # a transformers *ForCausalLM (families differ)
        super().__init__()
        config = copy.deepcopy(hf.config)
        config.layer_types = ["full_attention"] * config.num_hidden_layers  # the family's attention layer
        hidden, eps = config.hidden_size, config.rms_norm_eps
        norm = type(hf.model.norm)  # zero-centred (Qwen3.5: starts at 0) or plain (Qwen3: starts at 1)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (norm(hidden, eps=eps) for _ in range(3))
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = type(hf.model.layers[0])(config, 0)
        # Random init (std 0.02), not the target's last full-attention layer: no better on held-out data
        # (dense h256 l4, 300 steps: 2.0% random, 1.2% copied; hybrid, 200 steps: 0.3% both).
        for p in [self.fc.weight, *self.layer.parameters()]:
            if p.dim() > 1:  # matrices and stacked experts; norms keep their neutral start
                nn.init.normal_(p, std=0.02)
        # Tuples: the target's modules are used, not registered (not trained, not in state_dict()).
        self.embed, self.rotary, self.lm_head = (hf.model.embed_tokens,), (hf.model.rotary_emb,), (hf.lm_head,)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The normed output at positions j = 0 .. S-3 (what lm_head reads for t[j+2]): [B, S-2, H], from
        tokens [B, S] and the target's hidden states there [B, S, H]."""
        e = self.embed[0](tokens[:, 1:-1])  # t[j+1]: [B, T, H], T = S-2
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden[:, :-2])], dim=-1))
        T = x.shape[1]
        positions = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)[None, None]  # causal: [1, 1, T, T]
        out = self.layer(x, position_embeddings=self.rotary[0](x, positions), attention_mask=mask,
                         position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        normed: torch.Tensor = self.norm(out)
        return normed

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """`mtp.*` as ignis' MtpPredictor names them, experts one tensor each (tests/checkpoints.py)."""
        state = {f"mtp.{k}": v.detach().clone().contiguous() for k, v in self.state_dict().items()}
        return per_expert({k.replace("mtp.layer.", "mtp.layers.0.", 1): v for k, v in state.items()})


@torch.no_grad()
def target_hidden(hf: Any, tokens: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """The target's final normed hidden states of whole sequences: [N, S, H]."""
    return torch.cat([hf.model(input_ids=tokens[i:i + chunk], use_cache=False).last_hidden_state
                      for i in range(0, len(tokens), chunk)])


@torch.no_grad()
def accuracy(layer: MtpLayer, tokens: torch.Tensor, hidden: torch.Tensor) -> float:
    """Top-1 of t[j+2] where the target generated it (j+2 >= PROMPT): the first draft's acceptance."""
    hits = layer.lm_head[0](layer(tokens, hidden)[:, PROMPT - 2:]).argmax(-1) == tokens[:, PROMPT:]
    return float(hits.float().mean())


def train(layer: MtpLayer, tokens: torch.Tensor, hidden: torch.Tensor, seconds: float) -> tuple[int, float]:
    """AdamW on shuffled batches until `seconds` of wall time: (steps, mean loss of the last 10).

    The loss is the distance of the layer's normed output at j to the target's hidden state at j+1, which
    lm_head turns into t[j+2]: H numbers a position, not one label (dense h256 l4, 60 s: held-out 0.8%
    against 0.1% with cross-entropy on t[j+2], 0.3% with KL to the target's distribution). Every position
    counts, the prompt's too: teacher-forced, the target's next hidden state is as right a label there
    (all 1.2%, generated only 1.0%, 120 s)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    gen = torch.Generator().manual_seed(0)
    losses: list[float] = []
    deadline = time.monotonic() + seconds
    order = torch.empty(0, dtype=torch.long)
    while time.monotonic() < deadline:
        if len(order) < BATCH:
            order = torch.randperm(len(tokens), generator=gen)
        pick, order = order[:BATCH], order[BATCH:]
        loss = nn.functional.mse_loss(layer(tokens[pick], hidden[pick]), hidden[pick, 1:-1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    tail = losses[-10:]
    return len(losses), sum(tail) / max(len(tail), 1)


def load_target(base: Path) -> Any:
    arch = json.loads((base / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, arch).from_pretrained(base, dtype=torch.float32).eval()
    hf.requires_grad_(False)  # embed_tokens and lm_head (tied) stay the target's
    return hf


def ensure_trained_mtp(kind: str, hidden: int = 1024, layers: int = 16, seconds: float = 90.0) -> Path:
    base = ensure_geometry(kind, hidden, layers)
    target = default_cache_dir() / f"{base.name}-mtp"
    identity = base_identity(base)
    if (target / SUMMARY).is_file():
        done = json.loads((target / SUMMARY).read_text())
        if (done.get("version"), done.get("base"), done.get("seconds")) == (VERSION, identity, seconds):
            _stated_config(base, target)  # a directory made before the config said so
            return target
    tokens = greedy_sequences(base, TRAIN + HELD_OUT)
    hf = load_target(base)
    states = target_hidden(hf, tokens)
    torch.manual_seed(0)
    layer = MtpLayer(hf)
    steps, loss = train(layer, tokens[:TRAIN], states[:TRAIN], seconds)
    held_out = accuracy(layer, tokens[TRAIN:], states[TRAIN:])
    summary = Summary(VERSION, seconds, steps, TRAIN, loss, held_out, HELD_OUT * OUTPUT, identity)
    write(base, target, layer.checkpoint_tensors(), summary)
    return target


def write(base: Path, target: Path, tensors: dict[str, torch.Tensor], summary: Summary) -> None:
    """Build the directory beside `target` and rename it into place, so a half-written one is never seen."""
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _fill(base, building, tensors, summary)
    except BaseException:
        shutil.rmtree(building)
        raise
    building.chmod(0o755)  # mkdtemp's 0700 otherwise
    if target.exists():
        shutil.rmtree(target)  # stale (another base or budget); rmtree removes links, not what they name
    building.rename(target)


def _stated_config(base: Path, directory: Path) -> None:
    """config.json as published checkpoints with an MTP layer have it: `mtp_num_hidden_layers` stated
    (llama.cpp's converter keeps the layer only when it is)."""
    config = json.loads((base / "config.json").read_text())
    stated = directory / "config.json"  # none yet in a directory being built
    if stated.is_file() and not stated.is_symlink() \
            and json.loads(stated.read_text()).get("mtp_num_hidden_layers") == 1:
        return
    config["mtp_num_hidden_layers"] = 1
    stated.unlink(missing_ok=True)
    stated.write_text(json.dumps(config, indent=2))


def _fill(base: Path, building: Path, tensors: dict[str, torch.Tensor], summary: Summary) -> None:
    for p in base.iterdir():
        if p.name not in ("model.safetensors.index.json", "config.json"):
            (building / p.name).symlink_to(p.resolve())
    _stated_config(base, building)
    save_file(tensors, str(building / SHARD), metadata={"format": "pt"})
    index_path = base / "model.safetensors.index.json"
    if index_path.is_file():  # a sharded base names the new shard's tensors in its index
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: SHARD for name in tensors})
        (building / index_path.name).write_text(json.dumps(index, indent=2))
    (building / SUMMARY).write_text(json.dumps(dataclasses.asdict(summary), indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="hybrid", choices=("dense", "hybrid", "moe"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=90.0)
    a = parser.parse_args()
    path = ensure_trained_mtp(a.kind, a.hidden, a.layers, a.seconds)
    summary: dict[str, Any] = json.loads((path / SUMMARY).read_text())
    print(json.dumps({"path": str(path), **summary}, indent=2))


if __name__ == "__main__":
    main()
