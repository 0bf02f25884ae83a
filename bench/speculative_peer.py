"""llama.cpp's speculative decoding on the same checkpoint, for bench/speculative.py's table.

llama-server (bench/peers/llama_cpp.py) decodes the same prompts greedily three ways: plain, with
prompt lookup (`--spec-type ngram-simple`: the continuation of the last n-gram's earlier occurrence)
and, on a Qwen3.5 checkpoint that carries an MTP layer, with it (`--spec-type draft-mtp`; llama.cpp's
converter keeps `mtp.*` as the `nextn` block). Batch 1: its own timings (`predicted_per_second`, and
`draft_n` / `draft_n_accepted`, the drafted and kept tokens). Batch 8: every slot streams, and the rate
is the tokens decoded while all of them decode (bench/profile.py's window), as ignis' is measured.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.profile import _complete, _stream, all_decoding_window

# llama-server's flags per drafting method; k is the most tokens it drafts a step (ignis' num_tokens).
SPEC_FLAGS = {
    "none": lambda k: [],
    "ngram": lambda k: ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                        "--spec-ngram-simple-size-m", str(k)],
    "mtp": lambda k: ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"],
}


@dataclass(frozen=True, slots=True)
class PeerRate:
    tok_s: float
    drafted: int
    accepted: int
    verifies: int  # llama.cpp does not report its verify steps: decoded tokens - kept drafts, an upper bound

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.verifies if self.verifies else 1.0


def peer_rates(checkpoint: Path, method: str, k: int, batch: int, prompts: list[tuple[int, ...]], decode: int,
               threads: int, repeats: int) -> PeerRate | str:
    """llama-server's decode rate (median of `repeats`) with `method`'s drafts, or why there is none."""
    from bench.peers import llama_cpp  # imported here: a run without the peer needs none of it

    if not llama_cpp.is_built():
        return "peer not built (python -m bench.peers.llama_cpp build)"
    try:
        gguf = llama_cpp.convert_to_gguf(checkpoint, "f32")
        server = llama_cpp.launch_llama_server(
            llama_cpp.BUILD / f"speculative-{method}", gguf, threads=threads, parallel=batch,
            ctx_size=batch * (max(map(len, prompts)) + decode + 64), cache_ram_mib=0, extra=SPEC_FLAGS[method](k))
    except llama_cpp.PeerUnavailable as e:
        return f"peer unavailable: {e}"
    except RuntimeError as e:  # llama-server refused the flags or the model: say so in the table, go on
        return f"llama-server did not start: {str(e).splitlines()[-1] if str(e) else e!r}"
    http = httpx.Client(base_url=f"http://{server.address}", timeout=3600,
                        limits=httpx.Limits(max_keepalive_connections=0))  # see bench/profile.py's Peer
    try:
        _complete(http, prompts[0], 4)  # warm-up
        runs = [_round(http, prompts, decode, batch) for _ in range(repeats)]
    finally:
        http.close()
        server.stop()
    runs.sort(key=lambda r: r.tok_s)
    return runs[len(runs) // 2]


def _round(http: httpx.Client, prompts: list[tuple[int, ...]], decode: int, batch: int) -> PeerRate:
    if batch == 1:
        timings = [_complete(http, p, decode) for p in prompts[:1]]
        tok_s = float(timings[0]["predicted_per_second"])
    else:
        with ThreadPoolExecutor(batch) as pool:
            streamed = list(pool.map(lambda p: _stream(http, p, decode), prompts[:batch]))
        window_s, tokens = all_decoding_window([s for s, _ in streamed])
        timings = [t for _, t in streamed]
        tok_s = tokens / window_s if window_s > 0 else 0.0
    drafted = sum(int(t.get("draft_n", 0)) for t in timings)
    accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timings)
    decoded = sum(int(t.get("predicted_n", 0)) for t in timings)
    return PeerRate(tok_s, drafted, accepted, max(decoded - accepted, 0))


def describe(rate: PeerRate | str) -> dict[str, Any]:
    if isinstance(rate, str):
        return {"peer_note": rate}
    return {"peer_tps": rate.tok_s, "peer_drafted": rate.drafted, "peer_accepted": rate.accepted,
            "peer_acceptance_length": rate.acceptance_length}
