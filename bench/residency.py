"""Where state lives under pressure (issue 15), each figure against its baseline in the same run,
on the benchmark geometry (bench/geometry.py), CPU fp32 unless CUDA is there:

1. pressure (hybrid): 8 agent requests decode in a KV pool sized so that they fill it, then
   interactive requests arrive one at a time: move-down (a real tierstore process: displaced
   sequences go to KV-RAM and resume) vs recompute (the same config without a tierstore);
2. reuse tax (hybrid): cold TTFT with reuse on vs off, on two ways of capturing: device slots
   (the slot and a partial page copied in the step) and host slots through the staging ring
   (the same two copies in the step into a ring buffer, the pages copied by the worker);
3. inter-token latency of 4 running decodes while a ~150 MiB state spills, written on the step
   thread as the allocator reaches it vs written ahead by the copy worker, each vs nothing
   spilling (dense: its state is KV only, so 150 MiB is a prompt it can prefill);
4. KV pool pages free with 8 retained states in host slots vs in device slots (hybrid);
5. same-class pressure (dense, issue 49): 6 requests that each grow to 7 pages arrive together on a
   16-page pool, all interactive: move-down vs recompute vs a pool with room to spare. Live moves
   once traded the room back and forth here forever; every request must finish, each moved a few
   times at most.

    python -m bench.residency [--hidden 1024 --layers 16] [--repeats 5] [--smoke] [--out DIR]

Every engine is an EngineCore stepped on this thread (never started), so the figures are the
step's own wall time; the tierstore is a process of its own (common/launch.py).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench import table
from bench.drive import random_prompt
from bench.geometry import ensure_geometry
from common.launch import Service, launch_tierstore
from common.logs import event_of
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.facts import RequestClass, ReuseTier
from engine.model.loader import LoadedModel, load_model
from engine.outputs import EngineStats, RequestUpdate
from engine.request import EngineRequest, EngineSequence
from engine.sampling.params import SamplingParams
from engine.scheduler import StepPlan
from engine.text.tokenizer import Tokenizer

P = 16
MiB = 1 << 20
Model = tuple[LoadedModel, Tokenizer]


@dataclass(frozen=True, slots=True)
class Sizes:
    agents: int = 8
    agent_prompt: int = 192  # 12 pages; the 14th page is taken at output 18 and the pool is full
    agent_tokens: int = 32
    interactive: int = 4
    interactive_prompt: int = 128
    interactive_tokens: int = 8
    gap_steps: int = 4  # decode steps between interactive arrivals
    tax_sizes: tuple[int, ...] = (1024, 4096)
    repeats: int = 5
    spill_mib: int = 150
    decoders: int = 4
    decoder_prompt: int = 48
    decoder_tokens: int = 48
    retained: int = 8
    retained_tokens: int = 1024
    crowd: int = 6  # same-class pressure: requests, each prompt + tokens, on crowd_pages pages
    crowd_prompt: int = 20
    crowd_tokens: int = 80
    crowd_pages: int = 16

    @classmethod
    def smoke(cls) -> Sizes:
        return cls(agent_prompt=32, agent_tokens=8, interactive_prompt=32, interactive_tokens=4, gap_steps=2,
                   tax_sizes=(64, 128), repeats=2, spill_mib=1, decoder_prompt=16, decoder_tokens=40,
                   retained_tokens=64)


# --- an EngineCore stepped here ----------------------------------------------------------------

class Stepper:
    """An EngineCore never started: this thread drains its inbox and runs its steps. It keeps each
    request's updates and when each arrived, and counts the tokens every forward pass computes and
    the computed tokens a step throws away (a preempted sequence's, to be recomputed)."""

    def __init__(self, model: Model, **config: Any) -> None:
        # Its scenarios are laid out in steps (a request every gap_steps, the pool full at a step): the
        # step time target would cut prompts by this machine's speed (bench/long_prefill.py measures it).
        config = {"step_time_target_ms": math.inf, **config}
        self.core = EngineCore(model[0], model[1], EngineConfig(page_size=P, **config))
        self.updates: dict[str, list[RequestUpdate]] = {}
        self.token_times: dict[str, list[float]] = {}  # perf_counter of each update carrying tokens
        self.done_at: dict[str, float] = {}
        self.steps = 0
        self.forward_tokens = 0
        self.lost_tokens = 0
        schedule = self.core.scheduler.schedule

        def counted() -> StepPlan:
            before = {id(s): (s, s.num_computed) for s in self._sequences()}
            plan = schedule()
            self.forward_tokens += sum(c.num_tokens for c in plan.chunks)
            self.lost_tokens += sum(n - s.num_computed for s, n in before.values() if s.num_computed < n)
            return plan

        setattr(self.core.scheduler, "schedule", counted)  # noqa: B010 - this instance only

    def _sequences(self) -> list[EngineSequence]:
        sched = self.core.scheduler
        return [*sched.running, *self.core.moves.moving, *(s for q in sched.waiting.values() for s in q)]

    def submit(self, rid: str, prompt: tuple[int, ...], max_tokens: int, cls: RequestClass = RequestClass.INTERACTIVE,
               lookup: bool = True, head_tokens: int = 0) -> str:
        self.updates[rid], self.token_times[rid] = [], []

        def sink(update: RequestUpdate) -> None:
            now = time.perf_counter()
            self.updates[rid].append(update)
            if any(d.token_ids for d in update.deltas):
                self.token_times[rid].append(now)
            if update.done:
                self.done_at[rid] = now

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.core.submit(EngineRequest(rid, prompt, params, cls, lookup=lookup, head_tokens=head_tokens), sink)
        self.core.drain_inbox()
        return rid

    def done(self, rid: str) -> bool:
        return rid in self.done_at

    def tokens(self, rid: str) -> list[int]:
        updates = self.updates[rid]
        if updates and updates[-1].error:
            raise RuntimeError(f"request {rid} failed: {updates[-1].error}")
        return [t for u in updates for d in u.deltas for t in d.token_ids]

    def ttft_ms(self, rid: str) -> float:
        usage = self.updates[rid][-1].usage
        assert usage is not None, f"{rid} is not done"
        return usage.time_to_first_token_ms

    def step(self) -> None:
        self.core.drain_inbox()
        if not self.core.scheduler.has_work():
            raise RuntimeError("requests are unfinished but the engine has no work: this is a bug")
        self.core.step()
        self.steps += 1

    def step_until(self, cond: Callable[[], bool], limit: int = 100_000) -> None:
        for _ in range(limit):
            if cond():
                return
            self.step()
        raise RuntimeError("the condition never came")

    def run(self, rid: str, prompt: tuple[int, ...], max_tokens: int = 1, **kw: Any) -> str:
        self.submit(rid, prompt, max_tokens, **kw)
        self.step_until(lambda: self.done(rid))
        self.tokens(rid)  # raises if it failed
        return rid

    def warm_up(self) -> None:
        """First-call costs out of the figures; nothing it computes is published. With a tierstore the
        warm-up request is also moved down and back once (the namespace's Register, the arena's mapping)."""
        rid = self.submit("warm-up", random_prompt(32, 1), 4, lookup=False)
        if self.core.tiers is not None:
            running = self.core.scheduler.running
            self.step_until(lambda: any(s.num_output >= 1 for s in running))
            if not self.core.scheduler.move_down(running[0]):
                raise RuntimeError("the warm-up request could not be moved down: is the tierstore up?")
        self.step_until(lambda: self.done(rid))
        self.tokens(rid)
        self.forward_tokens = self.lost_tokens = 0

    def settle(self) -> None:
        """Let captures copied off the step finish (where the engine stages them: EngineConfig.staging_ring):
        each step collects the copies done by then, so steps of a tiny bypass request run until what reuse
        holds stops changing."""
        held = self.core.stats().cached_pages
        for i in range(20):
            time.sleep(0.05)
            self.run(f"settle-{i}", random_prompt(16, 2), lookup=False)
            held, before = self.core.stats().cached_pages, held
            if held == before:
                return

    def drain_copies(self) -> None:
        """Collect every copy the worker runs off the step (what a step's poll would do)."""
        while self.core.residency.copying:
            self.core.residency.poll()
            time.sleep(0.001)

    def close(self) -> None:
        self.core.check_integrity()
        self.core.stop()


@contextmanager
def spilled_events() -> Iterator[list[dict[str, Any]]]:
    """The fields of every `ignis.request.spilled` event logged inside the block."""
    found: list[dict[str, Any]] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            event = event_of(record)
            if event is not None and event[0] == "ignis.request.spilled":
                found.append(event[1])

    logger, handler = logging.getLogger("ignis.request"), Catch(logging.INFO)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the engine's INFO events are ours to read, not to print
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def page_bytes(model: Model) -> int:
    return model[0].config.state_shape().kv_bytes_per_page(P, model[0].model.dtype)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- 1. pressure: move-down vs recompute ----------------------------------------------------------

def pressure(model: Model, store: Service, z: Sizes) -> dict[str, Any]:
    pages_each = -(-(z.agent_prompt + z.agent_tokens - 1) // P)  # the last sampled token is never computed
    agents = {f"agent{i}": random_prompt(z.agent_prompt, 300 + i) for i in range(z.agents)}
    asks = {f"ask{i}": random_prompt(z.interactive_prompt, 400 + i) for i in range(z.interactive)}
    modes: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, list[int]]] = {}
    for mode, address in (("move-down", store.address), ("recompute", "")):
        s = Stepper(model, kv_cache_bytes=z.agents * pages_each * page_bytes(model),
                    max_num_seqs=z.agents + z.interactive, reuse_prompt=False, tierstore_address=address,
                    tier_timeout=30.0)
        try:
            s.warm_up()
            base = s.core.stats()  # the warm-up's own move is not counted
            with spilled_events() as spills:
                t0 = time.perf_counter()
                for rid, prompt in agents.items():
                    s.submit(rid, prompt, z.agent_tokens, RequestClass.AGENT)
                # Until every agent holds all its pages: the pool is full.
                s.step_until(lambda: s.core.pages.num_free == 0 and len(s.core.scheduler.running) == z.agents)
                full_at = s.steps
                for i, (rid, prompt) in enumerate(asks.items()):
                    s.step_until(lambda: s.steps >= full_at + i * z.gap_steps)
                    s.submit(rid, prompt, z.interactive_tokens)
                s.step_until(lambda: all(s.done(r) for r in [*agents, *asks]))
            stats = s.core.stats()
            outputs[mode] = {rid: s.tokens(rid) for rid in [*agents, *asks]}
            ideal = sum(len(p) + len(outputs[mode][r]) - 1 for r, p in [*agents.items(), *asks.items()])
            done = [s.done_at[r] - t0 for r in agents]
            ttft = [s.ttft_ms(r) for r in asks]
            modes[mode] = {
                "interactive_ttft_ms": ttft, "agents_done_s": done, "steps": s.steps - full_at,
                "sequences_moved": moved(stats) - moved(base),
                "sequences_recomputed": stats.sequences_recomputed - base.sequences_recomputed,
                "requests_preempted": stats.requests_preempted - base.requests_preempted,
                "recomputed_tokens": s.lost_tokens, "forward_tokens": s.forward_tokens, "ideal_tokens": ideal,
                "moved_bytes": sum(int(e.get("bytes", 0)) for e in spills if e.get("kind") == "live"),
                "move_ms": [float(e["ms"]) for e in spills if e.get("kind") == "live"],
            }
        finally:
            s.close()
    same = [r for r in outputs["move-down"] if outputs["move-down"][r] == outputs["recompute"][r]]
    return {"pool_pages": z.agents * pages_each, "pages_each": pages_each, "modes": modes,
            "identical": len(same), "requests": len(outputs["move-down"])}


def moved(stats: EngineStats) -> int:
    return stats.sequences_moved.get(ReuseTier.RAM, 0)


def pressure_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for mode, m in res["modes"].items():
        ttft, done = m["interactive_ttft_ms"], m["agents_done_s"]
        rows.append([
            f"{mode} ({'tierstore' if mode == 'move-down' else 'no tierstore'})",
            round(statistics.median(ttft)), round(max(ttft)), round(statistics.median(done), 1), round(max(done), 1),
            m["sequences_moved"], m["sequences_recomputed"], m["recomputed_tokens"],
            m["forward_tokens"] - m["ideal_tokens"],
            f"identical ({res['identical']}/{res['requests']})" if res["identical"] == res["requests"]
            else f"**differ** ({res['requests'] - res['identical']}/{res['requests']})"])
    return rows


PRESSURE_HEADERS = ["mode", "interactive TTFT p50 ms", "max ms", "agents done p50 s", "max s", "sequences moved down",
                    "sequences recomputed", "recomputed tokens", "extra forward tokens", "greedy outputs vs other mode"]


# --- 5. same-class pressure: every request finishes ------------------------------------------

def crowd(model: Model, store: Service, z: Sizes) -> dict[str, Any]:
    """z.crowd interactive requests arrive together on z.crowd_pages pages, each growing to more than a
    third of the pool: moved down (a tierstore), recomputed (none), and with room to spare (the baseline)."""
    prompts = {f"crowd{i}": random_prompt(z.crowd_prompt, 500 + i) for i in range(z.crowd)}
    pages_each = -(-(z.crowd_prompt + z.crowd_tokens - 1) // P)
    modes: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, list[int]]] = {}
    for mode, address, pages in (("room to spare", "", z.crowd * pages_each), ("move-down", store.address, z.crowd_pages),
                                 ("recompute", "", z.crowd_pages)):
        s = Stepper(model, kv_cache_bytes=pages * page_bytes(model), max_num_seqs=z.crowd, reuse_prompt=False,
                    tierstore_address=address, tier_timeout=30.0)
        try:
            s.warm_up()
            base, steps = s.core.stats(), s.steps
            t0 = time.perf_counter()
            for rid, prompt in prompts.items():
                s.submit(rid, prompt, z.crowd_tokens)
            s.step_until(lambda: all(s.done(r) for r in prompts), limit=100 * z.crowd * (z.crowd_prompt + z.crowd_tokens))
            wall = time.perf_counter() - t0
            stats = s.core.stats()
            outputs[mode] = {rid: s.tokens(rid) for rid in prompts}
            moves = {done.request_id: done.moves for _, done in s.core.outputs.recent if done.request_id in prompts}
            modes[mode] = {
                "pages": pages, "wall_s": wall, "steps": s.steps - steps,
                "tokens": sum(len(t) for t in outputs[mode].values()),
                "sequences_moved": moved(stats) - moved(base), "max_moves": max(moves.values()),
                "thrash": stats.sequence_thrash - base.sequence_thrash,
                "sequences_recomputed": stats.sequences_recomputed - base.sequences_recomputed,
                "recomputed_tokens": s.lost_tokens,
            }
        finally:
            s.close()
    baseline = outputs["room to spare"]
    for mode, m in modes.items():
        m["identical"] = sum(1 for r in prompts if outputs[mode][r] == baseline[r])
    return {"pages_each": pages_each, "requests": z.crowd, "modes": modes}


def crowd_rows(res: dict[str, Any]) -> list[list[Any]]:
    return [[mode, m["pages"], round(m["wall_s"], 2), m["steps"], round(m["tokens"] / m["wall_s"], 1),
             m["sequences_moved"], m["max_moves"], m["thrash"], m["sequences_recomputed"], m["recomputed_tokens"],
             f"identical ({m['identical']}/{res['requests']})" if m["identical"] == res["requests"]
             else f"**differ** ({res['requests'] - m['identical']}/{res['requests']})"]
            for mode, m in res["modes"].items()]


CROWD_HEADERS = ["mode", "pool pages", "all done s", "steps", "tokens/s", "sequences moved down",
                 "most moves of one request", "thrash", "sequences recomputed", "recomputed tokens",
                 "greedy outputs vs room to spare"]


# --- 2. the reuse tax --------------------------------------------------------------------------

def reuse_tax(model: Model, z: Sizes) -> dict[str, Any]:
    longest = max(z.tax_sizes)
    captures = 2 * z.repeats * len(z.tax_sizes)  # a prefix and an opener checkpoint per request
    # Room for the live prompt and every retained copy, and a slot for each: every capture finds
    # room and nothing is evicted, so each repeat does the same work.
    pages = -(-longest // P) + 4 + sum(z.repeats * -(-n // P) for n in z.tax_sizes)
    config = {"kv_cache_bytes": pages * page_bytes(model), "max_num_seqs": 2, "prefill_chunk_tokens": 2048}
    sides = {
        "on": Stepper(model, reuse_prompt=True, retained_device=captures, **config),
        "ring": Stepper(model, reuse_prompt=True, retained_device=0, retained_host=captures,
                        retained_host_tokens=longest, staging_ring=True, **config),
        "off": Stepper(model, reuse_prompt=False, **config),
    }
    out: list[dict[str, Any]] = []
    try:
        for s in sides.values():
            s.warm_up()
        for n in z.tax_sizes:
            head = (n // 2) // P * P  # a chat-shaped prompt: half of it is the stable head
            ms: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(z.repeats):
                prompt = random_prompt(n, 1000 * n + r)  # distinct every repeat: nothing hits
                names = list(sides)
                order = names[r % len(names):] + names[:r % len(names)]  # rotated: load drift falls on all
                for side in order:
                    s = sides[side]
                    rid = s.run(f"tax-{side}-{n}-{r}", prompt, head_tokens=head)
                    if s.updates[rid][-1].usage.cached_tokens:  # type: ignore[union-attr]
                        raise RuntimeError(f"{rid} hit reused state: the tax must be measured cold")
                    ms[side].append(s.ttft_ms(rid))
            out.append({"tokens": n, "head": head, "on_ms": ms["on"], "ring_ms": ms["ring"], "off_ms": ms["off"]})
        sides["ring"].settle()
        on, ring = sides["on"].core.stats(), sides["ring"].core.stats()
    finally:
        for s in sides.values():
            s.close()
    return {"sizes": out, "captured": on.retained_slots_used, "skips": on.retained_slot_skips,
            "ring_captured": ring.retained_host_slots_used,
            "ring_skips": ring.retained_slot_skips + ring.retained_staging_skips}


def tax_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for r in res["sizes"]:
        off = statistics.median(r["off_ms"])
        for side, how in (("on", "device slots: slot + partial page copied in the step"),
                          ("ring", "host slots, staging ring: slot + partial page staged, pages by the worker")):
            ms = r[f"{side}_ms"]
            on = statistics.median(ms)
            best = 100 * (min(ms) / min(r["off_ms"]) - 1)
            rows.append([r["tokens"], how, round(on), f"{min(ms):.0f}–{max(ms):.0f}", round(off),
                         f"{min(r['off_ms']):.0f}–{max(r['off_ms']):.0f}", f"{100 * (on / off - 1):+.1f}",
                         f"{best:+.1f}", f"prefix at {r['head']} + opener at {r['tokens']}"])
    return rows


TAX_HEADERS = ["prompt tokens", "reuse on: captures to", "reuse on p50 ms", "on min–max", "reuse off p50 ms",
               "off min–max", "tax % (p50)", "tax % (min)", "captures"]


# --- 3. decodes while a state spills -------------------------------------------------------------

def spill_itl(model: Model, store: Service, z: Sizes) -> dict[str, Any]:
    """Both ways a spill can run: on the step (spill_ahead_pages=-1) and written ahead."""
    out: dict[str, Any] = {}
    for mode, ahead in (("on the step", -1), ("written ahead", 0)):
        out[mode] = _spill_itl(model, store, z, ahead)
    first = out["on the step"]
    return {"tokens": first["tokens"], "state_bytes": first["state_bytes"], "blank_pages": first["blank_pages"],
            "modes": out}


def _spill_itl(model: Model, store: Service, z: Sizes, ahead: int) -> dict[str, Any]:
    big_pages = max(4, z.spill_mib * MiB // page_bytes(model))
    big = big_pages * P  # page-aligned: its every page is registered, the chain is big_pages long
    first = -(-z.decoder_prompt // P) + 1  # each decoder's pages once it decodes
    final = -(-(z.decoder_prompt + z.decoder_tokens - 1) // P)
    if final <= first:
        raise ValueError("the decoders must outgrow their first pages inside the window")
    blank = z.decoders * first + z.decoders // 2  # runs out mid-window: the next page is one of the chain's
    # No kept prompt ends: the big prompt's pages must be a finished chain on the free list (what spills).
    s = Stepper(model, kv_cache_bytes=(big_pages + blank) * page_bytes(model), max_num_seqs=z.decoders,
                prefill_chunk_tokens=2048, tierstore_address=store.address, tier_timeout=60.0,
                spill_ahead_pages=ahead, retained_device=0)
    runs: dict[str, dict[str, Any]] = {}
    try:
        s.warm_up()

        def window(name: str, seed: int) -> None:
            rids = [s.submit(f"{name}-{i}", random_prompt(z.decoder_prompt, seed + i), z.decoder_tokens, lookup=False)
                    for i in range(z.decoders)]  # bypass: their own pages never become a chain to spill
            waits = s.core.stats().copy_waits
            with spilled_events() as spills:
                s.step_until(lambda: all(s.done(r) for r in rids))
                s.drain_copies()  # a write ahead still in flight is part of this window
            itl = [(b - a) * 1000 for r in rids for a, b in zip(s.token_times[r], s.token_times[r][1:])]
            runs[name] = {"itl_ms": itl, "spills": spills, "waits": s.core.stats().copy_waits - waits,
                          "ahead": s.core.stats().spills_ahead}

        window("warm", 500)  # the first decodes of these shapes pay one-off costs: not a baseline
        del runs["warm"]
        window("no-spill", 600)  # the pool is all blank pages: nothing to spill
        s.run("big", random_prompt(big, 700 + ahead))  # finished: its pages stay cached on the free list
        # (a prompt of its own per mode: the store, shared by both, would already hold the other's)
        if s.core.pages.num_cached != big_pages:
            raise RuntimeError(f"expected {big_pages} cached pages, found {s.core.pages.num_cached}")
        window("spill", 800)
        if len(runs["spill"]["spills"]) != 1:
            raise RuntimeError(f"expected one spill inside the window, saw {runs['spill']['spills']}")
    finally:
        s.close()
    return {"tokens": big, "state_bytes": big_pages * page_bytes(model), "blank_pages": blank, "runs": runs}


def spill_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for mode, m in res["modes"].items():
        base = statistics.median(m["runs"]["no-spill"]["itl_ms"])
        for name, r in m["runs"].items():
            itl, spills = r["itl_ms"], r["spills"]
            what = "nothing" if not spills else \
                ", ".join(f"{int(e['bytes']) / MiB:.0f} MiB ({e['tokens']} tokens, {e['kind']})" for e in spills)
            p50 = statistics.median(itl)
            rows.append([mode, name, len(itl), round(p50, 1), f"{100 * (p50 / base - 1):+.1f}", round(pct(itl, 0.9), 1),
                         round(max(itl), 1), what, round(sum(float(e["ms"]) for e in spills), 1) if spills else "-",
                         r["waits"]])
    return rows


SPILL_HEADERS = ["spill written", "run", "inter-token gaps", "ITL p50 ms", "p50 vs no-spill %", "p90 ms", "max ms",
                 "spilled in the window", "write ms (wall, its thread)", "step waited for it"]


# --- 4. host slots vs device slots ---------------------------------------------------------------

def pool_room(model: Model, z: Sizes) -> dict[str, Any]:
    state_pages = -(-z.retained_tokens // P)
    pages = z.retained * state_pages + state_pages + 8  # the states, one live prompt, a little more
    prompts = [random_prompt(z.retained_tokens, 900 + i) for i in range(z.retained)]
    out: dict[str, dict[str, Any]] = {}
    for where, slots in (("device", {"retained_device": z.retained}),
                         ("host", {"retained_device": 0, "retained_host": z.retained,
                                   "retained_host_tokens": z.retained_tokens})):
        s = Stepper(model, kv_cache_bytes=pages * page_bytes(model), max_num_seqs=2, **slots)
        try:
            s.warm_up()
            for i, prompt in enumerate(prompts):
                s.run(f"{where}-{i}", prompt)  # its opener checkpoint is retained
            s.settle()
            stats = s.core.stats()
            free = s.core.pages.num_free - s.core.pages.num_cached  # free without evicting anything
            rid = s.run(f"{where}-claim", prompts[0])  # an exact retry claims a retained state
            usage = s.updates[rid][-1].usage
            assert usage is not None
            host = s.core.residency.host_slots
            host_mib = host[0] * s.core.residency.states.host.slot_bytes / MiB if host[0] else 0.0  # type: ignore[union-attr]
            slot_bytes = model[0].config.state_shape().state_bytes_per_slot(model[0].model.dtype)
            out[where] = {"pool_pages": pages, "free_pages": free, "retained_pages": stats.cached_pages,
                          "staging_ring": bool(getattr(s.core.config, "staging_ring", False)) and where == "host",
                          "device_slot_mib": s.core.residency.retained_slots[0] * slot_bytes / MiB,
                          "states": stats.retained_slots_used + stats.retained_host_slots_used,
                          "skips": stats.retained_slot_skips, "host_mib": host_mib,
                          "claim_tier": usage.reuse.tier.value, "claim_ttft_ms": usage.time_to_first_token_ms}
        finally:
            s.close()
    return {"tokens": z.retained_tokens, "configs": out}


def room_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for where, r in res["configs"].items():
        config = f"retained_device={r['states']}" if where == "device" else \
            f"retained_device=0, retained_host={r['states']}"
        if r.get("staging_ring"):
            config += ", staging ring"
        rows.append([f"{where} slots ({config})", r["states"], r["retained_pages"], r["free_pages"],
                     r["free_pages"] * P, r["pool_pages"], f"{r['device_slot_mib']:.0f}", f"{r['host_mib']:.0f}",
                     f"{r['claim_tier']}, {r['claim_ttft_ms']:.1f} ms"])
    return rows


ROOM_HEADERS = ["retained states in", "states held", "device pages they hold", "free pages", "free tokens",
                "pool pages", "device retained slots MiB", "host block MiB", "retry of one: tier, TTFT"]


# --- the run -------------------------------------------------------------------------------------

RING_NOTE = ("Device-slot captures copy the slot and a partial page inside the step (device to device); "
             "host-slot captures stage the same two copies into a ring buffer inside the step and leave the "
             "pages to the copy worker, so in the step the two cost the same copies; the difference is where "
             "the state lives afterwards.")


def render(a: argparse.Namespace, z: Sizes, res: dict[str, Any], loads: tuple[float, float]) -> str:
    p, t, sp, room, cr = res["pressure"], res["tax"], res["spill"], res["room"], res["crowd"]
    device = "CUDA" if torch.cuda.is_available() else f"CPU fp32, {res['threads']} threads"
    recompute = p["modes"]["recompute"]
    parts = [
        f"### Residency under pressure (issue 15): h{a.hidden}, {a.layers} layers, {device}, page {P}",
        f"Each figure against its baseline in the same run. 1-minute load average {loads[0]:.2f} → {loads[1]:.2f}: "
        "other work on the machine slows both sides of a comparison alike only roughly; read spreads, not digits.",
        f"#### 1. {z.agents} agents fill the KV pool, {z.interactive} interactive requests arrive (hybrid)",
        table.markdown(PRESSURE_HEADERS, pressure_rows(p)),
        f"Agents: {z.agent_prompt}-token prompts, {z.agent_tokens} tokens each; the pool is {p['pool_pages']} pages, "
        f"exactly the agents' {p['pages_each']} pages each at their full length, so once they all hold them (the "
        f"first arrival) every page is taken. Interactive: {z.interactive_prompt}-token prompts, "
        f"{z.interactive_tokens} tokens, one every {z.gap_steps} decode steps. Same EngineConfig in both modes "
        "(reuse.prompt=false, so only the fate of a displaced sequence differs); move-down has a tierstore "
        "process. *Sequences moved down*: `stats().sequences_moved[ram]`; *sequences recomputed*: "
        f"`stats().sequences_recomputed` (recompute mode: `requests_preempted` = {recompute['requests_preempted']}). "
        "*Recomputed tokens*: computed tokens whose state a step threw away (a preempted sequence's "
        "`num_computed` at preemption), summed; *extra forward tokens*: tokens the forward passes computed beyond "
        "an uninterrupted run (prompt + output − 1 per request); the two agree when recompute is the only extra "
        "work. TTFT is the engine's (arrival to first token); agents done: from their submission. Outputs: "
        "greedy, every request's tokens compared between the two modes.",
        "#### 2. Reuse tax: cold TTFT, reuse on vs off (hybrid)",
        table.markdown(TAX_HEADERS, tax_rows(t)),
        f"{z.repeats} repeats per size, a distinct prompt each time (no hit), the same prompt on every side, "
        "max_tokens=1, the order of the three rotated; on a loaded machine the min is the figure other work disturbs "
        "least, the max is mostly that work. With reuse on the prefill is cut at the publish point (the stable "
        f"head, half the prompt) and at the prompt's end, and each cut captures a state. {RING_NOTE} Every capture "
        f"found a free slot (device: {t['captured']} captured, {t['skips']} skipped; host: {t['ring_captured']} "
        f"captured, {t['ring_skips']} skipped).",
        f"#### 3. ITL of {z.decoders} running decodes while a {sp['state_bytes'] / MiB:.0f} MiB state spills (dense)",
        table.markdown(SPILL_HEADERS, spill_rows(sp)),
        f"One engine with a tierstore per mode, {z.decoders} decoders ({z.decoder_prompt}-token prompts, "
        f"{z.decoder_tokens} tokens, reuse bypassed so their own pages are never a chain) in every run. Before the "
        f"spill run a {sp['tokens']}-token prompt finished and its {sp['state_bytes'] / MiB:.0f} MiB of pages stayed "
        f"cached on the free list; the pool's {sp['blank_pages']} blank pages run out mid-window. *On the step* "
        "(`spill_ahead_pages = -1`): the allocation that reaches the chain writes it whole to KV-RAM (copy, "
        "checksum, integrity tag, Commit) before it hands a page out, so every running decode waits for it (the "
        "max). *Written ahead* (the default): once fewer blank pages than an eighth of the pool are left, the "
        "copy worker writes the chain while the decodes step on; the allocator then hands its pages out with nothing "
        "to copy, unless it reaches them before the write is done (*step waited for it*). The no-spill run is "
        "the same decoders before the big prompt existed, on the same engine, after a window of them to warm up "
        "(not shown: the first decodes of these shapes pay one-off costs). Dense because its state is KV pages "
        "only: a hybrid state this size is ~17k tokens, minutes of prefill here.",
        f"#### 4. KV pool free with {z.retained} retained states of {room['tokens']} tokens: host vs device slots "
        "(hybrid)",
        table.markdown(ROOM_HEADERS, room_rows(room)),
        f"{z.retained} distinct {room['tokens']}-token prompts, max_tokens=1: each retains its opener checkpoint. "
        "*Device pages they hold*: `stats().cached_pages` (pages held only for reuse); *free pages*: free and "
        "blank, taken by live work without evicting a retained state (device-held pages are reclaimable too, "
        "but only by evicting the states). Same pool in both; device retained slots (recurrent + conv state) are "
        "reserved on the device at load, host slots are host memory. Host captures the engine copies off the "
        "step (the staging ring, where built) hold their pages until the copy is collected; the figures are "
        "taken once they are. The retry claims one state back: from a device "
        "slot by sharing its pages, from a host slot by one host-to-device copy.",
        f"#### 5. {z.crowd} requests of {cr['pages_each']} pages arrive together on {z.crowd_pages} (dense, one class)",
        table.markdown(CROWD_HEADERS, crowd_rows(cr)),
        f"All interactive, {z.crowd_prompt}-token prompts, {z.crowd_tokens} greedy tokens each (ignore_eos), "
        "submitted in one step. *Room to spare*: a pool of every request's pages at once, the baseline for time and "
        "tokens. *Most moves of one request*: the `moves` of its `ignis.request.done` line; *thrash*: "
        "`ignis_sequence_thrash_total` (moved again with nothing computed since it resumed). Before issue 49's fix "
        "the move-down row never finished: a move's freed room was admitted back to the moved sequence before the "
        "decode it was freed for could take it.",
    ]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.residency", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=None, help="checkpoint geometry (default 1024; --smoke 128)")
    parser.add_argument("--layers", type=int, default=None, help="(default 16; --smoke 4)")
    parser.add_argument("--repeats", type=int, default=None, help="reuse tax repeats per size (default 5)")
    parser.add_argument("--tax-sizes", default=None, help="reuse tax prompt lengths (default 1024,4096)")
    parser.add_argument("--retained-tokens", type=int, default=None, help="length of each retained state (1024)")
    parser.add_argument("--spill-mib", type=int, default=None, help="size of the spilled state (default 150)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default torch's; --smoke 1)")
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint and tiny sizes (tests)")
    parser.add_argument("--out", type=Path, default=table.RESULTS,
                        help="where residency.{json,md} go (bench/results/: the .json in raw/)")
    parser.add_argument("--models", type=Path, default=None, help="checkpoint cache (default: ignis' own)")
    a = parser.parse_args(argv)
    z = Sizes.smoke() if a.smoke else Sizes()
    a.hidden = a.hidden or (128 if a.smoke else 1024)
    a.layers = a.layers or (4 if a.smoke else 16)
    overrides: dict[str, Any] = {"repeats": a.repeats, "retained_tokens": a.retained_tokens, "spill_mib": a.spill_mib,
                                 "tax_sizes": tuple(int(n) for n in a.tax_sizes.split(",")) if a.tax_sizes else None}
    z = Sizes(**{**asdict(z), **{k: v for k, v in overrides.items() if v is not None}})
    hybrid = ensure_geometry("hybrid", a.hidden, a.layers, root=a.models)
    dense = ensure_geometry("dense", a.hidden, a.layers, root=a.models)
    folder = Path(tempfile.mkdtemp(prefix="ignis-bench-residency-"))
    loads = os.getloadavg()[0]
    arena = max(z.spill_mib * 3 // 2 + 16, 384) * MiB
    store = launch_tierstore(folder, arena, 0, env={"IGNIS_LOG_LEVEL": "WARNING"})
    res: dict[str, Any] = {"seconds": {}}
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads or (1 if a.smoke else threads))  # tiny ops on a busy machine: one thread
    res["threads"] = torch.get_num_threads()

    def section(key: str, title: str, fn: Callable[[], dict[str, Any]]) -> None:
        print(f"residency: {title}", flush=True)
        started = time.perf_counter()
        res[key] = fn()
        res["seconds"][key] = round(time.perf_counter() - started, 1)
        print(f"residency: {title}: {res['seconds'][key]:.0f} s", flush=True)

    try:
        with torch.set_grad_enabled(False):
            model = (load_model(hybrid, onednn_linears=True), Tokenizer.from_dir(hybrid))  # as the engine service
            section("pressure", "1. pressure, move-down vs recompute", lambda: pressure(model, store, z))
            section("tax", "2. reuse tax", lambda: reuse_tax(model, z))
            section("room", "4. host vs device slots", lambda: pool_room(model, z))
            del model
            dense_model = (load_model(dense, onednn_linears=True), Tokenizer.from_dir(dense))
            section("spill", "3. decodes while a state spills", lambda: spill_itl(dense_model, store, z))
            section("crowd", "5. same-class pressure", lambda: crowd(dense_model, store, z))
    finally:
        torch.set_num_threads(threads)
        store.stop()
        shutil.rmtree(folder, ignore_errors=True)
    after = os.getloadavg()[0]
    text = render(a, z, res, (loads, after))
    print(text, flush=True)
    payload = {"sizes": asdict(z), "hidden": a.hidden, "layers": a.layers, "loadavg_1m": [loads, after],
               **res}
    path = table.save("residency", payload, text, a.out)
    print(f"\nwrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
