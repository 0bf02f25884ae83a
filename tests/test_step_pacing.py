"""Short requests keep moving while a long prompt prefills (issue 49 item 6).

The pacing's allowance follows measured step times to the target (a synthetic cost, so the test says
what it converges to, not how fast a machine is); in the engine, a short prompt that arrives while a
long one prefills ends its prompt in the next step with no long chunk beside it, the long prompt
still moves under a stream of short ones, and a paced prefill computes what an unpaced one does.
The time it saves is measured by bench/long_prefill.py, not asserted here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from common.settings import load_settings
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import LoadedModel, load_model
from engine.outputs import RequestUpdate
from engine.request import EngineRequest, EngineSequence
from engine.sampling.params import SamplingParams
from engine.scheduler import MAX_PREFILL_YIELDS, StepPlan
from engine.step_pacing import AUTO_BUSY, AUTO_QUIET, MIN_CHUNK, StepPacing
from engine.text.tokenizer import Tokenizer


# --- the allowance ------------------------------------------------------------
def settle(pacing: StepPacing, cost: Callable[[int], float], steps: int = 60) -> list[int]:
    """Steps whose prefill the allowance bounds, each taking cost(allowance) seconds: the allowances seen."""
    seen = []
    for _ in range(steps):
        seen.append(pacing.allowance)
        pacing.observe(cost(pacing.allowance), bounded=True)
    return seen


def test_the_allowance_settles_where_a_step_takes_the_target() -> None:
    pacing = StepPacing(target_ms=30.0, max_tokens=2048)
    seen = settle(pacing, lambda n: 0.005 + 0.0002 * n)  # the target is met at 125 tokens
    assert seen[0] == 4 * MIN_CHUNK  # the first step is small, before anything is measured
    assert set(seen[-20:]) <= {96, 128, 192}  # the rungs around 125: it stays near the fixed point
    assert 0.005 + 0.0002 * seen[-1] == pytest.approx(0.030, rel=0.35)


def test_the_allowance_follows_a_slower_step_down_and_back_up() -> None:
    pacing = StepPacing(target_ms=30.0, max_tokens=2048)
    settle(pacing, lambda n: 0.005 + 0.0002 * n)
    slow = settle(pacing, lambda n: 0.005 + 0.0010 * n)  # a longer context: each token costs 5x
    assert set(slow[-10:]) <= {16, 24, 32}  # 25 tokens meet the target
    fast = settle(pacing, lambda n: 0.001 + 0.00001 * n)
    assert fast[-1] == 2048  # never above the step's token budget


def test_a_step_over_the_target_whatever_its_size_keeps_the_least_chunk() -> None:
    pacing = StepPacing(target_ms=5.0, max_tokens=2048)
    assert settle(pacing, lambda n: 0.020 + 0.0001 * n)[-1] == MIN_CHUNK  # progress, whatever the target


def test_unbounded_steps_move_the_floor_but_not_the_allowance() -> None:
    pacing = StepPacing(target_ms=0.0, max_tokens=2048)  # auto
    assert pacing.target_s is None  # nothing measured yet
    pacing.observe(0.010, bounded=False)  # a short prompt's step: it ended within the allowance
    assert pacing.allowance == 4 * MIN_CHUNK
    assert pacing.target_s == pytest.approx(AUTO_QUIET * 0.010)
    pacing.observe(0.004, bounded=False)
    assert pacing.floor_s == pytest.approx(0.004)  # the cheapest prefill step
    pacing.observe(0.050, bounded=True)
    assert pacing.floor_s == pytest.approx(0.004 * 1.0005)  # a costly step does not raise it, time does a little
    assert pacing.allowance < 4 * MIN_CHUNK


def test_auto_aims_at_short_steps_while_others_wait_and_long_ones_alone() -> None:
    pacing = StepPacing(target_ms=0.0, max_tokens=2048)
    pacing.observe(0.004, bounded=False)
    cost = lambda n: 0.004 + 0.0001 * n  # noqa: E731
    for _ in range(40):
        pacing.observe(cost(pacing.pace(decoding=False)), bounded=True)
    alone = pacing.allowance
    assert cost(alone) == pytest.approx(AUTO_QUIET * 0.004, rel=0.35)  # long steps: little fixed cost
    busy = pacing.pace(decoding=True)  # a sequence decodes beside it: at once much smaller
    assert busy <= alone * AUTO_BUSY / AUTO_QUIET * 1.5
    for _ in range(40):
        pacing.observe(cost(pacing.pace(decoding=True)), bounded=True)
    assert cost(pacing.allowance) == pytest.approx(AUTO_BUSY * 0.004, rel=0.35)
    pacing.arrived()  # no decode, but a request just arrived: still short
    assert pacing.pace(decoding=False) == pacing.allowance and pacing.busy
    pacing.last_arrival -= 10  # long ago: alone again, the allowance grows back at once
    before = pacing.allowance
    assert pacing.pace(decoding=False) > 2 * before and not pacing.busy


def test_off_keeps_the_token_budget() -> None:
    pacing = StepPacing(target_ms=math.inf, max_tokens=512)
    assert settle(pacing, lambda n: 1.0) == [512] * 60
    assert pacing.target_s is None and pacing.floor_s is None


@pytest.mark.parametrize("raw, parsed", [("auto", 0.0), ("off", math.inf), ("25", 25.0), ("7.5", 7.5)])
def test_the_setting_reads_auto_off_or_milliseconds(raw: str, parsed: float) -> None:
    settings = load_settings(env={"IGNIS_ENGINE__STEP_TIME_TARGET_MS": raw})
    assert settings.value("engine.step_time_target_ms") == parsed
    assert EngineConfig.from_settings(settings).step_time_target_ms == parsed


@pytest.mark.parametrize("raw", ["-5", "soon", "nan"])
def test_a_bad_step_time_target_is_refused_naming_the_key(raw: str) -> None:
    with pytest.raises(ValueError, match="STEP_TIME_TARGET_MS: expected auto, off or milliseconds"):
        load_settings(env={"IGNIS_ENGINE__STEP_TIME_TARGET_MS": raw})


# --- the engine -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


class Driven:
    """An EngineCore stepped by the test, each step's plan kept."""

    def __init__(self, tiny: tuple[LoadedModel, Tokenizer], **config: object) -> None:
        self.core = EngineCore(*tiny, EngineConfig(kv_cache_bytes=64 << 20, reuse_prompt=False,  # type: ignore[arg-type]
                                                   **config))
        self.updates: dict[str, list[RequestUpdate]] = {}
        self.plans: list[StepPlan] = []
        schedule = self.core.scheduler.schedule

        def kept() -> StepPlan:
            self.plans.append(schedule())
            return self.plans[-1]

        self.core.scheduler.schedule = kept  # type: ignore[method-assign]

    def submit(self, rid: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        self.core.submit(EngineRequest(rid, prompt, params), lambda u: self.updates.setdefault(u.request_id, []).append(u))
        self.core.drain_inbox()

    def step(self) -> StepPlan:
        self.core.step()
        return self.plans[-1]

    def seq(self, rid: str) -> EngineSequence:
        return next(s for s in self.core.scheduler.running if s.request.request_id == rid)

    def tokens(self, rid: str) -> list[int]:
        return [t for u in self.updates.get(rid, ()) for d in u.deltas for t in d.token_ids]

    def done(self, rid: str) -> bool:
        return any(u.done for u in self.updates.get(rid, ()))

    def finish(self) -> None:
        while self.core.scheduler.has_work():
            self.core.step()


def prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def chunk_of(plan: StepPlan, seq: EngineSequence) -> int:
    return sum(c.num_tokens for c in plan.chunks if c.seq is seq)


def test_a_short_prompt_ends_in_the_next_step_with_no_long_chunk_beside_it(tiny: tuple[LoadedModel, Tokenizer]
                                                                           ) -> None:
    run = Driven(tiny, step_time_target_ms=1000.0)  # a target no step reaches here: the allowance only grows
    run.submit("long", prompt(3000, 1), 1)
    run.step()
    run.step()
    long = run.seq("long")
    assert 0 < long.num_computed < 3000  # prefilling, in chunks
    run.submit("probe", prompt(12, 2), 3)
    plan = run.step()
    assert run.tokens("probe")  # its first token: the very next step
    assert chunk_of(plan, long) == 0  # that step ran no long chunk beside it
    before = long.num_computed
    plan = run.step()  # the probe decodes: the long prompt runs its chunk beside the decode
    assert chunk_of(plan, long) > 0 and long.num_computed > before
    run.finish()
    assert run.done("long") and len(run.tokens("probe")) == 3


def test_the_token_budget_alone_shares_the_step(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    """`off`: the step that ends the probe's prompt also runs the long prompt's chunk (the old way,
    which bench/long_prefill.py compares against)."""
    run = Driven(tiny, step_time_target_ms=math.inf, prefill_chunk_tokens=512)
    run.submit("long", prompt(3000, 1), 1)
    run.step()
    run.submit("probe", prompt(12, 2), 3)
    plan = run.step()
    assert run.tokens("probe") and chunk_of(plan, run.seq("long")) == 512 - 12
    run.finish()


def test_a_stream_of_short_prompts_slows_a_long_one_and_never_stops_it(tiny: tuple[LoadedModel, Tokenizer]
                                                                       ) -> None:
    run = Driven(tiny, step_time_target_ms=1000.0)
    run.submit("long", prompt(2000, 3), 1)
    run.step()
    long = run.seq("long")
    still = 0
    for i in range(4 * (MAX_PREFILL_YIELDS + 1)):
        run.submit(f"probe{i}", prompt(8, 100 + i), 1)  # one short prompt ends in every step
        before = long.num_computed
        run.step()
        assert run.done(f"probe{i}")
        still = still + 1 if long.num_computed == before else 0
        assert still <= MAX_PREFILL_YIELDS  # it yields a few steps in a row at most, then takes its chunk
        if long.num_computed == 2000:
            break
    assert long.num_computed > 0
    run.finish()
    assert run.done("long")


@pytest.mark.parametrize("target_ms", [0.001, 0.0])  # every chunk the least one; auto
def test_a_paced_prefill_computes_what_an_unpaced_one_does(tiny: tuple[LoadedModel, Tokenizer],
                                                           target_ms: float) -> None:
    long = prompt(700, 4)
    outputs = []
    for target in (math.inf, target_ms):
        run = Driven(tiny, step_time_target_ms=target)
        run.submit("long", long, 6)
        run.finish()
        prefill_steps = [p for p in run.plans if p.prefill_tokens]
        if target == 0.001:
            assert all(p.prefill_tokens <= 4 * MIN_CHUNK for p in prefill_steps)  # cut into small chunks
            assert len(prefill_steps) >= 700 // (4 * MIN_CHUNK)
        logprobs = [lp for u in run.updates["long"] for d in u.deltas for lp in (d.logprobs or ())]
        outputs.append((run.tokens("long"), logprobs))
        if target == 0.001:  # what /metrics says of it
            stats = run.core.stats()
            assert stats.paced_steps >= len(prefill_steps) - 2  # all but the first and the last
            assert (stats.prefill_allowance_tokens, stats.step_time_target_seconds) == (MIN_CHUNK, 1e-6)
            exposed = generate_latest(run.core.metrics.registry).decode()
            assert f"ignis_prefill_allowance_tokens {float(MIN_CHUNK)}" in exposed
            assert f"ignis_paced_steps_total {float(stats.paced_steps)}" in exposed
    assert outputs[1][0] == outputs[0][0]  # the same greedy tokens
    for paced, unpaced in zip(outputs[1][1], outputs[0][1]):
        assert paced.logprob == pytest.approx(unpaced.logprob, abs=1e-3)
