"""Retained slots on the host (`reuse.retained_host`, issue 15): with no device slots, later turns
and subagents still hit, from the host tier, with outputs equal to a cold run; a full host block
moves its lowest-ranked state down to KV-RAM."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from engine.facts import RequestClass, ReuseTier
from engine.model.loader import LoadedModel, load_model
from engine.text.tokenizer import Tokenizer
from services import RunningService, start_tierstore
from test_reuse import TOOLS, Harness, conversation, same

MiB = 1 << 20


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunningService]:
    service = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", str(32 * MiB), "--kv-disk-bytes", "0"])
    yield service
    service.stop()


def test_later_turns_and_subagents_hit_host_slots(hybrid: tuple[LoadedModel, Tokenizer]) -> None:
    loaded, tokenizer = hybrid
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=0, retained_host=4)
    cold = Harness(loaded, tokenizer, reuse=False)
    try:
        assert warm.core.residency.retained_slots == (0, 0) and warm.core.residency.host_slots == (4, 0)
        task = conversation("Find the flaky test.")
        first = warm.run(warm.request(task, tools=TOOLS))[0]
        same(first, cold.run(cold.request(task, tools=TOOLS))[0])
        again = warm.run(warm.request(task, tools=TOOLS))[0]  # an exact retry: the opener checkpoint
        same(again, cold.run(cold.request(task, tools=TOOLS))[0])
        assert (again.kind, again.tier) == ("checkpoint", "host")
        other = conversation("Read the changelog.")
        sub = warm.run(warm.request(other, tools=TOOLS))[0]  # a subagent: the system+tools prefix
        same(sub, cold.run(cold.request(other, tools=TOOLS))[0])
        assert (sub.kind, sub.tier) == ("prefix", "host") and sub.cached > 0
        stats = warm.core.stats()
        assert stats.retained_host_slots_used >= 2 and stats.reused_tokens[ReuseTier.HOST] > 0
        assert warm.core.pages.num_used == 0  # retained state keeps no device pages
        warm.core.check_integrity()
    finally:
        warm.close()
        cold.close()


def test_a_claimed_host_state_moves_up_to_a_free_device_slot(hybrid: tuple[LoadedModel, Tokenizer]) -> None:
    """Captures go to the host first; a host state claimed while a device slot is free is promoted
    to it, and the next claim of it shares device pages. Every answer equals cold."""
    loaded, tokenizer = hybrid
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=1, retained_host=4)
    cold = Harness(loaded, tokenizer, reuse=False)
    try:
        task = conversation("Find the flaky test.")
        want = cold.run(cold.request(task, tools=TOOLS))[0]
        same(warm.run(warm.request(task, tools=TOOLS))[0], want)
        assert warm.core.residency.retained_slots == (1, 0)  # captured on the host, not the device
        tiers = []
        for _ in range(2):
            again = warm.run(warm.request(task, tools=TOOLS))[0]
            same(again, want)
            tiers.append(again.tier)
        assert tiers == ["host", "device"]
        assert warm.core.stats().retained_promotions == 1 and warm.core.residency.retained_slots == (1, 1)
        warm.core.check_integrity()
    finally:
        warm.close()
        cold.close()


def test_a_full_host_block_moves_its_lowest_state_down_to_ram(hybrid: tuple[LoadedModel, Tokenizer],
                                                              store: RunningService) -> None:
    loaded, tokenizer = hybrid
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=0, retained_host=2,
                   tierstore_address=store.address, retained_interactive_ttl=0.0)
    cold = Harness(loaded, tokenizer, reuse=False)
    try:
        topics = ["tides", "glaciers", "volcanoes"]
        for t in topics:  # each conversation's opener and reply checkpoints: the host block overflows
            warm.run(warm.request(conversation(f"Tell me about {t}."), cls=RequestClass.AGENT))
        assert warm.core.reuse.counters.evictions >= 2
        back = warm.run(warm.request(conversation("Tell me about tides."), cls=RequestClass.AGENT))[0]
        same(back, cold.run(cold.request(conversation("Tell me about tides.")))[0])
        assert back.tier == "ram" and back.cached > 0
        warm.core.check_integrity()
    finally:
        warm.close()
        cold.close()


def test_a_capture_is_claimable_only_once_its_staged_copy_is_done(hybrid: tuple[LoadedModel, Tokenizer]) -> None:
    """The copy worker is held back: the exact retry of a finished request must wait (held at
    admission, never reading a half-filled host slot) and claims the state once it is copied."""
    import threading

    loaded, tokenizer = hybrid
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=0, retained_host=4)
    cold = Harness(loaded, tokenizer, reuse=False)
    try:
        ring = warm.core.residency.states.ring  # type: ignore[union-attr]
        ring.running.clear()
        task = conversation("Profile the decoder.")
        first = warm.run(warm.request(task))[0]  # its opener and reply-end captures wait in the ring
        retry: list[object] = []
        thread = threading.Thread(target=lambda: retry.extend(warm.run(warm.request(task))))
        thread.start()
        while warm.core.stats().inflight_holds == 0:  # held at admission, not served a torn state
            thread.join(0.01)
        assert not retry and ring.in_flight == 2
        ring.running.set()
        thread.join(60)
        got = retry[0]
        want = cold.run(cold.request(task))[0]
        same(first, want)
        same(got, want)  # type: ignore[arg-type]
        assert (got.tier, got.cached) == ("host", len(warm.request(task).prompt_ids))  # type: ignore[attr-defined]
        warm.core.check_integrity()
    finally:
        warm.close()
        cold.close()


def test_a_capture_that_finds_both_staging_buffers_busy_is_skipped_and_counted(
        hybrid: tuple[LoadedModel, Tokenizer]) -> None:
    loaded, tokenizer = hybrid
    warm = Harness(loaded, tokenizer, reuse=True, retained_device=0, retained_host=4)
    try:
        ring = warm.core.residency.states.ring  # type: ignore[union-attr]
        ring.running.clear()
        # No system message, so no shared head: each request captures its opener and its reply's end.
        warm.run(warm.request([{"role": "user", "content": "Check the disk budget."}]))  # both buffers busy
        other: list[dict[str, object]] = [{"role": "user", "content": "Draft the release notes."}]
        warm.run(warm.request(other))  # its two captures find no buffer
        assert warm.core.stats().retained_staging_skips == 2
        ring.running.set()
        again = warm.run(warm.request(other))[0]
        assert again.cached == 0  # nothing of it was retained
        warm.core.check_integrity()
    finally:
        warm.close()
