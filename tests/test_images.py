"""Prompts with images through the engine, against transformers' Qwen3_5ForConditionalGeneration (the oracle)
on random-weight tiny checkpoints, and their reuse: images are in the key, so the same pictures hit, a
changed, swapped or removed one misses from its first token, and whatever is claimed, the output equals
a cold prefill's."""

from __future__ import annotations

import dataclasses
import io
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from prometheus_client import generate_latest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.chain_hash import MEDIA_KEY_BASE
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.outputs import RequestUpdate
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from engine.vision.media import VisionInput, prepare_prompt
from services import start_tierstore
from test_vision_tower import IMAGE, MAX_PIXELS, MIN_PIXELS, TEXT, VISION, VISION_END, VISION_START, make_tiny_vlm

MiB = 2**20
P = 16  # page size: an image of 20 tokens crosses a page boundary
VOCAB = TEXT["vocab_size"]
SIZES = {"a": (56, 84), "b": (40, 40), "c": (96, 64), "d": (84, 56)}  # (width, height): 20, 9, 24, 24 tokens


@dataclass(frozen=True)
class Vlm:
    loaded: LoadedModel
    tokenizer: Tokenizer
    oracle: tf.Qwen3_5ForConditionalGeneration
    vision: VisionInput


def write_processor(directory: Path) -> None:
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "patch_size": 8,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessor"}))


def build(directory: Path, layer_types: list[str]) -> Vlm:
    from engine.text.tiny_tokenizer import write_tiny_tokenizer
    tiny = make_tiny_vlm(directory, text={"layer_types": layer_types})
    write_processor(directory)
    write_tiny_tokenizer(directory)  # decodes the outputs (ids < 300); prompts here are token ids
    loaded = load_model(directory)
    return Vlm(loaded, Tokenizer.from_dir(directory), tiny.model, VisionInput.of_checkpoint(directory,
                                                                                             loaded.config.raw))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Vlm:
    return build(tmp_path_factory.mktemp("vlm_hybrid"), ["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Vlm:
    return build(tmp_path_factory.mktemp("vlm_dense"), ["full_attention", "full_attention"])


def picture(name: str, seed: int = 0) -> bytes:
    width, height = SIZES[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{seed}".encode()))
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def text(seed: int, n: int) -> list[int]:
    return torch.randint(10, 280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def placeholder() -> list[int]:
    return [VISION_START, IMAGE, VISION_END]


def engine(vlm: Vlm, **config: object) -> EngineCore:
    settings: dict[str, object] = {"page_size": P, "kv_cache_bytes": 8 * MiB, "max_num_seqs": 4,
                                   "prefill_chunk_tokens": 24, **config}  # chunks cut through image spans
    return EngineCore(vlm.loaded, vlm.tokenizer, EngineConfig(**settings))  # type: ignore[arg-type]


def request(vlm: Vlm, rid: str, ids: list[int], images: list[bytes], max_tokens: int = 8) -> EngineRequest:
    widened, media = prepare_prompt(ids, images, vlm.vision)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    return EngineRequest(rid, widened, params, media=media)


@dataclass
class Out:
    tokens: list[int]
    logprobs: list[float]
    cached: int
    images: tuple[int, int]  # (in the prompt, reused: the tower did not run for them)
    tier: str = "none"  # where its reused state came from


def outcome(updates: list[RequestUpdate]) -> Out:
    assert updates[-1].error is None, updates[-1].error
    deltas = [d for u in updates for d in u.deltas]
    usage = updates[-1].usage
    assert usage is not None
    return Out([t for d in deltas for t in d.token_ids], [lp.logprob or 0.0 for d in deltas for lp in d.logprobs],
               usage.cached_tokens, (usage.images, usage.images_reused), usage.reuse.tier.value)


def run(core: EngineCore, *requests: EngineRequest) -> list[Out]:
    """On a started core: the requests together, then the core's books checked."""
    outs = [outcome(u) for u in run_to_completion(core, *requests, timeout=600)]
    core.check_integrity()
    return outs


def oracle(vlm: Vlm, ids: list[int], images: list[bytes], max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers: each step a whole forward of prompt + output."""
    widened, media = prepare_prompt(ids, images, vlm.vision)
    tokens = media.model_ids(widened)
    pixels = torch.cat([span.image.pixel_values for span in media.spans]) if media.spans else None
    grids = torch.tensor([span.image.grid_thw for span in media.spans]) if media.spans else None
    out: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            input_ids = torch.tensor([tokens + out])
            logits = vlm.oracle(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grids,
                                mm_token_type_ids=(input_ids == IMAGE).int()).logits[0, -1].float()
            token = int(logits.argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
    return out, logprobs


def equal(got: Out, want: tuple[list[int], list[float]]) -> None:
    assert got.tokens == want[0]
    assert max(abs(a - b) for a, b in zip(got.logprobs, want[1])) <= 1e-4


CONVERSATIONS = {  # (token ids with one placeholder per image, the images)
    "1 image": (text(1, 5) + placeholder() + text(2, 7), ["a"]),
    "2 images": (text(3, 3) + placeholder() + text(4, 11) + placeholder() + text(5, 4), ["c", "b"]),
    "3 images, one first": (placeholder() + text(6, 9) + placeholder() + placeholder() + text(7, 6), ["b", "d", "a"]),
}


@pytest.mark.parametrize("conversation", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_prompts_with_images_equal_transformers(hybrid: Vlm, conversation: tuple[list[int], list[str]]) -> None:
    ids, names = conversation
    images = [picture(name) for name in names]
    core = engine(hybrid)
    core.start()
    try:
        # alone, then beside a text-only request and another image request in one batch
        alone, = run(core, request(hybrid, "alone", ids, images))
        mixed = run(core, request(hybrid, "text", text(9, 30), []), request(hybrid, "with", ids, images),
                    request(hybrid, "other", CONVERSATIONS["1 image"][0], [picture("a")]))
    finally:
        core.stop()
    want = oracle(hybrid, ids, images)
    equal(alone, want)
    equal(mixed[1], want)
    equal(mixed[2], oracle(hybrid, CONVERSATIONS["1 image"][0], [picture("a")]))


def test_the_key_holds_the_image_not_its_placeholder(hybrid: Vlm) -> None:
    ids = text(1, 4) + placeholder() + text(2, 3)
    a, a_again, b = (prepare_prompt(ids, [picture(n)], hybrid.vision)[0] for n in ("a", "a", "d"))
    span = slice(5, 25)  # 4 text + vision start, then the image's 20 tokens
    assert a == a_again and a[span] != b[span]
    assert all(t >= MEDIA_KEY_BASE for t in a[span]) and a[:5] == b[:5] and a[25:] == b[25:]
    assert len(set(a[span])) == 20  # each position its own key id


def test_an_image_placeholder_typed_as_text_is_refused(hybrid: Vlm) -> None:
    with pytest.raises(ValueError, match="2 image placeholder token.*for 1 image"):
        prepare_prompt(placeholder() + placeholder(), [picture("a")], hybrid.vision)
    with pytest.raises(ValueError, match="image 1: the image is not a PNG"):
        prepare_prompt(placeholder(), [b"GIF89a not a supported image"], hybrid.vision)


def test_turn_two_claims_turn_ones_state_and_equals_cold(hybrid: Vlm) -> None:
    turn1 = text(1, 6) + placeholder() + text(2, 5) + placeholder() + text(3, 4)
    images1 = [picture("a"), picture("c")]
    core = engine(hybrid)
    core.start()
    try:
        first, = run(core, request(hybrid, "t1", turn1, images1))
        turn2 = turn1 + first.tokens + text(4, 5) + placeholder() + text(5, 3)
        images2 = images1 + [picture("b")]
        second, = run(core, request(hybrid, "t2", turn2, images2))
        prompt1 = len(prepare_prompt(turn1, images1, hybrid.vision)[0])
        assert second.cached >= prompt1  # at least turn 1's prompt, with both its images
        encoded = core.runner.encoder.counts.misses if core.runner.encoder else 0
        assert encoded == 3  # turn 2 ran the tower for its new image only
        assert first.images == (2, 0) and second.images == (3, 2)
        # the first image changed: nothing from its first token on is claimed
        changed, = run(core, request(hybrid, "changed", turn2, [picture("d")] + images2[1:]))
        assert changed.cached <= 7  # 6 tokens of text and the vision start at most
        swapped, = run(core, request(hybrid, "swapped", turn2, [images2[1], images2[0], images2[2]]))
        assert swapped.cached <= 7
        # the second image removed: what comes before it may be claimed, nothing from its place on
        removed_ids = turn1[:14] + turn1[17:] + first.tokens + text(4, 5) + placeholder() + text(5, 3)
        removed, = run(core, request(hybrid, "removed", removed_ids, [images2[0], images2[2]]))
        assert removed.cached <= 6 + 1 + 20 + 1 + 5  # the first image and the text after it, at most
    finally:
        core.stop()
    assert second.tokens == oracle(hybrid, turn2, images2)[0]
    equal(changed, oracle(hybrid, turn2, [picture("d")] + images2[1:]))
    equal(swapped, oracle(hybrid, turn2, [images2[1], images2[0], images2[2]]))
    equal(removed, oracle(hybrid, removed_ids, [images2[0], images2[2]]))


def test_an_image_state_in_the_host_block_is_claimed_equal_to_cold(hybrid: Vlm) -> None:
    turn1 = text(1, 6) + placeholder() + text(2, 5)
    images = [picture("a", seed=3)]
    core = engine(hybrid, retained_device=1, retained_host=4)  # captures go to the host block first
    core.start()
    try:
        first, = run(core, request(hybrid, "t1", turn1, images))
        run(core, request(hybrid, "other", text(8, 40), []))
        turn2 = turn1 + first.tokens + text(3, 4) + placeholder() + text(4, 3)
        second, = run(core, request(hybrid, "t2", turn2, images + [picture("b", seed=3)]))
    finally:
        core.stop()
    assert second.tier == "host" and second.images == (2, 1)
    equal(second, oracle(hybrid, turn2, images + [picture("b", seed=3)]))


def test_a_page_boundary_inside_an_image_span_is_claimed_and_the_rest_recomputed(dense: Vlm) -> None:
    """Dense pages are named by the whole image (every key id of its span is drawn from its digest), so a page
    that holds part of the span is claimed where the image is the same, and the rest of the span is
    prefilled from the boundary with the image's embeddings (from the encoder cache)."""
    head = text(1, 3)  # 3 + vision start: the image's 20 tokens span positions 4..23, across the boundary at 16
    a = head + placeholder() + text(2, 12)
    b = head + placeholder() + text(3, 12)  # differs right after the image: the page 16..31 differs
    at_start = text(1, 11) + placeholder() + text(2, 6)  # the image starts at 12, its page [0, 16) differs
    core = engine(dense)
    core.start()
    try:
        run(core, request(dense, "a", a, [picture("a")]))
        got_b, = run(core, request(dense, "b", b, [picture("a")]))
        assert got_b.cached == P  # the page 0..15, with the image's first 12 tokens
        encoder = core.runner.encoder
        assert encoder is not None and (encoder.counts.misses, encoder.counts.hits) == (1, 1)
        assert got_b.images == (1, 1)  # part of its span was prefilled again, from the encoder cache
        scraped = generate_latest(core.metrics.registry).decode()
        assert "ignis_encoder_cache_hits_total 1.0" in scraped and "ignis_encoder_cache_misses_total 1.0" in scraped
        other, = run(core, request(dense, "other image", b, [picture("d")]))
        assert other.cached == 0  # the page holds part of another image: not claimed
        run(core, request(dense, "at start", at_start, [picture("a")]))
        again, = run(core, request(dense, "at start again", at_start[:-6] + text(3, 6), [picture("a")]))
        assert again.cached == 2 * P  # the span (12..31) ends on the boundary: its pages claimed, none of it run
    finally:
        core.stop()
    equal(got_b, oracle(dense, b, [picture("a")]))
    equal(other, oracle(dense, b, [picture("d")]))
    equal(again, oracle(dense, at_start[:-6] + text(3, 6), [picture("a")]))


def test_the_encoder_cache_is_bounded_and_off_at_zero(dense: Vlm) -> None:
    ids = text(1, 3) + placeholder() + text(2, 4)
    core = engine(dense, encoder_cache_bytes=0, reuse_prompt=False)
    core.start()
    try:
        first, = run(core, request(dense, "1", ids, [picture("a")]))
        second, = run(core, request(dense, "2", ids, [picture("a")]))
        encoder = core.runner.encoder
        assert encoder is not None and (encoder.counts.misses, encoder.counts.hits) == (2, 0)
        assert encoder.cached_bytes == 0
    finally:
        core.stop()
    assert first.tokens == second.tokens
    one_image = 20 * TEXT["hidden_size"] * 4  # 20 tokens of fp32 rows
    core = engine(dense, encoder_cache_bytes=one_image + 100, reuse_prompt=False)
    core.start()
    try:
        for k, name in enumerate(["a", "d", "a"]):
            run(core, request(dense, str(k), ids, [picture(name)]))
        encoder = core.runner.encoder
        assert encoder is not None and encoder.cached_bytes <= one_image + 100
        assert encoder.counts.misses == 3  # "d" pushed "a" out
    finally:
        core.stop()


@pytest.mark.parametrize("arena, tier", [(16 * MiB, "ram"), (64 * 1024, "disk")], ids=["ram", "disk"])
def test_an_image_conversation_moved_below_the_device_is_restored_equal_to_cold(hybrid: Vlm, tmp_path: Path,
                                                                                  arena: int, tier: str) -> None:
    """Conversations with screenshots push each other's states off the device (one retained slot) into the
    tierstore's RAM arena, and on to its disk when the arena is small; turn 2 of the first one claims its
    state from there, images and all, and equals a cold prefill."""
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(arena), "--kv-disk-path",
                                              str(tmp_path / "kv-disk"), "--kv-disk-bytes", str(64 * MiB)])
    core = engine(hybrid, tierstore_address=store.address, retained_device=1, tier_timeout=2.0,
                  tier_retry_seconds=0.3)
    core.start()
    conversations = [(text(10 + k, 6) + placeholder() + text(20 + k, 5), [picture("a", seed=k)]) for k in range(6)]
    try:
        firsts = [run(core, request(hybrid, f"c{k}", ids, images))[0] for k, (ids, images) in
                  enumerate(conversations)]
        ids, images = conversations[0]
        turn2 = ids + firsts[0].tokens + text(30, 4) + placeholder() + text(31, 3)
        images2 = images + [picture("b", seed=9)]
        second, = run(core, request(hybrid, "turn 2", turn2, images2))
    finally:
        core.stop()
        store.stop()
    assert second.tier == tier and second.cached >= len(prepare_prompt(ids, images, hybrid.vision)[0])
    assert second.images == (2, 1)
    equal(second, oracle(hybrid, turn2, images2))


def test_salted_tenants_never_share_an_image_state(hybrid: Vlm) -> None:
    ids = text(1, 6) + placeholder() + text(2, 5)
    core = engine(hybrid)
    core.start()
    try:
        def salted(rid: str, salt: str) -> EngineRequest:
            widened, media = prepare_prompt(ids, [picture("a")], hybrid.vision)
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            return EngineRequest(rid, widened, params, cache_salt=salt, media=media)

        run(core, salted("a1", "tenant a"))
        other, = run(core, salted("b1", "tenant b"))
        again, = run(core, salted("a2", "tenant a"))
    finally:
        core.stop()
    assert other.cached == 0 and again.cached > 0
    assert other.images == (1, 0)  # the tower ran for tenant b: the encoder cache is per namespace too


def test_an_image_sent_again_is_known_by_its_bytes_and_its_pixels_made_only_when_asked(dense: Vlm) -> None:
    catalog = dense.vision.catalog
    ids = text(1, 3) + placeholder() + text(2, 4)
    before = catalog.hits
    first = prepare_prompt(ids, [picture("c", seed=5)], dense.vision)[1].spans[0].image
    again = prepare_prompt(ids, [picture("c", seed=5)], dense.vision)[1].spans[0].image
    assert catalog.hits == before + 1
    assert first.pixels is not None and again.pixels is None  # known: not decoded again
    assert (again.digest, again.grid_thw, again.num_tokens) == (first.digest, first.grid_thw, first.num_tokens)
    assert torch.equal(again.pixel_values, first.pixel_values)  # made when the tower needs them
    first.drop_pixels()  # what the encoder does once the tower ran
    assert first.pixels is None and torch.equal(first.pixel_values, again.pixel_values)


def test_images_past_the_context_are_refused_before_their_pixels_are_made(dense: Vlm) -> None:
    small = dataclasses.replace(dense.vision, max_image_tokens=30)
    with pytest.raises(ValueError, match="the images come to 40 tokens, more than this model's context"):
        prepare_prompt(placeholder() + placeholder(), [picture("a", seed=8), picture("d", seed=8)], small)


def test_an_image_known_to_one_tenant_is_prepared_afresh_for_another(dense: Vlm) -> None:
    ids = text(1, 3) + placeholder() + text(2, 4)
    image = picture("b", seed=21)
    mine = prepare_prompt(ids, [image], dense.vision, cache_salt="tenant a")[1].spans[0].image
    again = prepare_prompt(ids, [image], dense.vision, cache_salt="tenant a")[1].spans[0].image
    theirs = prepare_prompt(ids, [image], dense.vision, cache_salt="tenant b")[1].spans[0].image
    assert mine.pixels is not None and again.pixels is None  # known to tenant a
    assert theirs.pixels is not None and theirs.digest == mine.digest  # decoded again for tenant b: same key
