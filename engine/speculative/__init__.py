"""Speculative decoding (issue 44): drafts proposed cheaply, verified by one forward of the target.

- `ngram.py`: prompt lookup, the draft for every model (no weights).
- `verify.py`: the target's logits at the drafted positions -> the tokens that stand (greedy: exact;
  sampled: the rejection rule, so the output distribution is the target's).
- `speculator.py`: per sequence, whether and what to draft this step (and when drafting does not pay).

What the step does with a verified chunk (appending, rollback, freeing) is `engine/verify_step.py`,
above the scheduler and the output processor it drives; this package sits below the scheduler.
"""
