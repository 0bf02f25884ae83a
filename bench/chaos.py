"""`python -m bench.chaos`: a soak with forced spills and a fault schedule against the real stack.

    python -m bench.chaos [--minutes 10 | --smoke] [--concurrency 4] [--seed 0] [--out DIR] [--keep]

It starts a tierstore, an engine (the built-in ignis-tiny) and a gateway as processes
(common/launch.py), with budgets so small that states leave the device at once: 2 retained
device slots, a KV-RAM arena of a few states and a KV-disk tier smaller than the run's states
(so it evicts too), in the run's scratch folder, nothing protected
(`reuse.retained_interactive_ttl=0`). Traffic: OpenAI chat requests through the gateway
(httpx, half of them streamed), greedy, drawn from a fixed set of multi-turn conversations
that repeat, so reuse, spills and restores happen all the time. Each prompt's reference
answer is computed once up front on an undisturbed engine (reuse off, no tierstore): a
completed answer whose text differs from it is *wrong*.

Each fault is a window of traffic around it: a few requests, the fault, then every prompt
once (so every stored state is asked for) while it lasts, then what repairs it, if anything:

1. tierstore kill -9, restarted on the same workdir (same socket) while traffic runs, and
   traffic until the engine is back on it;
2. engine kill -9, restarted on the same port; new requests wait while it is down (one
   engine); requests in flight on the killed engine may fail: the only allowed failures;
3. corrupt blobs (bytes flipped in every second blob of kv-disk/blobs);
4. delete blobs (every second one);
5. truncated index (the LMDB data file cut while the store runs: to half, then to nothing, then
   mid-page, episode by episode);
6. read-only disk (kv-disk bind-mounted on itself and remounted read-only, then unmounted:
   needs root and mount; otherwise the row says it was skipped and why);
7. arena deleted (the /dev/shm file named by the tierstore's Stats.arena_path);
8. aborted streams (cut after their first chunk), then the engine must be idle (running 0,
   waiting 0, used pages 0) and normal requests still served.

The soak runs rounds of (a steady window without a fault, faults 1 and 3-8) for --minutes,
each fault's row summing its episodes; the engine kill runs once, last, so the engine RSS
figures (start, after warm-up, after round 1, end) are one process's. The RSS target is judged
from the end of round 1 (every code path has run once) to the end. --smoke: one round with a
few requests per window and 50 aborts (tests/test_chaos_bench.py runs it; about a minute).

Columns: tried (requests sent in the window), failed (an error status, an error event in the
stream or a stream cut short), lost (no answer within the request deadline), wrong (completed
with other text than the reference), allowed (failures of requests in flight on the engine
when it was killed), reuse (completed answers by the tier their reuse came from), idle (after
the window drains: the engine runs nothing and holds no pages, the tierstore holds no leases
or reservations and counts every blob file against its budget). Target, shown and not asserted:
0 wrong, 0 lost, 0 failed but the allowed, idle after every window, and the fault seen by the
store (a PROBLEM in the row otherwise); engine RSS within ±5%. Writes chaos.md and chaos.json
(bench/table.save: the JSON in raw/ under bench/results/). A run whose targets are not all met
keeps its scratch folder (the logs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from bench.chaos_stack import ENGINE_ARGS, FULL, ROWS, SMOKE, TIERSTORE_ARGS, Mode, Stack, references, rss_mib
from bench.chaos_traffic import Record, Traffic
from common.launch import launch
from bench.table import RESULTS, markdown, save
from ignis.v1 import tierstore_pb2


@dataclass(slots=True)
class Row:
    key: str
    label: str
    episodes: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    allowed: int = 0
    tiers: Counter[str] = field(default_factory=Counter)
    idle: list[str] = field(default_factory=list)  # per episode: "ok" or what was still held
    problems: list[str] = field(default_factory=list)  # a fault that did not bite, a leak, a store that did not recover
    notes: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)  # the first failures, losses and wrong answers
    skipped: str = ""

    @property
    def tried(self) -> int:
        return sum(self.outcomes.values())

    def passed(self) -> bool:
        return (not self.outcomes["wrong"] and not self.outcomes["lost"] and self.outcomes["failed"] <= self.allowed
                and all(i.startswith("ok") for i in self.idle) and not self.problems)

    def cells(self) -> list[Any]:
        if self.skipped or not self.episodes:
            why = f"skipped: {self.skipped}" if self.skipped else "not run"
            return [self.label, 0, "-", "-", "-", "-", "-", "-", "-", why]
        tiers = "/".join(str(self.tiers[t]) for t in ("device", "ram", "disk"))
        idle = "ok" if all(i.startswith("ok") for i in self.idle) else "; ".join(i for i in self.idle if i != "ok")
        note = self.notes[0] + (f" (first of {self.episodes})" if self.episodes > 1 else "")
        if self.problems:
            note += "; PROBLEM: " + "; ".join(dict.fromkeys(self.problems))
        return [self.label, self.tried, self.outcomes["failed"], self.allowed, self.outcomes["lost"],
                self.outcomes["wrong"], tiers, idle, "pass" if self.passed() else "FAIL", note]


HEADERS = ["fault", "tried", "failed", "allowed", "lost", "wrong", "reuse device/ram/disk", "idle after",
           "target", "what happened"]


def deltas(s0: tierstore_pb2.StatsResponse | None, s1: tierstore_pb2.StatsResponse | None, *names: str) -> str:
    """"spills +3, restores +1": tierstore counters over a window (from 0 when `s0` is None: a new store)."""
    if s1 is None:
        return "tierstore Stats failed"
    return ", ".join(f"{n} +{getattr(s1, n) - (getattr(s0, n) if s0 else 0)}" for n in names)


async def until(check: Callable[[], Awaitable[bool]], timeout: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every)
    return True


def can_mount(folder: Path) -> str:
    """"" when a read-only bind mount can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (a read-only bind mount)"
    if shutil.which("mount") is None:
        return "no mount command"
    probe = folder / "mount-probe"
    probe.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "--bind", str(probe), str(probe)], capture_output=True, text=True)
    if done.returncode:
        return f"mount --bind failed: {done.stderr.strip()[:120]}"
    subprocess.run(["umount", str(probe)], check=False)
    return ""


class Chaos:
    def __init__(self, stack: Stack, traffic: Traffic, mode: Mode) -> None:
        self.stack, self.traffic, self.mode = stack, traffic, mode
        self.rows = {key: Row(key, label) for key, label in ROWS}
        self.kill_at: float | None = None
        self.problems: list[str] = []
        self.mounted: list[Path] = []
        self.rss: list[tuple[str, float]] = []
        self.rounds = 0
        self.arenas: list[tuple[str, int, int]] = []  # (when, arena files the engine maps, of them deleted)

    async def store(self) -> tierstore_pb2.StatsResponse | None:
        return await asyncio.to_thread(self.stack.store_stats)

    async def window(self, key: str, script: Callable[[], Awaitable[str]], store_idle: bool = True) -> None:
        row = self.rows[key]
        self.kill_at, self.problems = None, []
        self.traffic.start()
        window = self.traffic.window
        try:
            note = await script()
        finally:
            await self.traffic.stop()
        self.problems += await asyncio.to_thread(self.stack.revive)
        row.idle.append(await self.idle(store_idle))
        records = self.traffic.of(window)
        row.episodes += 1
        row.notes.append(note)
        row.problems += self.problems
        for r in records:
            row.outcomes[r.outcome] += 1
            if r.tier:
                row.tiers[r.tier] += 1
            allowed = r.outcome == "failed" and self.kill_at is not None and r.start < self.kill_at <= r.end
            row.allowed += allowed
            if r.outcome in ("failed", "lost", "wrong") and len(row.samples) < 5:
                row.samples.append(f"{r.outcome}{' (allowed)' if allowed else ''}, "
                                   f"{'stream' if r.stream else 'whole'}: {r.detail}")
        self.rss.append((f"{key}#{row.episodes}", self.stack.engine_rss()))
        self.arenas.append((f"{key}#{row.episodes}", *self.stack.engine_arenas()))
        print(f"  {row.label}: {Counter(r.outcome for r in records)} idle={row.idle[-1]} :: {note}", flush=True)

    async def idle(self, store: bool, timeout: float = 20.0) -> str:
        """"ok" once the engine runs nothing and holds no pages (and the store no leases), else what stayed."""
        t0 = time.monotonic()
        held: list[str] = []

        async def quiet() -> bool:
            held.clear()
            e = await asyncio.to_thread(self.stack.engine_stats)
            if e is None:
                held.append("engine GetStats failed")
            else:
                running, waiting = e.running.interactive + e.running.agent, e.waiting.interactive + e.waiting.agent
                if running or waiting or e.page_pool.used_pages or e.state_slots.used:
                    held.append(f"engine running {running}, waiting {waiting}, used pages {e.page_pool.used_pages}, "
                                f"state slots {e.state_slots.used}")
            if store:
                s = await self.store()
                if s is None:
                    held.append("tierstore Stats failed")
                elif s.leases_active or s.reservations_pending:
                    held.append(f"tierstore leases {s.leases_active}, reservations {s.reservations_pending}")
                elif (on_disk := await asyncio.to_thread(self.stack.blob_bytes)) > s.disk_bytes_used:
                    held.append(f"blob files take {on_disk} bytes, the store counts {s.disk_bytes_used}")
            return not held

        if await until(quiet, timeout):
            return "ok" if time.monotonic() - t0 < 1 else f"ok after {time.monotonic() - t0:.1f}s"
        return f"after {timeout:.0f}s: " + "; ".join(held)

    # ------------------------------------------------------------ the windows

    async def warm_up(self) -> str:
        await self.traffic.sweep()
        await self.traffic.sweep()
        return "every prompt twice"

    async def steady(self) -> str:
        s0 = await self.store()
        await self.traffic.send(self.mode.pre)
        await self.traffic.sweep()
        await self.traffic.send(self.mode.extra)
        return deltas(s0, await self.store(), "spills", "restores", "evictions")

    async def store_until(self, check: Callable[[tierstore_pb2.StatsResponse], bool], timeout: float) -> bool:
        async def ok() -> bool:
            s = await self.store()
            return s is not None and check(s)
        return await until(ok, timeout)

    async def tierstore_kill(self) -> str:
        assert self.stack.tierstore is not None
        await self.traffic.send(self.mode.pre)
        s0 = await self.store()
        arena, t0 = s0.arena_path if s0 else "", time.monotonic()
        self.stack.tierstore.process.kill()
        await asyncio.to_thread(self.stack.tierstore.process.wait)
        await self.traffic.send(self.mode.pre)  # served while the store is gone
        await asyncio.to_thread(self.stack.start_tierstore)
        down, stale = time.monotonic() - t0, bool(arena) and os.path.exists(arena)
        if stale:
            self.problems.append(f"the killed store's arena {arena} was still in /dev/shm after the restart")
        await self.traffic.sweep()
        if not await self.store_until(lambda s: s.spills + s.restores > 0, 30):  # the engine retries every 5 s
            self.problems.append("no spill or restore on the restarted tierstore within 30 s")
        await self.traffic.send(self.mode.extra)
        return f"store down {down:.1f}s; dead arena {'left' if stale else 'removed'}; restarted store: " + \
            deltas(None, await self.store(), "spills", "restores")

    async def engine_kill(self) -> str:
        assert self.stack.engine is not None and self.stack.gateway is not None
        await self.traffic.send(self.mode.pre)

        async def busy() -> bool:
            return self.traffic.inflight > 0

        await until(busy, 10, every=0.005)
        self.traffic.gate.clear()  # one engine: new requests wait while it is down
        inflight, port, self.kill_at = self.traffic.inflight, self.stack.engine.port, time.monotonic()
        self.stack.engine.process.kill()
        await asyncio.to_thread(self.stack.engine.process.wait)
        await asyncio.to_thread(self.stack.start_engine, port)
        health = f"http://{self.stack.gateway.address}/health"

        async def routed() -> bool:
            try:
                return (await self.traffic.http.get(health)).status_code == 200
            except httpx.HTTPError:
                return False

        if not await until(routed, 60, every=0.2):
            self.problems.append("the gateway did not report the restarted engine healthy within 60 s")
        held = time.monotonic() - self.kill_at
        self.traffic.gate.set()
        await self.traffic.sweep()
        await self.traffic.send(self.mode.extra)
        s = await self.store()
        orphans = f"; the store still holds {s.leases_active} leases, {s.reservations_pending} reservations" \
            if s and (s.leases_active or s.reservations_pending) else ""
        return f"{inflight} in flight at the kill; new requests held {held:.1f}s until the gateway saw the " \
               f"restarted engine (same port){orphans}"

    async def _disk_fault(self, act: Callable[[], str], counter: str) -> str:
        """A few requests, `act` (blocking, on a thread), then every prompt once and the extra requests."""
        await self.traffic.send(self.mode.pre)
        s0 = await self.store()
        what = await asyncio.to_thread(act)
        await self.traffic.sweep()
        await self.traffic.send(self.mode.extra)
        return f"{what}; " + deltas(s0, await self.store(), *filter(None, [counter, "disk_errors", "restores"]))

    async def corrupt_blobs(self) -> str:
        def act() -> str:
            blobs, hit = self.stack.blobs(), 0
            for path in blobs[::2]:
                try:
                    with open(path, "r+b") as f:
                        size = f.seek(0, os.SEEK_END)
                        for at in (64, size // 2, size - 8):  # the header, the middle, the tail
                            f.seek(at)
                            byte = f.read(1)[0] ^ 0xFF
                            f.seek(at)
                            f.write(bytes([byte]))
                    hit += 1
                except (FileNotFoundError, IndexError):  # removed or rewritten meanwhile
                    pass
            return f"3 bytes flipped in {hit} of {len(blobs)} blobs"
        return await self._disk_fault(act, "checksum_failures")

    async def delete_blobs(self) -> str:
        def act() -> str:
            blobs = self.stack.blobs()
            for path in blobs[::2]:
                path.unlink(missing_ok=True)
            return f"{len(blobs[::2])} of {len(blobs)} blobs deleted"
        return await self._disk_fault(act, "blobs_missing")

    async def truncate_index(self) -> str:
        data = self.stack.kv_disk / "index" / "data.mdb"

        def act() -> str:  # half, then nothing, then one page and a bit: a cut mid-page
            size = data.stat().st_size
            cut = [size // 2, 0, 4096 + 123][self.rows["truncate-index"].episodes % 3]
            os.truncate(data, cut)
            return f"index/data.mdb cut from {size} to {cut} bytes"
        before = set(self.stack.kv_disk.glob("index.damaged-*"))
        note = await self._disk_fault(act, "")
        aside = sorted(p.name for p in set(self.stack.kv_disk.glob("index.damaged-*")) - before)
        if not aside:
            self.problems.append("the damaged index was not moved aside")
        return note + (f"; moved aside as {', '.join(aside)}" if aside else "")

    async def read_only_disk(self) -> str:
        folder = self.stack.kv_disk
        await self.traffic.send(self.mode.pre)
        s0 = await self.store()
        refused = await asyncio.to_thread(self.make_read_only, folder)
        if refused:
            await asyncio.to_thread(self.unmount, folder)
            self.problems.append(f"bench: could not remount kv-disk read-only ({refused})")
            return "not made read-only"
        await self.traffic.sweep()
        went = await self.store_until(lambda s: not s.disk_usable, 10)
        await asyncio.to_thread(self.unmount, folder)
        t0 = time.monotonic()
        back = await self.store_until(lambda s: s.disk_usable, 30)  # it tries the disk again every 5 s
        if not back:
            self.problems.append("the disk tier was not usable again within 30 s of the unmount")
        again = f"usable again {time.monotonic() - t0:.1f}s after the unmount" if back else "not usable again"
        await self.traffic.send(self.mode.extra)
        return f"kv-disk read-only (bind mount): disk_usable {'went false' if went else 'stayed true'}, " + \
            deltas(s0, await self.store(), "disk_errors") + f"; {again}"

    def make_read_only(self, folder: Path) -> str:
        """Bind-mounts `folder` on itself read-only: "" once done, else why not. Files the store opened
        before keep their old mount (and stay writable); a file it opens for writing between the two
        mount calls makes the remount busy, so it is tried again."""
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        self.mounted.append(folder)
        for _ in range(100):
            done = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True, text=True)
            if done.returncode == 0:
                return ""
            time.sleep(0.02)
        return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]

    def unmount(self, folder: Path) -> None:
        if folder in self.mounted:
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(folder)], check=False)  # busy: detach it lazily
            self.mounted.remove(folder)

    async def arena_deleted(self) -> str:
        await self.traffic.send(self.mode.pre)
        s0 = await self.store()
        if s0 is None or not s0.arena_path:
            self.problems.append("tierstore Stats gave no arena_path")
            return "no arena to delete"
        os.unlink(s0.arena_path)
        await self.traffic.sweep()
        if not await self.store_until(lambda s: s.arena_recreations > s0.arena_recreations, 10):
            self.problems.append("the arena was not recreated within 10 s")
        await self.traffic.send(self.mode.extra)
        s1 = await self.store()
        return f"{s0.arena_path} deleted; " + deltas(s0, s1, "arena_recreations", "ram_states_lost") + \
            f", new instance {bool(s1 and s1.instance_id != s0.instance_id)}"

    async def aborts(self) -> str:
        await self.traffic.send(self.mode.pre)
        e0 = await asyncio.to_thread(self.stack.engine_stats)
        lanes, rng = asyncio.Semaphore(8), random.Random(len(self.traffic.records))

        async def one() -> Record:
            async with lanes:
                return await self.traffic.abort(rng.choice(self.traffic.prompts))

        cut = sum(r.outcome == "aborted" for r in await asyncio.gather(*(one() for _ in range(self.mode.aborts))))
        await self.traffic.pause()
        idle = await self.idle(store=True)
        if not idle.startswith("ok"):
            self.problems.append(f"after the aborts: {idle}")
        e1 = await asyncio.to_thread(self.stack.engine_stats)
        cancelled = e1.counters.requests_cancelled - e0.counters.requests_cancelled if e0 and e1 else "?"
        self.traffic.gate.set()
        await self.traffic.sweep()  # normal requests still served
        return f"{cut} of {self.mode.aborts} streams cut after their first chunk, engine counted {cancelled} " \
               f"cancelled; then idle ({idle}) and every prompt served"

    # ------------------------------------------------------------ the run

    async def run(self, minutes: float, smoke: bool) -> None:
        await self.window("warm-up", self.warm_up)
        self.rss.append(("after warm-up", self.stack.engine_rss()))
        mount = can_mount(self.stack.dir)
        if mount:
            self.rows["read-only-disk"].skipped = mount
        schedule: list[tuple[str, Callable[[], Awaitable[str]]]] = [
            ("steady", self.steady), ("tierstore-kill", self.tierstore_kill), ("corrupt-blobs", self.corrupt_blobs),
            ("delete-blobs", self.delete_blobs), ("truncate-index", self.truncate_index),
            ("read-only-disk", self.read_only_disk), ("arena-deleted", self.arena_deleted),
            ("aborts", self.aborts)]
        end = time.monotonic() + minutes * 60
        self.rounds = 0
        while True:
            self.rounds += 1
            print(f"round {self.rounds}", flush=True)
            for key, script in schedule:
                if not self.rows[key].skipped:
                    await self.window(key, script)
            if self.rounds == 1:
                self.rss.append(("after round 1", self.stack.engine_rss()))
            if smoke or time.monotonic() >= end:
                break
        self.rss.append(("end", self.stack.engine_rss()))
        self.arenas.append(("end", *self.stack.engine_arenas()))
        await self.window("engine-kill", self.engine_kill, store_idle=False)
        self.rss.append(("restarted engine, end", self.stack.engine_rss()))


# ---------------------------------------------------------------- report


def rss_table(rss: dict[str, float], rounds: int) -> tuple[str, float | None]:
    """Engine RSS at each point; the target is judged from the end of round 1 (every fault once: each
    code path has run, so the allocators have grown to what they need) to the end, when there are rounds after it."""
    warm, first = rss["after warm-up"], rss["after round 1"]
    change = (rss["end"] - first) / first * 100 if rounds > 1 else None
    target = "n/a (one round)" if change is None else "pass" if abs(change) <= 5 else "FAIL"
    cells = [round(rss[k], 1) for k in ("start", "after warm-up", "after round 1", "end")]
    rows = [["engine RSS, MiB", *cells, f"{(rss['end'] - warm) / warm * 100:+.1f}%",
             "-" if change is None else f"{change:+.1f}%", target, round(rss["restarted engine, end"], 1)]]
    return markdown(["", "start", "after warm-up", "after round 1", "end (before the engine kill)",
                     "change from warm-up", "change from round 1", "target ±5%", "restarted engine at the end"],
                    rows), change


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the soak (rounds of faults)")
    parser.add_argument("--smoke", action="store_true", help="one round, a few requests per window (< 90 s)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, kv-disk)")
    args = parser.parse_args(argv)
    mode = SMOKE if args.smoke else FULL
    scratch = Path(tempfile.mkdtemp(prefix="ignis-chaos-"))
    t0 = time.monotonic()
    stack = Stack(scratch)
    chaos: Chaos | None = None
    try:
        prompts = references(scratch, args.seed)
        distinct = len({p.reference for p in prompts})
        print(f"references: {len(prompts)} prompts, {distinct} distinct answers ({time.monotonic() - t0:.1f}s)",
              flush=True)
        stack.start()
        start_rss = stack.engine_rss()

        async def go() -> Chaos:
            assert stack.gateway is not None
            traffic = Traffic(f"http://{stack.gateway.address}/v1", prompts, args.concurrency, mode.deadline,
                              args.seed)
            c = Chaos(stack, traffic, mode)
            c.rss.append(("start", start_rss))
            try:
                await c.run(args.minutes, args.smoke)
            finally:
                for folder in list(c.mounted):
                    c.unmount(folder)
                await traffic.http.aclose()
            return c

        chaos = asyncio.run(go())
    finally:
        stack.stop()
        keep = args.keep or chaos is None or not all(r.passed() for r in chaos.rows.values())
        if keep:
            print(f"scratch kept: {scratch} (service logs in stack/)")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    wall = time.monotonic() - t0
    rows = [chaos.rows[key] for key, _ in ROWS]
    rss = dict(chaos.rss)
    rss_text, change = rss_table(rss, chaos.rounds)
    _, maps, gone = next(a for a in chaos.arenas if a[0] == "end")
    what = "smoke" if args.smoke else f"{args.minutes:g}-minute soak"
    title = (f"### Chaos: faults under load, {what}, {chaos.rounds} round(s) "
             f"({wall:.0f} s, ignis-tiny, {args.concurrency} requests in flight, greedy, "
             f"{len(prompts)} prompts with {distinct} distinct reference answers)")
    samples = [f"- {r.label}: {s}" for r in rows for s in r.samples]
    text = "\n\n".join([title, markdown(HEADERS, [r.cells() for r in rows]), rss_text,
                        "Budgets: engine `" + " ".join(ENGINE_ARGS) + "`, tierstore `" + " ".join(TIERSTORE_ARGS) +
                        "`. The engine kill ran last; RSS 'end' is the first engine's, before it. Arena files "
                        f"that engine mapped at the end: {maps} ({gone} of them deleted files).",
                        *(["Failures, losses and wrong answers (first of each row):\n\n" + "\n".join(samples)]
                          if samples else [])])
    print(text, flush=True)
    payload = {"smoke": args.smoke, "minutes": args.minutes, "concurrency": args.concurrency, "seed": args.seed,
               "wall_s": wall, "mode": asdict(mode), "engine_args": ENGINE_ARGS, "tierstore_args": TIERSTORE_ARGS,
               "prompts": len(prompts), "distinct_references": distinct, "headers": HEADERS,
               "rows": [{"key": r.key, "label": r.label, "episodes": r.episodes, "tried": r.tried,
                         "failed": r.outcomes["failed"], "allowed": r.allowed, "lost": r.outcomes["lost"],
                         "wrong": r.outcomes["wrong"], "aborted": r.outcomes["aborted"], "tiers": dict(r.tiers),
                         "idle": r.idle, "problems": r.problems, "notes": r.notes, "samples": r.samples,
                         "skipped": r.skipped, "passed": r.passed()} for r in rows],
               "rounds": chaos.rounds, "rss_mib": chaos.rss, "rss_change_pct": change,
               "engine_arena_maps": chaos.arenas}
    path = save("chaos", payload, text, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
