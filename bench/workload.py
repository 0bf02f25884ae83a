"""A reproducible agent-swarm trace, and a driver that runs it against any OpenAI-compatible server.

The trace (seeded): N agents, each a conversation of T turns over one shared
system prompt that carries the tool definitions; every turn appends the
assistant's reply (the one the server actually returned, so the trace is honest
for each server) and then a tool result or a user message. After every
`burst_every` rounds of turns, a burst of subagents starts together from the
same system+tools head, each with its own task.

(With random weights a reply is a random token sequence that the tokenizer does
not produce again from its text, so a later turn can match the earlier prompt
and only the first few tokens of the reply: on every server alike.)

Everything but the replies is decided by the seed. Text comes from a word list
that the ignis-tiny tokenizer (the bench checkpoints' tokenizer) holds as whole
tokens, so lengths in tokens are predictable; pass `count_tokens` to size them
exactly.

Why the tools are text in the system message rather than the API's `tools`
field: every server then sees the same tokens whatever its chat-template
support, and no server turns a random model's `<tool_call>` into a parse error.
Tool results are user messages wrapped in `<tool_response>`, as the ChatML tool
template renders them.

The driver runs the rounds in lockstep: the agents' turns of one round run
concurrently, then the burst (if one is due), then the next round; so both
servers see the same batches. Requests stream (`stream_options.include_usage`)
and carry `X-Ignis-Class: agent` (other servers ignore the header).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any, Callable, Literal

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]

Kind = Literal["first-turn", "later-turn", "subagent"]
Message = dict[str, str]
TokenCounter = Callable[[str], int]

# Common words of the ignis-tiny tokenizer's corpus: each is one token with its leading space.
WORDS = """time year people way day thing life world school state family group country problem
hand part place case week company system program question work number night point home water
room area money story fact month lot right study book job word business issue side kind head house
service friend power hour game line end member law car city community name team minute idea body
information back parent face level office door health person art history party result change
morning reason research moment teacher force model server request token cache memory page engine
response function argument value weather temperature forecast file folder database query table
column index record message conversation assistant user tool error warning status code test package
module library version release update network address port window button screen image train ticket
hotel garden tree river mountain street road bridge is was are be have has do did say go get make
know think take see come want look use find give tell work call try ask need feel become leave put
mean keep let begin seem help show hear play run move live believe hold bring write provide read
compute store load send receive good new first last long great little own other old right big high
different small large next early young important few public bad same able fast slow quick simple
easy hard short open closed local remote final current previous valid the a of to in for on with
at by from up about into over after and but or because if when while so than that this it they we
you not no very also just only then there here what which who how why where all some any each more
most""".split()
TOOL_NAMES = """read_file write_file list_dir run_tests run_shell search_code search_web get_weather
send_email query_database git_diff git_commit open_url fetch_issue create_ticket calculator""".split()


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    agents: int = 8
    turns: int = 8
    head_tokens: int = 2048  # the shared system prompt + tool definitions
    task_tokens: int = 48  # each agent's and subagent's first user message
    message_tokens: int = 96  # each tool result or user message after a reply
    max_tokens: int = 32  # per reply
    burst_every: int = 2  # rounds of turns between subagent bursts (0: no bursts)
    burst_size: int = 4
    tool_result_share: float = 0.75  # of the messages after a reply, how many are tool results
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("agents", "turns", "head_tokens", "task_tokens", "message_tokens", "max_tokens", "burst_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.burst_every < 0:
            raise ValueError(f"burst_every must be 0 (no bursts) or more, got {self.burst_every}")
        if not 0.0 <= self.tool_result_share <= 1.0:
            raise ValueError(f"tool_result_share must be in [0, 1], got {self.tool_result_share}")

    @property
    def concurrency(self) -> int:
        """The most requests in flight at once (a round, or a burst)."""
        return max(self.agents, self.burst_size if self.burst_every else 0)


@dataclass(frozen=True, slots=True)
class Burst:
    after_round: int  # runs once rounds 0..after_round are done
    tasks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    config: WorkloadConfig
    head: str  # the system message: instructions and tool definitions
    tasks: tuple[str, ...]  # [agent]: the first user message
    followups: tuple[tuple[str, ...], ...]  # [agent][turn - 1]: the message after the reply of turn - 1
    bursts: tuple[Burst, ...]

    def first_messages(self, task: str) -> list[Message]:
        return [{"role": "system", "content": self.head}, {"role": "user", "content": task}]

    def conversation(self, agent: int, replies: list[str]) -> list[Message]:
        """The messages of `agent`'s turn len(replies): the head, the task, then reply + follow-up each turn."""
        messages = self.first_messages(self.tasks[agent])
        for turn, reply in enumerate(replies):
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": self.followups[agent][turn]}]
        return messages

    def request_count(self) -> int:
        return self.config.agents * self.config.turns + sum(len(b.tasks) for b in self.bursts)


def rough_count(text: str) -> int:
    """Tokens of `text` estimated as words plus punctuation marks (when no tokenizer is at hand)."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def words_of_tokens(rng: random.Random, tokens: int, count: TokenCounter) -> str:
    """Seeded text of at least `tokens` tokens by `count` (a little more where a word is several)."""
    words: list[str] = []
    have = 0
    while have < tokens:
        words += [rng.choice(WORDS) for _ in range(max(tokens - have, 1))]
        have = count(" ".join(words))
    return " ".join(words)


def _tool(rng: random.Random, name: str, count: TokenCounter) -> dict[str, Any]:
    params = {w: {"type": rng.choice(["string", "integer", "boolean"]), "description": words_of_tokens(rng, 8, count)}
              for w in rng.sample(WORDS[:120], rng.randint(1, 4))}
    return {"type": "function", "function": {"name": name, "description": words_of_tokens(rng, 24, count),
                                             "parameters": {"type": "object", "properties": params,
                                                            "required": sorted(params)[:1]}}}


def make_head(rng: random.Random, tokens: int, count: TokenCounter) -> str:
    """Instructions, then tool definitions in the ChatML tool layout, until about `tokens` tokens."""
    intro = "You are one agent of a swarm that maintains a software project. " + words_of_tokens(rng, 64, count)
    tools: list[str] = []

    def render() -> str:
        return (f"{intro}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"<tools>\n" + "\n".join(tools) + "\n</tools>")

    while count(render()) < tokens:
        name = TOOL_NAMES[len(tools) % len(TOOL_NAMES)] + ("" if len(tools) < len(TOOL_NAMES) else
                                                          f"_{len(tools) // len(TOOL_NAMES)}")
        tools.append(json.dumps(_tool(rng, name, count)))
    return render()


def make_trace(config: WorkloadConfig, count_tokens: TokenCounter = rough_count) -> Trace:
    """The trace of `config`, its lengths measured by `count_tokens` (the server's tokenizer, for exact sizes)."""
    rng = random.Random(config.seed)
    head = make_head(rng, config.head_tokens, count_tokens)

    def task(who: str) -> str:
        return f"Task for {who}: " + words_of_tokens(rng, config.task_tokens, count_tokens)

    def followup() -> str:
        text = words_of_tokens(rng, config.message_tokens, count_tokens)
        return f"<tool_response>\n{text}\n</tool_response>" if rng.random() < config.tool_result_share else text

    tasks = tuple(task(f"agent {a}") for a in range(config.agents))
    followups = tuple(tuple(followup() for _ in range(config.turns - 1)) for _ in range(config.agents))
    every = config.burst_every
    after = range(every - 1, config.turns, every) if every else range(0)
    bursts = tuple(Burst(r, tuple(task(f"subagent {i} of burst {b}") for i in range(config.burst_size)))
                   for b, r in enumerate(after))
    return Trace(config, head, tasks, followups, bursts)


# ------------------------------------------------------------------ the driver

@dataclass(frozen=True, slots=True)
class RequestRecord:
    server: str
    agent: str  # "agent-3", or "burst-1/sub-2"
    turn: int  # the agent's turn; a subagent's is 0
    round: int  # the lockstep round it ran in (a burst: the round it followed)
    kind: Kind
    ttft_s: float  # to the first streamed token of the reply (or to the end, for an empty reply)
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int  # as the server reports it
    output_tokens: int
    started_s: float  # since the trace started

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the server prefilled (the rest it reused)."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(slots=True)
class _Reply:
    text: str = ""
    first: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)


def cached_from(usage: dict[str, Any], timings: dict[str, Any]) -> int:
    """`usage.prompt_tokens_details.cached_tokens`, else llama-server's own `timings.cache_n`."""
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    return int(timings.get("cache_n") or 0)


async def chat_chunks(http: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The SSE chunks of one streamed chat completion (an agent's); RuntimeError on an HTTP or a stream error."""
    async for chunk in sse_chunks(http, "/chat/completions", body, {"X-Ignis-Class": "agent"}):
        yield chunk


async def sse_chunks(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
    """The SSE chunks of one streamed POST to `path` (chat or completions); RuntimeError on an HTTP or a
    stream error."""
    async with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: "
                               f"{(await response.aread()).decode(errors='replace')[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            yield chunk


def chunk_text(chunk: dict[str, Any]) -> str:
    return "".join((choice.get("delta") or {}).get("content") or "" for choice in chunk.get("choices") or [])


async def stream_chat(http: httpx.AsyncClient, model: str, messages: list[Message], config: WorkloadConfig
                      ) -> tuple[str, float | None, int, int, int]:
    """One streamed chat completion: (reply text, first-token time, prompt, cached, output tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": config.max_tokens, "temperature": 0,
            "seed": config.seed, "stream": True, "stream_options": {"include_usage": True}}
    reply = _Reply()
    async for chunk in chat_chunks(http, body):
        text = chunk_text(chunk)
        if text and reply.first is None:
            reply.first = time.perf_counter()
        reply.text += text
        reply.usage = chunk.get("usage") or reply.usage
        reply.timings = chunk.get("timings") or reply.timings
    usage = reply.usage
    if not usage:
        raise RuntimeError("the server sent no usage (stream_options.include_usage)")
    return (reply.text, reply.first, int(usage["prompt_tokens"]), cached_from(usage, reply.timings),
            int(usage.get("completion_tokens") or 0))


@dataclass
class _Run:
    http: httpx.AsyncClient
    server: str
    model: str
    trace: Trace
    t0: float
    bar: tqdm
    records: list[RequestRecord] = field(default_factory=list)

    async def request(self, agent: str, turn: int, rnd: int, kind: Kind, messages: list[Message]) -> str:
        start = time.perf_counter()
        text, first, prompt, cached, output = await stream_chat(self.http, self.model, messages, self.trace.config)
        end = time.perf_counter()
        self.records.append(RequestRecord(self.server, agent, turn, rnd, kind, (first or end) - start, end - start,
                                          prompt, cached, output, start - self.t0))
        self.bar.update(1)
        return text


async def run_trace(base_url: str, model: str, trace: Trace, server: str, *, api_key: str | None = None,
                    progress: bool = True, timeout: float = 3600.0) -> tuple[list[RequestRecord], float]:
    """Run the whole trace against `base_url` (…/v1); returns the records and the wall time in seconds."""
    config = trace.config
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # A fresh connection per request: a server that closes an idle stream's connection (llama-server
    # does) must not fail the next request of the trace; on loopback a connect costs well under a ms.
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=0)
    bursts = {b.after_round: b for b in trace.bursts}
    replies: list[list[str]] = [[] for _ in range(config.agents)]
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, headers=headers) as http:
        with tqdm(total=trace.request_count(), desc=server, unit="req", file=sys.stderr,
                  disable=not progress) as bar:
            run = _Run(http, server, model, trace, time.perf_counter(), bar)

            async def turn(agent: int, t: int) -> None:
                kind: Kind = "first-turn" if t == 0 else "later-turn"
                messages = trace.conversation(agent, replies[agent])
                replies[agent].append(await run.request(f"agent-{agent}", t, t, kind, messages))

            for rnd in range(config.turns):
                await asyncio.gather(*(turn(a, rnd) for a in range(config.agents)))
                if rnd in bursts:
                    b = trace.bursts.index(bursts[rnd])
                    await asyncio.gather(*(run.request(f"burst-{b}/sub-{i}", 0, rnd, "subagent",
                                                       trace.first_messages(task))
                                           for i, task in enumerate(bursts[rnd].tasks)))
            wall = time.perf_counter() - run.t0
    return sorted(run.records, key=lambda r: r.started_s), wall
