"""engine/vision against transformers' Qwen3.5 (the oracle) on a random-weight tiny checkpoint: the vision
tower, the M-RoPE positions and cos/sin of prompts with images, image preprocessing and decoding."""

from __future__ import annotations

import io
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from safetensors.torch import load_file

from engine.model.config import parse_config
from engine.model.layers import MRope, Rotary, mrope_section_of
from engine.model.loader import load_model
from engine.vision.positions import mrope_positions
from engine.vision.preprocess import (ProcessorSettings, decode_image, load_processor_settings,
                                      preprocess_images)
from engine.vision.tower import VisionConfig, VisionTower

IMAGE, VIDEO, VISION_START, VISION_END = 290, 291, 292, 293  # token ids in the tiny vocabulary
MERGE = 2
# Depth 2; a 6x6 learned position table, so grids both larger and smaller than it are resampled.
VISION: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                              temporal_patch_size=2, spatial_merge_size=MERGE, in_channels=3, out_hidden_size=64,
                              num_position_embeddings=36)
# 8 rotary frequencies, interleaved t h w t h w t h as Qwen3.5's [11, 11, 10] over 32.
TEXT: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                         mrope_section=[3, 3, 2], mrope_interleaved=True))
# Processor settings for 56x84 pictures: factor 16 (patch 8 x merge 2), so 64x80 -> grid (1, 8, 10).
MIN_PIXELS, MAX_PIXELS = 1024, 10240


@dataclass(frozen=True)
class Tiny:
    path: Path
    model: tf.Qwen3_5ForConditionalGeneration
    weights: dict[str, torch.Tensor]  # the checkpoint's vision tensors, as named on disk


def make_tiny_vlm(directory: Path, seed: int = 0, text: dict[str, Any] | None = None,
                  special: tuple[int, int, int, int] = (IMAGE, VIDEO, VISION_START, VISION_END)) -> Tiny:
    """`text`: settings over TEXT's (e.g. another `layer_types`); `special`: the image, video, vision start and
    vision end token ids."""
    image, video, start, end = special
    config = tf.Qwen3_5Config(text_config={**TEXT, **(text or {})}, vision_config=VISION, image_token_id=image,
                              video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms off identity, biases off zero
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory)
    weights = {}
    for shard in sorted(directory.glob("*.safetensors")):
        weights.update({k: v for k, v in load_file(shard).items() if k.startswith("model.visual.")})
    return Tiny(directory, model, weights)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return make_tiny_vlm(tmp_path_factory.mktemp("qwen3_5_vlm"))


@pytest.fixture(scope="module")
def tower(tiny: Tiny) -> VisionTower:
    return VisionTower.from_weights(VISION, tiny.weights)


def hf_image_embeds(tiny: Tiny, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(tiny.model.model.get_image_features(pixel_values, grid_thw).pooler_output)


# --- the tower ---------------------------------------------------------------------------------------------

GRIDS = {  # several images of different sizes in one call; a 2-frame grid attends per frame
    "1 image": [(1, 8, 10)],
    "2 images": [(1, 8, 10), (1, 4, 6)],
    "3 images": [(1, 12, 4), (1, 2, 2), (1, 6, 14)],
    "2 frames": [(2, 4, 4), (1, 6, 6)],
}


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_the_tower_equals_transformers_image_features(tiny: Tiny, tower: VisionTower,
                                                      grids: list[tuple[int, int, int]]) -> None:
    grid_thw = torch.tensor(grids)
    torch.manual_seed(1)
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), tower.config.patch_dim)
    expected = hf_image_embeds(tiny, pixel_values, grid_thw)
    with torch.no_grad():
        got = tower(pixel_values, grid_thw)
    assert got.shape == (sum(e.shape[0] for e in expected), TEXT["hidden_size"])
    for image, want in zip(got.split([e.shape[0] for e in expected]), expected):
        assert (image - want).abs().max().item() <= 1e-5


def test_the_tower_loads_from_the_loaders_side_weights_and_either_prefix(tiny: Tiny) -> None:
    side = load_model(tiny.path).side_weights["vision tower"]
    assert set(side) == set(tiny.weights)
    grid_thw = torch.tensor([[1, 4, 6]])
    pixel_values = torch.randn(24, VisionConfig.from_dict(VISION).patch_dim)
    want = hf_image_embeds(tiny, pixel_values, grid_thw)[0]
    bare = {name.removeprefix("model."): t for name, t in tiny.weights.items()}  # "visual.*"
    for weights in (side, bare):
        with torch.no_grad():
            got = VisionTower.from_weights(VISION, weights)(pixel_values, grid_thw)
        assert (got - want).abs().max().item() <= 1e-5


def test_a_missing_extra_or_misshapen_tensor_is_named(tiny: Tiny) -> None:
    missing = {k: v for k, v in tiny.weights.items() if k != "model.visual.blocks.1.attn.qkv.bias"}
    with pytest.raises(ValueError, match=r"'blocks\.1\.attn\.qkv\.bias' is missing"):
        VisionTower.from_weights(VISION, missing)
    extra = {**tiny.weights, "model.visual.deepstack_merger_list.0.norm.weight": torch.zeros(128)}
    with pytest.raises(ValueError, match=r"'deepstack_merger_list\.0\.norm\.weight' is not used"):
        VisionTower.from_weights(VISION, extra)
    stray = {**tiny.weights, "model.language_model.norm.weight": torch.zeros(64)}
    with pytest.raises(ValueError, match=r"'model\.language_model\.norm\.weight' is not under"):
        VisionTower.from_weights(VISION, stray)
    with pytest.raises(ValueError, match=r"'pos_embed\.weight' has shape \[36, 32\]"):
        VisionTower.from_weights({**VISION, "num_position_embeddings": 49}, tiny.weights)


def test_pixel_values_that_do_not_fit_the_grid_are_refused(tower: VisionTower) -> None:
    with pytest.raises(ValueError, match="needs"):
        tower(torch.zeros(10, tower.config.patch_dim), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        tower(torch.zeros(15, tower.config.patch_dim), torch.tensor([[1, 3, 5]]))


# --- M-RoPE positions and cos/sin ----------------------------------------------------------------------------

Part = int | tuple[int, int, int]  # text tokens, or an image's grid


def prompt(parts: list[Part]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Tokens from parts: an int is that many text tokens, a grid is an image span as the chat template
    writes it (vision start, its placeholders, vision end)."""
    rng = np.random.default_rng(len(parts))
    tokens: list[int] = []
    grids = []
    for part in parts:
        if isinstance(part, int):
            tokens += rng.integers(0, 280, part).tolist()
        else:
            t, h, w = part
            tokens += [VISION_START] + [IMAGE] * (t * h * w // MERGE ** 2) + [VISION_END]
            grids.append(part)
    return tokens, grids


PROMPTS: dict[str, list[Part]] = {
    "text only": [9],
    "image first": [(1, 8, 10), 5],
    "text, image, text": [4, (1, 4, 6), 3],
    "two images between text": [3, (1, 8, 10), 2, (1, 12, 4), 6],
    "three images, adjacent, last at the end": [2, (1, 4, 6), (1, 6, 14), 3, (1, 2, 2)],
    "a grid of two frames": [3, (2, 4, 6), 2],
}


def hf_rope_index(tiny: Tiny, tokens: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    ids = torch.tensor([tokens])
    pos, delta = tiny.model.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(),
                                                 image_grid_thw=torch.tensor(grids) if grids else None)
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("parts", PROMPTS.values(), ids=PROMPTS.keys())
def test_positions_equal_transformers_get_rope_index(tiny: Tiny, parts: list[Part]) -> None:
    tokens, grids = prompt(parts)
    got = mrope_positions(tokens, grids, image_token_id=IMAGE, spatial_merge_size=MERGE,
                          vision_start_token_id=VISION_START)
    want, delta = hf_rope_index(tiny, tokens, grids)
    assert got.positions.dtype == torch.int64 and torch.equal(got.positions, want)
    assert got.rope_delta == delta
    if not grids:
        assert torch.equal(got.positions, torch.arange(len(tokens)).expand(3, -1)) and delta == 0


def test_positions_after_the_prompt_continue_as_transformers_decodes(tiny: Tiny) -> None:
    tokens, grids = prompt(PROMPTS["two images between text"])
    ids = torch.tensor([tokens])
    model = tiny.model.model
    model.rope_deltas = None
    embeds = torch.zeros(1, len(tokens), TEXT["hidden_size"])
    model.compute_3d_position_ids(ids, embeds, image_grid_thw=torch.tensor(grids),
                                  mm_token_type_ids=(ids == IMAGE).int())  # keeps the prompt's delta

    class Cache:  # what compute_3d_position_ids asks a cache: how many tokens it holds
        def get_seq_length(self) -> int:
            return len(tokens)

    want = model.compute_3d_position_ids(None, torch.zeros(1, 4, TEXT["hidden_size"]), cache=Cache())
    delta = mrope_positions(tokens, grids, image_token_id=IMAGE, spatial_merge_size=MERGE).rope_delta
    # past the prompt the engine adds rope_delta to a token's index on all three axes
    after = torch.arange(len(tokens) + delta, len(tokens) + delta + 4, dtype=torch.int64).expand(3, -1)
    assert torch.equal(after, want[:, 0])
    model.rope_deltas = None


def test_prompts_that_disagree_with_their_images_are_refused() -> None:
    tokens, grids = prompt([3, (1, 4, 6), 2])
    with pytest.raises(ValueError, match="has 6 tokens but its grid"):
        mrope_positions(tokens, [(1, 4, 8)], image_token_id=IMAGE, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match="has no image"):
        mrope_positions(tokens, [], image_token_id=IMAGE, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match="2 image"):
        mrope_positions(tokens, grids * 2, image_token_id=IMAGE, spatial_merge_size=MERGE)
    bare = [t for t in tokens if t != VISION_START]  # placeholders a user typed, with no image span around
    with pytest.raises(ValueError, match="does not follow the vision start token"):
        mrope_positions(bare, grids, image_token_id=IMAGE, spatial_merge_size=MERGE,
                        vision_start_token_id=VISION_START)


def published_geometry() -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3.5's text rope as published (head dim 256, a quarter rotary, [11, 11, 10], theta 1e7)."""
    text = {**TEXT, "head_dim": 256, "rope_parameters": dict(
        rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
        mrope_interleaved=True)}
    return text, tf.Qwen3_5Config(text_config=text, vision_config=VISION).to_dict()


@pytest.mark.parametrize("geometry", ["tiny", "published"])
@pytest.mark.parametrize("parts", PROMPTS.values(), ids=PROMPTS.keys())
def test_mrope_cos_sin_equal_transformers_rotary(tiny: Tiny, parts: list[Part], geometry: str) -> None:
    if geometry == "tiny":
        raw = json.loads((tiny.path / "config.json").read_text())
    else:
        raw = {**published_geometry()[1], "architectures": ["Qwen3_5ForConditionalGeneration"]}
    config = parse_config(raw)
    hf_rotary = tf.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(
        tf.Qwen3_5TextConfig(**raw["text_config"]))
    tokens, grids = prompt(parts)
    positions = mrope_positions(tokens, grids, image_token_id=IMAGE, spatial_merge_size=MERGE).positions
    mrope = MRope.for_model(config, torch.device("cpu"))
    cos, sin = mrope.cos_sin(positions, torch.float32)
    want_cos, want_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    if not grids:  # text alone: the plain 1-D rotary ignis runs today
        plain = Rotary(config, torch.device("cpu")).cos_sin(positions[0], torch.float32)
        assert torch.equal(cos, plain[0]) and torch.equal(sin, plain[1])


def test_mrope_settings_are_checked() -> None:
    assert mrope_section_of({"rope_parameters": {"mrope_section": [11, 11, 10]}}) == (11, 11, 10)
    with pytest.raises(ValueError, match="mrope_interleaved is false"):
        mrope_section_of({"rope_parameters": {"mrope_section": [11, 11, 10], "mrope_interleaved": False}})
    with pytest.raises(ValueError, match="does not fit 8 rotary frequencies"):
        MRope(torch.ones(8), 1.0, (2, 4, 2))


# --- preprocessing -------------------------------------------------------------------------------------------

def picture(seed: int = 0, size: tuple[int, int] = (84, 56)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def encode(img: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def settings(tiny: Tiny) -> ProcessorSettings:
    return load_processor_settings(tiny.path, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def test_settings_default_to_qwen3_5s_processor_with_the_towers_patches(tiny: Tiny, settings: ProcessorSettings,
                                                                        tmp_path: Path) -> None:
    # No preprocessor_config.json: Qwen3.5's published processor, patches from vision_config.
    assert (settings.patch_size, settings.temporal_patch_size, settings.merge_size) == (8, 2, 2)
    assert settings.image_mean == settings.image_std == (0.5, 0.5, 0.5)
    assert (settings.min_pixels, settings.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    assert load_processor_settings(tiny.path).max_pixels == 16777216
    # A preprocessor_config.json as published (the fast class named), read by transformers.
    (tmp_path / "config.json").write_text((tiny.path / "config.json").read_text())
    published = {"size": {"longest_edge": 20000, "shortest_edge": 2048}, "patch_size": 8, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                 "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(published))
    read = load_processor_settings(tmp_path, max_pixels=MAX_PIXELS)
    assert (read.min_pixels, read.max_pixels, read.patch_size) == (2048, MAX_PIXELS, 8)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**published, "patch_size": 14}))
    with pytest.raises(ValueError, match="patch_size 14 differs from config.json's vision_config patch_size 8"):
        load_processor_settings(tmp_path)


def test_the_same_pixels_in_png_and_lossless_webp_share_a_digest(settings: ProcessorSettings) -> None:
    img = picture()
    png = decode_image(encode(img, "PNG"), 1 << 20)
    webp = decode_image(encode(img, "WEBP", lossless=True), 1 << 20)
    assert np.array_equal(np.asarray(png), np.asarray(webp))
    a, b = preprocess_images([png, webp], settings)
    assert a.digest == b.digest and len(a.digest) == 16 and torch.equal(a.pixel_values, b.pixel_values)
    # One pixel changed visibly. (A change of one level can round away in the resize: then the tower's input,
    # hence its output, is the same, and so, rightly, is the digest.)
    changed = np.asarray(img).copy()
    changed[10, 20] = 255 - changed[10, 20]
    (c,) = preprocess_images([Image.fromarray(changed)], settings)
    assert not torch.equal(c.pixel_values, a.pixel_values) and c.digest != a.digest


def test_another_max_pixels_gives_another_digest(tiny: Tiny, settings: ProcessorSettings) -> None:
    img = picture()
    (base,) = preprocess_images([img], settings)
    (same_pixels,) = preprocess_images([img], load_processor_settings(tiny.path, min_pixels=MIN_PIXELS,
                                                                      max_pixels=2 * MAX_PIXELS))
    assert same_pixels.grid_thw == base.grid_thw and torch.equal(same_pixels.pixel_values, base.pixel_values)
    assert same_pixels.digest != base.digest  # the settings that shaped the pixels are part of their identity
    (smaller,) = preprocess_images([img], load_processor_settings(tiny.path, min_pixels=MIN_PIXELS, max_pixels=4096))
    assert smaller.grid_thw == (1, 6, 8) and smaller.digest != base.digest


def test_prepared_images_run_through_transformers_with_their_placeholder_counts(
        tiny: Tiny, tower: VisionTower, settings: ProcessorSettings) -> None:
    images = preprocess_images([picture(1), picture(2, (40, 100)), picture(3, (120, 40))], settings)
    for p in images:  # the processor's output fits the tower it feeds
        t, h, w = p.grid_thw
        assert p.num_tokens == t * h * w // MERGE ** 2
        assert p.pixel_values.shape == (t * h * w, VisionConfig.from_dict(VISION).patch_dim)
    tokens, grids = prompt([3, images[0].grid_thw, 2, images[1].grid_thw, images[2].grid_thw, 4])
    pixel_values = torch.cat([p.pixel_values for p in images])
    grid_thw = torch.tensor(grids)
    ids = torch.tensor([tokens])
    with torch.no_grad():  # transformers checks the placeholder count against the features it computes
        tiny.model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid_thw,
                   mm_token_type_ids=(ids == IMAGE).int())
        got = tower(pixel_values, grid_thw)
    tiny.model.model.rope_deltas = None
    assert got.shape[0] == sum(p.num_tokens for p in images)
    want_embeds = torch.cat(hf_image_embeds(tiny, pixel_values, grid_thw))
    assert (got - want_embeds).abs().max().item() <= 1e-5
    positions = mrope_positions(tokens, grids, image_token_id=IMAGE, spatial_merge_size=MERGE,
                                vision_start_token_id=VISION_START).positions
    assert torch.equal(positions, hf_rope_index(tiny, tokens, grids)[0])


# --- decoding ------------------------------------------------------------------------------------------------

def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels and holds none: only its header is ever read."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_decode_gives_rgb_with_transparency_on_white() -> None:
    jpeg = decode_image(encode(picture(), "JPEG"), 1 << 20)
    assert jpeg.mode == "RGB" and jpeg.size == (84, 56)
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 3] = 0  # fully transparent black
    rgba[0, 0] = (10, 20, 30, 255)
    img = decode_image(encode(Image.fromarray(rgba, "RGBA"), "PNG"), 1 << 20)
    assert img.mode == "RGB" and np.asarray(img)[1, 1].tolist() == [255, 255, 255]
    assert np.asarray(img)[0, 0].tolist() == [10, 20, 30]


def test_decode_refuses_bad_data_with_a_clear_value_error() -> None:
    png = encode(picture(), "PNG")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        decode_image(png[:len(png) // 2], 1 << 20)
    with pytest.raises(ValueError, match="not a PNG, JPEG or WebP"):
        decode_image(np.random.default_rng(0).bytes(4000), 1 << 20)
    with pytest.raises(ValueError, match="not a PNG, JPEG or WebP"):
        decode_image(encode(picture(), "GIF"), 1 << 20)  # a real image, not an accepted format
    with pytest.raises(ValueError, match="over the limit of 1000"):
        decode_image(png, 1000)
    with pytest.raises(ValueError, match=r"84x56 pixels, over the limit of 4000"):
        decode_image(png, 1 << 20, max_image_pixels=4000)
    with pytest.raises(ValueError, match=r"9000x9000 pixels, over the limit"):
        decode_image(png_header(9000, 9000), 1 << 20)  # over ours, under Pillow's own limit
    with pytest.raises(ValueError, match="too large to decode"):
        decode_image(png_header(100_000, 100_000), 1 << 20, max_image_pixels=10**11)  # Pillow's bomb check


def test_preprocess_refuses_what_the_processor_cannot_take(settings: ProcessorSettings) -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        preprocess_images([picture(size=(402, 2))], settings)
