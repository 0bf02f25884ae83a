"""What the engine core hands back to a request's owner, one update per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.facts import ReuseReport, ReuseTier
from engine.request import FinishReason


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None for the first prompt token, which nothing predicts
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)  # not frozen: made per sequence every step, and a frozen init costs 4x; never changed
class ChoiceDelta:
    choice: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    time_to_first_token_ms: float
    reuse: ReuseReport = ReuseReport()
    draft_tokens: int = 0  # speculative decoding: drafted and verified, all choices
    accepted_tokens: int = 0  # of those, kept
    images: int = 0  # images in the prompt
    images_reused: int = 0  # of those, the ones the vision tower did not run for (state reused, or encoder cache)


@dataclass(slots=True)  # not frozen: made per request every step, and a frozen init costs 4x; never changed
class RequestUpdate:
    request_id: str
    deltas: tuple[ChoiceDelta, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # echo with logprobs: one per prompt token
    usage: Usage | None = None  # on the last update of the request only
    error: str | None = None  # an internal failure; the request is over

    @property
    def done(self) -> bool:
        return self.usage is not None or self.error is not None


@dataclass(frozen=True, slots=True)
class EngineStats:  # noqa: D101 - a snapshot for GetStats and /metrics
    waiting_interactive: int
    waiting_agent: int
    running_interactive: int
    running_agent: int
    total_pages: int
    used_pages: int  # held by live sequences
    cached_pages: int  # held only so that retained state can be reused (retained states, cached free pages)
    page_size: int
    total_slots: int
    used_slots: int
    requests_finished: int
    requests_cancelled: int
    requests_preempted: int
    prompt_tokens: int
    generated_tokens: int
    retained_slots_total: int = 0
    retained_slots_used: int = 0
    retained_host_slots_total: int = 0
    retained_host_slots_used: int = 0
    retained_hits: int = 0
    retained_misses: int = 0
    reused_tokens: dict[ReuseTier, int] = field(default_factory=dict)  # by the tier they came from
    prefix_reused_tokens: int = 0
    retained_slot_skips: int = 0
    retained_protected_skips: int = 0
    retained_staging_skips: int = 0
    spills_ahead: int = 0  # states written to KV-RAM off the step, before the device gave them up
    spills_on_step: int = 0  # states written to KV-RAM on the step, as the device gave them up
    copy_waits: int = 0  # steps that waited for a copy off the step before reusing the memory it read
    retained_promotions: int = 0  # host states moved up to a free device slot when claimed
    inflight_holds: int = 0
    sequences_moved: dict[ReuseTier, int] = field(default_factory=dict)  # live sequences moved down, by tier
    sequences_recomputed: int = 0  # live sequences that lost their state and prefilled it again
    moving: int = 0  # live sequences being moved down now
    sequence_thrash: int = 0  # moved down again with nothing computed since they resumed (a bug if ever > 0)
    prefill_allowance_tokens: int = 0  # prompt tokens the next step may run (engine/step_pacing.py)
    step_time_target_seconds: float = 0.0  # what the allowance aims at now; 0 when off or not measured yet
    paced_steps: int = 0  # steps whose prefill the step time target cut
