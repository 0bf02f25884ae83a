"""Images in a conversation: a computer-use agent's six turns, two screenshots each, every turn re-sending the
conversation so far. Time to first token per turn, cold, with the encoder cache alone, and with reuse,
against the same conversation with every image's tokens replaced by text (the cost of the images
themselves once their state is reused); the vision tower's time per image; the encoder cache's hit rate.

    python -m bench.media [--hidden 1024 --layers 16] [--turns 6] [--vision-depth 4 --vision-hidden 512]

The checkpoint is the hybrid bench geometry (Qwen3.5's text model) as a Qwen3_5ForConditionalGeneration
with a random vision tower (--vision-depth blocks of --vision-hidden, patch 16, merge 2), scaled down
with the text model: a 1024x768 image through it costs about half the FLOPs of prefilling its 768
tokens (~150 of ~300 GFLOP), as a 24-block, 1024-wide tower (Qwen3-VL-4B's) does beside a 4B text
model (~2.8 of ~6.1 TFLOP). Its time per image is printed; and
Qwen3.5's published image processor (no resize below 16.7M pixels), so a 1024x768 screenshot is 768
tokens. Screenshots are drawn (windows, text lines), each different. TTFT: from the request's arrival
(the images decoded, preprocessed and widened, as the engine's prompt worker does) to its first token.
Rows: "cold" (no reuse, no encoder cache: every image through the tower and every token prefilled),
"encoder cache" (no state reuse; each earlier image's tower output from the cache), "reused" (turn N
claims turn N-1's state: only the new reply, text and screenshots run), "text twin, reused" (the same
token ids with each image span's key ids replaced by text tokens: the same prefill without a tower).
Target: a later turn's reused TTFT within 1.5x of its text twin's.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from bench.geometry import geometry_config
from bench.table import RESULTS, markdown, save
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.chain_hash import MEDIA_KEY_BASE
from engine.model.loader import load_model
from engine.model.openmp import on_own_thread
from engine.model.tiny import default_cache_dir, random_weights
from engine.offline import run_to_completion
from engine.prompt import render_chat
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tiny_tokenizer import VISION_TOKEN_IDS, write_tiny_vision_tokenizer
from engine.text.tokenizer import Tokenizer
from engine.vision.tower import VisionConfig, VisionTower
from ignis.v1 import engine_pb2

SCREEN = (1024, 768)
PROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
             "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "image_processor_type": "Qwen2VLImageProcessor"}  # Qwen3.5's published preprocessor_config.json


def ensure_checkpoint(hidden: int, layers: int, depth: int, vision_hidden: int, root: Path | None) -> Path:
    target = (root or default_cache_dir()) / f"bench-media-h{hidden}-l{layers}-v{depth}x{vision_hidden}"
    if (target / "model.safetensors").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    text = geometry_config("hybrid", hidden, layers)
    text = {**text, "vocab_size": VISION_TOKEN_IDS[-1] + 1,
            # 16 rotary frequencies (head_dim 128, partial 0.25), interleaved t h w as Qwen3.5's [11, 11, 10] of 32
            "rope_parameters": {**text["rope_parameters"], "mrope_section": [6, 5, 5], "mrope_interleaved": True}}
    vision = {"depth": depth, "hidden_size": vision_hidden, "intermediate_size": 4 * vision_hidden,
              "num_heads": max(vision_hidden // 64, 1), "patch_size": 16, "temporal_patch_size": 2,
              "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": hidden, "num_position_embeddings": 2304,
              "hidden_act": "gelu_pytorch_tanh", "model_type": "qwen3_5"}
    image, video, start, end = VISION_TOKEN_IDS
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {k: v for k, v in text.items() if k != "architectures"}, "vision_config": vision,
              "image_token_id": image, "video_token_id": video, "vision_start_token_id": start,
              "vision_end_token_id": end, "tie_word_embeddings": True}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (target / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2))
    write_tiny_vision_tokenizer(target)
    weights = {f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k: v
               for k, v in random_weights(text, seed=7).items()}
    torch.manual_seed(11)
    tower = VisionTower(VisionConfig.from_dict(vision))  # torch's default initialisation: random weights
    weights.update({f"model.visual.{k}": v.contiguous() for k, v in tower.state_dict().items()})
    partial = target / "model.safetensors.partial"
    save_file(weights, str(partial), metadata={"format": "pt"})
    partial.rename(target / "model.safetensors")
    return target


def screenshot(turn: int, which: int) -> bytes:
    """A 1024x768 desktop: a few windows with title bars and lines of text, different for every (turn, which)."""
    rng = random.Random(turn * 100 + which)
    img = Image.new("RGB", SCREEN, tuple(rng.randrange(40, 90) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randrange(2, 5)):
        x, y = rng.randrange(0, 600), rng.randrange(0, 400)
        w, h = rng.randrange(300, 500), rng.randrange(200, 360)
        draw.rectangle((x, y, x + w, y + h), fill=(245, 245, 245), outline=(20, 20, 20))
        draw.rectangle((x, y, x + w, y + 22), fill=tuple(rng.randrange(0, 255) for _ in range(3)))
        for line in range(y + 30, y + h - 12, 14):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 9)))
            draw.text((x + 8, line), words, fill=(10, 10, 10))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


WORDS = ("build", "passed", "error", "src/main.py", "def", "return", "import", "tests", "ok", "failed", "line",
         "click", "Run", "Terminal", "Files", "Edit", "View", "$", "make", "git", "status", "commit")


def conversation(turn: int) -> engine_pb2.ChatInput:
    """Turn `turn`'s request: the system message, each earlier turn's screenshots and reply, then this turn's."""
    chat = engine_pb2.ChatInput()
    chat.messages.add(role="system", content="You operate a computer. Look at the screenshots and say what to do.")
    for k in range(1, turn + 1):
        user = chat.messages.add(role="user")
        user.content_parts.add(type="text", text=f"Step {k}: the editor and the terminal now.")
        for which in range(2):
            user.content_parts.add(type="image", image_data=screenshot(k, which))
        if k < turn:
            chat.messages.add(role="assistant", content=f"Step {k}: I click Run in the terminal and read the "
                                                         f"output of the tests, then edit src/main.py line {10 * k}.")
    return chat


@dataclass
class Turn:
    prompt_tokens: int
    ttft: float  # seconds: preparation (decode, preprocess, widen) + the engine's arrival to first token
    prepare: float
    cached: int


def run_turn(core: EngineCore, tokenizer: Tokenizer, turn: int, twin: bool, tag: str) -> Turn:
    chat = conversation(turn)  # drawn before the clock starts: the client's screenshots
    began = time.perf_counter()
    prompt = render_chat(tokenizer, chat, vision=core.vision)
    media = prompt.media
    ids = prompt.token_ids
    if twin:  # each image's key ids -> text tokens drawn from its key: the same ids every turn, no tower
        ids = tuple(t if t < MEDIA_KEY_BASE else 16 + t % 4000 for t in ids)
        media = None
    prepared = time.perf_counter() - began
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    [updates] = run_to_completion(core, EngineRequest(f"{tag}-{turn}", ids, params, media=media), timeout=1800)
    usage = updates[-1].usage
    if usage is None:
        raise RuntimeError(f"turn {turn} failed: {updates[-1].error}")
    return Turn(len(ids), prepared + usage.time_to_first_token_ms / 1000, prepared, usage.cached_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--vision-hidden", type=int, default=512)
    parser.add_argument("--cache", type=Path, default=None, help="where the checkpoint is written (default: ignis' cache)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    path = ensure_checkpoint(args.hidden, args.layers, args.vision_depth, args.vision_hidden, args.cache)
    tokenizer = Tokenizer.from_dir(path)
    loaded = on_own_thread(lambda: load_model(path, onednn_linears=True))

    def scenario(reuse: bool, encoder_cache: int, twin: bool, tag: str, turns: int = args.turns
                 ) -> tuple[list[Turn], Any]:
        core = on_own_thread(lambda: EngineCore(loaded, tokenizer, EngineConfig(
            page_size=16, kv_cache_bytes=2 << 30, max_num_seqs=4, prefill_chunk_tokens=2048,
            step_time_target_ms=float("inf"), reuse_prompt=reuse, encoder_cache_bytes=encoder_cache)))
        core.start()
        try:
            runs = [run_turn(core, tokenizer, n, twin, tag) for n in range(1, turns + 1)]
            print(tag, [(t.prompt_tokens, round(t.ttft, 2), t.cached) for t in runs], flush=True)
            encoder = core.runner.encoder
            if encoder is None:
                raise RuntimeError(f"{path} has no vision tower")
            return runs, dataclasses.replace(encoder.counts)
        finally:
            core.stop()

    scenario(False, 0, False, "warm", turns=2)  # oneDNN builds its kernels for the prefill shapes once
    cold, cold_counts = scenario(False, 0, False, "cold")
    cached, cache_counts = scenario(False, 1 << 30, False, "encoder-cache")
    reused, _ = scenario(True, 1 << 30, False, "reused")
    twin, _ = scenario(True, 1 << 30, True, "twin")
    tower_ms = 1000 * cold_counts.seconds_encoding / max(cold_counts.misses, 1)
    hit_rate = cache_counts.hits / max(cache_counts.hits + cache_counts.misses, 1)
    rows = [[n + 1, cold[n].prompt_tokens, 2 * (n + 1), cold[n].ttft, cached[n].ttft, reused[n].ttft,
             reused[n].cached, twin[n].ttft, reused[n].ttft / twin[n].ttft, 1000 * reused[n].prepare]
            for n in range(args.turns)]
    table = markdown(["turn", "prompt tokens", "images", "cold TTFT s", "encoder cache TTFT s", "reused TTFT s",
                      "reused tokens", "text twin reused TTFT s", "reused / twin", "images prepared ms"], rows)
    later = [r[8] for r in rows[1:]]
    summary = markdown(["vision tower ms per image (cold run)", "encoder cache hit rate (no state reuse)",
                        "reused / twin, turns 2+ (median)", "reused / twin, turns 2+ (worst)"],
                       [[tower_ms, hit_rate, statistics.median(later) if later else 0.0, max(later, default=0.0)]])
    title = (f"### Images: a {args.turns}-turn computer-use conversation, 2 screenshots ({SCREEN[0]}x{SCREEN[1]}, "
             f"768 tokens each) per turn (hybrid h{args.hidden}/{args.layers} layers, CPU fp32; vision tower "
             f"{args.vision_depth} blocks of {args.vision_hidden})")
    notes = ("TTFT: the images decoded, preprocessed and widened, then the engine's arrival to the first token; one "
             "run each. The text twin is the same token ids with each image's span as text tokens (the prefill "
             "without a tower). Target: reused / twin <= 1.5 from turn 2 on.")
    text = title + "\n\n" + table + "\n\n" + summary + "\n\n" + notes
    print(text)
    save("media", {"cold": [vars(t) for t in cold], "encoder_cache": [vars(t) for t in cached],
                   "reused": [vars(t) for t in reused], "twin": [vars(t) for t in twin], "tower_ms": tower_ms,
                   "hit_rate": hit_rate, "args": {k: str(v) for k, v in vars(args).items()}}, text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
