"""Speculative decoding: decode tok/s with drafts verified in one forward against plain decoding, one run.

    python -m bench.speculative [--hidden 1024 --layers 16] [--kinds dense,hybrid] [--batches 1,8]
                                [--mtp-seconds 90] [--peer llama.cpp|none]

Random weights do not copy from their prompt, so prompt lookup (`ngram`) drafts almost nothing that
stands on them; the table says what it does on an agent-like workload (a file in the prompt, asked to
be repeated) at that acceptance, which is the "never slower" half of the target. What drafting buys at
a given acceptance is measured with `reference` drafts: the tokens a plain run produced, each one
replaced by a wrong token with probability q, through the same verify path (the drafter is the only
part swapped), so acceptance is set by q and the cost of drafting and verifying is the engine's own.
`mtp`: the checkpoint's MTP layer, trained for --mtp-seconds on the target's own greedy outputs
(bench/mtp_training.py, cached), drafting on random prompts.

llama.cpp (`--peer llama.cpp`, bench/speculative_peer.py): llama-server on the same checkpoint, plain,
with prompt lookup (`ngram-simple`) on the echo workload, and with the same trained MTP layer
(`draft-mtp`, Qwen3.5 only: llama.cpp's Qwen3 has no MTP block).

The three engines (plain, ngram/reference, mtp) are stepped on this one thread, one at a time: three
step threads would be three OpenMP teams on the CPUs, throttling each other (engine/model/openmp.py).
Decode tok/s counts the steps run once every row has its first token (their tokens over their
time); every request decodes --decode tokens greedily. Each configuration alternates with plain decoding in pairs; its ratio is
the median over the pairs. Acceptance length: tokens a verify step yields (drafts kept + 1).
Target: batch-1 decode >= 1.6x `none` at acceptance length >= 2.5; never slower at acceptance ~0.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Any

from bench.drive import random_prompt, run_stepped
from bench.geometry import ensure_geometry
from bench.mtp_training import ensure_trained_mtp
from bench.speculative_peer import PeerRate, describe, peer_rates
from bench.table import markdown, save
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import load_model
from engine.model.openmp import on_own_thread
from engine.outputs import RequestUpdate
from engine.request import EngineRequest, EngineSequence
from engine.sampling.params import SamplingParams
from engine.speculative.speculator import NgramDrafter, SpecState
from engine.text.tokenizer import Tokenizer

PROMPT = 64


class ReferenceDrafter:
    """The tokens a plain run of the same prompt produced, each wrong with probability `q` (the drafter of
    this benchmark and of tests/test_speculative.py: every verify outcome, at an acceptance q sets)."""

    proposes_every_step = True  # a lookup, as prompt lookup's

    def __init__(self, reference: dict[tuple[int, ...], list[int]], q: float, vocab: int, seed: int = 0) -> None:
        self.reference, self.q, self.vocab = reference, q, vocab
        self.rng = random.Random(seed)

    def propose(self, seq: EngineSequence, state: SpecState, k: int) -> list[int]:
        ahead = self.reference.get(seq.request.prompt_ids, [])[seq.num_output:seq.num_output + k]
        return [t if self.rng.random() >= self.q else (t + 1) % self.vocab for t in ahead]


def prompts(batch: int, echo: bool) -> list[tuple[int, ...]]:
    """Random prompts; `echo`: a "file" of 48 tokens, then the same file's first 16 again (an agent asking
    for it back), so prompt lookup drafts the rest of the file."""
    out = []
    for i in range(batch):
        body = random_prompt(PROMPT - 16 if echo else PROMPT, 1000 + i)
        out.append((*body, *body[:16]) if echo else body)
    return out


def greedy_requests(batch: int, tokens: int, tag: str, echo: bool) -> list[EngineRequest]:
    return [EngineRequest(f"{tag}-{i}", p, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                          lookup=False) for i, p in enumerate(prompts(batch, echo))]


def decode_rate(core: EngineCore, batch: int, decode: int, tag: str, echo: bool) -> tuple[float, list[list[int]]]:
    """Tokens a second of the steps run once every row has its first token (the core stepped on this
    thread), and each row's tokens. Counted on those steps alone, not as the difference of two whole
    runs' times (a run of `decode` tokens less one of 1): on this shared machine that difference of
    two noisy figures moved a batch-8 ratio by 0.2 between runs."""
    requests = greedy_requests(batch, decode, tag, echo)
    updates: dict[str, list[RequestUpdate]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.submit(request, updates[request.request_id].append)

    def tokens(rid: str) -> list[int]:
        return [t for u in updates[rid] for d in u.deltas for t in d.token_ids]

    clock, first = 0.0, -1  # first: the tokens out when every row had one (-1: not yet)
    while not all(u and u[-1].done for u in updates.values()):
        core.drain_inbox()
        if first < 0 and all(tokens(rid) for rid in updates):
            first = sum(len(tokens(rid)) for rid in updates)
        began = time.perf_counter()
        core.step()
        if first >= 0:
            clock += time.perf_counter() - began
    failed = [u[-1].error for u in updates.values() if u[-1].error]
    if failed:
        raise RuntimeError(f"request failed: {failed[0]}")
    outs = [tokens(r.request_id) for r in requests]
    return (sum(map(len, outs)) - first) / max(clock, 1e-9), outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kinds", default="dense,hybrid")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mtp-seconds", type=float, default=90.0, help="training budget of the MTP layer (cached)")
    parser.add_argument("--peer", default="llama.cpp", choices=["llama.cpp", "none"])
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    peers: dict[tuple[str, int, bool], PeerRate | str] = {}  # llama.cpp's plain rate per (checkpoint, batch, echo)
    for kind in args.kinds.split(","):
        base = ensure_geometry(kind, args.hidden, args.layers)
        path = ensure_trained_mtp(kind, args.hidden, args.layers, args.mtp_seconds)  # the same target, with MTP
        loaded = on_own_thread(lambda: load_model(path, onednn_linears=True))
        tokenizer = Tokenizer.from_dir(path)

        def core_for(method: str) -> EngineCore:
            # Prefill unpaced: a batch's prompts in one step, so batch 8 decodes as 8 (paced, they entered a
            # few a step and drafting rows finished early: the "batch 8" rows before 2026-12-07 ran 1-5).
            core = on_own_thread(lambda: EngineCore(loaded, tokenizer, EngineConfig(
                page_size=16, kv_cache_bytes=1 << 30, max_num_seqs=max(batches), prefill_chunk_tokens=4096,
                step_time_target_ms=math.inf, reuse_prompt=False, speculative_method=method, speculative_num_tokens=args.num_tokens,
                speculative_disable_batch_size=0)))  # the verify path's own cost at every batch size
            return core  # not started: every core's steps run on this thread (bench/drive.py's run_stepped)

        plain, drafting, mtp = core_for("none"), core_for("ngram"), core_for("mtp")
        vocab = loaded.config.vocab_size
        try:
            for core, tag in ((plain, "warm"), (drafting, "warm-d"), (mtp, "warm-m")):
                run_stepped(core, *greedy_requests(1, 4, tag, False))
            for b in batches:
                reference: dict[tuple[int, ...], list[int]] = {}
                for echo in (False, True):
                    _, outs = decode_rate(plain, b, args.decode, f"ref{b}{echo}", echo)
                    reference.update(zip(prompts(b, echo), outs))
                configs: list[tuple[str, float | None, bool]] = [("ngram", None, True), ("mtp", None, False)]
                configs += [("reference", q, False) for q in (0.0, 0.15, 0.4, 1.0)]
                for method, q, echo in configs:
                    core = mtp if method == "mtp" else drafting
                    if method != "mtp":
                        core.speculator.drafter = NgramDrafter() if q is None else ReferenceDrafter(reference, q, vocab)
                    pairs = []
                    before = (core.speculator.totals.draft_tokens, core.speculator.totals.accepted_tokens,
                              core.speculator.totals.verifies)
                    for r in range(args.repeats):
                        got, outs = decode_rate(core, b, args.decode, f"d{b}{method}{q}{r}", echo)
                        want, plain_outs = decode_rate(plain, b, args.decode, f"p{b}{method}{q}{r}", echo)
                        if outs != plain_outs:
                            raise RuntimeError(f"{kind} b{b} {method} q={q}: output differs from plain decoding")
                        pairs.append((got, want))
                    totals = core.speculator.totals
                    drafted = totals.draft_tokens - before[0]
                    accepted = totals.accepted_tokens - before[1]
                    verifies = totals.verifies - before[2]
                    row = {"kind": kind, "batch": b, "drafts": method if q is None else f"reference q={q}",
                           "workload": "file echoed" if echo else "random prompt",
                           "none_tps": statistics.median(w for _, w in pairs),
                           "spec_tps": statistics.median(g for g, _ in pairs),
                           "ratio": statistics.median(g / w for g, w in pairs),
                           "acceptance_rate": accepted / drafted if drafted else 0.0,
                           "acceptance_length": 1 + accepted / verifies if verifies else 1.0,
                           "verifies": verifies, "pairs": pairs}
                    if args.peer == "llama.cpp" and q is None and (method == "ngram" or kind == "hybrid"):
                        # The peer reads the checkpoint without `mtp.*` unless it drafts with it (its Qwen3
                        # converter knows no MTP tensors).
                        row.update(peer_pair(path if method == "mtp" else base, method, args, b, prompts(b, echo),
                                             peers))
                    rows.append(row)
                    print({k: v for k, v in row.items() if k != "pairs"}, flush=True)
        finally:
            plain.stop()
            drafting.stop()
            mtp.stop()
    headers = ["model", "batch", "drafts", "workload", "none decode tok/s", "drafting decode tok/s",
               "ratio (median of pairs)", "drafts kept", "acceptance length", "llama.cpp none tok/s",
               "llama.cpp drafting tok/s", "llama.cpp ratio", "llama.cpp drafts kept", "llama.cpp tokens/step"]
    table = markdown(headers, [[r["kind"], r["batch"], r["drafts"], r["workload"], r["none_tps"], r["spec_tps"],
                                r["ratio"], r["acceptance_rate"], r["acceptance_length"], *peer_cells(r)]
                               for r in rows])
    title = (f"### Speculative decoding: drafted tokens verified in one forward vs plain decoding "
             f"(hidden {args.hidden}, {args.layers} layers, CPU fp32, k={args.num_tokens}, greedy)")
    notes = ("Every drafted run's tokens equal plain decoding's (checked). `reference q`: the plain run's own "
             "tokens as drafts, each wrong with probability q (acceptance set by q); `ngram`: prompt lookup on "
             "a file echoed back, which random weights do not copy; `mtp`: the checkpoint's MTP layer trained "
             f"for {args.mtp_seconds:.0f} s on the target's greedy outputs (bench/mtp_training.py), random "
             "prompts. llama.cpp: llama-server on the same checkpoint, 2 threads, ngram-simple / draft-mtp with "
             "the same k; its tokens/step = decoded / (decoded - kept), its ratio against its own plain run. "
             "Target: batch 1 >= 1.6x at acceptance length >= 2.5, never slower at acceptance ~0.")
    print(title + "\n\n" + table + "\n\n" + notes)
    save("speculative", {"rows": rows, "args": vars(args)}, title + "\n\n" + table + "\n\n" + notes)


def peer_pair(path: Any, method: str, args: argparse.Namespace, batch: int, batch_prompts: list[tuple[int, ...]],
              peers: dict[tuple[str, int, bool], PeerRate | str]) -> dict[str, Any]:
    """llama.cpp's rate with `method`'s drafts and plain, on the same prompts (plain measured once a workload)."""
    echo = method == "ngram"
    key = (str(path), batch, echo)
    if key not in peers:
        peers[key] = peer_rates(path, "none", args.num_tokens, batch, batch_prompts, args.decode, 2, args.repeats)
    drafted = peer_rates(path, method, args.num_tokens, batch, batch_prompts, args.decode, 2, args.repeats)
    out = describe(drafted)
    plain = peers[key]
    if isinstance(plain, PeerRate):
        out["peer_none_tps"] = plain.tok_s
    return out


def peer_cells(row: dict[str, Any]) -> list[Any]:
    if "peer_tps" not in row:
        return [row.get("peer_note", "—"), "—", "—", "—", "—"]
    none = row.get("peer_none_tps")
    return [none if none else "—", row["peer_tps"], row["peer_tps"] / none if none else "—",
            row["peer_accepted"] / row["peer_drafted"] if row["peer_drafted"] else 0.0, row["peer_acceptance_length"]]


if __name__ == "__main__":
    main()
