"""Protection is earned by a claim (common/eviction.py): single-use states do not hold the device's
retained slots for the whole TTL (issue 47 item 7), and a state someone claimed keeps its slot.

An EngineCore with two retained slots and the default 300 s TTL is stepped by hand, interactive requests
only, no tier below: a capture that finds no slot it may take is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.facts import ReuseTier
from engine.model.loader import load_model
from engine.text.tokenizer import Tokenizer
from test_live_moves import Driver, make_prompt, make_request


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir: Path) -> tuple[str, object, Tokenizer]:
    return "hybrid", load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def cached(driver: Driver, rid: str, prompt: tuple[int, ...]) -> tuple[int, ReuseTier]:
    """Run `prompt`; the prompt tokens it found retained and the tier they came from."""
    driver.run(make_request(rid, prompt, max_tokens=4))
    usage = driver.updates[rid][-1].usage
    assert usage is not None
    return usage.cached_tokens, usage.reuse.tier


def test_unclaimed_states_give_way_and_a_claimed_one_keeps_its_slot(hybrid) -> None:  # type: ignore[no-untyped-def]
    driver = Driver(hybrid, retained_device=2, retained_interactive_ttl=300.0, reuse_prompt=True)
    try:
        first, second, third = (make_prompt(48, seed=s) for s in (1, 2, 3))
        assert cached(driver, "a", first)[0] == 0
        assert cached(driver, "b", second)[0] == 0  # its captures take the slots of a's, which nobody claimed
        assert cached(driver, "b-again", second) == (48, ReuseTier.DEVICE)  # b's state is there: a hit
        assert cached(driver, "c", third)[0] == 0  # takes what b left unclaimed, never b's claimed state
        assert cached(driver, "b-third", second) == (48, ReuseTier.DEVICE)
        assert driver.core.stats().retained_slots_used == 2
        driver.core.check_integrity()
    finally:
        driver.close()
