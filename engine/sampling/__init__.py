"""Sampling: turning one step's logits into next tokens, per request parameters."""

from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler, SampleOutput, process_logits, sample

__all__ = ["RequestSampler", "SampleOutput", "SamplingParams", "process_logits", "sample"]
