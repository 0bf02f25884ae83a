"""The decode road (issue 18): a decode-only step hands a plain choice's token on in one pass
(OutputProcessor.decoded), and reuse strategies look at a decode step once (after_decodes). Each is
checked against the general way on the same tokens, and against greedy decoding of the model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.cache.page_reuse import PageReuse
from engine.cache.reuse import PromptReuse
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import LoadedModel, load_model
from engine.offline import greedy_generate
from engine.output_processor import LiveRequest
from engine.request import EngineRequest, EngineSequence, FinishReason
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from tests.test_engine_core import Collector, make_core, make_prompt, run_all

Tiny = tuple[LoadedModel, Tokenizer]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tiny:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def dense(dense_chat_model_dir: Path) -> Tiny:
    return load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir)


def ask(rid: str, prompt: tuple[int, ...], max_tokens: int, **params: object) -> EngineRequest:
    """A greedy request that ignores EOS unless told otherwise."""
    sampling: dict[str, object] = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **params}
    return EngineRequest(rid, prompt, SamplingParams(**sampling))  # type: ignore[arg-type]


def text_of(out: Collector, rid: str) -> str:
    return "".join(d.text for u in out.updates[rid] for d in u.deltas)


def finish_of(out: Collector, rid: str) -> FinishReason | None:
    return next(d.finish_reason for u in out.updates[rid] for d in u.deltas if d.finish_reason is not None)


def plain_of(core: EngineCore, request: EngineRequest) -> bool:
    """Whether `request` would go the plain way (what the core decides when it arrives)."""
    live = LiveRequest(request, lambda update: None, [])
    seq = core._new_seq(request, 0, None)  # type: ignore[arg-type]  # the sampler plays no part here
    return core.outputs.plain_decode(live, seq) is not None


@pytest.mark.parametrize("extra, plain", [
    ({}, True),
    ({"ignore_eos": False}, True),
    ({"logprobs": True}, False),
    ({"stop": ("zz",)}, False),
    ({"stop_token_ids": (7,)}, False),
    ({"n": 2}, False),
])
def test_which_choices_are_plain(tiny: Tiny, extra: dict[str, object], plain: bool) -> None:
    core = make_core(tiny, pages=16)
    assert plain_of(core, ask("r", make_prompt(8, 0), 4, **extra)) is plain
    echo = dataclasses.replace(ask("e", make_prompt(8, 0), 4), echo=True)
    assert not plain_of(core, echo)


@pytest.mark.parametrize("which, sampling", [
    ("tiny", {}), ("dense", {}),
    # Penalties and a seeded draw read the choice's own past tokens: the plain way must record them too.
    ("dense", {"presence_penalty": 1.5, "frequency_penalty": 0.5}),
    ("tiny", {"temperature": 0.8, "seed": 11, "repetition_penalty": 1.3}),
])
def test_plain_and_general_choices_give_the_same_updates(which: str, sampling: dict[str, object],
                                                          request: pytest.FixtureRequest) -> None:
    """The same prompts, plain and (with logprobs) the general way, in one batch that crosses page
    boundaries: the same tokens, text, finish and usage; greedy, the model's greedy tokens."""
    model: Tiny = request.getfixturevalue(which)
    core = make_core(model, pages=64) if which == "tiny" else make_model_core(model)
    prompts = [make_prompt(5 + 7 * i, seed=i) for i in range(4)]
    requests = [ask(f"plain{i}", p, 30, **sampling) for i, p in enumerate(prompts)]
    requests += [ask(f"general{i}", p, 30, logprobs=True, **sampling) for i, p in enumerate(prompts)]
    plain_ones: list[str] = []
    add = core.outputs.add

    def noting(live: LiveRequest) -> None:
        add(live)
        if live.seqs[0] in core.outputs.plain:
            plain_ones.append(live.request.request_id)
    core.outputs.add = noting  # type: ignore[method-assign]
    out = run_all(core, requests)
    assert sorted(plain_ones) == [f"plain{i}" for i in range(4)] and not core.outputs.plain
    for i, p in enumerate(prompts):
        plain, general = f"plain{i}", f"general{i}"
        assert out.tokens(plain) == out.tokens(general)
        if not sampling:
            assert out.tokens(plain) == greedy_generate(model[0], list(p), 30).token_ids
        assert text_of(out, plain) == text_of(out, general) == model[1].decode(out.tokens(plain))
        assert finish_of(out, plain) is finish_of(out, general) is FinishReason.LENGTH
        usage_plain, usage_general = out.updates[plain][-1].usage, out.updates[general][-1].usage
        assert usage_plain is not None and usage_general is not None
        assert usage_plain.completion_tokens == usage_general.completion_tokens == 30
    assert core.totals.generated_tokens == 8 * 30
    core.check_integrity()


def make_model_core(model: Tiny) -> EngineCore:
    loaded, tokenizer = model
    page_bytes = loaded.config.state_shape().kv_bytes_per_page(16, loaded.model.dtype)
    return EngineCore(loaded, tokenizer, EngineConfig(page_size=16, kv_cache_bytes=64 * page_bytes))


def test_eos_and_ignore_eos_on_the_decode_road(tiny: Tiny) -> None:
    """A plain choice ends at EOS sampled in a decode step exactly as the general way does, and goes
    past it under ignore_eos."""
    prompt = make_prompt(12, seed=9)
    greedy = greedy_generate(tiny[0], list(prompt), 12).token_ids
    eos = greedy[6]  # the 7th token: sampled by a decode-only step
    cut = greedy.index(eos) + 1
    core = make_core(tiny, pages=64)
    core.eos_ids = core.outputs.eos_ids = frozenset({eos})
    out = run_all(core, [ask("plain", prompt, 12, ignore_eos=False),
                         ask("general", prompt, 12, ignore_eos=False, logprobs=True),
                         ask("past", prompt, 12, ignore_eos=True)])
    assert out.tokens("plain") == out.tokens("general") == greedy[:cut]
    assert finish_of(out, "plain") is finish_of(out, "general") is FinishReason.STOP
    assert text_of(out, "plain") == text_of(out, "general")
    assert out.tokens("past") == greedy and finish_of(out, "past") is FinishReason.LENGTH


def test_a_failing_plain_choice_fails_only_its_request(tiny: Tiny) -> None:
    """One plain choice whose token handling raises on the decode road: that request ends with an
    error, its batch mates finish with the model's tokens, and nothing is left held."""
    core = make_core(tiny, pages=64)
    prompts = [make_prompt(10, seed=20 + i) for i in range(3)]
    out = Collector()
    out.expected = 3
    for i, p in enumerate(prompts):
        core.submit(ask(f"r{i}", p, 20), out.sink)
    core.drain_inbox()
    core.step()  # the prefill and first tokens
    seq: EngineSequence = core._live["r1"].seqs[0]

    def broken(token: int) -> str:
        raise RuntimeError("a detokenizer that breaks")
    core.outputs.plain[seq] = dataclasses.replace(core.outputs.plain[seq], push=broken)
    while core.scheduler.has_work():
        core.step()
    assert out.updates["r1"][-1].error is not None
    for i in (0, 2):
        assert out.tokens(f"r{i}") == greedy_generate(tiny[0], list(prompts[i]), 20).token_ids
        assert out.updates[f"r{i}"][-1].usage is not None
    core.check_integrity()
    assert core.stats().used_pages == 0 and not core._live and not core.outputs.plain  # none left behind


def test_page_reuse_publishes_the_same_pages_once_a_step(dense: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """PageReuse looks only at sequences whose computed tokens fill a page it has not published; what
    it publishes is what after_compute on every sequence of every step publishes."""
    prompts = [make_prompt(9 + 5 * i, seed=30 + i) for i in range(3)]

    def published(every_step: bool) -> tuple[list[list[int]], set[bytes]]:
        core = make_model_core(dense)
        assert isinstance(core.reuse, PageReuse)
        if every_step:
            monkeypatch.setattr(PageReuse, "after_decodes", PromptReuse.after_decodes)
        seen: list[list[int]] = []
        finish = core.reuse.on_finish

        def record(seq: EngineSequence) -> None:
            seen.append([seq.num_registered, len(seq.page_hashes), seq.num_computed])
            finish(seq)
        core.reuse.on_finish = record  # type: ignore[method-assign]
        run_all(core, [ask(f"r{i}", p, 40) for i, p in enumerate(prompts)])
        monkeypatch.undo()
        return sorted(seen), set(core.pages._page_of)

    once, every = published(False), published(True)
    assert once == every
    assert all(registered == computed // 16 for registered, _, computed in once[0])


def test_token_text_is_the_token_bytes_when_they_are_whole_characters(tiny: Tiny) -> None:
    tokenizer = tiny[1]
    partial = 0
    for i in range(tokenizer.vocab_size):
        data = tokenizer.token_bytes(i)
        try:
            expected: str | None = data.decode("utf-8")
        except UnicodeDecodeError:
            expected = None
            partial += 1
        assert tokenizer.token_text(i) == expected
    assert partial > 0  # the tiny vocabulary has byte tokens that are parts of characters
    assert tokenizer.token_text(tokenizer.vocab_size + 5) == ""  # past the vocabulary, as token_bytes


@pytest.mark.parametrize("model", ["tiny", "dense"])  # hybrid and attention-only
def test_decodes_beside_prefills_take_the_decode_road(model: str, request: pytest.FixtureRequest) -> None:
    """Requests arriving while others decode, so most steps prefill one and decode the rest: the decodes
    of those steps go the decode road as one block (ModelRunner.run's StepLogits; the batch built by
    ForwardBatch.mixed), plain or not, and each request gets what it gets alone (greedy, seeded with
    penalties, logprobs, a stop string, n=2)."""
    tiny: Tiny = request.getfixturevalue(model)
    kinds: list[dict[str, object]] = [{}, {"logprobs": True, "top_logprobs": 2}, {"stop": ("a",)},
                                      {"temperature": 0.9, "seed": 5, "presence_penalty": 0.7}, {"n": 2, "seed": 3,
                                                                                                 "temperature": 0.8}]
    requests = [ask(f"r{i}", make_prompt(6 + 5 * i, seed=60 + i), 14 + i, **kinds[i % len(kinds)]) for i in range(10)]

    def updates(out: Collector, rid: str) -> list[tuple[object, ...]]:
        return [(d.choice, d.token_ids, d.text, d.finish_reason, d.stop_reason) for u in out.updates[rid] for d in u.deltas]

    def logprobs(out: Collector, rid: str) -> list[tuple[int, float | None]]:  # another batch: float noise
        return [(lp.token_id, lp.logprob) for u in out.updates[rid] for d in u.deltas for lp in d.logprobs]

    core = make_core(tiny, pages=96)
    blocks: list[int] = []
    run = core.runner.run

    def noting(chunks):  # type: ignore[no-untyped-def]
        step = run(chunks)
        blocks.append(len(step.decodes))
        return step
    core.runner.run = noting  # type: ignore[method-assign]
    out = Collector()
    out.expected = len(requests)
    for request in requests:  # one arrives each step: its prefill runs beside the others' decodes
        core.submit(request, out.sink)
        core.drain_inbox()
        core.step()
    while core.scheduler.has_work():
        core.step()
    assert sum(1 for b in blocks if b) >= 5  # steps with a prefill whose decodes went as one block
    core.check_integrity()
    for request in requests:
        alone = run_all(make_core(tiny, pages=96), [request])
        assert updates(out, request.request_id) == updates(alone, request.request_id), request.request_id
        mixed, solo = logprobs(out, request.request_id), logprobs(alone, request.request_id)
        assert [t for t, _ in mixed] == [t for t, _ in solo]
        assert [lp for _, lp in mixed] == pytest.approx([lp for _, lp in solo], abs=1e-4)
        mine, theirs = out.updates[request.request_id][-1].usage, alone.updates[request.request_id][-1].usage
        assert mine is not None and theirs is not None
        assert (mine.prompt_tokens, mine.completion_tokens) == (theirs.prompt_tokens, theirs.completion_tokens)
