"""How many prefill tokens the next step may run, so that a step ends within the step time target.

A request that arrives while a step runs waits for that step to end, and its own first step is next:
with 2,048-token chunks of a long prompt, a step takes a second on a CPU and a 16-token probe waits that
long for its first token (and as long again for each token after). So the prefill tokens of a step are
paced by time: the engine measures each step and sizes the next step's prefill allowance so that a step
takes about `engine.step_time_target_ms`. Auto scales from a small CPU to a GPU by itself: a multiple of
the engine's cheapest recent prefill step (its fixed cost on this device and model), `AUTO_BUSY` times
it while other work is about (sequences decoding, or a request arrived within `BUSY_WINDOW_S`), and
`AUTO_QUIET` times it when a prompt prefills alone: short steps cost a long prompt their fixed cost
each (measured by bench/long_prefill.py: a 24k prompt of the tiny model 2.3x as long at 20 ms steps
as in 2,048-token chunks, 1.2x at 40 ms), a price worth paying only while someone waits on the steps.

The allowance follows the measured time of the steps it bounded (n' = n * target / took, damped): the
fixed point is the chunk whose step takes the target, and it follows the attention's cost as a prompt's
context grows. It never goes below `MIN_CHUNK` tokens, so a long prompt always moves, nor above the
token budget of a step (`engine.prefill_chunk_tokens`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

AUTO_BUSY = 2.5  # auto target while other work is about: this many times the cheapest recent prefill step
AUTO_QUIET = 8.0  # ... while a prompt prefills alone
BUSY_WINDOW_S = 1.0  # a request that arrived this recently makes the engine busy
MIN_CHUNK = 16  # tokens: the least a paced prefill gets in a step (progress whatever the target)
_FLOOR_DRIFT = 1.0005  # the cheapest-step figure creeps up by this per step, so a slower machine is followed
_DAMPING = 0.5  # exponent on target / took: halves each correction, so one noisy step moves it little
# (and where half the way does not leave the rung, it moves one rung: else it could rest a rung off)


@dataclass(slots=True)
class StepPacing:
    target_ms: float  # 0.0: auto; math.inf: off (the token budget alone)
    max_tokens: int  # a step's token budget (engine.prefill_chunk_tokens)
    allowance: int = 0  # prefill tokens the next step may run
    floor_s: float | None = None  # the cheapest recent step (seconds), None before the first
    bounded_steps: int = 0  # steps whose prefill the allowance cut
    busy: bool = False  # other work is about (set by the scheduler each step): auto aims at short steps
    last_arrival: float = -math.inf  # time.monotonic() of the latest request's arrival

    def __post_init__(self) -> None:
        # Before anything is measured, a first step of a few chunks' worth: it measures the floor
        # without running a whole 2,048-token step first.
        self.allowance = self.max_tokens if self.off else min(self.max_tokens, 4 * MIN_CHUNK)

    @property
    def off(self) -> bool:
        return math.isinf(self.target_ms)

    @property
    def target_s(self) -> float | None:
        """The step time the allowance aims at; None while auto has measured nothing."""
        if self.off:
            return None
        if self.target_ms > 0:
            return self.target_ms / 1e3
        return None if self.floor_s is None else (AUTO_BUSY if self.busy else AUTO_QUIET) * self.floor_s

    def arrived(self) -> None:
        """A request arrived: the steps stay short for a while, whatever is running."""
        self.last_arrival = time.monotonic()

    def pace(self, decoding: bool) -> int:
        """The next step's prefill allowance; `decoding`: sequences decode in it (they wait on its end)."""
        busy = decoding or time.monotonic() - self.last_arrival < BUSY_WINDOW_S
        if busy != self.busy and self.target_ms == 0:
            # The target moves by AUTO_QUIET / AUTO_BUSY: so does the allowance, at once (following it
            # by measurement would leave the first steps that someone waits on long).
            self._set(self.allowance * (AUTO_BUSY / AUTO_QUIET if busy else AUTO_QUIET / AUTO_BUSY))
        self.busy = busy
        return self.allowance

    def observe(self, seconds: float, bounded: bool) -> None:
        """A step that ran prefill tokens took `seconds`; `bounded`: the allowance cut its prefill.

        Only such steps set the floor: a decode-only step is cheaper than any prefill step, and a
        target made from it would cut a long prompt into chunks that cost mostly their fixed cost."""
        if self.off or seconds <= 0:
            return
        self.floor_s = seconds if self.floor_s is None else min(seconds, self.floor_s * _FLOOR_DRIFT)
        target = self.target_s
        if not bounded or target is None:
            return
        self.bounded_steps += 1
        wanted = _on_ladder(self.allowance * target / seconds)
        damped = _on_ladder(self.allowance * (target / seconds) ** _DAMPING)
        if damped == self.allowance != wanted:  # half the way stays on this rung: one rung toward it
            damped = _on_ladder(self.allowance * (1.4 if wanted > self.allowance else 1 / 1.4))
        self._set(damped)

    def _set(self, tokens: float) -> None:
        """The allowance: `tokens` on the ladder, at least MIN_CHUNK, at most the step's token budget."""
        self.allowance = min(self.max_tokens, max(MIN_CHUNK, _on_ladder(tokens)))


def _on_ladder(tokens: float) -> int:
    """`tokens` (at least 1) rounded to the nearest (by ratio) of 2^k and 1.5 * 2^k: a few chunk sizes, each
    seen again and again, so a library that builds its kernels per input shape (oneDNN's linear layers:
    ~0.4 ms each, the first time) builds a handful rather than one for every size a step was ever given.
    Nearest, not down: rounded down, a damped correction never climbs back a rung."""
    tokens = max(1.0, tokens)
    low = 1 << (int(tokens).bit_length() - 1)
    rungs = (low, low + low // 2, 2 * low)
    return min(rungs, key=lambda r: abs(math.log(tokens / r)))
