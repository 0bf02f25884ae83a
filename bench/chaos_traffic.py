"""The chaos bench's traffic: OpenAI chat requests through the gateway, each recorded and
checked against its reference answer (bench/chaos.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx


from bench.chaos_stack import Prompt, body, divergence


@dataclass(slots=True)
class Record:
    window: int
    prompt: str
    stream: bool
    start: float
    end: float = 0.0
    outcome: str = ""  # ok, wrong, failed, lost, aborted
    tier: str = ""  # where its reuse came from (the answer's `ignis.tier`)
    detail: str = ""


class Traffic:
    """`concurrency` workers sending chat requests while running; a sweep queue goes first, then random prompts."""

    def __init__(self, base_url: str, prompts: list[Prompt], concurrency: int, deadline: float, seed: int) -> None:
        self.prompts, self.concurrency, self.deadline = prompts, concurrency, deadline
        self.rng = random.Random(seed)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=deadline + 30,
                                      limits=httpx.Limits(max_connections=concurrency + 32))
        self.records: list[Record] = []
        self.gate = asyncio.Event()  # cleared: workers hold new requests (the engine is down)
        self.gate.set()
        self.window = 0
        self.sent = 0  # requests started in this window
        self.inflight = 0
        self.queue: list[Prompt] = []
        self._workers: list[asyncio.Task[None]] = []
        self._running = False

    def start(self) -> None:
        self.window += 1
        self.sent, self.queue, self._running = 0, [], True
        self.gate.set()
        self._workers = [asyncio.create_task(self._worker()) for _ in range(self.concurrency)]

    async def stop(self) -> None:
        """Stop sending; returns once every request in flight has ended."""
        self._running = False
        self.gate.set()
        await asyncio.gather(*self._workers)

    async def pause(self) -> None:
        self.gate.clear()
        while self.inflight:
            await asyncio.sleep(0.02)

    async def send(self, n: int) -> None:
        """Returns once `n` more requests have been sent."""
        target = self.sent + n
        while self.sent < target:
            await asyncio.sleep(0.02)

    async def sweep(self) -> None:
        """Every prompt once (shuffled), ahead of random ones; returns once all are sent."""
        order = list(self.prompts)
        self.rng.shuffle(order)
        self.queue.extend(order)
        while self.queue:
            await asyncio.sleep(0.02)

    def of(self, window: int) -> list[Record]:
        return [r for r in self.records if r.window == window]

    async def _worker(self) -> None:
        while self._running:
            await self.gate.wait()
            if not self._running:
                break
            prompt = self.queue.pop(0) if self.queue else self.rng.choice(self.prompts)
            await self.one(prompt, self.rng.random() < 0.5)

    def _begin(self, prompt: Prompt, stream: bool) -> Record:
        record = Record(self.window, prompt.key, stream, time.monotonic())
        self.records.append(record)
        self.sent += 1
        self.inflight += 1
        return record

    async def one(self, prompt: Prompt, stream: bool) -> Record:
        record = self._begin(prompt, stream)  # before any await: a cleared gate holds every later request
        try:
            async with asyncio.timeout(self.deadline):
                text, record.tier = await (self._stream(prompt) if stream else self._whole(prompt))
            record.outcome = "ok" if text == prompt.reference else "wrong"
            if record.outcome == "wrong":
                record.detail = divergence(prompt, text)
        except TimeoutError:
            record.outcome, record.detail = "lost", f"{prompt.key}: no answer within {self.deadline:.0f}s"
        except (Failed, httpx.HTTPError, ValueError, KeyError) as err:  # ValueError, KeyError: a malformed answer
            record.outcome, record.detail = "failed", f"{prompt.key}: {type(err).__name__}: {str(err)[:200]}"
        finally:
            record.end = time.monotonic()
            self.inflight -= 1
        return record

    async def _whole(self, prompt: Prompt) -> tuple[str, str]:
        reply = await self.http.post("/chat/completions", json=body(prompt, False))
        if reply.status_code != 200:
            raise Failed(f"HTTP {reply.status_code}: {reply.text[:200]}")
        data = reply.json()
        return data["choices"][0]["message"]["content"] or "", (data.get("ignis") or {}).get("tier", "")

    async def _stream(self, prompt: Prompt) -> tuple[str, str]:
        text, tier, finish, done = "", "", None, False
        async with self.http.stream("POST", "/chat/completions", json=body(prompt, True)) as reply:
            if reply.status_code != 200:
                raise Failed(f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:200]}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise Failed(f"error event: {json.dumps(chunk['error'])[:200]}")
                for choice in chunk.get("choices") or []:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
                tier = (chunk.get("ignis") or {}).get("tier", tier)
        if not (done and finish):
            raise Failed("stream ended without a finish_reason and [DONE]")
        return text, tier

    async def abort(self, prompt: Prompt) -> Record:
        """A long stream cut (the connection closed) after its first chunk."""
        record = self._begin(prompt, True)
        try:
            async with asyncio.timeout(self.deadline):
                payload = body(prompt, True, max_tokens=256, ignore_eos=True)
                async with self.http.stream("POST", "/chat/completions", json=payload) as reply:
                    if reply.status_code != 200:
                        raise Failed(f"HTTP {reply.status_code}")
                    async for line in reply.aiter_lines():
                        if line.startswith("data: "):
                            record.outcome = "aborted"
                            break  # leaving the block closes the connection mid-stream
                    else:
                        raise Failed("stream ended before its first chunk")
        except TimeoutError:
            record.outcome, record.detail = "lost", f"abort {prompt.key}: no first chunk within {self.deadline:.0f}s"
        except (Failed, httpx.HTTPError) as err:
            record.outcome, record.detail = "failed", f"abort {prompt.key}: {type(err).__name__}: {err}"
        finally:
            record.end = time.monotonic()
            self.inflight -= 1
        return record


class Failed(Exception):
    """An error status, an error event, or a stream cut short."""


# ---------------------------------------------------------------- windows and faults


