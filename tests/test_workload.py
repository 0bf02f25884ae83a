"""The agent-swarm trace (bench/workload.py): deterministic for a seed, the asked shapes and sizes,
and its driver run for real against an engine + gateway serving ignis-tiny."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bench.workload import TokenCounter, WorkloadConfig, cached_from, make_trace, run_trace
from engine.text.tokenizer import Tokenizer
from services import RunningService, start_gateway


def make_config(**overrides: int) -> WorkloadConfig:
    return replace(WorkloadConfig(agents=3, turns=4, head_tokens=300, task_tokens=12, message_tokens=20,
                                  max_tokens=4, burst_every=2, burst_size=4, seed=11), **overrides)


@pytest.fixture(scope="module")
def count(tiny_model_dir: Path) -> TokenCounter:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    return lambda text: len(tokenizer.encode(text))


def test_same_seed_same_trace_other_seed_other_trace(count: TokenCounter) -> None:
    a, b = make_trace(make_config(), count), make_trace(make_config(), count)
    assert a == b
    replies = ["first reply", "second reply", "third reply"]
    assert a.conversation(2, replies) == b.conversation(2, replies)
    other = make_trace(make_config(seed=12), count)
    assert other.head != a.head and other.tasks != a.tasks and other.followups != a.followups


def test_shapes_agents_turns_and_bursts_sharing_the_head(count: TokenCounter) -> None:
    trace = make_trace(make_config(), count)
    assert len(trace.tasks) == 3 and len(set(trace.tasks)) == 3
    assert [len(f) for f in trace.followups] == [3, 3, 3]  # a message after each reply but the last
    # bursts after rounds 2 and 4 (0-based 1 and 3), four different tasks each
    assert [b.after_round for b in trace.bursts] == [1, 3]
    assert all(len(set(b.tasks)) == 4 for b in trace.bursts)
    assert trace.request_count() == 3 * 4 + 2 * 4
    head = {"role": "system", "content": trace.head}
    for burst in trace.bursts:
        assert all(trace.first_messages(task)[0] == head for task in burst.tasks)
    # turn t: head, task, then (reply, follow-up) for each earlier turn; every turn extends the last
    turns = [trace.conversation(1, [f"reply {i}" for i in range(t)]) for t in range(4)]
    assert [len(m) for m in turns] == [2, 4, 6, 8]
    assert all(turns[t + 1][:len(turns[t])] == turns[t] for t in range(3))
    assert turns[3][0] == head and turns[3][1] == {"role": "user", "content": trace.tasks[1]}
    assert turns[3][2:4] == [{"role": "assistant", "content": "reply 0"},
                             {"role": "user", "content": trace.followups[1][0]}]
    assert "<tools>" in trace.head and '"type": "function"' in trace.head
    assert make_trace(make_config(burst_every=0), count).bursts == ()


def test_sizes_in_tokens_of_the_tiny_tokenizer(count: TokenCounter) -> None:
    trace = make_trace(make_config(head_tokens=2048, message_tokens=96, task_tokens=48), count)
    assert 2048 <= count(trace.head) < 2048 + 200  # whole tool definitions: at most one too many
    bodies = [f.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
              for fs in trace.followups for f in fs]
    assert all(96 <= count(b) <= 96 + 8 for b in bodies)
    assert any(f.startswith("<tool_response>") for fs in trace.followups for f in fs)
    assert any(not f.startswith("<tool_response>") for fs in trace.followups for f in fs)


def test_cached_tokens_from_usage_else_llama_server_timings() -> None:
    assert cached_from({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}, {"cache_n": 7}) == 4
    assert cached_from({"prompt_tokens": 10}, {"cache_n": 7, "prompt_n": 3}) == 7
    assert cached_from({"prompt_tokens": 10, "prompt_tokens_details": None}, {}) == 0


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ValueError, match="agents"):
        WorkloadConfig(agents=0)
    with pytest.raises(ValueError, match="burst_every"):
        WorkloadConfig(burst_every=-1)


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
    yield service
    assert service.stop() == 0, service.log()


def test_driver_against_ignis_reports_reuse_on_later_turns_and_bursts(gateway: RunningService,
                                                                      count: TokenCounter) -> None:
    config = make_config(agents=2, turns=2, head_tokens=96, burst_every=2, burst_size=2)
    trace = make_trace(config, count)
    records, wall = asyncio.run(run_trace(f"http://{gateway.address}/v1", "ignis-tiny", trace, "ignis",
                                          progress=False))
    assert wall > 0
    assert sorted((r.agent, r.turn, r.kind) for r in records) == [
        ("agent-0", 0, "first-turn"), ("agent-0", 1, "later-turn"), ("agent-1", 0, "first-turn"),
        ("agent-1", 1, "later-turn"), ("burst-0/sub-0", 0, "subagent"), ("burst-0/sub-1", 0, "subagent")]
    assert all(r.server == "ignis" and 0 < r.ttft_s <= r.e2e_s and 0 < r.output_tokens <= 4 for r in records)
    by = {(r.agent, r.turn): r for r in records}
    for agent in ("agent-0", "agent-1"):
        first, later = by[(agent, 0)], by[(agent, 1)]
        assert later.prompt_tokens > first.prompt_tokens + 20  # the reply and the follow-up were appended
        # the later turn reuses at least the first turn's whole prompt (its opener checkpoint)
        assert later.cached_tokens >= first.prompt_tokens
        assert later.computed_tokens == later.prompt_tokens - later.cached_tokens
    # the subagents start from the head the agents published (whole pages of it)
    subs = [r for r in records if r.kind == "subagent"]
    assert all(r.cached_tokens > 0 and r.cached_tokens % 16 == 0 for r in subs)
    assert all(r.round == 1 for r in subs)
