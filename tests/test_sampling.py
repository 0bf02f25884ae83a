"""engine.sampling: params validation, logits processing, truncation, seeded draws, logprobs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.sampling import RequestSampler, SamplingParams, process_logits, sample
from engine.sampling.processors import truncated_probs

NO_EOS: frozenset[int] = frozenset()


def make_sampler(prompt: tuple[int, ...] = (), **params: Any) -> RequestSampler:
    return RequestSampler(SamplingParams(**params), prompt)


def make_logits(steps: int, batch: int, vocab: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """Fixed random logits per step: [batch, vocab] each."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, vocab, generator=g) * 2 for _ in range(steps)]


def run(samplers: list[RequestSampler], steps: list[torch.Tensor], eos: frozenset[int] = NO_EOS) -> list[list[int]]:
    """Sample and observe for each step; returns the token sequence of each row."""
    seqs: list[list[int]] = [[] for _ in samplers]
    for step, logits in enumerate(steps):
        out = sample(logits, samplers, eos, [step] * len(samplers))
        for s, seq, t in zip(samplers, seqs, out.token_ids):
            s.observe(t)
            seq.append(t)
    return seqs


# --- params -----------------------------------------------------------------


def test_temperature_error_message_is_exact() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be between 0 and 2, got 3.0$"):
        SamplingParams(temperature=3.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"n": 0}, "n must be"),
        ({"n": 17}, "n must be"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs requires logprobs"),
        ({"stop": tuple(f"s{i}" for i in range(17))}, "stop"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_coerce_to_tuples_and_greedy_flag() -> None:
    p = SamplingParams(stop=["a"], stop_token_ids=[5], logit_bias={"7": 2})  # type: ignore[arg-type]
    assert p.stop == ("a",) and p.stop_token_ids == (5,) and p.logit_bias == ((7, 2.0),)
    hash(p)  # frozen and hashable
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


# --- greedy and truncation ----------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    (logits,) = make_logits(1, 4)
    out = sample(logits, [make_sampler(temperature=0) for _ in range(4)], NO_EOS, [0] * 4)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    tie = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sample(tie, [make_sampler(temperature=0)], NO_EOS, [0]).token_ids == [1]


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=str)
def test_truncation_to_one_token_equals_greedy(params: dict[str, Any]) -> None:
    steps = make_logits(20, 3, seed=1)
    samplers = [make_sampler(temperature=1.5, **params) for _ in range(3)]
    seqs = run(samplers, steps)
    expected = torch.stack([s.argmax(dim=-1) for s in steps], dim=1).tolist()  # [3, 20]
    assert seqs == expected


def test_top_k_one_breaks_ties_like_argmax() -> None:
    tie = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    for seed in range(10):
        assert sample(tie, [make_sampler(top_k=1, seed=seed)], NO_EOS, [0]).token_ids == [1]


def test_low_temperature_approaches_greedy() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.5, 2.0, -1.0]])  # best leads by 0.5: 50 nats at t=0.01
    s = make_sampler(temperature=0.01, seed=3)
    assert {sample(logits, [s], NO_EOS, [0]).token_ids[0] for _ in range(50)} == {2}


def test_top_p_reached_exactly_keeps_only_the_tokens_that_reach_it() -> None:
    """The boundary: with probabilities [0.5, 0.25, 0.25] and top_p = 0.5, the first token's mass
    reaches top_p on its own, so it is kept alone (a `<=` in the nucleus rule would keep two)."""
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.25]]))
    probs = truncated_probs(logits, torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.0]))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0]]))


def test_truncated_probs_exact_values() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05 placed at ids 1, 3, 0, 2 (not sorted, so
    # the scatter back to vocabulary order is exercised too).
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))

    def probs(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
        return truncated_probs(
            logits, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
        )[0]

    torch.testing.assert_close(probs(), torch.tensor([0.15, 0.5, 0.05, 0.3]))
    torch.testing.assert_close(probs(top_k=3), torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95)
    # top_p=0.7: 0.5 alone is short of 0.7, 0.5+0.3 reaches it -> keep two.
    torch.testing.assert_close(probs(top_p=0.7), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(probs(top_p=0.4), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # min_p=0.5: keep tokens with prob >= 0.25 = 0.5 * max.
    torch.testing.assert_close(probs(min_p=0.5), torch.tensor([0.0, 0.625, 0.0, 0.375]))


# --- seeded sampling ----------------------------------------------------------

TARGET: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "presence_penalty": 0.5, "seed": 1234}


def test_seeded_sampling_is_reproducible() -> None:
    steps = make_logits(20, 1, seed=2)
    first = run([make_sampler(**TARGET)], steps)
    second = run([make_sampler(**TARGET)], steps)
    assert first == second
    assert len(set(first[0])) > 1  # actually sampled, not stuck on one token


@pytest.mark.parametrize("position", [0, 1, 3])
def test_seeded_sampling_is_independent_of_batch_mates_and_position(position: int) -> None:
    batch_steps = make_logits(20, 4, seed=5)
    alone = run([make_sampler(**TARGET)], [s[position : position + 1] for s in batch_steps])
    mates = [
        make_sampler(temperature=0),
        make_sampler(temperature=1.3, min_p=0.1, seed=99),
        make_sampler(prompt=(1, 2, 3), temperature=0.7, repetition_penalty=1.3, logit_bias=((5, 3.0),)),
    ]
    samplers = mates[:position] + [make_sampler(**TARGET)] + mates[position:]
    together = run(samplers, batch_steps)
    assert together[position] == alone[0]


def test_different_seeds_differ() -> None:
    steps = make_logits(20, 1, seed=4)
    a = run([make_sampler(temperature=1.0, seed=1)], steps)
    b = run([make_sampler(temperature=1.0, seed=2)], steps)
    assert a != b


def test_unseeded_samplers_get_distinct_random_seeds() -> None:
    assert make_sampler().seed != make_sampler().seed


def test_fork_gives_choice_specific_reproducible_streams() -> None:
    steps = make_logits(20, 1, seed=6)
    base = make_sampler(prompt=(4, 5), temperature=1.0, seed=7, n=3)
    base.observe(9)
    forks = [base.fork(i) for i in range(3)]
    assert [f.seed for f in forks] == [7, 8, 9]
    assert all(f.output_token_ids == [9] and f.prompt_token_ids == (4, 5) for f in forks)
    streams = [run([f], steps)[0] for f in forks]
    assert len({tuple(s) for s in streams}) == 3
    # Choice i is reproducible on its own: a fresh fork replays it exactly.
    assert run([base.fork(1)], steps)[0] == streams[1]
    # Choice 0 matches a plain request with the same seed.
    assert run([make_sampler(temperature=1.0, seed=7)], steps)[0] == streams[0]
    # Without a seed, each fork gets its own random one.
    unseeded = make_sampler(n=2)
    assert unseeded.fork(0).seed != unseeded.fork(1).seed


# --- logits processing --------------------------------------------------------

BASE = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0]])  # V=5


def penalised(prompt: tuple[int, ...] = (1,), outputs: tuple[int, ...] = (0, 0, 2), **params: Any) -> torch.Tensor:
    s = make_sampler(prompt=prompt, **params)
    for t in outputs:
        s.observe(t)
    return process_logits(BASE, [s], NO_EOS, [len(outputs)])[0]


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output() -> None:
    # seen = prompt {1} + output {0, 2}: 2/2, -1*2, 0.5/2; ids 3 and 4 untouched.
    torch.testing.assert_close(penalised(repetition_penalty=2.0), torch.tensor([1.0, -2.0, 0.25, 0.0, -3.0]))


def test_frequency_penalty_scales_with_output_count_only() -> None:
    # counts: id 0 twice, id 2 once; prompt id 1 is not counted.
    torch.testing.assert_close(penalised(frequency_penalty=0.5), torch.tensor([1.0, -1.0, 0.0, 0.0, -3.0]))


def test_presence_penalty_is_flat_per_output_token() -> None:
    torch.testing.assert_close(penalised(presence_penalty=0.25), torch.tensor([1.75, -1.0, 0.25, 0.0, -3.0]))


def test_penalties_combine_repetition_first() -> None:
    got = penalised(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # id 0: 2/2 - 0.5*2 - 0.25; id 2: 0.5/2 - 0.5*1 - 0.25; id 1: -1*2 (prompt only)
    torch.testing.assert_close(got, torch.tensor([-0.25, -2.0, -0.5, 0.0, -3.0]))


def test_penalty_state_follows_later_observations() -> None:
    s = make_sampler(frequency_penalty=1.0)
    torch.testing.assert_close(process_logits(BASE, [s], NO_EOS, [0])[0], BASE[0])
    s.observe(3)
    s.observe(3)
    torch.testing.assert_close(process_logits(BASE, [s], NO_EOS, [2])[0], torch.tensor([2.0, -1.0, 0.5, -2.0, -3.0]))
    s.observe(4)
    torch.testing.assert_close(process_logits(BASE, [s], NO_EOS, [3])[0], torch.tensor([2.0, -1.0, 0.5, -2.0, -4.0]))


def test_logit_bias_is_added() -> None:
    s = make_sampler(temperature=0, logit_bias=((3, 5.0), (0, -100.0)))
    torch.testing.assert_close(process_logits(BASE, [s], NO_EOS, [0])[0], torch.tensor([-98.0, -1.0, 0.5, 5.0, -3.0]))
    assert sample(BASE, [s], NO_EOS, [0]).token_ids == [3]


def test_logit_bias_out_of_vocab_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="logit_bias token id 9"):
        sample(BASE, [make_sampler(logit_bias=((9, 1.0),))], NO_EOS, [0])


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    eos = frozenset({0})
    s = make_sampler(temperature=0, min_tokens=2, stop_token_ids=(2,))
    for step in range(2):
        row = process_logits(BASE, [s], eos, [step])[0]
        assert row[0] == -math.inf and row[2] == -math.inf
        assert sample(BASE, [s], eos, [step]).token_ids == [3]
    assert sample(BASE, [s], eos, [2]).token_ids == [0]
    # With ignore_eos, eos does not end the request, so only stop ids are held back.
    row = process_logits(BASE, [make_sampler(min_tokens=2, ignore_eos=True, stop_token_ids=(2,))], eos, [0])[0]
    assert row[0] == 2.0 and row[2] == -math.inf


def test_caller_logits_are_not_modified() -> None:
    logits = BASE.clone()
    s = make_sampler(repetition_penalty=2.0, logit_bias=((1, 1.0),), min_tokens=1, stop_token_ids=(0,))
    s.observe(0)
    sample(logits, [s], NO_EOS, [0])
    assert torch.equal(logits, BASE)


def test_batch_size_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 5), [make_sampler()], NO_EOS, [0])


# --- logprobs -----------------------------------------------------------------


def test_logprobs_match_log_softmax_and_top_logprobs_are_sorted_and_sized() -> None:
    (logits,) = make_logits(1, 4, vocab=30, seed=8)
    samplers = [
        make_sampler(temperature=0, logprobs=True, top_logprobs=5),
        make_sampler(temperature=0.5, seed=1, logprobs=True),  # before temperature, so same scale as greedy
        make_sampler(temperature=0.7),
        make_sampler(temperature=1.0, seed=2, logprobs=True, top_logprobs=20),
    ]
    out = sample(logits, samplers, NO_EOS, [0] * 4)
    ref = torch.log_softmax(logits, dim=-1)
    for i, s in enumerate(samplers):
        if not s.params.logprobs:
            assert out.logprobs[i] is None and out.top_logprobs[i] == []
            continue
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-6)
        top = out.top_logprobs[i]
        assert len(top) == s.params.top_logprobs
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        expected = torch.topk(ref[i], s.params.top_logprobs) if top else None
        if expected is not None:
            assert [t for t, _ in top] == expected.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(expected.values.tolist(), abs=1e-6)
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy picks the top alternative


def test_logprobs_reflect_penalties_and_bias() -> None:
    s = make_sampler(
        prompt=(1,), temperature=0, repetition_penalty=2.0, logit_bias=((4, 3.0),), logprobs=True, top_logprobs=5
    )
    for t in (0, 0, 2):
        s.observe(t)
    out = sample(BASE, [s], NO_EOS, [3])
    processed = torch.tensor([1.0, -2.0, 0.25, 0.0, 0.0])
    ref = torch.log_softmax(processed, dim=-1)
    assert dict(out.top_logprobs[0]) == pytest.approx(dict(enumerate(ref.tolist())), abs=1e-6)


def test_max_tokens_unset_means_the_rest_of_the_context() -> None:
    """One rule, the engine's: no competing default (it was 256 here while the API said the context)."""
    assert SamplingParams().max_tokens is None
    assert SamplingParams().length_limit(10, 100) == 100
    assert SamplingParams(min_tokens=40).length_limit(10, 100) == 100
    assert SamplingParams(max_tokens=5).length_limit(10, 100) == 15
    assert SamplingParams(max_tokens=500).length_limit(10, 100) == 100
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
