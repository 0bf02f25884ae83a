"""Reused state against a cold prefill of the same tokens, on a dense and a hybrid model.

Each scenario runs twice on the same checkpoint: once with reuse on, once with
reuse off (the oracle). Greedy tokens must be identical, the chosen tokens'
logprobs within 1e-5, and cached_tokens exactly what was reused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.prompt import render_chat
from engine.facts import RequestClass
from engine.request import CommitPolicy, EngineRequest
from engine.sampling.params import SamplingParams
from engine.text.tokenizer import Tokenizer
from ignis.v1 import engine_pb2

P = 16
SYSTEM = "You are a careful agent. Follow the plan, call tools when needed, and report back. " * 3
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"does thing {i} " * 4,
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for i in range(3)]


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    cached: int
    kind: str
    text: str
    tier: str = "none"


class Harness:
    """One EngineCore driven synchronously from the test thread."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, reuse: bool, retained_device: int = 8,
                 start: bool = True, **config: object) -> None:
        self.tokenizer = tokenizer
        self.core = EngineCore(loaded, tokenizer, EngineConfig(
            page_size=P, kv_cache_bytes=64 << 20, max_num_seqs=8, reuse_prompt=reuse,
            retained_device=retained_device, **config))  # type: ignore[arg-type]
        self.started = start
        if start:
            self.core.start()
        self.n = 0

    def close(self) -> None:
        self.core.stop()

    def request(self, messages: list[dict[str, object]], max_tokens: int = 6, tools: list[object] | None = None,
                **kw: object) -> EngineRequest:
        chat = engine_pb2.ChatInput(tools_json=json.dumps(tools) if tools else "")
        for m in messages:
            chat.messages.add(role=str(m["role"]), content=str(m["content"]))
        rendered = render_chat(self.tokenizer, chat)
        self.n += 1
        params = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
        params.update({k: v for k, v in kw.items() if k in ("temperature", "seed", "n")})
        return EngineRequest(
            f"r{self.n}", rendered.token_ids, SamplingParams(**params),  # type: ignore[arg-type]
            request_class=kw.get("cls", RequestClass.INTERACTIVE),  # type: ignore[arg-type]
            cache_salt=str(kw.get("salt", "")), lookup=bool(kw.get("lookup", True)),
            commit=kw.get("commit", CommitPolicy.INCLUDING_GENERATED_TOKENS),  # type: ignore[arg-type]
            head_tokens=rendered.head_tokens,
        )

    def run(self, *requests: EngineRequest) -> list[Result]:
        """Submit together (so they may batch) and wait for all. On a harness made with
        start=False, the first run's requests all arrive before the engine's first step."""
        all_updates = run_to_completion(self.core, *requests, timeout=120, start=not self.started)
        self.started = True
        out = []
        for updates in all_updates:
            deltas = [d for u in updates for d in u.deltas if d.choice == 0]
            usage = updates[-1].usage
            assert usage is not None
            out.append(Result([t for d in deltas for t in d.token_ids], [lp.logprob for d in deltas for lp in d.logprobs],
                              usage.cached_tokens, usage.reuse.kind.value, "".join(d.text for d in deltas),
                              usage.reuse.tier.value))
        return out

    def check(self) -> None:
        # The engine thread is idle once every request is done; integrity is read from here.
        self.core.check_integrity()
        assert self.core.stats().used_pages == 0


# "hybrid" is ignis-tiny (Qwen3_5ForCausalLM); the published ones are the classes the Qwen3.5/3.6
# family ships under (the text model nested in a multimodal one, dense MLP or MoE), hybrid too.
MODELS = ["dense", "hybrid", "qwen3.5-published", "qwen3.5-moe-published"]
_PUBLISHED = {"qwen3.5-published": "Qwen3_5ForConditionalGeneration",
              "qwen3.5-moe-published": "Qwen3_5MoeForConditionalGeneration"}


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest, tiny_model_dir: Path, dense_chat_model_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LoadedModel, Tokenizer]:
    if request.param in _PUBLISHED:
        from checkpoints import make_checkpoint
        from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

        path = make_checkpoint(tmp_path_factory.mktemp("published"), _PUBLISHED[request.param], seed=3,
                               vocab_size=TINY_VOCAB_SIZE, hidden_size=128)
        write_tiny_tokenizer(path)
    else:
        path = tiny_model_dir if request.param == "hybrid" else dense_chat_model_dir
    return request.param, load_model(path), Tokenizer.from_dir(path)


@pytest.fixture()
def pair(model: tuple[str, LoadedModel, Tokenizer]):  # type: ignore[no-untyped-def]
    name, loaded, tokenizer = model
    warm, cold = Harness(loaded, tokenizer, reuse=True), Harness(loaded, tokenizer, reuse=False)
    yield name, warm, cold
    warm.check()
    cold.check()
    warm.close()
    cold.close()


def same(a: Result, b: Result) -> None:
    assert a.tokens == b.tokens
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def conversation(task: str, system: str = SYSTEM) -> list[dict[str, object]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


def test_same_prompt_twice(pair) -> None:  # type: ignore[no-untyped-def]
    name, warm, cold = pair
    req = warm.request(conversation("Summarise the incident report in three lines."), tools=TOOLS)
    first, second = warm.run(req)[0], warm.run(warm.request(conversation("Summarise the incident report in three lines."), tools=TOOLS))[0]
    oracle = cold.run(cold.request(conversation("Summarise the incident report in three lines."), tools=TOOLS))[0]
    same(first, oracle)
    same(second, oracle)
    n = len(req.prompt_ids)
    # The opener checkpoint, or the dense model's kept end, carries its logits: nothing is prefilled again.
    assert (second.cached, second.kind) == (n, "pages" if name == "dense" else "checkpoint")


def test_turn_two_reuses_turn_one(pair) -> None:  # type: ignore[no-untyped-def]
    name, warm, cold = pair
    turn1 = conversation("Plan the migration of the billing service.")
    req1 = warm.request(turn1, max_tokens=10, tools=TOOLS)
    r1 = warm.run(req1)[0]
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Now list the risks."}]
    req2 = warm.request(turn2, max_tokens=6, tools=TOOLS)
    r2 = warm.run(req2)[0]
    same(r2, cold.run(cold.request(turn2, max_tokens=6, tools=TOOLS))[0])
    full1 = list(req1.prompt_ids) + r1.tokens[:-1]  # the last sampled token was never computed
    shared = common_prefix(full1, req2.prompt_ids)
    if name != "dense":
        # Retained at the opener (end of prompt 1) and at the end of the reply: the longest that prefixes turn 2.
        candidates = [m for m in (len(req1.prompt_ids), len(full1)) if m <= shared]
        assert r2.cached == max(candidates) and r2.kind == "checkpoint"
    else:
        assert r2.cached == min(shared, len(req2.prompt_ids) - 1) // P * P and r2.kind == "pages"
    assert r2.cached >= len(req1.prompt_ids) // P * P


# SYSTEM's head (system + tools) renders to exactly 29 pages; with this ending it ends 7 tokens into the 30th,
# whose other 9 tokens begin the task (which differs per subagent).
MID_PAGE_SYSTEM = SYSTEM + " Be brief."


@pytest.mark.parametrize("system", [SYSTEM, MID_PAGE_SYSTEM], ids=["head-on-a-page-end", "head-mid-page"])
def test_subagent_burst_shares_the_system_and_tools_head(pair, system: str) -> None:  # type: ignore[no-untyped-def]
    """The head is published at its last whole page: a head that ends mid-page is published before it
    (its partial page holds task tokens, which differ per subagent)."""
    name, warm, cold = pair
    tasks = ["Find the flaky test.", "Read the changelog.", "Profile the decoder.", "Draft the release notes.",
             "Check the disk budget."]
    requests = [warm.request(conversation(t, system), tools=TOOLS) for t in tasks]
    head = requests[0].head_tokens // P * P
    assert head > 0 and (requests[0].head_tokens % P == 0) == (system == SYSTEM)
    results = [warm.run(r)[0] for r in requests]
    for task, result in zip(tasks, results):
        same(result, cold.run(cold.request(conversation(task, system), tools=TOOLS))[0])
    assert results[0].cached == 0
    for k in range(1, len(tasks)):
        if name != "dense":
            assert (results[k].cached, results[k].kind) == (head, "prefix")
        else:
            best = max(common_prefix(requests[k].prompt_ids, requests[j].prompt_ids) for j in range(k))
            assert results[k].cached == min(best, len(requests[k].prompt_ids) - 1) // P * P >= head
    assert warm.core.reuse.counters.prefix_reused_tokens == (4 * head if name != "dense" else 0)


def test_identical_heads_arriving_together_are_prefilled_once(model: tuple[str, LoadedModel, Tokenizer]) -> None:
    """A swarm's agents start together with one system+tools head: the first computes it, the
    others are held at admission until it is published, then claim it (no timing: all four are
    queued before the engine's first step). An unrelated request is not held behind them."""
    name, loaded, tokenizer = model
    held, cold = Harness(loaded, tokenizer, reuse=True, start=False), Harness(loaded, tokenizer, reuse=False)
    try:
        tasks = ["Find the flaky test.", "Read the changelog.", "Profile the decoder.", "Draft the release notes."]
        requests = [held.request(conversation(t), tools=TOOLS, cls=RequestClass.AGENT) for t in tasks]
        other = held.request([{"role": "user", "content": "Unrelated: name three prime numbers."}],
                             cls=RequestClass.AGENT)
        results = held.run(*requests, other)
        head = requests[0].head_tokens // P * P
        assert results[0].cached == 0 and results[-1].cached == 0
        for result in results[1:-1]:
            assert result.cached >= head
            if name != "dense":
                assert result.kind == "prefix"
        assert held.core.reuse.counters.inflight_holds == len(tasks) - 1
        assert held.core.stats().inflight_holds == len(tasks) - 1
        for task, result in zip(tasks, results):
            same(result, cold.run(cold.request(conversation(task), tools=TOOLS))[0])
        held.check()
    finally:
        held.close()
        cold.close()


def test_bypass_requests_are_never_held(model: tuple[str, LoadedModel, Tokenizer]) -> None:
    """Held admission waits only for state the request may claim and the running one will publish."""
    _, loaded, tokenizer = model
    held = Harness(loaded, tokenizer, reuse=True, start=False)
    try:
        msgs = conversation("Find the flaky test.")
        results = held.run(held.request(msgs, tools=TOOLS, lookup=False), held.request(msgs, tools=TOOLS),
                           held.request(msgs, tools=TOOLS, lookup=False))
        assert [r.cached for r in results] == [0, 0, 0]
        assert held.core.reuse.counters.inflight_holds == 0
    finally:
        held.close()


def test_seeded_regenerate_hits_and_matches(pair) -> None:  # type: ignore[no-untyped-def]
    _, warm, cold = pair
    msgs = conversation("Write a haiku about page tables.")
    warm.run(warm.request(msgs, tools=TOOLS))
    again = warm.run(warm.request(msgs, tools=TOOLS, temperature=0.9, seed=42))[0]
    oracle = cold.run(cold.request(msgs, tools=TOOLS, temperature=0.9, seed=42))[0]
    assert again.cached > 0
    same(again, oracle)


def test_concurrent_forks_both_hit(pair) -> None:  # type: ignore[no-untyped-def]
    _, warm, cold = pair
    base = conversation("Compare the two designs.")
    warm.run(warm.request(base, max_tokens=4, tools=TOOLS))
    fork_a = base + [{"role": "assistant", "content": "Design A is simpler."}, {"role": "user", "content": "Why?"}]
    fork_b = base + [{"role": "assistant", "content": "Design B is faster."}, {"role": "user", "content": "Prove it."}]
    a, b = warm.run(warm.request(fork_a, tools=TOOLS), warm.request(fork_b, tools=TOOLS))
    assert a.cached > 0 and b.cached > 0
    same(a, cold.run(cold.request(fork_a, tools=TOOLS))[0])
    same(b, cold.run(cold.request(fork_b, tools=TOOLS))[0])
    # n > 1 forks of one request: every choice equals the cold greedy run.
    multi = warm.request(base, tools=TOOLS, n=2)
    assert warm.run(multi)[0].tokens == cold.run(cold.request(base, tools=TOOLS))[0].tokens


def test_misses(pair) -> None:  # type: ignore[no-untyped-def]
    name, warm, _ = pair
    msgs = conversation("Estimate the cost of the run.")
    warm.run(warm.request(msgs, tools=TOOLS))
    assert warm.run(warm.request(msgs, tools=TOOLS, commit=CommitPolicy.NONE))[0].cached > 0  # looks up
    changed_system = [{"role": "system", "content": "Different system prompt."}, msgs[1]]
    assert warm.run(warm.request(changed_system, tools=TOOLS))[0].cached == 0
    assert warm.run(warm.request(msgs, tools=TOOLS, salt="tenant-b"))[0].cached == 0
    hits_before = warm.core.reuse.counters.hits
    assert warm.run(warm.request(msgs, tools=TOOLS, lookup=False))[0].cached == 0
    assert warm.core.reuse.counters.hits == hits_before
    # bypass publishes nothing: a new prompt sent with bypass, then normally, misses.
    fresh = conversation("A question never asked before, sent with bypass first.")
    other_system = [{"role": "system", "content": "Another system block for bypass."}, fresh[1]]
    warm.run(warm.request(other_system, lookup=False))
    assert warm.run(warm.request(other_system))[0].cached == 0
    # commit=none looks up (it hits what others published) but publishes nothing of its own.
    third = [{"role": "system", "content": "A third system block, committed with none."}, fresh[1]]
    assert warm.run(warm.request(third, commit=CommitPolicy.NONE))[0].cached == 0
    assert warm.run(warm.request(third))[0].cached == 0


def test_retained_slots_exhausted_skip_and_count(model: tuple[str, LoadedModel, Tokenizer]) -> None:
    name, loaded, tokenizer = model
    if name == "dense":
        pytest.skip("retained-state slots are a hybrid-model mechanism; dense models share pages")
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=1)
    cold = Harness(loaded, tokenizer, reuse=False)
    try:
        first = warm.run(warm.request([{"role": "user", "content": "interactive and protected"}], max_tokens=1))[0]
        assert warm.core.residency.retained_slots == (1, 1)
        skips = warm.core.reuse.counters.slot_skips
        # An agent capture may not evict a protected interactive state: it is skipped and counted.
        req = warm.request([{"role": "user", "content": "agent work"}], max_tokens=3, cls=RequestClass.AGENT)
        got = warm.run(req)[0]
        assert warm.core.reuse.counters.slot_skips > skips
        same(got, cold.run(cold.request([{"role": "user", "content": "agent work"}], max_tokens=3))[0])
        assert first.tokens
    finally:
        warm.check()
        warm.close()
        cold.close()
