"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step every running sequence that is decoding gets one token, then prefills
share the rest of the step's token budget (`engine.prefill_chunk_tokens`), so a
long prompt is cut into chunks and never stalls running decodes. Interactive
work is admitted first and preempted last; memory is counted in pages and state
slots. The scheduler owns that memory for live sequences: the page pool, the
slot pool, the running list, and the forks of an n > 1 request's choices.
"""

from __future__ import annotations

from collections import abc, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import overload

from engine.cache.reuse import Claim, NoReuse, PromptReuse
from engine.facts import RequestClass
from engine.kv.page_pool import PagePool, SlotPool
from engine.residency.layer import Residency
from engine.residency.live_moves import LiveMoves
from engine.speculative.speculator import Speculator
from engine.request import EngineSequence, MovedState, SeqStatus
from engine.steady_decodes import SteadyDecodes
from engine.step_pacing import StepPacing
from engine.tracing import admission_stage

_RANK = attrgetter("rank_key")
MAX_PREFILL_YIELDS = 4  # steps in a row a prompt's chunk waits for shorter prompts ending theirs
# Copies a parent's computed state into a forked child: (parent, child, child's private last page or None).
ForkCopy = Callable[[EngineSequence, EngineSequence, int | None], None]


@dataclass(slots=True)  # not frozen: made per sequence every step, and a frozen init costs 4x
class ScheduledChunk:
    seq: EngineSequence
    num_tokens: int  # tokens that run this step: seq.token_ids[seq.num_computed:] ones, then the draft's
    draft: tuple[int, ...] = ()  # drafted tokens verified after the pending ones (engine/speculative/)
    spare_slot: int | None = None  # a drafting hybrid's copy of its state before the step (its rollback)


class DecodeChunks(abc.Sequence[ScheduledChunk]):
    """A steady plan's chunks (each sequence, one token), made when asked: the engine reads the sequences."""

    __slots__ = ("_seqs",)

    def __init__(self, seqs: list[EngineSequence]) -> None:
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @overload
    def __getitem__(self, i: int) -> ScheduledChunk: ...

    @overload
    def __getitem__(self, i: slice) -> list[ScheduledChunk]: ...

    def __getitem__(self, i: int | slice) -> ScheduledChunk | list[ScheduledChunk]:
        if isinstance(i, slice):
            return [ScheduledChunk(seq, 1) for seq in self._seqs[i]]
        return ScheduledChunk(self._seqs[i], 1)


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] | DecodeChunks = field(default_factory=list)
    preempted: list[EngineSequence] = field(default_factory=list)  # lost their state: recomputed later
    moving: list[EngineSequence] = field(default_factory=list)  # started moving down a tier this step
    # Every chunk is one sequence decoding its one pending token, past its first (the steady state: the
    # runner's fast path; a first token may fork, echo prompt logprobs or end at max_tokens=0).
    decodes_only: bool = False
    decode_seqs: list[EngineSequence] = field(default_factory=list)  # a decodes_only plan's sequences, in order
    # The same list of sequences as the last step's plan (decode_seqs is that list), each one token on.
    steady: bool = False
    prefill_tokens: int = 0  # prompt tokens the plan's chunks run (not the decodes')
    paced: bool = False  # the step pacing's allowance cut a prefill chunk (engine/step_pacing.py)

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    page_size: int
    max_num_seqs: int
    step_token_budget: int  # tokens per step, decodes and prefill chunks together (engine.prefill_chunk_tokens)

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.step_token_budget <= 0:
            raise ValueError(f"invalid scheduler limits {self}")


class Scheduler:
    def __init__(self, limits: SchedulerLimits, pages: PagePool, slots: SlotPool | None,
                 reuse: PromptReuse | None = None, fork_copy: ForkCopy | None = None,
                 residency: Residency | None = None, pacing: StepPacing | None = None,
                 speculator: Speculator | None = None) -> None:
        self.limits = limits
        self.speculator = speculator if speculator is not None and speculator.on else None
        self.pacing = pacing  # None: a step's prefill is bounded by the token budget alone
        self.pages = pages
        self.slots = slots
        self.reuse = reuse or NoReuse()
        self._fork_copy = fork_copy
        self.residency = residency
        self.mover: LiveMoves | None = residency.moves if residency is not None else None
        self.waiting: dict[RequestClass, deque[EngineSequence]] = {c: deque() for c in RequestClass}
        self.running: list[EngineSequence] = []
        self._steady: SteadyDecodes | None = None  # the last plan, while it is the steady state
        self._step = 0  # schedule() calls so far: the clock of a resumed sequence's hold
        self._headroom: int | None = None  # this step's _decode_headroom, counted once when admission asks

    # --- queues -------------------------------------------------------------
    def add(self, seq: EngineSequence) -> None:
        self.waiting[seq.request.request_class].append(seq)
        if self.pacing is not None:
            self.pacing.arrived()

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0 or bool(self.mover and self.mover.moving)

    def remove(self, seq: EngineSequence) -> None:
        """Drop a sequence (finished or cancelled) and free what it holds, in every tier."""
        if self.mover is not None:
            self.mover.cancel(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            queue = self.waiting[seq.request.request_class]
            if seq in queue:
                queue.remove(seq)
        self._release(seq)

    # --- memory -------------------------------------------------------------
    def _release(self, seq: EngineSequence) -> None:
        pages, slot = seq.release_memory()
        if pages:
            self.pages.release(pages)
        if slot is not None and self.slots is not None:
            self.slots.release(slot)

    def _grow(self, seq: EngineSequence, total_tokens: int) -> bool:
        need = seq.pages_needed(total_tokens, self.limits.page_size)
        if need == 0:
            return True
        if not self.pages.can_allocate(need):
            self.reuse.reclaim(need)  # retained state is a cache: live work comes first
        got = self.pages.allocate(need)
        if got is None:
            return False
        seq.grow(got)
        return True

    def _displace(self, victim: EngineSequence, plan: StepPlan) -> None:
        """Make room: move `victim` down a tier (its memory is freed once the bytes are
        committed), or, when no tier can take it, drop its state to recompute it later."""
        if self.move_down(victim):
            plan.moving.append(victim)
            return
        self.running.remove(victim)
        self._release(victim)
        victim.reset_for_recompute()
        self._requeue(victim)
        plan.preempted.append(victim)

    def _requeue(self, seq: EngineSequence) -> None:
        """Put a sequence that ran back in its queue: ahead of every newcomer of its class (it keeps the
        rank it was admitted with), behind the ones that ran before it and rank above it."""
        queue = self.waiting[seq.request.request_class]
        at = 0
        while at < len(queue) and queue[at].times.admitted is not None and queue[at].rank_key < seq.rank_key:
            at += 1
        queue.insert(at, seq)

    def move_down(self, seq: EngineSequence) -> bool:
        """Start moving a running sequence down a tier (pressure does, through `_displace`; tests force
        it); False, and it keeps running, when no tier can take it."""
        if seq not in self.running or self.mover is None or not self.mover.begin(seq):
            return False
        self.running.remove(seq)
        self._steady = None  # the kept batch points at pages this move frees
        return True

    def _settle_moves(self, plan: StepPlan) -> None:
        """Between decode rounds: write the next window of each move; free what is committed."""
        if self.mover is None:
            return
        done, failed = self.mover.advance()
        for seq, moved in done:
            self._release(seq)
            seq.moved_down(moved)
            self._requeue(seq)
        for seq in failed:  # the store went away mid-move: recompute instead
            self._release(seq)
            seq.reset_for_recompute()
            self._requeue(seq)
            plan.preempted.append(seq)

    def _incoming(self) -> tuple[int, int]:
        """(pages, slots) that moves in progress free once committed."""
        if self.mover is None:
            return 0, 0
        pages = {p for p in self.mover.pages_in_flight() if self.pages.refcount(p) == 1}
        return len(pages), sum(1 for s in self.mover.moving if s.slot is not None)

    def _victim_below(self, rank: tuple[int, float]) -> EngineSequence | None:
        """The lowest-ranked running sequence ranked strictly below `rank` that may give up its room now:
        one that just resumed from a move keeps it for its hold (else the one that displaced it would
        take the room back the moment it resumed, and the two would trade it forever)."""
        step = self._step
        return max((s for s in self.running if s.rank_key > rank and s.hold_until_step <= step),
                   key=_RANK, default=None)

    def _decode_headroom(self) -> int:
        """Free pages the running decodes take this step (each whose next position starts a page):
        admission leaves them, so room a move freed for a decode is not handed to the queue instead.
        Counted once a step: what admission does next only lowers it (a displaced sequence leaves, an
        admitted one has its pages), so the first count is the safe one."""
        if self._headroom is None:
            size = self.limits.page_size
            self._headroom = sum(1 for s in self.running if len(s.token_ids) - s.num_computed == 1
                                 and s.num_computed >= len(s.page_table) * size)
        return self._headroom

    # --- the step -------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._step += 1
        self._headroom = None
        if self.residency is not None:
            self.residency.poll()  # captures copied off the step become claimable
        self._settle_moves(plan)
        self._admit(plan)
        budget = self.limits.step_token_budget
        page_size = self.limits.page_size
        steady, self._steady = self._steady, None
        drafts = self._drafts() if self.speculator is not None else None
        if steady is not None and not drafts and not plan.preempted and not plan.moving and steady.holds(self.running) \
                and len(steady.seqs) <= budget and self._grow_each(steady.next_step()):
            plan.chunks, plan.decode_seqs = DecodeChunks(steady.seqs), steady.seqs
            plan.decodes_only = plan.steady = True
            self._steady = steady
            return plan
        chunks: list[ScheduledChunk] = []
        plan.chunks = chunks
        decoding: list[EngineSequence] = []
        prefilling: list[EngineSequence] = []
        first_tokens = False  # a decode of its first token: forks, prompt logprobs or max_tokens=0 may follow
        verifying: list[ScheduledChunk] = []  # chunks of more than one token past the prompt (drafts, catch-ups)
        for s in self.running:  # inline, not a property: this runs for every sequence of every step
            length = len(s.token_ids)
            # More than one token pending past the prompt: a drafting hybrid catching up (engine/speculative/).
            if s.num_computed == 0 or (length - s.num_computed > 1 and s.num_computed < s.num_prompt):
                prefilling.append(s)
            else:
                decoding.append(s)
                first_tokens |= length <= s.num_prompt
        plan.decodes_only = not prefilling and not first_tokens
        # Decodes first, highest rank first, so growth failures preempt from the bottom.
        for seq in sorted(decoding, key=_RANK):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_pending == 0:  # claimed a state with its next-token logits: nothing to compute
                chunks.append(ScheduledChunk(seq, 0))
                plan.decodes_only = False
                continue
            waits = False
            pending = seq.num_pending
            if seq.num_computed + pending > len(seq.page_table) * page_size:  # a new position needs a page
                while not self._grow(seq, seq.num_computed + pending):
                    if self._incoming()[0] >= seq.pages_needed(seq.num_computed + pending, page_size):
                        waits = True  # a move in progress frees the page: wait a round for it
                        break
                    victim = self._victim_below(seq.rank_key)
                    if victim is not None:
                        self._displace(victim, plan)
                        continue
                    if max(self.running, key=_RANK) is seq and seq.hold_until_step <= self._step:
                        self._displace(seq, plan)  # the lowest gives way to those above it
                    else:
                        waits = True  # what ranks below keeps its room a few steps more
                    break
            if seq.status is not SeqStatus.RUNNING or waits or budget < pending:
                continue
            draft = drafts.get(seq, ())[:budget - pending] if drafts else ()
            if pending == 1 and not draft:
                chunks.append(ScheduledChunk(seq, 1))
                budget -= 1
                continue
            chunk = self._verify_chunk(seq, pending, draft)
            verifying.append(chunk)
            budget -= chunk.num_tokens
        if verifying:  # after the single-token decodes: the runner takes those as one block
            chunks.extend(verifying)
            plan.decodes_only = False
        self._prefill_chunks(prefilling, budget, plan, chunks, bool(decoding))
        if plan.decodes_only:
            plan.decode_seqs = [c.seq for c in chunks]
            if plan.decode_seqs and not plan.preempted and not plan.moving \
                    and len(plan.decode_seqs) == len(self.running):
                self._steady = SteadyDecodes.of(self.running, plan.decode_seqs, page_size)
        return plan

    def _drafts(self) -> dict[EngineSequence, tuple[int, ...]]:
        """This step's drafts of the running sequences past their first token (asked once a step each), cut to
        what pays (engine/speculative/draft_sizing.py)."""
        assert self.speculator is not None
        drafts: dict[EngineSequence, tuple[int, ...]] = {}
        if not self.speculator.begin_step(len(self.running)):
            return drafts
        for seq in self.running:
            if seq.num_computed >= seq.num_prompt:  # a decode (the speculator asks for a first token too)
                draft = self.speculator.draft(seq)
                if draft:
                    drafts[seq] = draft
        return self.speculator.size(drafts)

    def _verify_chunk(self, seq: EngineSequence, pending: int, draft: tuple[int, ...]) -> ScheduledChunk:
        """The chunk of a sequence with a draft or several pending tokens: the draft as far as free pages
        and (hybrids) a spare state slot allow it; room is never made for a draft."""
        if draft and not self._grow(seq, seq.num_computed + pending + len(draft)):
            have = len(seq.page_table) * self.limits.page_size - seq.num_computed - pending
            draft = draft[:max(0, have)]
        spare = None
        if draft and self.slots is not None:
            spare = self.slots.allocate()
            if spare is None:
                draft = ()
        return ScheduledChunk(seq, pending + len(draft), draft, spare)

    def grow_for_draft(self, seq: EngineSequence, total_tokens: int) -> bool:
        """Pages for `total_tokens` positions of `seq` if the pool (or retained state) has them: a drafter
        writing past the sequence's tokens (engine/speculative/mtp_drafter.py); room is never made for it."""
        return self._grow(seq, total_tokens)

    def trim_pages(self, seq: EngineSequence) -> None:
        """After a verify: free the pages past the ones its tokens need (drafted positions that did not stand)."""
        keep = -(-len(seq.token_ids) // self.limits.page_size)
        if len(seq.page_table) > keep:
            self.pages.release(seq.drop_pages(keep))

    def release_slot(self, slot: int) -> None:
        """A state slot no sequence holds any more (a drafting hybrid's state it did not keep)."""
        if self.slots is not None:
            self.slots.release(slot)

    def _prefill_chunks(self, prefilling: list[EngineSequence], budget: int, plan: StepPlan,
                        chunks: list[ScheduledChunk], decoding: bool) -> None:
        """Prefills by class, then shortest remaining first: a short prompt that arrives during a 16k-token
        prefill gets its first token without waiting for all of it.

        Paced by time (engine/step_pacing.py), the allowance bounds a step's prefill tokens, so a step
        that runs a long prompt's chunk still ends soon and what arrives meanwhile waits little; and a
        step that ends a prompt runs no longer prompt beside it: that first token costs a small step (a
        long prompt's chunk costs its attention over the whole context, however few its tokens). A prompt
        that yielded MAX_PREFILL_YIELDS steps in a row takes its chunk anyway, so a stream of short
        prompts slows a long one and never stops it."""
        paced_by_time = self.pacing is not None and not self.pacing.off
        allowance = budget if self.pacing is None or not prefilling else self.pacing.pace(decoding)
        ends_a_prompt = False
        for seq in sorted(prefilling, key=lambda s: (s.rank_key[0], s.num_pending, s.rank_key[1])):
            if budget <= 0 or allowance <= 0 or seq.status is not SeqStatus.RUNNING:
                continue
            if ends_a_prompt and seq.prefill_yields < MAX_PREFILL_YIELDS:
                seq.prefill_yields += 1
                continue
            n = min(seq.num_pending, budget, allowance)
            paced = n == allowance < min(seq.num_pending, budget)
            cut = self.reuse.cut_point(seq)
            if cut is not None and cut - seq.num_computed < n:
                n, paced = cut - seq.num_computed, False  # end the chunk where state is captured
            if not self._grow(seq, seq.num_computed + n):
                continue  # pages were reserved at admission; only a fork's growth can get here
            chunks.append(ScheduledChunk(seq, n))
            seq.prefill_yields = 0
            budget -= n
            allowance -= n
            plan.prefill_tokens += n
            plan.paced |= paced
            ends_a_prompt |= paced_by_time and n == seq.num_pending

    def _grow_each(self, entering: list[EngineSequence]) -> bool:
        """A page for each of a steady plan's sequences whose new position starts one, unless it has it;
        False if one cannot have it now (the general plan then makes room or waits)."""
        page_size = self.limits.page_size
        for seq in entering:
            if seq.num_computed >= len(seq.page_table) * page_size and not self._grow(seq, seq.num_computed + 1):
                return False
        return True

    def _admit(self, plan: StepPlan) -> None:
        """Admit waiting sequences whose whole prompt fits: interactive first, FIFO within a class.

        Reuse is matched once per attempt; making room keeps what the claim matched (reclaim
        spares the claimed state, preemption only frees pages). A sequence whose reusable
        state another is computing right now is held back (and does not block the queue):
        it is admitted once that state is published."""
        for cls in RequestClass:
            queue = self.waiting[cls]
            for seq in list(queue):
                claim = None if seq.moved is not None else self._match(seq)  # a moved one resumes its own
                if seq.moved is None and self.reuse.in_flight(seq, claim, self.running):
                    if seq.hold_for_inflight():
                        self.reuse.counters.inflight_holds += 1
                    continue  # what it would claim is being computed now: wait for it; the rest may pass
                if not self._fits(seq, claim):
                    self.reuse.reclaim(self._pages_for(seq, claim), keep=claim)
                    if not self._fits(seq, claim) and not self._make_room_for(seq, claim, plan):
                        return  # keep order: nothing behind the head jumps it
                queue.remove(seq)
                self._start(seq, claim)

    def _start(self, seq: EngineSequence, claim: Claim | None) -> None:
        first_admission = seq.times.admitted is None
        seq.admit(self.slots.allocate() if self.slots is not None else None)
        moved = seq.take_moved()
        if moved is not None:
            self._resume(seq, moved)
        elif claim is not None:
            with admission_stage(seq, "claim"):  # a restore's tierstore calls join the request's trace
                self.reuse.apply(seq, claim)
        if first_admission:
            self.reuse.record(seq, claim)
        got = self.pages.allocate(seq.pages_needed(len(seq.token_ids), self.limits.page_size))
        assert got is not None, "admitted without its pages: this is a bug"
        seq.grow(got)
        seq.start_running()
        self.running.append(seq)

    def _resume(self, seq: EngineSequence, moved: MovedState) -> None:
        """Copy a moved-down sequence's state back; if that fails it is recomputed."""
        assert self.mover is not None
        self._steady = None  # a batch kept from before the move reads its old pages and slot
        got = self.pages.allocate(-(-moved.tokens // self.limits.page_size))
        assert got is not None, "resumed without its pages: this is a bug"
        if self.mover.restore(seq, moved, got):
            seq.adopt(got, moved.tokens, seq.pending_logits)  # restored pages are published again
            seq.resumed(self._step + self.limits.page_size)  # keeps its room for a page of decode steps
        else:
            self.pages.release(got)
            seq.lose_state()

    def _match(self, seq: EngineSequence) -> Claim | None:
        with admission_stage(seq, "lookup"):  # the lookup's tierstore calls join the request's trace
            return self.reuse.match(seq)

    def _pages_for(self, seq: EngineSequence, claim: Claim | None) -> int:
        """Free pages admitting `seq` takes: its whole prompt, less the full pages a claim shares,
        plus the claimed pages it takes back off the free list (counted now: room-making changes it)."""
        total = -(-len(seq.token_ids) // self.limits.page_size)
        if claim is None:
            return total
        return total - claim.num_tokens // self.limits.page_size + self.reuse.revived_free_pages(claim)

    def _fits(self, seq: EngineSequence, claim: Claim | None, incoming: tuple[int, int] = (0, 0),
              leaving: int = 0) -> bool:
        """Whether `seq` fits now (with `incoming`: once the moves in progress have freed their room; with
        `leaving`: once that many running sequences have left), beside the pages the running decodes
        take this step."""
        if len(self.running) - leaving >= self.limits.max_num_seqs:
            return False
        if self.slots is not None and self.slots.num_free + incoming[1] == 0:
            return False
        return self.pages.can_allocate(self._pages_for(seq, claim) + self._decode_headroom() - incoming[0])

    def _room_of(self, seqs: list[EngineSequence]) -> tuple[int, int]:
        """(pages, slots) that `seqs` would free: pages only they hold, and their slots."""
        pages = {p for s in seqs for p in s.page_table if self.pages.refcount(p) == 1}
        return len(pages), sum(1 for s in seqs if s.slot is not None)

    def _make_room_for(self, seq: EngineSequence, claim: Claim | None, plan: StepPlan) -> bool:
        """Displace running sequences of a lower class than `seq` (agent work for interactive) until it
        fits: moved down, the room comes back over the next steps, and `seq` waits for it at the head.
        Nothing is displaced unless displacing all it may would make it fit."""
        below = sorted((s for s in self.running if s.rank_key[0] > seq.rank_key[0]
                        and s.hold_until_step <= self._step), key=_RANK, reverse=True)
        incoming, room = self._incoming(), self._room_of(below)
        if not self._fits(seq, claim, (incoming[0] + room[0], incoming[1] + room[1]), len(below)):
            return False
        for victim in below:
            if self._fits(seq, claim, self._incoming()):
                break
            self._displace(victim, plan)
        return self._fits(seq, claim)

    # --- forks -------------------------------------------------------------------
    def fork_children(self, parent: EngineSequence) -> list[EngineSequence]:
        """Choices 1..n-1 copy the parent's state once its prompt is computed; the ones
        that do not fit now wait and prefill the prompt themselves."""
        children = parent.take_forks()
        forked = []
        page_size = self.limits.page_size
        for child in children:
            full = parent.num_computed // page_size
            partial = parent.num_computed % page_size != 0
            slot = self.slots.allocate() if self.slots is not None else None
            new_page = self.pages.allocate(1) if partial else []
            if (self.slots is not None and slot is None) or new_page is None or \
                    len(self.running) >= self.limits.max_num_seqs:
                if slot is not None and self.slots is not None:
                    self.slots.release(slot)
                if new_page:
                    self.pages.release(new_page)
                self.add(child)
                continue
            shared = parent.page_table[:full]
            self.pages.share(shared)
            child.fork_from(parent, shared + list(new_page), slot)
            if self._fork_copy is not None:
                self._fork_copy(parent, child, new_page[0] if new_page else None)
            self.running.append(child)
            forked.append(child)
        return forked

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        if self.residency is not None:
            self.residency.check_integrity()
        if self.slots is not None:
            self.slots.check_integrity()
        held = {p for s in self.running for p in s.page_table}
        if self.residency is not None:
            held |= self.residency.held_pages()
            held |= set(self.residency.moves.pages_in_flight())
        if len(held) != self.pages.num_used:
            # Every page in use is held by a running sequence or a retained state; otherwise it leaked.
            raise AssertionError(f"{self.pages.num_used} pages used but {len(held)} are held")
