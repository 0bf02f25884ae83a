"""The swarm benchmark's figures: a summary per server, ignis/peer ratios, the table and the TTFT plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.table import markdown
from bench.workload import RequestRecord, Trace

# (key, label, better when lower): the summary figures, in table order.
MEASURES: list[tuple[str, str, bool]] = [
    ("first_turn_ttft_p50_s", "first-turn TTFT p50, cold: all agents start together (s)", True),
    ("later_turn_ttft_p50_s", "later-turn TTFT p50 (s)", True),
    ("later_turn_ttft_p95_s", "later-turn TTFT p95 (s)", True),
    ("burst_ttft_p50_s", "subagent-burst TTFT p50 (s)", True),
    ("computed_tokens", "prefill tokens computed", True),
    ("prompt_tokens", "prompt tokens sent", False),
    ("reuse_ratio", "reuse ratio (1 - computed/sent)", False),
    ("requests_per_min", "throughput (requests/min)", False),
    ("e2e_p50_s", "end-to-end latency p50 (s)", True),
]


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    def ttfts(kind: str) -> list[float]:
        return [r.ttft_s for r in records if r.kind == kind]

    prompt = sum(r.prompt_tokens for r in records)
    computed = sum(r.computed_tokens for r in records)
    return {
        "requests": len(records), "wall_s": wall_s,
        "first_turn_ttft_p50_s": _pct(ttfts("first-turn"), 50),
        "later_turn_ttft_p50_s": _pct(ttfts("later-turn"), 50),
        "later_turn_ttft_p95_s": _pct(ttfts("later-turn"), 95),
        "burst_ttft_p50_s": _pct(ttfts("subagent"), 50),
        "prompt_tokens": prompt, "cached_tokens": prompt - computed, "computed_tokens": computed,
        "reuse_ratio": 1 - computed / prompt if prompt else None,
        "output_tokens": sum(r.output_tokens for r in records),
        "requests_per_min": len(records) / wall_s * 60 if wall_s else None,
        "e2e_p50_s": _pct([r.e2e_s for r in records], 50),
    }


def ratios(ignis: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """ignis / peer for each figure (None where either side has none)."""
    out: dict[str, float | None] = {}
    for key, _, _ in MEASURES:
        a, b = ignis.get(key), peer.get(key)
        out[key] = a / b if a is not None and b else None
    return out


def table(summaries: dict[str, dict[str, Any]], peer: str, peer_note: str | None) -> str:
    """Measure | ignis | peer | ignis/peer; the peer's columns say why they are empty when it did not run."""
    ignis = summaries["ignis"]
    other = summaries.get(peer)
    rows: list[list[Any]] = []
    r = ratios(ignis, other) if other else {}
    for key, label, lower in MEASURES:
        def show(v: Any) -> Any:
            return "-" if v is None else v
        ratio = r.get(key)
        rows.append([label, show(ignis[key]), show(other[key]) if other else "-",
                     "-" if ratio is None else f"{ratio:.3g} ({'lower' if lower else 'higher'} is better for ignis)"])
    text = markdown(["measure", "ignis", peer if other else f"{peer} (did not run)", "ignis/peer"], rows)
    if peer_note:
        text += f"\n\n**{peer}: {peer_note}**"
    return text


def _median(values: Sequence[float]) -> float:
    return float(np.percentile(values, 50))


def per_turn(records: list[RequestRecord], turns: int) -> list[float | None]:
    """p50 TTFT of the agents' turn t, for t in 0..turns-1."""
    return [_pct([r.ttft_s for r in records if r.kind != "subagent" and r.turn == t], 50) for t in range(turns)]


def plot(path: Path, title: str, series: dict[str, list[RequestRecord]], trace: Trace) -> None:
    """TTFT per turn (p50 over agents, a band from min to max) and each burst's p50, for every server."""
    import matplotlib
    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    turns = trace.config.turns
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (server, records), color in zip(series.items(), ("tab:red", "tab:blue", "tab:green")):
        by_turn = [[r.ttft_s for r in records if r.kind != "subagent" and r.turn == t] for t in range(turns)]
        done = [t for t in range(turns) if by_turn[t]]  # a run cut short has no later turns
        xs = [t + 1 for t in done]
        ax.plot(xs, [_median(by_turn[t]) for t in done], marker="o", color=color,
                label=f"{server}: agent turns (p50)")
        ax.fill_between(xs, [min(by_turn[t]) for t in done], [max(by_turn[t]) for t in done], color=color,
                        alpha=0.15)
        bursts = [(b.after_round + 1.5, _median(ys)) for b in trace.bursts
                  if (ys := [r.ttft_s for r in records if r.kind == "subagent" and r.round == b.after_round])]
        if bursts:
            ax.scatter([x for x, _ in bursts], [y for _, y in bursts], marker="x", s=60, color=color,
                       label=f"{server}: subagent bursts (p50)")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn (bursts between turns)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
