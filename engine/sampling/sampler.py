"""From one step's logits to next tokens, for a batch of requests with their own parameters.

Order of operations (each only on the rows that asked for it):
  0. guided decoding: tokens the row's grammar cannot take next get -inf
  1. logit_bias
  2. min_tokens: eos and stop_token_ids get -inf while too few tokens exist
     (unless the grammar allows nothing else: a complete grammar only lets a stop token follow)
  3. repetition, then frequency and presence penalties
  -> these are the "processed logits"; logprobs are reported from them
  4. greedy rows: argmax (ties -> lowest id)
  5. sampled rows: temperature, top_k, top_p, min_p, then one
     `torch.multinomial` draw per row with that request's own generator.

Step 5 uses only the row's own data and generator, so a seeded request yields
the same tokens alone or in any batch, at any position.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.sampling.guide import TokenGuide, apply_guides
from engine.sampling.params import SamplingParams
from engine.sampling.processors import apply_logit_bias, apply_penalties, mask_tokens, truncated_probs
from kernels.select import kernels_for

_UINT64_MASK = 2**64 - 1
# Processed logits stay below this; divided by the smallest sampled temperature (1e-5) they are still finite.
LOGIT_CEILING = 1e30


class RequestSampler:
    """One request's (or one choice's) sampling state: params, generator, token history.

    The token history exists only for penalties. It lives in two [V] tensors
    (output counts, prompt+output seen mask) allocated on the first step that
    needs them, when the vocabulary size and device are known, and is kept up
    to date incrementally: `observe` queues a token, the next step folds the
    queue in, so a step costs O(new tokens), not O(sequence length).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Iterable[int] = (),
        device: torch.device | str = "cpu",
        *,
        seed: int | None = None,
        guide: TokenGuide | None = None,
    ) -> None:
        self.params = params
        # Read for every row of every step: kept, not recomputed by the params' properties.
        self.greedy = params.is_greedy
        self.penalised = params.has_penalties
        self.guide = guide  # the request's grammar, at this choice's position in it
        # Greedy and nothing for process_logits to do but sanitize: the batch may skip its copy.
        self.plain_greedy = self.greedy and not self.penalised and guide is None and not params.logit_bias \
            and not params.logprobs and params.min_tokens == 0
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # `seed` overrides params.seed (fork uses it); without either, draw one so
        # unseeded requests still differ from each other and from run to run.
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.seed: int = seed
        self.device = torch.device(device)
        self._generator: torch.Generator | None = None  # made at the first draw: a greedy choice never draws
        self._output_counts: torch.Tensor | None = None  # [V] int32
        self._seen: torch.Tensor | None = None  # [V] bool
        self._synced = 0  # how many of output_token_ids the tensors reflect

    @property
    def generator(self) -> torch.Generator:
        """The choice's own generator, seeded with `seed` (made when first drawn from: ~10 µs a request)."""
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
            # Generators take an unsigned 64-bit seed; wrap so seed+i never overflows.
            self._generator.manual_seed(self.seed & _UINT64_MASK)
        return self._generator

    def observe(self, token_id: int) -> None:
        """Record a token accepted into the output (after any stop/accept decision)."""
        if token_id < 0:
            raise ValueError(f"token id must be >= 0, got {token_id}")
        self.output_token_ids.append(token_id)
        if self.guide is not None:
            self.guide.accept(token_id)

    def fork(self, seed_offset: int) -> RequestSampler:
        """A sampler for choice `seed_offset` of an n>1 request, with the same history.

        With a seed, choice i draws from seed+i, so each choice is reproducible
        on its own (choice 0 matches a plain n=1 request); without one, each
        fork gets a fresh random seed.
        """
        seed = None if self.params.seed is None else self.params.seed + seed_offset
        guide = self.guide.fork() if self.guide is not None else None
        child = RequestSampler(self.params, self.prompt_token_ids, self.device, seed=seed, guide=guide)
        child.output_token_ids = list(self.output_token_ids)
        return child

    def penalty_state(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [V] int32, seen mask [V] bool), brought up to date with observed tokens."""
        if self._output_counts is None or self._seen is None:
            self._output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if self.prompt_token_ids:
                _check_ids("prompt token", self.prompt_token_ids, vocab_size)
                self._seen[torch.tensor(self.prompt_token_ids, device=device)] = True
            self._synced = 0
        if self._output_counts.shape[0] != vocab_size:
            raise ValueError(
                f"vocabulary size changed from {self._output_counts.shape[0]} to {vocab_size}; this is a bug"
            )
        pending = self.output_token_ids[self._synced :]
        if pending:
            _check_ids("output token", pending, vocab_size)
            ids = torch.tensor(pending, device=device)
            # accumulate=True so a token repeated within `pending` counts each time.
            self._output_counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
            self._seen[ids] = True
            self._synced = len(self.output_token_ids)
        return self._output_counts, self._seen


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: list[int]  # [B]
    logprobs: list[float | None]  # [B]: the chosen token's logprob, None where not requested
    top_logprobs: list[list[tuple[int, float]]]  # [B][top_logprobs]: (id, logprob), best first


def process_logits(
    logits: torch.Tensor,
    samplers: list[RequestSampler],
    eos_token_ids: frozenset[int],
    step_counts: list[int],
) -> torch.Tensor:
    """Steps 0-3: grammar, bias, min_tokens masking and penalties, on a copy of `logits`."""
    # logits: [B, V]
    _check_batch(logits, samplers, step_counts)
    vocab = logits.shape[1]
    x = logits.to(torch.float32, copy=True)  # never modify the caller's tensor

    guided = [i for i, s in enumerate(samplers) if s.guide is not None]
    apply_guides(x, guided, [g for s in samplers if (g := s.guide) is not None])

    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, s in enumerate(samplers):
        for token_id, bias in s.params.logit_bias:
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    _check_ids("logit_bias token", cols, vocab)
    apply_logit_bias(x, rows, cols, values)

    rows, cols = [], []
    for i, s in enumerate(samplers):
        if step_counts[i] < s.params.min_tokens:
            # With ignore_eos, eos does not end the request, so there is no need to hold it back.
            stops = set(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                stops |= eos_token_ids
            _check_ids("stop token", stops, vocab)
            if s.guide is not None and _only_these_allowed(x[i], stops):
                continue  # the grammar is complete: holding back its stop would leave nothing to sample
            rows.extend([i] * len(stops))
            cols.extend(sorted(stops))
    mask_tokens(x, rows, cols)

    penalised = [i for i, s in enumerate(samplers) if s.penalised]
    if penalised:
        states = [samplers[i].penalty_state(vocab, x.device) for i in penalised]
        counts = torch.stack([c for c, _ in states])  # [P, V]
        seen = torch.stack([m for _, m in states])  # [P, V]
        params = [samplers[i].params for i in penalised]
        idx = torch.tensor(penalised, device=x.device)  # [P]
        x[idx] = apply_penalties(
            x[idx],
            counts,
            seen,
            _column([p.repetition_penalty for p in params], x.device),
            _column([p.presence_penalty for p in params], x.device),
            _column([p.frequency_penalty for p in params], x.device),
        )
    # A tiny repetition penalty can push a logit past float32's range; +inf (and the NaN of
    # inf - inf in a softmax) would break the draw. Cap it: the token stays the most likely one.
    return x.nan_to_num_(nan=float("-inf"), posinf=LOGIT_CEILING, neginf=float("-inf")).clamp_(max=LOGIT_CEILING)


@dataclass(frozen=True, slots=True)
class SamplerRows:
    """A batch's samplers, row by row, and whether each is plain greedy where the capped argmax kernel runs
    (then sampling reads nothing else of the batch); the engine makes it once for the steady state's list
    of sequences, not every step."""

    samplers: list[RequestSampler]
    plain_greedy: bool

    @classmethod
    def of(cls, samplers: list[RequestSampler], device: torch.device) -> SamplerRows:
        fast = kernels_for(device).argmax_rows_capped is not None
        return cls(samplers, fast and all(s.plain_greedy for s in samplers))


def sample_rows(logits: torch.Tensor, rows: SamplerRows, eos_token_ids: frozenset[int],
                step_counts: Callable[[], list[int]]) -> SampleOutput:
    """sample(logits, rows.samplers, eos_token_ids, step_counts()), the counts asked for only where read.

    A batch whose every row is plain greedy (no grammar, bias, min_tokens, penalties or logprobs:
    process_logits would only turn NaN to -inf and cap at LOGIT_CEILING) is read from the raw logits by
    the C capped argmax, without process_logits' [B, V] copy and its two passes; any other batch, or
    logits the kernel does not take, goes the general way, which gives the same."""
    if rows.plain_greedy:
        if logits.shape[0] != len(rows.samplers):
            raise ValueError(f"logits have {logits.shape[0]} rows but got {len(rows.samplers)} samplers")
        fast = kernels_for(logits.device).argmax_rows_capped
        picked = fast(logits, LOGIT_CEILING) if fast is not None else None
        if picked is not None:
            return _plain_output(picked, len(rows.samplers))
    counts = step_counts()
    _check_batch(logits, rows.samplers, counts)
    return _sample_processed(logits, rows.samplers, eos_token_ids, counts)


def _plain_output(tokens: torch.Tensor, batch: int) -> SampleOutput:
    # One empty list shared by every row: nobody writes a row's top logprobs, and none are asked for here.
    return SampleOutput(token_ids=tokens.tolist(), logprobs=[None] * batch, top_logprobs=[[]] * batch)


def sample(
    logits: torch.Tensor,
    samplers: list[RequestSampler],
    eos_token_ids: frozenset[int],
    step_counts: list[int],
) -> SampleOutput:
    """Next token for each row of `logits`; `step_counts[i]` = tokens row i has generated so far."""
    # logits: [B, V]
    _check_batch(logits, samplers, step_counts)
    return sample_rows(logits, SamplerRows.of(samplers, logits.device), eos_token_ids, lambda: step_counts)


def _sample_processed(logits: torch.Tensor, samplers: list[RequestSampler], eos_token_ids: frozenset[int],
                      step_counts: list[int]) -> SampleOutput:
    """The general way: process the logits (grammar, bias, min_tokens, penalties), then greedy or a draw."""
    x = process_logits(logits, samplers, eos_token_ids, step_counts)  # [B, V]
    batch = x.shape[0]
    token_ids = [0] * batch

    greedy = [i for i, s in enumerate(samplers) if s.greedy]
    if greedy:
        rows = x if len(greedy) == batch else x[greedy]  # an all-greedy batch: no copy of [B, V]
        picked = argmax_lowest(rows).tolist()  # ties -> lowest id
        if len(greedy) == batch:
            token_ids = picked
        else:
            for i, t in zip(greedy, picked):
                token_ids[i] = t

    drawn = [i for i, s in enumerate(samplers) if not s.greedy]
    if drawn:
        probs = draw_probs(x[drawn], [samplers[i].params for i in drawn])  # [S, V]
        # One draw per row from the row's own generator: batch-independent.
        choices = torch.cat(
            [torch.multinomial(probs[row], 1, generator=samplers[i].generator) for row, i in enumerate(drawn)]
        ).tolist()  # one device sync for all rows, not one per row
        for i, t in zip(drawn, choices):
            token_ids[i] = t

    logprobs, top = chosen_logprobs(x, samplers, token_ids)
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)


def draw_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What sampled rows draw from: processed logits [S, V] (row i under params[i]) through temperature,
    top-k, top-p and min-p, as probabilities [S, V]."""
    scaled = x / _column([p.temperature for p in params], x.device)[:, None]
    return truncated_probs(scaled, torch.tensor([p.top_k for p in params], dtype=torch.int64, device=x.device),
                           _column([p.top_p for p in params], x.device),
                           _column([p.min_p for p in params], x.device))


def chosen_logprobs(
    x: torch.Tensor, samplers: list[RequestSampler], token_ids: list[int]
) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    # Convention: logprobs describe the model's distribution after bias and
    # penalties but before temperature and top-k/top-p/min-p (close to vLLM's
    # "raw" mode). They then mean the same thing for greedy and sampled
    # requests and do not become -inf for tokens truncation happened to drop.
    batch = x.shape[0]
    chosen: list[float | None] = [None] * batch
    top: list[list[tuple[int, float]]] = [[] for _ in range(batch)]
    rows = [i for i, s in enumerate(samplers) if s.params.logprobs]
    if not rows:
        return chosen, top
    lp = torch.log_softmax(x[rows], dim=-1)  # [L, V]
    ids = torch.tensor([token_ids[i] for i in rows], device=x.device)  # [L]
    picked = lp.gather(1, ids[:, None]).squeeze(1).tolist()  # [L]
    k = max(samplers[i].params.top_logprobs for i in rows)
    values_l: list[list[float]] = []
    indices_l: list[list[int]] = []
    if k:
        values, indices = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)  # [L, k] each, descending
        values_l, indices_l = values.tolist(), indices.tolist()
    for row, i in enumerate(rows):
        chosen[i] = picked[row]
        n = samplers[i].params.top_logprobs
        if n:
            top[i] = list(zip(indices_l[row][:n], values_l[row][:n]))
    return chosen, top


def _check_batch(logits: torch.Tensor, samplers: list[RequestSampler], step_counts: list[int]) -> None:
    batch = logits.shape[0]
    if len(samplers) != batch or len(step_counts) != batch:
        raise ValueError(
            f"logits have {batch} rows but got {len(samplers)} samplers and {len(step_counts)} step counts"
        )


def argmax_lowest(rows: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim; on the CPU the C kernel's (torch's is a scalar loop there)."""
    fast = kernels_for(rows.device).argmax_rows
    picked = fast(rows) if fast is not None else None
    return picked if picked is not None else torch.argmax(rows, dim=-1)


def _only_these_allowed(row: torch.Tensor, ids: set[int]) -> bool:
    """Whether every token outside `ids` is already masked in `row` ([V])."""
    rest = row.clone()
    rest[list(ids)] = float("-inf")
    return bool(torch.isneginf(rest).all())


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _check_ids(what: str, ids: Iterable[int], vocab_size: int) -> None:
    bad = [t for t in ids if not (0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"{what} id {bad[0]} is out of range for vocabulary size {vocab_size}")
