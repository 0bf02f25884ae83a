"""A step's sampling: every sequence that computed its next-token logits draws its token in one call.

A sampling failure (a request's logit bias or grammar raising) ends that request
only: the batch is sampled again one sequence at a time, and the ones that still
fail are reported back as failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.guided.matcher import GrammarDeadEnd
from engine.output_processor import Deltas
from engine.request import EngineSequence
from engine.sampling.sampler import SampleOutput, SamplerRows, sample_rows

log = logging.getLogger("ignis.engine")

# What takes a round's sampled tokens: OutputProcessor.append_sampled, or .decoded on the decode road.
Appender = Callable[[list[EngineSequence], SampleOutput, Deltas, dict[str, str]], None]


class StepSampling:
    def __init__(self, eos_ids: frozenset[int], append: Appender) -> None:
        self.eos_ids = eos_ids
        self.append = append  # where the tokens go unless a call says otherwise
        self._last_rows: tuple[list[EngineSequence], SamplerRows] | None = None  # see _sampler_rows

    def _sampler_rows(self, seqs: list[EngineSequence], device: torch.device) -> SamplerRows:
        """The samplers of `seqs`: the last step's again when it is the same list (the steady state's)."""
        last = self._last_rows
        if last is not None and last[0] is seqs:
            return last[1]
        rows = SamplerRows.of([s.sampler for s in seqs], device)
        self._last_rows = (seqs, rows)  # held: the list is not freed (and its id reused) while compared
        return rows

    def sample(self, seqs: list[EngineSequence], logits: torch.Tensor, deltas: Deltas,
               failed: dict[str, str], handle: Appender | None = None) -> None:
        """Sample the batch (logits [B, V], row i for seqs[i]) in one call and hand the tokens to `handle`
        (`append` unless told); if sampling raises, sample each sequence alone so that one request's
        failure ends that request only (`failed`: request id -> why)."""
        # What raises in sampling does so before any draw (the checks and logit processing come
        # first, and capped logits keep the probabilities finite), so a retry draws what the batch
        # would have: no generator state needs saving on every step.
        try:
            out = sample_rows(logits, self._sampler_rows(seqs, logits.device), self.eos_ids,
                              lambda: [s.num_output for s in seqs])
        except Exception as exc:
            if len(seqs) == 1:
                rid = seqs[0].request.request_id
                if isinstance(exc, GrammarDeadEnd):  # the request's grammar, not the engine: say why
                    log.info("request %s: %s", rid, exc)
                    failed.setdefault(rid, f"guided decoding: {exc}")
                    return
                log.exception("sampling failed for request %s", rid)
                failed.setdefault(rid, "sampling failed for this request (see the engine log)")
                return
            log.warning("batched sampling failed: sampling the %d sequences one by one", len(seqs))
            for i, seq in enumerate(seqs):
                self.sample([seq], logits[i : i + 1], deltas, failed)
            return
        (handle or self.append)(seqs, out, deltas, failed)
