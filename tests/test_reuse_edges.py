"""Edges of prompt reuse that the broad scenarios in test_reuse.py do not reach.

Each test pins an exact token count at a boundary: a page-aligned prompt, a
commit policy that must keep generated pages private, the free-list count of an
admission that revives cached pages, the two-checkpoint lineage bound, and a
prompt that ends exactly where a state without next-token logits ends. Outputs
are checked against a cold run (reuse off) of the same prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
import torch

from engine.cache.page_reuse import PageReuse
from engine.cache.reuse import DevicePages
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.chain_hash import StateHash, page_hashes
from engine.kv.page_pool import PagePool
from engine.model.loader import LoadedModel, load_model
from engine.offline import run_to_completion
from engine.request import CommitPolicy, EngineRequest, EngineSequence, FinishReason, SeqStatus
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler
from engine.scheduler import Scheduler, SchedulerLimits
from engine.text.tokenizer import Tokenizer

P = 16
TIMEOUT = 60.0  # a wrong claim can leave a sequence with nothing to compute and no logits: fail, do not hang


@dataclass
class Result:
    tokens: list[int]
    cached: int
    kind: str


@dataclass
class Model:
    name: str  # dense | hybrid
    loaded: LoadedModel
    tokenizer: Tokenizer
    _cold: "Engine | None" = None
    _memo: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)

    def engine(self, reuse: bool = True) -> "Engine":
        return Engine(self, reuse)

    def cold(self, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        """Greedy tokens of a cold run (reuse off) of `prompt`."""
        key = (prompt, max_tokens)
        if key not in self._memo:
            if self._cold is None:
                self._cold = self.engine(reuse=False)
            result = self._cold.run(prompt, max_tokens)
            assert result.cached == 0
            self._memo[key] = result.tokens
        return self._memo[key]

    def close(self) -> None:
        if self._cold is not None:
            self._cold.close()


class Engine:
    """One started EngineCore, driven synchronously from the test thread."""

    def __init__(self, model: Model, reuse: bool, retained_device: int = 8) -> None:
        config = EngineConfig(page_size=P, kv_cache_bytes=8 << 20, max_num_seqs=4, reuse_prompt=reuse,
                              retained_device=retained_device)
        self.core = EngineCore(model.loaded, model.tokenizer, config)
        self.core.start()
        self.n = 0

    def run(self, prompt: tuple[int, ...], max_tokens: int,
            commit: CommitPolicy = CommitPolicy.INCLUDING_GENERATED_TOKENS) -> Result:
        self.n += 1
        request = EngineRequest(f"r{self.n}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                      ignore_eos=True), commit=commit)
        updates = run_to_completion(self.core, request, timeout=TIMEOUT)[0]
        usage = updates[-1].usage
        assert usage is not None and updates[-1].error is None
        tokens = [t for u in updates for d in u.deltas if d.choice == 0 for t in d.token_ids]
        assert len(tokens) == max_tokens
        return Result(tokens, usage.cached_tokens, usage.reuse.kind.value)

    def check(self) -> None:
        # The engine thread is idle once every request is done; integrity is read from here.
        self.core.check_integrity()
        assert self.core.stats().used_pages == 0

    def close(self) -> None:
        try:
            self.check()
        finally:
            self.core.stop()


@pytest.fixture(scope="module")
def dense(dense_chat_model_dir: Path) -> Iterator[Model]:
    model = Model("dense", load_model(dense_chat_model_dir), Tokenizer.from_dir(dense_chat_model_dir))
    yield model
    model.close()


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir: Path) -> Iterator[Model]:
    model = Model("hybrid", load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir))
    yield model
    model.close()


@pytest.fixture(params=["dense", "hybrid"])
def model(request: pytest.FixtureRequest) -> Model:
    return request.getfixturevalue(request.param)


@pytest.fixture()
def engines() -> Iterator[list[Engine]]:
    """Engines a test starts; each is checked (integrity, no page left in use) and stopped after it."""
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def warm(model: Model, engines: list[Engine]) -> Engine:
    engine = model.engine(reuse=True)
    engines.append(engine)
    return engine


def make_prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


# --- 1. a page-aligned dense prompt -------------------------------------------------------


@pytest.mark.parametrize("pages", [1, 3])
@pytest.mark.parametrize("kept_ends", [8, 0])
def test_page_aligned_dense_prompt_claims_all_but_its_last_page(dense: Model, engines: list[Engine],
                                                                pages: int, kept_ends: int) -> None:
    """A prompt of exactly k full pages, sent twice. With its end kept (its next-token logits), the
    second claims all k pages and computes nothing; without, it claims k-1 pages (n - P tokens), never
    all k, because the logits after the last token come from computing it."""
    engine = Engine(dense, reuse=True, retained_device=kept_ends)
    engines.append(engine)
    prompt = make_prompt(pages * P, seed=pages)
    n = len(prompt)
    first = engine.run(prompt, 4)
    second = engine.run(prompt, 4)
    assert first.cached == 0
    if kept_ends:
        assert (second.cached, second.kind) == (n, "pages")
    else:
        assert second.cached == n - P
        assert second.kind == ("pages" if n - P else "none")
    assert first.tokens == second.tokens == dense.cold(prompt, 4)


# --- 2. commit=prefill_state_only ----------------------------------------------------------


@pytest.mark.parametrize("commit", [CommitPolicy.PREFILL_STATE_ONLY, CommitPolicy.INCLUDING_GENERATED_TOKENS],
                         ids=["prefill_state_only", "including_generated_tokens"])
def test_prefill_state_only_keeps_generated_state_private(model: Model, engines: list[Engine],
                                                          commit: CommitPolicy) -> None:
    """The next turn (prompt + reply + more) hits the reply's state only when the first request
    committed its generated tokens; with prefill_state_only it hits only the prompt's state."""
    engine = warm(model, engines)
    prompt = make_prompt(40, seed=11)  # 2.5 pages: the prompt's last page is shared with the reply
    reply = engine.run(prompt, 30, commit=commit).tokens
    follow = prompt + tuple(reply) + make_prompt(5, seed=12)  # 75 tokens
    computed = len(prompt) + len(reply) - 1  # 69: the last sampled token was never computed
    got = engine.run(follow, 6)
    if model.name == "dense":
        want = (len(prompt) // P * P if commit is CommitPolicy.PREFILL_STATE_ONLY else computed // P * P, "pages")
    else:
        want = (len(prompt) if commit is CommitPolicy.PREFILL_STATE_ONLY else computed, "checkpoint")
    assert (got.cached, got.kind) == want
    assert got.tokens == model.cold(follow, 6)


# --- 3. admission that revives cached free pages, at the free-list boundary ------------------

PS = 4  # page size of the scheduler-level scenarios
SEED = StateHash(bytes(16))
PREFIX = tuple(range(1, 10))  # 9 tokens: two full pages registered, a partial third


def make_seq(seq_id: int, tokens: tuple[int, ...]) -> EngineSequence:
    request = EngineRequest(f"r{seq_id}", tokens, SamplingParams(max_tokens=8), arrival=float(seq_id))
    sampler = RequestSampler(request.params, request.prompt_ids)
    seq = EngineSequence(seq_id, request, 0, sampler, None)  # type: ignore[arg-type]  # the scheduler never detokenizes
    seq.name_pages(SEED, page_hashes(SEED, tokens, PS))
    return seq


class Pool:
    """A Scheduler over a PagePool with page reuse, stepped by hand like the engine does."""

    def __init__(self, num_pages: int) -> None:
        self.pages = PagePool(num_pages)
        self.reuse = PageReuse(self.pages, PS)
        self.scheduler = Scheduler(SchedulerLimits(PS, 8, 256), self.pages, None, reuse=self.reuse)
        self.next_id = 0

    def admit(self, tokens: tuple[int, ...]) -> EngineSequence:
        """Queue a sequence and run one step (admission, then its chunk and a sampled token)."""
        self.next_id += 1
        seq = make_seq(self.next_id, tokens)
        self.scheduler.add(seq)
        self.step()
        return seq

    def step(self) -> None:
        plan = self.scheduler.schedule()
        # The scenarios size every sequence so that its decodes fit its pages: no growth, no preemption.
        assert plan.preempted == []
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.mark_computed(chunk.num_tokens)
            self.reuse.after_compute(seq, None)
            if seq.num_computed == len(seq.token_ids):
                seq.append_token(7)

    def finish(self, seq: EngineSequence) -> None:
        self.reuse.on_finish(seq)
        seq.finish(FinishReason.LENGTH)
        self.scheduler.remove(seq)

    def finish_all(self) -> None:
        for seq in list(self.scheduler.running):
            self.finish(seq)
        self.scheduler.check_integrity()
        assert self.pages.num_free == self.pages.num_pages


def exact_and_one_over(pool: Pool, revived: int, free: int, used: dict[int, int]) -> EngineSequence:
    """The claimant of PREFIX's two pages that needs exactly the free pages is admitted; one that
    needs one page more waits (and takes nothing). Returns the admitted one."""
    over = make_seq(100, PREFIX[:8] + tuple(range(50, 59)))  # 17 tokens: 5 pages, 2 claimed
    exact = make_seq(101, PREFIX[:8] + tuple(range(50, 55)))  # 13 tokens: 4 pages, 2 claimed
    for seq, extra in ((over, 1), (exact, 0)):
        claim = pool.reuse.match(seq)
        assert claim is not None and claim.source == DevicePages((0, 1)) and claim.num_tokens == 2 * PS
        assert pool.reuse.revived_free_pages(claim) == revived
        need = -(-len(seq.token_ids) // PS) - 2 + revived  # fresh pages + revived ones, all off the free list
        assert need == free + extra
    assert pool.pages.num_free == free
    pool.scheduler.add(over)
    pool.step()
    assert over.status is SeqStatus.WAITING and over.page_table == [] and over.num_computed == 0
    assert pool.pages.num_free == free and {p: pool.pages.refcount(p) for p in used} == used
    pool.scheduler.check_integrity()
    pool.scheduler.remove(over)
    pool.scheduler.add(exact)
    pool.step()
    assert exact.status is SeqStatus.RUNNING and exact.num_cached == 2 * PS
    assert exact.num_computed == len(PREFIX[:8]) + 5 and pool.pages.num_free == 0
    pool.scheduler.check_integrity()
    return exact


def test_admission_reviving_cached_free_pages_counts_them_against_the_free_list() -> None:
    pool = Pool(5)
    prefix = pool.admit(PREFIX)
    assert prefix.page_table == [0, 1, 2]
    pool.finish(prefix)  # pages 0 and 1 stay findable on the free list
    assert (pool.pages.num_free, pool.pages.num_cached) == (5, 2)
    other = pool.admit((900,))  # holds page 3 (room for its decodes): free list [4, 0, 1, 2]
    assert other.page_table == [3]
    exact = exact_and_one_over(pool, revived=2, free=4, used={0: 0, 1: 0, 3: 1})
    assert exact.page_table == [0, 1, 4, 2]  # revived 0 and 1, then fresh pages from the head
    assert pool.pages.num_cached == 0
    pool.finish_all()


def test_admission_sharing_pages_in_use_revives_nothing() -> None:
    pool = Pool(7)
    prefix = pool.admit(PREFIX)  # still running: pages 0 and 1 are in use and registered
    other = pool.admit(tuple(range(900, 906)))  # holds 3 and 4: free list [5, 6]
    assert (prefix.page_table, other.page_table) == ([0, 1, 2], [3, 4])
    exact = exact_and_one_over(pool, revived=0, free=2, used={0: 1, 1: 1})
    assert exact.page_table == [0, 1, 5, 6]
    assert (pool.pages.refcount(0), pool.pages.refcount(1)) == (2, 2)
    pool.finish_all()


def test_admission_with_one_claimed_page_in_use_and_one_free_revives_one() -> None:
    pool = Pool(5)
    prefix = pool.admit(PREFIX)
    pool.finish(prefix)  # free list [3, 4, 0, 1, 2], 0 and 1 findable
    first_page = pool.admit(PREFIX[:4] + (60, 61))  # claims page 0 (revived), allocates 3
    assert first_page.num_cached == PS and first_page.page_table == [0, 3]
    assert (pool.pages.num_free, pool.pages.num_cached) == (3, 1)  # free list [4, 1, 2]
    exact = exact_and_one_over(pool, revived=1, free=3, used={0: 1, 1: 0})
    assert exact.page_table == [0, 1, 4, 2]
    assert pool.pages.refcount(0) == 2
    pool.finish_all()


# --- 4. a conversation keeps its newest two checkpoints -------------------------------------


def test_three_turn_lineage_keeps_only_the_newest_two_checkpoints(hybrid: Model, engines: list[Engine]) -> None:
    engine = warm(hybrid, engines)
    reuse = engine.core.reuse
    reply_len = 3
    p1 = make_prompt(40, seed=21)
    r1 = engine.run(p1, reply_len)
    assert r1.cached == 0
    p2 = p1 + tuple(r1.tokens) + make_prompt(5, seed=22)
    r2 = engine.run(p2, reply_len)
    assert (r2.cached, r2.kind) == (len(p1) + reply_len - 1, "checkpoint")  # turn 1's reply
    p3 = p2 + tuple(r2.tokens) + make_prompt(5, seed=23)
    r3 = engine.run(p3, reply_len)
    assert (r3.cached, r3.kind) == (len(p2) + reply_len - 1, "checkpoint")  # turn 2's reply
    # Turn 3's opener and reply; turn 1's and turn 2's checkpoints were released.
    states = reuse.states.eviction_order()  # type: ignore[attr-defined]
    assert sorted(s.num_tokens for s in states) == [len(p3), len(p3) + reply_len - 1]
    assert len({s.lineage for s in states}) == 1
    # What is kept still hits; what was released does not, at any length of its own.
    assert engine.run(p3, reply_len).cached == len(p3)
    again2 = engine.run(p2 + tuple(r2.tokens), reply_len)  # would claim turn 2's reply checkpoint
    assert again2.cached == 0
    again1 = engine.run(p1, reply_len)  # would claim turn 1's opener checkpoint
    assert again1.cached == 0 and again1.kind == "none"
    assert again1.tokens == r1.tokens == hybrid.cold(p1, reply_len)
    assert again2.tokens == hybrid.cold(p2 + tuple(r2.tokens), reply_len)


# --- 5. a prompt that ends where a finished request's state (without logits) ends ------------


def test_prompt_equal_to_a_finished_requests_computed_tokens(model: Model, engines: list[Engine]) -> None:
    """The state captured at finish covers prompt + reply[:-1] and has no next-token logits: a
    prompt of exactly those tokens must still compute at least one token; one more token may
    claim that state whole."""
    engine = warm(model, engines)
    prompt = make_prompt(44, seed=31)
    reply = engine.run(prompt, 5).tokens
    ends_at_state = prompt + tuple(reply[:-1])  # 48 tokens: exactly three pages
    got = engine.run(ends_at_state, 4)
    n = len(ends_at_state)
    # Dense: every page but the last; hybrid: the opener checkpoint (it has its logits).
    assert got.cached == (n - P if model.name == "dense" else len(prompt)) < n
    assert got.tokens == model.cold(ends_at_state, 4)
    one_more = prompt + tuple(reply)  # 49 tokens: the finish state, then one token computed
    got = engine.run(one_more, 4)
    assert got.cached == n == len(one_more) - 1
    assert got.tokens == model.cold(one_more, 4)
