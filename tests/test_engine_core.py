"""EngineCore in-process: preemption under page pressure, class ranking, integrity."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore, QueueFull
from engine.model.loader import LoadedModel, load_model
from engine.offline import greedy_generate
from engine.outputs import RequestUpdate
from engine.facts import RequestClass
from engine.request import EngineRequest, FinishReason
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def make_core(tiny: tuple[LoadedModel, Tokenizer], pages: int, **kw: int) -> EngineCore:
    loaded, tokenizer = tiny
    # ignis-tiny's page: 2 attention layers x K/V x 16 positions x 2 KV heads x 64 x fp32 (a dense model's: its own)
    page_bytes = loaded.config.state_shape().kv_bytes_per_page(16, loaded.model.dtype)
    core = EngineCore(loaded, tokenizer, EngineConfig(page_size=16, kv_cache_bytes=pages * page_bytes, **kw))
    assert core.pages.num_pages == pages
    return core


def make_prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def make_request(rid: str, prompt: tuple[int, ...], max_tokens: int, cls: RequestClass = RequestClass.INTERACTIVE,
                 **params: object) -> EngineRequest:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)  # type: ignore[arg-type]
    return EngineRequest(rid, prompt, sampling, cls)


class Collector:
    def __init__(self) -> None:
        self.updates: dict[str, list[RequestUpdate]] = {}
        self.order: list[str] = []
        self.lock = threading.Lock()
        self.all_done = threading.Event()
        self.expected = 0

    def sink(self, update: RequestUpdate) -> None:
        with self.lock:
            self.updates.setdefault(update.request_id, []).append(update)
            if update.done:
                self.order.append(update.request_id)
                if len(self.order) == self.expected:
                    self.all_done.set()

    def tokens(self, rid: str, choice: int = 0) -> list[int]:
        return [t for u in self.updates[rid] for d in u.deltas if d.choice == choice for t in d.token_ids]


def run_all(core: EngineCore, requests: list[EngineRequest]) -> Collector:
    out = Collector()
    out.expected = len(requests)
    core.start()
    try:
        for r in requests:
            core.submit(r, out.sink)
        assert out.all_done.wait(120), "requests did not finish"
    finally:
        core.stop()
    return out


def test_preemption_under_page_pressure_keeps_outputs_exact(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    prompts = [make_prompt(40, seed=i) for i in range(4)]
    core = make_core(tiny, pages=20)
    out = run_all(core, [make_request(f"r{i}", p, 60) for i, p in enumerate(prompts)])
    assert core.totals.preempted > 0  # 4 x 7 pages do not fit in 20
    for i, p in enumerate(prompts):
        assert out.tokens(f"r{i}") == greedy_generate(tiny[0], list(p), 60).token_ids
        assert out.updates[f"r{i}"][-1].usage is not None
    core.check_integrity()
    assert core.stats().used_pages == 0 and core.slots is not None and core.slots.num_used == 0


def test_interactive_preempts_agent_work(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    core = make_core(tiny, pages=64, max_num_seqs=1)
    agent = make_request("agent", make_prompt(20, 1), 40, RequestClass.AGENT)
    interactive = make_request("interactive", make_prompt(20, 2), 5)
    out = Collector()
    out.expected = 2
    core.start()
    try:
        core.submit(agent, out.sink)
        while not out.updates.get("agent"):  # the agent request is running
            threading.Event().wait(0.01)
        core.submit(interactive, out.sink)
        assert out.all_done.wait(120)
    finally:
        core.stop()
    assert out.order == ["interactive", "agent"]
    assert core.totals.preempted >= 1
    assert out.tokens("agent") == greedy_generate(tiny[0], list(agent.prompt_ids), 40).token_ids
    core.check_integrity()


def test_n_forks_share_prompt_pages(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    core = make_core(tiny, pages=64)
    prompt = make_prompt(40, 3)
    out = run_all(core, [make_request("n", prompt, 10, n=3)])
    expected = greedy_generate(tiny[0], list(prompt), 10).token_ids
    assert [out.tokens("n", c) for c in range(3)] == [expected] * 3
    finals = [d for u in out.updates["n"] for d in u.deltas if d.finish_reason is not None]
    assert sorted(d.choice for d in finals) == [0, 1, 2]
    assert all(d.finish_reason is FinishReason.LENGTH for d in finals)
    core.check_integrity()
    assert core.stats().used_pages == 0


def test_echo_prompt_logprobs_and_max_tokens_zero(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    core = make_core(tiny, pages=64)
    prompt = make_prompt(21, 4)
    request = EngineRequest("e", prompt, SamplingParams(temperature=0, max_tokens=0, logprobs=True, top_logprobs=2),
                            echo=True)
    out = run_all(core, [request])
    first = out.updates["e"][0]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
    assert first.prompt_logprobs[0].token_id == prompt[0] and first.prompt_logprobs[0].logprob is None
    # Oracle: the logprob of prompt token i+1 under the model's distribution after tokens 0..i.
    for i in (1, 6, 20):
        logits = greedy_generate(tiny[0], list(prompt[:i]), 1).logits[0]
        expected = torch.log_softmax(logits, -1)
        got = first.prompt_logprobs[i]
        assert got is not None and got.token_id == prompt[i]
        assert abs(got.logprob - expected[prompt[i]].item()) < 1e-4
        assert [t for t, _ in got.top] == torch.topk(expected, 2).indices.tolist()
    assert out.tokens("e") == []
    # Sent again, the prompt's state is retained, but echo with logprobs still prefills it all.
    again = run_all(make_core(tiny, pages=64), [request, EngineRequest("e2", prompt, request.params, echo=True)])
    repeated = again.updates["e2"][0].prompt_logprobs
    assert repeated is not None and len(repeated) == len(first.prompt_logprobs)
    for got, want in zip(repeated[1:], first.prompt_logprobs[1:]):  # batched with its twin: fp32 rounding differs
        assert got.token_id == want.token_id and [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.logprob is not None and want.logprob is not None and abs(got.logprob - want.logprob) < 1e-5
    core.check_integrity()


def test_queue_bound(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    core = make_core(tiny, pages=64, max_queue=2)
    core.submit(make_request("a", make_prompt(5, 1), 5), lambda u: None)
    core.submit(make_request("b", make_prompt(5, 2), 5), lambda u: None)
    with pytest.raises(QueueFull):
        core.submit(make_request("c", make_prompt(5, 3), 5), lambda u: None)
    with pytest.raises(ValueError, match="context"):
        core.validate(make_request("d", make_prompt(5, 3), 64 * 16))


def test_update_listeners_hear_each_round_after_its_updates(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    """A round of updates (a step's, or a cancel between steps) reaches the sinks, then the listeners:
    what a session's outbox waits for before it wakes its loop (engine/session.py)."""
    core = make_core(tiny, pages=64)
    log: list[str] = []
    done = threading.Event()

    def sink(update: RequestUpdate) -> None:
        log.append(f"update {update.request_id}")
        if update.done:
            done.set()

    def listener() -> None:
        log.append("round")

    core.add_update_listener(listener)
    core.start()
    try:
        core.submit(make_request("a", make_prompt(12, 1), 3), sink)
        assert done.wait(60)
        done.clear()
        core.submit(make_request("b", make_prompt(12, 2), 1000), sink)
        assert _until(lambda: "update b" in log)
        core.abort("b")  # ended between steps: its update is followed by a round too
        assert done.wait(60)
        assert _until(lambda: log[-1] == "round")
        updates_a = [i for i, entry in enumerate(log) if entry == "update a"]
        assert len(updates_a) == 3 and all(log[i + 1] in ("round", "update a") for i in updates_a)
        last_b = max(i for i, entry in enumerate(log) if entry == "update b")
        assert "round" in log[last_b + 1:]  # (idle, the loop tells listeners at each wake: they find nothing new)
        core.remove_update_listener(listener)
        rounds = log.count("round")
        done.clear()
        core.submit(make_request("c", make_prompt(12, 3), 2), sink)
        assert done.wait(60)
        assert log.count("round") == rounds
    finally:
        core.stop()


def _until(condition: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
