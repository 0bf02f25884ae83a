"""A request and its sequences. The sequence owns its cache state (page table,
state slot, computed-token count); the scheduler changes it only through the
methods here."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry.context import Context

from engine.facts import RequestClass, ReuseReport
from engine.guided.matcher import CompiledGuide
from engine.kv.chain_hash import StateHash
from engine.lora.registry import ServedAdapter
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler
from engine.text.detokenizer import TextStream

if TYPE_CHECKING:  # engine.vision imports the image processor, which a text-only engine never loads
    from engine.vision.media import PromptMedia


def context_length_message(max_model_len: int, prompt_tokens: int, completion_tokens: int, why: str = "") -> str:
    """A request too long for the context, in OpenAI's words (`why` goes before the advice): clients
    (litellm) tell a context error from other 400s by this text."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, {completion_tokens} in "
            f"the completion){why}. Please reduce the length of the messages or completion.")


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # how a request that failed ends (its ignis.request.done line); no sequence finishes so


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    MOVING = "moving"  # its state is being written to a lower tier; it resumes from there
    FINISHED = "finished"


class CommitPolicy(enum.Enum):
    INCLUDING_GENERATED_TOKENS = "including_generated_tokens"  # prompt and reply both stay findable
    PREFILL_STATE_ONLY = "prefill_state_only"  # only state computed from the prompt is kept
    NONE = "none"  # look up, but publish nothing


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    request_class: RequestClass = RequestClass.INTERACTIVE
    cache_salt: str = ""
    echo: bool = False
    lookup: bool = True  # False: bypass reuse entirely (no lookup, nothing published)
    commit: CommitPolicy = CommitPolicy.INCLUDING_GENERATED_TOKENS
    speculative: bool = True  # False: never drafted for (`ignis.speculative`), whatever the engine's method
    head_tokens: int = 0  # length of the stable head (system + tools) when it prefixes the prompt; 0: none
    arrival: float = field(default_factory=time.monotonic)
    # The trace of the RPC that submitted it (None: not traced); its engine spans are children of it.
    trace_context: Context | None = field(default=None, compare=False, repr=False)
    # Its grammar (guided decoding), compiled before it was queued; None: unconstrained.
    guided: CompiledGuide | None = field(default=None, compare=False, repr=False)
    # The LoRA adapter it runs with (the request's `model` named it); None: the base model.
    adapter: ServedAdapter | None = field(default=None, compare=False)
    # Its images (engine/vision/media.py): their spans in prompt_ids hold key ids, not token ids.
    media: PromptMedia | None = field(default=None, compare=False, repr=False)

    @property
    def adapter_slot(self) -> int:
        """Its adapter's slot in the LoRA sites (engine/lora/sites.py); -1: the base model."""
        return -1 if self.adapter is None else self.adapter.slot

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")

    @property
    def publishes(self) -> bool:
        """Whether state computed for this request is kept for others (bypass and commit=none: no)."""
        return self.lookup and self.commit is not CommitPolicy.NONE

    @property
    def claims_state(self) -> bool:
        """Whether this request may start from retained state. Echo with logprobs needs the
        logits at every prompt position, which only a full prefill produces."""
        return self.lookup and not (self.echo and self.params.logprobs)


@dataclass(frozen=True, slots=True)
class MovedState:
    """A live sequence's state, committed to a lower tier under a private name until it resumes."""

    name: StateHash
    tokens: int  # its computed tokens when it moved


@dataclass(slots=True)
class SeqTimes:
    """When a sequence went through each stage (time.monotonic()), for its request's trace spans.

    Only the way to its first admission is kept: a preempted sequence keeps these.
    """

    admitted: float | None = None  # left the queue
    lookup: tuple[float, float] | None = None  # the reuse lookup that admitted it
    claim: tuple[float, float] | None = None  # copying (or restoring) the claimed state in
    finished: float | None = None

    def mark_admitted(self) -> None:
        if self.admitted is None:
            self.admitted = time.monotonic()


class EngineSequence:
    """One choice of a request: prompt + generated tokens and where their state lives.

    The scheduler and the reuse strategies change its cache state only through
    the methods below, so each field has one kind of writer.
    """

    def __init__(self, seq_id: int, request: EngineRequest, choice: int, sampler: RequestSampler,
                 stream: TextStream) -> None:
        self.seq_id = seq_id
        self.request = request
        self.choice = choice
        self.sampler = sampler
        self.stream = stream
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt = len(request.prompt_ids)
        # Added to a position past the prompt for its rotary angle: M-RoPE's offset after images, else 0.
        self.rope_shift = request.media.rope_delta if request.media is not None else 0
        self.image_embeds: dict[bytes, torch.Tensor] = {}  # its images' tower outputs while its prompt computes
        self.images_encoded = 0  # images of its prompt the vision tower ran for (not reused, not cached)
        self.num_computed = 0  # tokens whose KV/state is in the cache
        self.page_table: list[int] = []
        self.slot: int | None = None
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # matched stop string or stop token id
        self.first_token_time: float | None = None
        self.token_round: Any = None  # the sampling round of its latest token (engine/metrics.py, the ITL metric)
        self.preemptions = 0
        self.times = SeqTimes()
        self.unforked: list[EngineSequence] = []  # choices 1..n-1, forked from this one after its prompt
        # Reuse state: the namespace hash h0, the chain hashes of its full pages (computed once), what it claimed.
        self.namespace: StateHash = StateHash(b"")
        self.page_hashes: list[StateHash] = []
        self.num_cached = 0
        self.reuse = ReuseReport()
        self.num_registered = 0  # leading pages of page_table already published by hash
        self.lineage: int | None = None  # checkpoints of one conversation share a lineage
        self.pending_logits: torch.Tensor | None = None  # claimed with the state's next-token logits
        self.held_for_inflight = False  # was held at admission while another computed its reusable state
        self.moved: MovedState | None = None  # where its state waits while it is moved down a tier
        self.moves = 0
        # Set when it resumes from a move: the scheduler step until which it keeps its room, and its
        # computed tokens then (moved again with no more computed is a thrash: engine/scheduler.py).
        self.hold_until_step = 0
        self.computed_at_resume: int | None = None
        self.speculation: Any = None  # its drafting state (engine/speculative/speculator.py), made when first drafted
        self.prefill_yields = 0  # steps in a row its prefill waited for shorter prompts' last chunks (scheduler)
        # Sort key: higher sorts later = lower rank = preempted first (kept: the scheduler sorts every step).
        self.rank_key: tuple[int, float] = (int(request.request_class), request.arrival)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    def pages_needed(self, total_tokens: int, page_size: int) -> int:
        return max(0, -(-total_tokens // page_size) - len(self.page_table))

    # --- naming (set once when the request reaches the engine thread) ---------------------------
    def name_pages(self, namespace: StateHash, page_hashes: list[StateHash]) -> None:
        self.namespace, self.page_hashes = namespace, page_hashes

    def hold_forks(self, children: list[EngineSequence]) -> None:
        """Choices 1..n-1 of its request, to fork from it once its prompt is computed."""
        self.unforked = list(children)

    def take_forks(self) -> list[EngineSequence]:
        children, self.unforked = self.unforked, []
        return children

    # --- cache state: the scheduler and the reuse strategies -----------------------------------
    def admit(self, slot: int | None) -> None:
        """Leaves the queue with its state slot (hybrid models)."""
        self.times.mark_admitted()
        self.slot = slot

    def start_running(self) -> None:
        self.status = SeqStatus.RUNNING

    def hold_for_inflight(self) -> bool:
        """Held at admission while another computes what it would claim; True the first time."""
        first, self.held_for_inflight = not self.held_for_inflight, True
        return first

    def adopt(self, pages: list[int], computed: int, logits: torch.Tensor | None = None,
              registered: int = 0) -> None:
        """Start from claimed state: `pages` hold the first `computed` tokens (the first
        `registered` of them already published by hash); `logits` are the next-token logits
        when the claim covers the whole sequence."""
        if computed > len(self.token_ids):
            raise RuntimeError("claimed more tokens than the sequence has: this is a bug")
        if computed == len(self.token_ids) and logits is None:
            # Nothing would be computed and nothing sampled: the sequence would never move.
            raise RuntimeError("claimed the whole sequence without its next-token logits: this is a bug")
        self.page_table = list(pages)
        self.num_computed = computed
        self.num_registered = registered
        self.pending_logits = logits if computed == len(self.token_ids) else None

    def fork_from(self, parent: EngineSequence, pages: list[int], slot: int | None) -> None:
        """Choice i of n starts from its parent's computed prompt: shared pages plus a private copy."""
        self.page_table = list(pages)
        self.slot = slot
        self.num_computed = parent.num_computed
        self.num_cached, self.reuse, self.lineage = parent.num_cached, parent.reuse, parent.lineage
        self.status = SeqStatus.RUNNING

    def grow(self, pages: list[int]) -> None:
        self.page_table.extend(pages)

    def swap_slot(self, slot: int) -> int | None:
        """Hold `slot` instead of its own, which it hands back (a drafting hybrid's state before and after
        a verify: engine/verify_step.py)."""
        held, self.slot = self.slot, slot
        return held

    def drop_pages(self, keep: int) -> list[int]:
        """Hand back the pages after the first `keep` (the caller frees them)."""
        dropped, self.page_table = self.page_table[keep:], self.page_table[:keep]
        return dropped

    def release_memory(self) -> tuple[list[int], int | None]:
        """Hand back the pages and slot it holds (the caller frees them)."""
        pages, slot = self.page_table, self.slot
        self.page_table, self.slot = [], None
        return pages, slot

    def mark_registered(self, num_pages: int) -> None:
        self.num_registered = max(self.num_registered, num_pages)

    def join_lineage(self, lineage: int) -> None:
        self.lineage = lineage

    def record_reuse(self, report: ReuseReport) -> None:
        self.num_cached = report.reused_tokens
        self.reuse = report

    def take_pending_logits(self) -> torch.Tensor | None:
        logits, self.pending_logits = self.pending_logits, None
        return logits

    # --- progress: the engine core --------------------------------------------------------------
    def mark_computed(self, n: int) -> None:
        self.num_computed += n
        if self.num_computed > len(self.token_ids):
            raise RuntimeError("computed more tokens than the sequence has: this is a bug")

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.sampler.observe(token)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def start_moving(self) -> None:
        """Stops running while its state is written to a lower tier (it keeps its memory until then)."""
        self.status = SeqStatus.MOVING

    def moved_down(self, state: MovedState) -> None:
        """Its state is committed below (its memory already released): it waits to resume from there."""
        if self.page_table or self.slot is not None:
            raise RuntimeError("moved down while still holding memory: this is a bug")
        self.moved = state
        self.status = SeqStatus.WAITING
        self.moves += 1

    def take_moved(self) -> MovedState | None:
        moved, self.moved = self.moved, None
        return moved

    def resumed(self, hold_until_step: int) -> None:
        """Its moved-down state is back: it keeps its room until `hold_until_step` (hysteresis)."""
        self.hold_until_step = hold_until_step
        self.computed_at_resume = self.num_computed

    @property
    def moved_without_progress(self) -> bool:
        """Resumed from a move and computed nothing since: moving it again would be a thrash."""
        return self.computed_at_resume is not None and self.num_computed <= self.computed_at_resume

    def lose_state(self) -> None:
        """Its moved-down state could not be restored: prompt + output so far are prefilled again."""
        self.num_computed = 0
        self.num_registered = 0
        self.pending_logits = None
        self.preemptions += 1

    def reset_for_recompute(self) -> None:
        """After preemption (its memory already released): prompt + output so far are prefilled again."""
        if self.page_table or self.slot is not None:
            raise RuntimeError("preempted while still holding memory: this is a bug")
        self.num_computed = 0
        self.num_registered = 0
        self.pending_logits = None
        self.status = SeqStatus.WAITING
        self.preemptions += 1

    def finish(self, reason: FinishReason, stop: str | int | None = None) -> None:
        self.status = SeqStatus.FINISHED
        self.times.finished = time.monotonic()
        self.finish_reason = reason
        self.stop_reason = stop

def rope_shifts(seqs: Sequence[EngineSequence]) -> list[int] | None:
    """Each decode's rotary shift (M-RoPE after a prompt with images), None where all are 0."""
    shifts = [seq.rope_shift for seq in seqs]
    return shifts if any(shifts) else None
