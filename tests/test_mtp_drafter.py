"""Drafting with the checkpoint's MTP layer (issue 44): the layer against a float64 reference written from its
definition, its window in the sequence's pages, and speculative decoding with it equal to plain decoding.

The reference is the published layer's structure: fc(cat(norm_e(embed(t[j+1])), norm_h(h[j]))) -> one
full-attention decoder layer of the family (transformers' own class, in float64, causal over the MTP
positions) -> norm -> the target's lm_head, with h the target's final normed hidden state (transformers'
`last_hidden_state`) and, for each draft past the first, the layer's own normed output at the position
before. The engine's MTP forwards are watched (a spy that records what the real method returns) and
their logits compared, so a near tie between two tokens cannot make the test flaky.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import load_hf, make_checkpoint, with_mtp_layer
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import LoadedModel, load_model
from engine.outputs import RequestUpdate, Usage
from engine.text.tokenizer import Tokenizer
from test_speculative import engine_for, greedy, plain_run, prompts, run, same_as_plain

P = 16
MiB = 1 << 20


@pytest.fixture(scope="module", params=["dense", "hybrid", "moe-hybrid", "recurrent"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def mtp_dir(kind: str, tiny_model_dir: Path, dense_chat_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

    if kind == "dense":
        base = dense_chat_model_dir
    elif kind == "hybrid":
        base = tiny_model_dir
    else:
        arch, extra = (("Qwen3NextForCausalLM-moe", {}) if kind == "moe-hybrid" else
                       ("Qwen3_5ForCausalLM", {"layer_types": ["linear_attention"] * 4}))
        base = make_checkpoint(tmp_path_factory.mktemp(kind), arch, seed=5, vocab_size=TINY_VOCAB_SIZE,
                               **extra)  # type: ignore[arg-type]
        write_tiny_tokenizer(base)
    return with_mtp_layer(base, tmp_path_factory.mktemp(f"{kind}-mtp") / "ckpt", seed=3, std=0.2)


@pytest.fixture(scope="module")
def mtp_model(mtp_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(mtp_dir), Tokenizer.from_dir(mtp_dir)


# --- the float64 reference ---------------------------------------------------------------------------
class Reference:
    """The MTP layer from its definition, in float64, on transformers' modules and the checkpoint's tensors."""

    def __init__(self, path: Path) -> None:
        self.hf = hf = cast(Any, load_hf(path, torch.float64))  # transformers' modules, untyped
        hf.config._experts_implementation = "eager"  # the grouped GEMM takes no float64: each expert on its own
        mtp = {k.removeprefix("mtp."): v.double() for k, v in load_file(str(path / "model-mtp.safetensors")).items()}
        config = copy.deepcopy(hf.config)  # the family's full-attention decoder layer (a recurrent model has none)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        self.layer = type(hf.model.layers[0])(config, 0).double().eval()
        loaded_mtp = load_model(path).mtp
        assert loaded_mtp is not None
        stacked = {k.removeprefix("layers.0."): v for k, v in loaded_mtp.state_dict().items()
                   if k.startswith("layers.0.")}
        self.layer.load_state_dict({k: v.double() for k, v in stacked.items()}, strict=True)
        hidden, eps = hf.config.hidden_size, hf.config.rms_norm_eps
        self.norms = {}
        for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = type(hf.model.norm)(hidden, eps=eps).double()
            norm.weight.data.copy_(mtp[f"{part}.weight"])
            self.norms[part] = norm
        self.fc = mtp["fc.weight"]

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        return self.hf.model(input_ids=torch.tensor([tokens]), use_cache=False).last_hidden_state[0]

    @torch.no_grad()
    def run(self, next_tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP positions 0 .. T-1 (token after each, hidden state at each): (normed output, logits) [T, .]."""
        hf = self.hf
        e = hf.model.embed_tokens(torch.tensor([next_tokens]))[0]
        norms = self.norms
        x = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](hidden)], -1) @ self.fc.T
        T = x.shape[0]
        positions = torch.arange(T)[None]
        cos_sin = hf.model.rotary_emb(x[None], positions)
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        out = self.layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        normed = self.norms["norm"](out)
        return normed, hf.lm_head(normed)

    def drafts(self, prompt: list[int], first: int, drafts: list[int]) -> torch.Tensor:
        """The logits of each draft position: after the prompt and its first token (draft 1), then each draft
        fed back with the layer's own output as its hidden state."""
        hidden = self.target_hidden(prompt)
        tokens = [*prompt[1:], first]
        out, logits = self.run(tokens, hidden)
        rows = [logits[-1]]
        for token in drafts[:-1]:
            tokens.append(token)
            hidden = torch.cat([hidden, out[-1:]])
            out, logits = self.run(tokens, hidden)
            rows.append(logits[-1])
        return torch.stack(rows)


def final_usage(updates: list[list[RequestUpdate]]) -> Usage:
    usage = updates[0][-1].usage
    assert usage is not None
    return usage


def watch_forwards(core: EngineCore) -> list[tuple[int, torch.Tensor]]:
    """Every MTP forward's (first position of its first run, logits), as the engine's method returns them."""
    drafter = core.drafter
    assert drafter is not None
    seen: list[tuple[int, torch.Tensor]] = []
    real = drafter._forward

    def spy(runs: Any) -> Any:
        out, logits = real(runs)
        seen.append((runs[0].start, logits.detach().clone()))
        return out, logits

    drafter._forward = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("chunk", [0, 16])
def test_the_drafts_come_from_the_layer_as_its_definition_says(mtp_dir: Path, mtp_model: tuple[LoadedModel, Tokenizer],
                                                               chunk: int) -> None:
    """After the prompt's forward and its first token, the engine's k=3 draft logits equal the float64
    reference's (1e-4): the window of the whole prompt is in the MTP layer's pages (written in one chunk or
    across several steps), the recursion feeds each draft back with the layer's own output."""
    vocab = mtp_model[0].config.vocab_size
    prompt = list(prompts(vocab, seed=4)[1])
    extra = {"prefill_chunk_tokens": chunk} if chunk else {}
    core = engine_for(mtp_model, "mtp", 3, **extra)
    seen = watch_forwards(core)
    updates: list[RequestUpdate] = []
    core.submit(greedy("r", tuple(prompt), max_tokens=8), updates.append)
    core.drain_inbox()
    try:
        while not core.scheduler.running or core.scheduler.running[0].num_output == 0:
            core.step()
        seq = core.scheduler.running[0]
        first = seq.token_ids[-1]
        draft = list(seq.speculation.draft)
        assert len(draft) == 3 and seq.speculation.draft_for == len(seq.token_ids)
    finally:
        core.stop()
    got = torch.stack([logits[-1] for _, logits in seen[-3:]]).double()
    assert [start for start, _ in seen[-3:]] == [len(prompt) - 1, len(prompt), len(prompt) + 1]
    assert draft == got.argmax(-1).tolist()
    want = Reference(mtp_dir).drafts(prompt, first, draft)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_equals_plain_decoding(mtp_model: tuple[LoadedModel, Tokenizer], k: int) -> None:
    """Three requests in one batch, one of them not drafting: every token and logprob is plain decoding's;
    each drafting request drafted (its report says so), no page or slot is left over."""
    vocab = mtp_model[0].config.vocab_size
    requests = [greedy(f"r{i}", p, max_tokens=30) for i, p in enumerate(prompts(vocab))]
    requests[2] = dataclasses.replace(requests[2], speculative=False)
    want = plain_run(mtp_model, *requests)
    got = run(engine_for(mtp_model, "mtp", k), *requests)
    same_as_plain(got, want)
    assert got.usage[0][0] > 0 and got.usage[1][0] > 0 and got.usage[2] == (0, 0)


def test_stops_and_limits_end_where_plain_decoding_ends(mtp_model: tuple[LoadedModel, Tokenizer]) -> None:
    vocab = mtp_model[0].config.vocab_size
    prompt = prompts(vocab)[1]
    want = plain_run(mtp_model, greedy("a", prompt, max_tokens=12))
    stop_at = want.tokens[0][5]
    requests = [greedy("a", prompt, max_tokens=7), greedy("b", prompt, max_tokens=30, stop_token_ids=[stop_at])]
    same_as_plain(run(engine_for(mtp_model, "mtp", 4), *requests), plain_run(mtp_model, *requests))


def test_the_window_is_in_the_pages_and_a_claimant_drafts_from_its_first_token(
        mtp_model: tuple[LoadedModel, Tokenizer]) -> None:
    """Turn 2 claims turn 1's state (its pages hold the MTP layer's K/V too): equal to cold, it drafts
    from its first verify on, and the claim is counted as a window that began at a state."""
    vocab = mtp_model[0].config.vocab_size
    first = greedy("t1", prompts(vocab)[1], max_tokens=10)
    core = engine_for(mtp_model, "mtp", 3)
    try:
        from engine.offline import run_to_completion
        from test_speculative import collect

        turn1 = collect(run_to_completion(core, first, start=True, timeout=600))
        second = greedy("t2", (*first.prompt_ids, *turn1.tokens[0], *prompts(vocab, seed=9)[1][:12]), max_tokens=12)
        gaps_before = core.metrics._window_gaps._value.get()
        updates = run_to_completion(core, second, timeout=600)
        got = collect(updates)
        assert updates[0][-1].usage is not None and final_usage(updates).cached_tokens >= P
        assert core.metrics._window_gaps._value.get() == gaps_before + 1
        core.check_integrity()
    finally:
        core.stop()
    same_as_plain(got, plain_run(mtp_model, second))
    assert got.usage[0][0] > 0


def test_states_of_another_drafter_layout_are_not_claimed(mtp_model: tuple[LoadedModel, Tokenizer]) -> None:
    """A page of an MTP engine holds more than a plain engine's: the reuse namespace says so, so neither
    claims the other's states (their roots differ); a plain engine's roots are as they were."""
    mtp_core = engine_for(mtp_model, "mtp", 2)
    plain_core = engine_for(mtp_model, "none")
    ngram_core = engine_for(mtp_model, "ngram")
    try:
        assert mtp_core.namespace_hash("") != plain_core.namespace_hash("")
        assert plain_core.namespace_hash("") == ngram_core.namespace_hash("")
        assert len(mtp_core.cache.shape.attention_layers) == len(plain_core.cache.shape.attention_layers) + 1
    finally:
        for core in (mtp_core, plain_core, ngram_core):
            core.stop()


def test_a_checkpoint_without_an_mtp_layer_refuses_mtp_at_start(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir)
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP layer"):
        EngineCore(loaded, Tokenizer.from_dir(tiny_model_dir),
                   EngineConfig(page_size=P, kv_cache_bytes=8 * MiB, speculative_method="mtp"))


def test_a_sequence_moved_down_resumes_with_its_window(kind: str, mtp_model: tuple[LoadedModel, Tokenizer],
                                                       tmp_path: Path) -> None:
    """A live move of an MTP-drafting sequence to KV-RAM and back onto poisoned memory: the output is the
    unmoved run's, and so is every MTP forward after the resume (the drafter's window came back in its
    pages; from poison the drafts' logits would not match)."""
    from engine.facts import ReuseTier
    from services import start_tierstore
    from test_live_moves import Driver, make_request, move_at, same

    model = (kind, *mtp_model)
    prompt = prompts(mtp_model[0].config.vocab_size)[1]
    still = Driver(model, speculative_method="mtp", speculative_num_tokens=3,
                   speculative_measured=False)  # the same drafts as the moved run, whatever the load
    want_forwards = watch_forwards(still.core)
    try:
        want = still.run(make_request("r", prompt, max_tokens=24))
    finally:
        still.close()
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(32 * MiB), "--kv-disk-bytes", "0"])
    driver = Driver(model, store.address, reuse_prompt=False, speculative_method="mtp", speculative_num_tokens=3,
                    speculative_measured=False)
    forwards = watch_forwards(driver.core)
    try:
        driver.submit(make_request("r", prompt, max_tokens=24))
        move_at(driver, "r", lambda s: s.num_output > 6)
        driver.step_until(lambda: driver.done("r"))
        same(driver.result("r"), want)
        assert driver.poisoned and driver.core.stats().sequences_moved[ReuseTier.RAM] == 1
        driver.core.check_integrity()
    finally:
        driver.close()
        store.stop()
    assert [start for start, _ in forwards] == [start for start, _ in want_forwards]
    for (_, got), (_, wanted) in zip(forwards, want_forwards):
        torch.testing.assert_close(got, wanted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_another_engine_claims_the_state_from_ram_and_disk(kind: str, mtp_model: tuple[LoadedModel, Tokenizer],
                                                           tier: str, method: str, tmp_path: Path) -> None:
    """A request on one engine, written ahead to the tierstore (for disk: the store restarted, its RAM gone);
    one that goes on from its prompt, on a fresh engine, claims it from that tier, drafts, and equals cold.
    MTP: its forwards are those of the same request claiming on the device where the first ran (the
    window came down and back in the pages, under their integrity tag). Prompt lookup's window is the
    tokens: drafted here by the plain run's own tokens, 30% of them wrong (test_speculative's drafter)."""
    import time

    from engine.offline import run_to_completion
    from services import start_tierstore
    from test_speculative import collect, drafter
    from tierstore.client import TierStoreClient

    vocab = mtp_model[0].config.vocab_size
    first = greedy("t1", (*prompts(vocab)[1], *prompts(vocab)[0][:3]), max_tokens=10)  # 48 tokens, 3 whole pages
    args = ["--kv-host-pool-bytes", str(32 * MiB), "--kv-disk-path", str(tmp_path / "kv"),
            "--kv-disk-bytes", str(64 * MiB if tier == "disk" else 0)]
    settings = {"spill_ahead_pages": 1 << 30, "tier_timeout": 2.0, "tier_retry_seconds": 0.3,
                "retained_interactive_ttl": 0.0, "integrity_key_file": str(tmp_path / "keys" / "integrity.key")}

    # Turn 2 goes on from turn 1's prompt (a subagent of the same system block): every claim cuts there
    # (the prompt is whole pages, where a dense model's device claim ends too).
    second = greedy("t2", (*first.prompt_ids, *prompts(vocab, seed=9)[1][:12]), max_tokens=12)

    plain = plain_run(mtp_model, second)

    def engine(**config: object) -> EngineCore:
        core = engine_for(mtp_model, method, 3, **config)
        if method == "ngram":
            core.speculator.drafter = drafter({second.prompt_ids: plain.tokens[0]}, 0.3, vocab)
        return core

    here = engine()  # the device claim: turn 2 where turn 1 ran
    try:
        turn1 = collect(run_to_completion(here, first, start=True, timeout=600)).tokens[0]
        want_forwards = watch_forwards(here) if method == "mtp" else []
        want_updates = run_to_completion(here, second, timeout=600)
        assert final_usage(want_updates).reuse.tier.value == "device"
    finally:
        here.stop()
    store = start_tierstore(tmp_path / "ts", args)
    try:
        writer = engine(tierstore_address=store.address, **settings)
        try:
            assert collect(run_to_completion(writer, first, start=True, timeout=600)).tokens[0] == turn1
            deadline = time.monotonic() + 60
            with TierStoreClient(store.address) as client:
                while time.monotonic() < deadline:
                    stats = client.stats()
                    if stats.states_ram and (tier == "ram" or stats.copies_ahead):
                        break
                    time.sleep(0.05)
                assert stats.states_ram and (tier == "ram" or stats.copies_ahead)
        finally:
            writer.stop()
        if tier == "disk":
            assert store.stop() == 0
            store = start_tierstore(tmp_path / "ts", args)  # the arena is gone with the process; the disk is not
        reader = engine(tierstore_address=store.address, **settings)
        forwards = watch_forwards(reader) if method == "mtp" else []
        try:
            updates = run_to_completion(reader, second, start=True, timeout=600)
            reader.check_integrity()
        finally:
            reader.stop()
    finally:
        store.stop()
    usage = final_usage(updates)
    assert usage.reuse.tier.value == tier and usage.cached_tokens == final_usage(want_updates).cached_tokens >= P
    same_as_plain(collect(updates), plain)
    same_as_plain(collect(want_updates), plain)
    assert usage.draft_tokens > 0 and (method == "mtp" or usage.accepted_tokens > 0)
    assert [start for start, _ in forwards] == [start for start, _ in want_forwards]
    for (_, got), (_, wanted) in zip(forwards, want_forwards):
        torch.testing.assert_close(got, wanted, rtol=0, atol=1e-5)


def test_a_prompt_claimed_whole_drafts_from_its_first_token(mtp_model: tuple[LoadedModel, Tokenizer]) -> None:
    """The same prompt again: its state is claimed whole with its next-token row (the logits and the target's
    hidden state the first draft needs), so it computes nothing for its first token and still drafts it:
    the same drafts as the first run's, no window gap counted."""
    from engine.offline import run_to_completion
    from test_speculative import collect

    vocab = mtp_model[0].config.vocab_size
    prompt = prompts(vocab)[1]
    core = engine_for(mtp_model, "mtp", 3)
    seen = watch_forwards(core)
    try:
        first = collect(run_to_completion(core, greedy("a", prompt, max_tokens=6), start=True, timeout=600))
        cold = list(seen)
        seen.clear()
        updates = run_to_completion(core, greedy("b", prompt, max_tokens=6), timeout=600)
        assert final_usage(updates).cached_tokens == len(prompt)
        assert core.metrics._window_gaps._value.get() == 0
        core.check_integrity()
    finally:
        core.stop()
    assert collect(updates).tokens == first.tokens
    drafting = [i for i, (start, _) in enumerate(cold) if start == len(prompt) - 1]
    assert drafting and [start for start, _ in seen[:3]] == [len(prompt) - 1, len(prompt), len(prompt) + 1]
    for (_, got), (_, want) in zip(seen[:3], cold[drafting[0]:drafting[0] + 3]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
