"""`python -m bench.monitor`: how fast the Monitor draws 1,000 retained states in headless Chromium.

A real engine (hybrid ignis-tiny with `--states` retained device slots) is filled with that
many checkpoints (each conversation leaves its opener's and its reply's end), behind a real
gateway. Then, in the same browser and the same run, the page is loaded with the first 10
states per engine (the baseline) and with all of them:

- JSON: GET /v1/ignis/state through the gateway (median of --repeats), and the part of it the
  engine's step thread spent (the copy of the index; the step waits for nothing else);
- first render: navigation start to the first update drawn (fetch included), from the page;
- update: the JS time of one redraw at 1 Hz (median of --repeats updates);
- scroll: redrawing the virtualised list after a jump to its end; and how many rows the DOM holds.

Prints a Markdown table, writes bench/results/monitor.md (and raw/monitor.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.browser import Page, chromium, chromium_path
from common.launch import launch_engine, launch_gateway
from bench.table import markdown, save

SCROLL = """(() => { const v = document.querySelector('.engine .viewport'); const t = performance.now();
  v.scrollTop = v.scrollHeight; v.dispatchEvent(new Event('scroll')); const ms = performance.now() - t;
  v.scrollTop = 0; v.dispatchEvent(new Event('scroll')); return ms; })()"""


def fill(url: str, states: int, workers: int = 4) -> float:
    """Conversations until the engine retains `states` checkpoints; seconds it took."""
    started = time.perf_counter()

    def one(i: int) -> None:
        body = {"model": "ignis-tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": f"Note {i}: summarise item {i * 7919 % 10007}."}]}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(states // 2)))  # two checkpoints each: the opener and the reply's end
    deadline = time.monotonic() + 120
    while total(url) < states and time.monotonic() < deadline:
        one(states + int(time.monotonic() * 1000))  # a capture was skipped (a busy staging buffer): one more
    return time.perf_counter() - started


def total(url: str) -> int:
    return int(httpx.get(f"{url}/v1/ignis/state", params={"limit": "1"}, timeout=60).json()["engines"][0]
               ["states_total"])


def json_ms(url: str, limit: int, repeats: int) -> dict[str, float]:
    """Medians: the GET through the gateway, and what the engine's step thread spent copying for it."""
    times, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reply = httpx.get(f"{url}/v1/ignis/state", params={"limit": str(limit)}, timeout=60)
        times.append((time.perf_counter() - t0) * 1000)
        reply.raise_for_status()
        copies.append(reply.json()["engines"][0]["snapshot_ms"])
    return {"json_ms": statistics.median(times), "snapshot_ms": statistics.median(copies)}


def page_timings(page: Page, url: str, limit: int, repeats: int) -> dict[str, float]:
    page.navigate(f"{url}/monitor?limit={limit}")
    page.wait_for(f"document.querySelectorAll('.engine .state').length > 0 && "
                  f"document.querySelector('[data-field=\"states-count\"]').textContent.startsWith('{limit:,}')")
    first = float(page.evaluate("document.body.dataset.firstRenderAt"))
    renders = []
    seen = int(page.evaluate("document.body.dataset.updates"))
    for _ in range(repeats):  # the page redraws once a second
        seen = int(page.wait_for(f"Number(document.body.dataset.updates) > {seen} && document.body.dataset.updates"))
        renders.append(float(page.evaluate("document.body.dataset.renderMs")))
    scroll = statistics.median(float(page.evaluate(SCROLL)) for _ in range(repeats))
    rows = int(page.evaluate("document.querySelectorAll('.engine .state').length"))
    return {"first_render_ms": first, "update_ms": statistics.median(renders), "scroll_ms": scroll, "dom_rows": rows}


def run(states: int, repeats: int, workdir: Path) -> dict[str, Any]:
    engine = launch_engine(workdir / "engine", "ignis-tiny", [
        "--served-model-name", "ignis-tiny", "--max-queue", "64",
        "--set", f"reuse.retained_device={states}", "--set", "reuse.retained_interactive_ttl=0"])
    try:
        gateway = launch_gateway(workdir / "gw", [engine.address])
        try:
            url = f"http://127.0.0.1:{gateway.port}"
            fill_s = fill(url, states)
            listed = min(total(url), 1000)
            results: dict[str, Any] = {"states": listed, "fill_seconds": fill_s, "rows": {}}
            with chromium() as page:
                page_timings(page, url, 10, 1)  # warm-up: the browser's first page load is not the page's cost
                for limit in (10, listed):  # the baseline first, in the same browser
                    results["rows"][limit] = {**json_ms(url, limit, repeats),
                                              **page_timings(page, url, limit, repeats)}
            return results
        finally:
            gateway.stop()
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=1000, help="retained states to fill the engine with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if chromium_path() is None:
        print("bench.monitor: chromium is not installed (apt-get install chromium); nothing measured")
        return 0
    with tempfile.TemporaryDirectory(prefix="ignis-bench-monitor-") as tmp:
        results = run(args.states, args.repeats, Path(tmp))
    headers = ["states listed", "JSON GET ms", "step-thread copy ms", "first render ms (fetch included)",
               "update redraw ms", "scroll redraw ms", "rows in the DOM"]
    rows = [[limit, r["json_ms"], r["snapshot_ms"], r["first_render_ms"], r["update_ms"], r["scroll_ms"],
             r["dom_rows"]] for limit, r in results["rows"].items()]
    table = (f"Monitor: a page with {results['states']} retained states in headless Chromium (one engine, "
             f"hybrid ignis-tiny; baseline: the first 10 states, same browser, same run; medians of "
             f"{args.repeats})\n\n" + markdown(headers, rows))
    print(table)
    print(f"\nwrote {save('monitor', results, table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
