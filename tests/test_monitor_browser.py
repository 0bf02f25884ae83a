"""The Monitor in a real browser (issue 21): headless Chromium (the system's, driven over the
DevTools protocol) shows a real stack's state. After a repeated chat the page shows a checkpoint
on the device and the request row with its cached tokens; after two more conversations push it
out of the two device slots, the same state is shown in `ram` (and flashes). The DOM is checked,
not pixels; a screenshot is saved under the test's tmp dir (IGNIS_MONITOR_SCREENSHOT=path copies
it there too, e.g. docs/monitor.png). With two engines behind the gateway (an attention-only one
and one that does not answer) the page has a section each, the dense one listing its page chain."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bench.browser import Page, chromium, chromium_path
from common.launch import free_port
from test_monitor import KEY, LONG_SYSTEM, cached_tokens, chat, start_stack, stop_stack

pytestmark = pytest.mark.skipif(chromium_path() is None,
                                reason="chromium is not installed (.ci/run installs it: apt-get install chromium)")

ROWS = "[...document.querySelectorAll('.engine .state')]"


def state_rows(page: Page) -> list[dict[str, str]]:
    return page.evaluate(f"{ROWS}.map(r => ({{name: r.dataset.name, tier: r.dataset.tier, kind: r.dataset.kind, "
                         f"rank: r.dataset.rank, flash: r.classList.contains('flash')}}))")


def open_monitor(page: Page, url: str) -> None:
    """Load /monitor and give it the key: the gateway has --api-key, and the page asks, as it would ask a person."""
    page.navigate(f"{url}/monitor")
    page.wait_for("!document.getElementById('keyform').hidden")
    page.evaluate(f"document.getElementById('key').value = {json.dumps(KEY)}; "
                  "document.getElementById('keyform').requestSubmit(); true")


def test_the_monitor_shows_a_checkpoint_move_from_the_device_to_ram(tmp_path: Path) -> None:
    stack = start_stack(tmp_path / "stack")
    try:
        chat(stack, "tides")
        cached = cached_tokens(chat(stack, "tides"))
        assert cached > 0
        with chromium() as page:
            open_monitor(page, stack.url)
            page.wait_for(f"{ROWS}.some(r => r.dataset.tier === 'device' && r.dataset.kind === 'checkpoint')")
            on_device = {r["name"] for r in state_rows(page) if r["tier"] == "device" and r["kind"] == "checkpoint"}
            assert len(on_device) == 2
            assert {r["rank"] for r in state_rows(page) if r["tier"] == "device"} == {"0", "1"}
            # The retry's row: its cached tokens, from the device, a checkpoint.
            row = page.wait_for("[...document.querySelectorAll('tr.request')].map(r => "
                                "[...r.cells].map(c => c.textContent)).find(c => c[4] !== '0')")
            assert row[4] == f"{cached:,}" and row[5:7] == ["device", "checkpoint"]
            assert page.evaluate("document.querySelector('[data-field=\"pool-total\"]').textContent") != ""
            assert page.evaluate("document.querySelectorAll('.engine').length") == 1
            # The hit-rate chart has its axes; the recent requests scroll in their card (issue 47 item 12).
            assert page.evaluate("document.querySelector('.engine .chart .yaxis').textContent") == "100 %50 %0 %"
            assert page.evaluate("document.querySelector('.engine .xaxis').textContent") == "3 min agonow"
            assert page.evaluate("(s => s.overflowY + ' ' + s.maxHeight)("
                                 "getComputedStyle(document.querySelector('.engine .recent-scroll')))") == "auto 352px"

            chat(stack, "glaciers")  # its two captures take both device slots: the tides states move to KV-RAM
            names = json.dumps(sorted(on_device))
            # Off the device and in ram (with every slot taken the engine may write its next victim to KV-RAM
            # ahead of need, so a state can show in both for a while: that is not yet the move).
            moved = page.wait_for(f"(rows => (m => m.length && m)(rows.filter(r => {names}.includes(r.dataset.name) && "
                                  "r.dataset.tier === 'ram' && !rows.some(d => d.dataset.name === r.dataset.name && "
                                  "d.dataset.tier === 'device')).map(r => [r.dataset.name, r.classList.contains('flash')])))"
                                  f"({ROWS})")
            assert {name for name, _ in moved} <= on_device
            assert any(flash for _, flash in moved)  # the move is shown (a flash), not only its result
            chat(stack, "volcanoes")
            page.wait_for("document.querySelectorAll('tr.request').length === 4")
            rows = state_rows(page)
            assert {r["name"] for r in rows if r["tier"] == "ram"} >= on_device
            assert not any(r["tier"] == "device" and r["name"] in on_device for r in rows)
            # The two states written down while the page was open: the engine's spills of the last minute.
            assert int(page.evaluate("document.querySelector('[data-field=\"engine-spm\"]').textContent")) >= 2
            ram_bar = page.evaluate("document.querySelector('[data-field=\"tiers\"]').textContent")
            assert "KV-RAM" in ram_bar and "16.0 MiB" in ram_bar
            shot = page.screenshot(tmp_path / "monitor.png")
            assert shot.stat().st_size > 10_000
            if target := os.environ.get("IGNIS_MONITOR_SCREENSHOT"):
                shutil.copyfile(shot, target)
    finally:
        stop_stack(stack)


def test_two_engines_two_sections_and_a_dense_model_shows_page_chains(tmp_path: Path,
                                                                     dense_chat_model_dir: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    stack = start_stack(tmp_path / "stack", model=str(dense_chat_model_dir), more_engines=(dead,))
    try:
        chat(stack, "tides", system=LONG_SYSTEM)
        with chromium() as page:
            open_monitor(page, stack.url)
            page.wait_for(f"{ROWS}.some(r => r.dataset.kind === 'pages')")
            sections = page.evaluate("[...document.querySelectorAll('.engine')].map(e => [e.dataset.address, "
                                     "e.querySelector('.error').hidden, e.querySelector('.health').textContent])")
            assert sections == [[stack.engine.address, True, "serving"], [dead, False, "unavailable"]]
            assert "UNAVAILABLE" in page.evaluate("document.querySelectorAll('.engine .error')[1].textContent")
            rows = state_rows(page)
            # The kept prompt end (ranked), then the page chain (not ranked: it leaves with its pages).
            assert [(r["kind"], r["tier"], r["rank"]) for r in rows] == [("pages", "device", "0"),
                                                                         ("pages", "device", "")]
            ranks = page.evaluate("[...document.querySelectorAll('.engine .state')].map(r => "
                                  "r.querySelector('span').textContent)")
            assert ranks[:2] == ["0", "–"]  # no rank for the chain
    finally:
        stop_stack(stack)
