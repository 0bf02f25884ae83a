"""Speculative decoding (issue 44): drafts verified in one forward, the output exactly plain decoding's.

The drafting is checked on its own (prompt lookup against a brute-force search, the verify rule on
constructed logits, the sampled rule's distribution by a chi-square test over thousands of seeds), then
in an in-process EngineCore on dense, hybrid, MoE-hybrid and pure recurrent random checkpoints. Random
weights rarely repeat themselves, so most engine tests draft with `ReferenceDrafter` (bench/speculative.py):
it proposes the tokens a cold run produced (each one wrong with probability q, so every verify outcome
happens: all drafts kept, some, none); the engine's own prompt lookup is checked on a checkpoint whose greedy output
falls into a loop. Every output is compared with the same request decoded one token a step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bench.speculative import ReferenceDrafter
from checkpoints import make_checkpoint
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.facts import ReuseTier
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.outputs import RequestUpdate
from engine.request import EngineRequest, EngineSequence
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler, sample
from engine.speculative.ngram import TokenHistory
from engine.speculative.speculator import SpecState, Speculator
from engine.speculative.verify import verify_drafts
from engine.text.tokenizer import Tokenizer

P = 16
MiB = 1 << 20


# --- prompt lookup -------------------------------------------------------------------------------
def brute_force(tokens: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; a token must follow the match
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_takes_the_latest_longest_match() -> None:
    h = TokenHistory()
    h.sync([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    assert h.propose(3) == [9, 9, 2]  # "1 2 3" (n=3) beats the later "2 3" (n=2)
    h.sync([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3, 4, 5, 2, 3])
    assert h.propose(2) == [4, 5]  # "2 3" last seen before "4 5"
    assert h.propose(0) == []


def test_prompt_lookup_matches_whole_tokens_only() -> None:
    h = TokenHistory()
    # 256 is bytes 00 01 00 00 and 1 is 01 00 00 00: "256, 1" contains the bytes of "1, 0" off a token boundary.
    h.sync([256, 1, 0, 7, 1, 0])
    assert h.propose(2) == [7, 1]
    h = TokenHistory()
    h.sync([256, 1, 5, 1, 0])
    assert h.propose(2) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 6))
def test_prompt_lookup_equals_a_brute_force_search(tokens: list[int], k: int) -> None:
    h = TokenHistory()
    h.sync(tokens[: len(tokens) // 2])  # kept up to date in two steps, as a sequence grows
    h.sync(tokens)
    assert h.propose(k) == brute_force(tokens, k)


# --- the verify rule ------------------------------------------------------------------------------
def peaked(vocab: int, winners: list[int]) -> torch.Tensor:
    """Logits whose row i has its argmax at winners[i]."""
    logits = torch.zeros(len(winners), vocab)
    for i, w in enumerate(winners):
        logits[i, w] = 5.0
    return logits


def greedy_sampler(**params: object) -> RequestSampler:
    return RequestSampler(SamplingParams(temperature=0.0, **params))  # type: ignore[arg-type]


@pytest.mark.parametrize("draft,kept", [((3, 4, 5), [3, 4, 5, 6]), ((3, 1, 5), [3, 4]), ((1, 4, 5), [3])])
def test_greedy_verify_keeps_drafts_while_they_are_the_argmax(draft: tuple[int, ...], kept: list[int]) -> None:
    out = verify_drafts(peaked(8, [3, 4, 5, 6]), draft, greedy_sampler(logprobs=True), frozenset(), 0)
    assert out.tokens.token_ids == kept and out.accepted == len(kept) - 1
    logprobs = torch.log_softmax(peaked(8, [3, 4, 5, 6]), -1)
    assert out.tokens.logprobs == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(kept)])


def test_greedy_verify_holds_eos_back_under_min_tokens_row_by_row() -> None:
    # EOS (0) is each row's argmax; min_tokens=2 with one token already out masks it in row 0 only.
    logits = peaked(6, [0, 0, 0])
    logits[:, 2] = 4.0
    out = verify_drafts(logits, (2, 0), greedy_sampler(min_tokens=2), frozenset({0}), 1)
    assert out.tokens.token_ids == [2, 0, 0]


def chi_square_p(observed: Counter[int], expected: dict[int, float], total: int) -> float:
    """The chi-square test's p-value (the regularised upper incomplete gamma, from torch)."""
    cells = [t for t, p in expected.items() if p * total >= 5]
    stat = sum((observed[t] - expected[t] * total) ** 2 / (expected[t] * total) for t in cells)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(stat / 2)))


def test_sampled_verify_keeps_the_target_distribution() -> None:
    """Over 4000 seeds, the tokens a verify yields at the first position (draft kept or replaced) and at
    the second (after a kept draft) are distributed as the target's sampling distribution, and as plain
    sampling's: chi-square, not one run."""
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 0.3, 2.0, 1.0, 0.2, -0.5]])
    params = SamplingParams(temperature=0.8, top_k=5)
    probs = torch.softmax(logits / 0.8, -1)
    for row in range(2):  # top_k=5 of 6 drops each row's least likely token
        probs[row, probs[row].argmin()] = 0
    probs = probs / probs.sum(-1, keepdim=True)
    draws = 4000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    plain: Counter[int] = Counter()
    for seed in range(draws):
        draft = (seed % vocab,)  # every token drafted in turn, likely ones and dropped ones
        out = verify_drafts(logits, draft, RequestSampler(params, seed=seed), frozenset(), 0)
        first[out.tokens.token_ids[0]] += 1
        if out.accepted >= 1:
            second[out.tokens.token_ids[1]] += 1
        plain[sample(logits[:1], [RequestSampler(params, seed=10**6 + seed)], frozenset(), [0]).token_ids[0]] += 1
    want = {t: float(probs[0, t]) for t in range(vocab)}
    assert chi_square_p(first, want, draws) > 1e-3
    assert chi_square_p(plain, want, draws) > 1e-3
    assert chi_square_p(second, {t: float(probs[1, t]) for t in range(vocab)}, sum(second.values())) > 1e-3
    assert first[int(probs[0].argmin())] == 0  # what top_k drops is never kept, drafted or not


# --- the engine -------------------------------------------------------------------------------------
def drafter(reference: dict[tuple[int, ...], list[int]], q: float, vocab: int) -> ReferenceDrafter:
    """The plain run's tokens of each prompt as drafts, each wrong with probability `q`."""
    return ReferenceDrafter(reference, q, vocab, seed=7)


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str | None]
    usage: list[tuple[int, int]]  # (drafted, accepted) per request


def collect(updates: list[list[RequestUpdate]]) -> Run:
    deltas = [[d for u in ups for d in u.deltas] for ups in updates]
    for ups in updates:
        assert ups[-1].error is None, ups[-1].error
    usage = [(ups[-1].usage.draft_tokens, ups[-1].usage.accepted_tokens) for ups in updates
             if ups[-1].usage is not None]
    return Run([[t for d in ds for t in d.token_ids] for ds in deltas],
               [[lp.logprob or 0.0 for d in ds for lp in d.logprobs] for ds in deltas],
               [next((d.finish_reason.value for d in ds if d.finish_reason), None) for ds in deltas], usage)


def engine_for(model: tuple[LoadedModel, Tokenizer], method: str = "ngram", k: int = 4, **config: object
               ) -> EngineCore:
    loaded, tokenizer = model
    # Drafting in batches of every size, and by acceptance alone (the same drafts on every run, whatever
    # this machine's load): the verify machinery is what these tests check (the batch-size limit and the
    # measured draft sizing have tests of their own).
    settings: dict[str, object] = {"page_size": P, "kv_cache_bytes": 8 * MiB, "max_num_seqs": 8,
                                   "speculative_method": method, "speculative_num_tokens": k,
                                   "speculative_disable_batch_size": 0, "speculative_measured": False,
                                   **config}
    return EngineCore(loaded, tokenizer, EngineConfig(**settings))  # type: ignore[arg-type]


def run(core: EngineCore, *requests: EngineRequest) -> Run:
    try:
        result = collect(run_to_completion(core, *requests, start=True, timeout=600))
        core.check_integrity()  # no page or slot a verify took is left over
        assert core.slots is None or core.slots.num_used == 0
        return result
    finally:
        core.stop()


def prompts(vocab: int, seed: int = 1) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(10, vocab, (20,), generator=g).tolist()
    return [tuple(base * 3), tuple(torch.randint(10, vocab, (45,), generator=g).tolist()), tuple(base[:7] * 5)]


def greedy(rid: str, prompt: tuple[int, ...], max_tokens: int = 40, **params: object) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True,
                              **params)  # type: ignore[arg-type]
    return EngineRequest(rid, prompt, sampling)


def same_as_plain(got: Run, want: Run) -> None:
    assert got.tokens == want.tokens and got.finish == want.finish
    for a, b in zip(got.logprobs, want.logprobs):
        assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= 1e-4


MODELS = ["dense", "hybrid", "moe-hybrid", "recurrent"]


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest, tiny_model_dir: Path, dense_chat_model_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Tokenizer]:
    from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

    if request.param == "dense":
        path = dense_chat_model_dir
    elif request.param == "hybrid":
        path = tiny_model_dir
    else:
        arch, extra = (("Qwen3NextForCausalLM-moe", {}) if request.param == "moe-hybrid" else
                       ("Qwen3_5ForCausalLM", {"layer_types": ["linear_attention"] * 4}))
        path = make_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=5, vocab_size=TINY_VOCAB_SIZE,
                               **extra)  # type: ignore[arg-type]
        write_tiny_tokenizer(path)
    return load_model(path), Tokenizer.from_dir(path)


def plain_run(model: tuple[LoadedModel, Tokenizer], *requests: EngineRequest) -> Run:
    return run(engine_for(model, "none"), *requests)


@pytest.mark.parametrize("q", [0.0, 0.3, 1.0])
def test_greedy_output_equals_plain_decoding_whatever_the_drafts(model: tuple[LoadedModel, Tokenizer],
                                                                  q: float) -> None:
    """All drafts right (q=0: every verify keeps k+1 tokens), some (a hybrid rolls back and catches up)
    or none: a batch of three decodes exactly what plain decoding does, token and logprob."""
    vocab = model[0].config.vocab_size
    requests = [greedy(f"r{i}", p) for i, p in enumerate(prompts(vocab))]
    want = plain_run(model, *requests)
    core = engine_for(model)
    core.speculator.drafter = drafter({r.prompt_ids: t for r, t in zip(requests, want.tokens)}, q, vocab)
    got = run(core, *requests)
    same_as_plain(got, want)
    drafted = sum(d for d, _ in got.usage)
    accepted = sum(a for _, a in got.usage)
    assert drafted > 0 and core.speculator.totals.draft_tokens == drafted
    if q == 0.0:
        assert accepted == drafted
    if q == 1.0:
        assert accepted == 0


def test_stops_inside_a_kept_run_end_where_plain_decoding_ends(model: tuple[LoadedModel, Tokenizer]) -> None:
    """A stop token id, a stop string and max_tokens each fall inside a run of kept drafts."""
    loaded, tokenizer = model
    vocab = loaded.config.vocab_size
    prompt = prompts(vocab)[0]
    reference = plain_run(model, greedy("ref", prompt)).tokens[0]
    stop_id = reference[6]
    stop_text = tokenizer.decode([reference[9]]).strip()
    requests = [greedy("by-id", prompt, stop_token_ids=[stop_id]), greedy("by-length", prompt, max_tokens=7)]
    if stop_text:
        requests.append(greedy("by-string", prompt, stop=[stop_text]))
    want = plain_run(model, *requests)
    core = engine_for(model)
    core.speculator.drafter = drafter({prompt: reference}, 0.0, vocab)
    got = run(core, *requests)
    same_as_plain(got, want)
    assert len(got.tokens[1]) == 7 and got.tokens[0][-1] == stop_id
    assert got.usage[1][0] > 0


def test_a_request_may_turn_it_off_beside_one_that_drafts(model: tuple[LoadedModel, Tokenizer]) -> None:
    vocab = model[0].config.vocab_size
    p = prompts(vocab)
    on, off = greedy("on", p[0]), EngineRequest("off", p[1], greedy("x", p[1]).params, speculative=False)
    want = plain_run(model, on, off)
    core = engine_for(model)
    core.speculator.drafter = drafter({on.prompt_ids: want.tokens[0], off.prompt_ids: want.tokens[1]}, 0.2, vocab)
    got = run(core, on, off)
    same_as_plain(got, want)
    assert got.usage[0][0] > 0 and got.usage[1] == (0, 0)


def test_seeded_sampling_is_reproducible_and_keeps_drafts(model: tuple[LoadedModel, Tokenizer]) -> None:
    vocab = model[0].config.vocab_size
    request = EngineRequest("s", prompts(vocab)[0], SamplingParams(temperature=0.7, seed=3, max_tokens=30,
                                                                      ignore_eos=True))
    reference = plain_run(model, greedy("s", request.prompt_ids, max_tokens=30)).tokens[0]
    runs = []
    for _ in range(2):
        core = engine_for(model)
        core.speculator.drafter = drafter({request.prompt_ids: reference}, 0.0, vocab)
        runs.append(run(core, request))
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens[0]) == 30
    assert runs[0].usage[0][0] > 0


def test_a_second_turn_claims_the_first_and_drafts_from_its_first_token(model: tuple[LoadedModel, Tokenizer]
                                                                        ) -> None:
    """Reuse and drafting together: turn 2 (turn 1's prompt and reply, then more) claims turn 1's state
    on the device, drafts from its first generated token, and decodes what a cold engine does."""
    vocab = model[0].config.vocab_size
    first = greedy("t1", prompts(vocab)[1], max_tokens=20)
    core = engine_for(model)
    turn1 = collect(run_to_completion(core, first, start=True, timeout=600)).tokens[0]
    second = greedy("t2", (*first.prompt_ids, *turn1, *prompts(vocab)[0][:9]), max_tokens=30)
    cold = plain_run(model, second)
    core.speculator.drafter = drafter({second.prompt_ids: cold.tokens[0]}, 0.25, vocab)
    try:
        updates = run_to_completion(core, second, timeout=600)
        got = collect(updates)
        core.check_integrity()
    finally:
        core.stop()
    same_as_plain(got, cold)
    usage = updates[0][-1].usage
    assert usage is not None and usage.cached_tokens > 0 and usage.draft_tokens > 0


def test_prompt_lookup_drafts_a_looping_output_and_changes_nothing(dense_chat_model_dir: Path) -> None:
    """The engine's own drafter: a random checkpoint's greedy output falls into a loop, which prompt
    lookup predicts; the output is plain decoding's and the metrics count what was drafted."""
    model = (load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir))
    vocab = model[0].config.vocab_size
    requests = [greedy(f"r{i}", p, max_tokens=160) for i, p in enumerate(prompts(vocab))]
    want = plain_run(model, *requests)
    core = engine_for(model)
    got = run(core, *requests)
    same_as_plain(got, want)
    totals = core.speculator.totals
    assert totals.accepted_tokens > 0 and sum(a for _, a in got.usage) == totals.accepted_tokens
    metrics = {m.name: m for m in core.metrics.registry.collect()}
    drafted = [s for s in metrics["ignis_spec_draft_tokens"].samples if s.name.endswith("_total")]
    assert drafted[0].labels == {"method": "ngram"} and drafted[0].value == totals.draft_tokens
    lengths = [s for s in metrics["ignis_spec_acceptance_length"].samples if s.name.endswith("_count")]
    assert lengths[0].value == totals.verifies


@pytest.mark.parametrize("limit", [-1, 0, 1, 2])
def test_no_drafting_in_a_batch_larger_than_the_limit(tiny_model_dir: Path, dense_chat_model_dir: Path,
                                                      limit: int) -> None:
    """speculative.disable_batch_size: no draft is asked in a step with more sequences running than the limit
    (1; on a hybrid also -1, auto), and drafts are asked beside another under 0 (no limit) or 2; alone, a
    request drafts under any limit. The output is plain decoding's either way."""
    for path, hybrid in ((tiny_model_dir, True), (dense_chat_model_dir, False)):
        model = (load_model(path), Tokenizer.from_dir(path))
        vocab = model[0].config.vocab_size
        pair = [greedy(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts(vocab)[:2])]
        want = plain_run(model, *pair)
        reference = drafter({r.prompt_ids: t for r, t in zip(pair, want.tokens)}, 0.0, vocab)
        asked_beside: list[int] = []  # the sequences running in each step a draft was asked in

        def drafting(*requests: EngineRequest) -> Run:
            core = engine_for(model, speculative_disable_batch_size=limit)

            class Watched:
                proposes_every_step = True

                def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
                    asked_beside.append(core.speculator.running)
                    return reference.propose(seq, state, k)

            core.speculator.drafter = Watched()
            return run(core, *requests)

        same_as_plain(drafting(*pair), want)
        gated = limit == 1 or (limit == -1 and hybrid)
        assert (max(asked_beside) == 1) if gated else (max(asked_beside) == 2), (hybrid, asked_beside)
        alone = drafting(pair[0])
        assert alone.usage[0][0] > 0 and alone.tokens[0] == want.tokens[0]


def stated_costs(speculator: Speculator, plain_step: float, per_draft: float) -> None:
    """The speculator measures each step as costing `plain_step` plus `per_draft` a verified draft token,
    whatever this machine's load (its own measurement's outcome is what the tests check)."""
    observe = speculator.observe_step

    def as_if(drafted: int, seconds: float) -> None:
        observe(drafted, plain_step + per_draft * drafted)
    speculator.observe_step = as_if  # type: ignore[method-assign]


def test_drafts_that_never_stand_are_cut_to_nothing_and_judged_as_shadows(dense_chat_model_dir: Path) -> None:
    """Every draft wrong: once the sequence's acceptance is measured its drafts are cut to nothing; a drafter
    that proposes every step (prompt lookup) needs no probe, its cut drafts judged against the tokens
    decoded instead, so every step after the first verifies is a plain decode."""
    model = (load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir))
    vocab = model[0].config.vocab_size
    request = greedy("r", prompts(vocab)[1], max_tokens=120)
    want = plain_run(model, request)
    core = engine_for(model, speculative_measured=True)
    core.speculator.drafter = drafter({request.prompt_ids: want.tokens[0]}, 1.0, vocab)
    stated_costs(core.speculator, 0.03, 0.003)  # batch 1 on a CPU: a drafted row costs a tenth of a step
    got = run(core, request)
    same_as_plain(got, want)
    totals = core.speculator.totals
    assert totals.accepted_tokens == 0
    assert 1 <= totals.verifies <= 3, totals.verifies  # of 119 decode steps
    kept = core.speculator.acceptance
    assert kept.judged > totals.verifies and kept.hits == 0  # the shadows were judged: all wrong


def test_a_sequence_whose_drafts_turn_right_drafts_again(dense_chat_model_dir: Path) -> None:
    """Drafts wrong for the first 40 tokens, right after: cut to nothing while wrong (their shadows judged),
    drafted and verified again once the shadows stand, with no probe in between."""
    model = (load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir))
    vocab = model[0].config.vocab_size
    request = greedy("r", prompts(vocab)[1], max_tokens=120)
    want = plain_run(model, request)
    right, wrong = (drafter({request.prompt_ids: want.tokens[0]}, q, vocab) for q in (0.0, 1.0))
    verified_at: list[int] = []  # outputs at the steps whose draft was verified

    class Turning:
        proposes_every_step = True

        def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
            return (wrong if seq.num_output < 40 else right).propose(seq, state, k)
    core = engine_for(model, speculative_measured=True)
    core.speculator.drafter = Turning()
    stated_costs(core.speculator, 0.03, 0.003)
    verified = core.speculator.verified

    def counted(seq: EngineSequence, drafted: int, accepted: int) -> None:
        verified_at.append(seq.num_output)
        verified(seq, drafted, accepted)
    core.speculator.verified = counted  # type: ignore[method-assign]
    same_as_plain(run(core, request), want)
    before = [n for n in verified_at if n < 40]
    assert 1 <= len(before) <= 3, verified_at
    assert len([n for n in verified_at if n >= 40]) >= 10, verified_at  # drafting again: ~80 tokens in 4-5s


@pytest.mark.parametrize("pays", [True, False])
def test_drafts_that_stand_are_verified_only_where_their_rows_pay(dense_chat_model_dir: Path, pays: bool) -> None:
    """Every draft right: where a drafted row costs a tenth of a plain step the sequence verifies whole
    drafts all along; where it costs three plain steps (stated), its drafts are cut to nothing but for the
    verifies that measure the cost again at growing intervals. The output is plain decoding's either way."""
    model = (load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir))
    vocab = model[0].config.vocab_size
    request = greedy("r", prompts(vocab)[1], max_tokens=120)
    want = plain_run(model, request)
    core = engine_for(model, speculative_measured=True)
    core.speculator.drafter = drafter({request.prompt_ids: want.tokens[0]}, 0.0, vocab)
    stated_costs(core.speculator, 0.01, 0.001 if pays else 0.03)
    got = run(core, request)
    same_as_plain(got, want)
    totals = core.speculator.totals
    if pays:
        assert totals.verifies >= 20 and totals.draft_tokens >= 4 * (totals.verifies - 1), totals  # the last: max_tokens
    else:  # one draft measures the cost, measured again after 4, 8, 16 .. steps (a first call may be slow)
        assert totals.verifies <= 8, totals


def test_step_costs_are_measured_while_drafting(dense_chat_model_dir: Path) -> None:
    model = (load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir))
    vocab = model[0].config.vocab_size
    request = greedy("r", prompts(vocab)[1], max_tokens=60)
    want = plain_run(model, request)
    core = engine_for(model, speculative_measured=True)
    core.speculator.drafter = drafter({request.prompt_ids: want.tokens[0]}, 0.3, vocab)
    same_as_plain(run(core, request), want)
    measured = core.speculator.times.figures[1]  # by drafted rows, 0 a plain step
    assert measured[0].seconds > 0.0
    assert any(rows and figure.seconds > 0.0 for rows, figure in measured.items()), "no step with drafts measured"


def test_no_draft_is_asked_before_a_plain_step_of_the_batch_size_is_measured() -> None:
    """Drafts are weighed against a plain step of as many sequences: the first step at a batch size is plain,
    and so is the first after its figure goes stale (costs change as contexts grow)."""
    from engine.speculative.draft_sizing import STALE_STEPS

    speculator = Speculator("ngram", 4, 4096)
    assert not speculator.begin_step(8)
    speculator.observe_step(0, 0.04)
    assert speculator.begin_step(8)
    assert not speculator.begin_step(3)  # another batch size: its own plain step
    for _ in range(STALE_STEPS):
        speculator.begin_step(1)
    assert not speculator.begin_step(8)
    assert Speculator("ngram", 4, 4096, measured=False).begin_step(8)  # unmeasured: drafts whatever the costs


def test_an_mtp_sequence_cut_to_nothing_probes_after_4_8_up_to_64_steps_without_a_verify() -> None:
    """With a drafter whose drafts cost a forward (MTP: no shadows), at batch 8, where a drafted row costs a tenth of a plain step, drafts that rarely stand are cut to
    nothing; the sequence probes 4 steps after its last verify, then 8, 16 .. 64 after each probe (kept or
    not: drafts that stand but do not pay probe rarely too), with one token, two after a probe kept whole,
    four after two; a verify that is not a probe starts it at 4 and one token again."""
    speculator = Speculator("mtp", 4, 4096)
    speculator.drafter = SimpleNamespace(proposes_every_step=False)  # drafts that cost a forward (MTP's)
    speculator.begin_step(8)
    speculator.observe_step(0, 0.04)  # plain: 8 tokens in 40 ms
    speculator.begin_step(8)
    speculator.observe_step(32, 0.04 + 32 * 0.004)
    seq = SimpleNamespace(speculation=SpecState())
    for _ in range(3):
        speculator.verified(seq, 4, 0)  # type: ignore[arg-type]
    probes: list[int] = []
    sizes: list[int] = []
    for _ in range(220):
        if not speculator.begin_step(8):
            speculator.observe_step(0, 0.04)  # the plain figure measured again, as the engine's plain step does
            continue
        lengths = speculator._lengths([seq], [4])  # type: ignore[list-item]
        if lengths != [0]:
            kept = lengths[0] if len(probes) in (1, 2, 4) else 0
            speculator.verified(seq, lengths[0], kept)  # type: ignore[arg-type]
            probes.append(speculator.times.step)
            sizes.append(lengths[0])
        else:
            assert speculator._lengths([seq], [4]) == [0]  # type: ignore[list-item]
    # Steps since the last verify (step 2) at each probe: a plain step measured again on the step a probe
    # falls due puts it off by one.
    waits = [b - a for a, b in zip([2, *probes], probes)]
    assert len(waits) >= 5 and all(want <= wait <= want + 1 for want, wait in zip([4, 8, 16, 32, 64, 64], waits)), waits
    assert sizes[:6] == [1, 1, 2, 4, 1, 2]  # missed; kept whole; kept whole; missed; kept whole
    assert speculator._lengths([seq], [4]) == [0] and seq.speculation.probe_after == 64  # type: ignore[list-item]
    speculator.verified(seq, 4, 2)  # type: ignore[arg-type]
    assert seq.speculation.probe_after == 4 and seq.speculation.probe_tokens == 1


def test_a_hybrid_that_rolls_back_replays_the_tokens_that_stood_on_its_state_from_before_the_step(
        tiny_model_dir: Path) -> None:
    """After a verify that kept some drafts and not all, a hybrid sequence holds the spare copy of its state
    from before the step, with the tokens that stood replayed on it: its computed count is past them and
    only the correction is pending; the next steps decode on exactly as plain decoding does."""
    model = (load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir))
    vocab = model[0].config.vocab_size
    request = greedy("r", prompts(vocab)[1], max_tokens=24)
    want = plain_run(model, request)
    core = engine_for(model)
    reference = drafter({request.prompt_ids: want.tokens[0]}, 0.0, vocab)
    spoil_at = 3  # the third draft token of the first verify is wrong: two stand

    class Spoiled:
        calls = 0
        proposes_every_step = True

        def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
            out = reference.propose(seq, state, k)
            Spoiled.calls += 1
            if Spoiled.calls == 1:
                out[spoil_at - 1] = (out[spoil_at - 1] + 1) % vocab
            return out

    core.speculator.drafter = Spoiled()
    updates: list[RequestUpdate] = []
    core.submit(request, updates.append)
    core.drain_inbox()
    try:
        while not core.scheduler.running or core.scheduler.running[0].num_output == 0:
            core.step()  # the prompt and its first token
        seq = core.scheduler.running[0]
        before, slot = seq.num_computed, seq.slot
        core.step()  # the first verify: drafts 1, 2 stand, 3 does not
        assert core.speculator.totals.accepted_tokens == spoil_at - 1
        assert seq.num_computed == before + spoil_at and seq.slot != slot  # the token it had and two drafts
        assert seq.num_pending == 1  # the correction
        while not (updates and updates[-1].done):
            core.step()
        core.check_integrity()
    finally:
        core.stop()
    assert [t for u in updates for d in u.deltas for t in d.token_ids] == want.tokens[0]


@pytest.fixture
def dense(dense_chat_model_dir: Path) -> Iterator[tuple[LoadedModel, Tokenizer]]:
    yield load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir)


def test_verify_frees_the_pages_of_drafts_that_did_not_stand(dense: tuple[LoadedModel, Tokenizer]) -> None:
    vocab = dense[0].config.vocab_size
    prompt = prompts(vocab)[1][:30]  # drafts after the first token (position 30) reach the third page
    request = greedy("r", prompt, max_tokens=8)
    core = engine_for(dense, k=8)
    core.speculator.drafter = drafter({prompt: [0] * 40}, 1.0, vocab)  # always wrong
    core.submit(request, lambda u: None)
    core.drain_inbox()
    try:
        while not core.scheduler.running or core.scheduler.running[0].num_output == 0:
            core.step()
        seq = core.scheduler.running[0]
        core.step()
        assert seq.num_computed == len(seq.token_ids) - 1
        assert len(seq.page_table) == math.ceil(len(seq.token_ids) / P) == 2  # the third went back
        core.check_integrity()
    finally:
        core.stop()


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_a_sequence_moved_down_while_drafting_resumes_exactly(kind: str, tiny_model_dir: Path,
                                                              dense_chat_model_dir: Path, tmp_path: Path) -> None:
    """A live move (engine/residency/live_moves.py) of a drafting sequence right after a verify (a hybrid's
    replayed state, a dense one's pages); each resumes from KV-RAM onto poisoned memory and ends with plain
    decoding's tokens and logprobs."""
    from services import start_tierstore
    from test_live_moves import Driver, make_request, move_at, same

    path = tiny_model_dir if kind == "hybrid" else dense_chat_model_dir
    model = (kind, load_model(path), Tokenizer.from_dir(path))
    prompt = prompts(model[1].config.vocab_size)[1]
    plain = Driver(model)
    try:
        want = plain.run(make_request("r", prompt, max_tokens=30))
    finally:
        plain.close()
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(32 * MiB), "--kv-disk-bytes", "0"])
    driver = Driver(model, store.address, reuse_prompt=False, speculative_method="ngram", speculative_num_tokens=4,
                    speculative_measured=False)  # drafting until the move, whatever the load
    try:
        driver.core.speculator.drafter = drafter({prompt: want.tokens}, 0.4, model[1].config.vocab_size)
        driver.submit(make_request("r", prompt, max_tokens=30))
        move_at(driver, "r", lambda s: driver.core.speculator.totals.verifies >= 2)
        driver.step_until(lambda: driver.done("r"))
        same(driver.result("r"), want)
        assert driver.poisoned and driver.core.stats().sequences_moved[ReuseTier.RAM] == 1
        assert driver.core.speculator.totals.accepted_tokens > 0
        driver.core.check_integrity()
    finally:
        driver.close()
        store.stop()
