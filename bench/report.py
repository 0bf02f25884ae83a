"""`python -m bench.report`: every benchmark's results in one page, bench/results/REPORT.md.

Each benchmark writes `<name>.md` (its table and the machine it ran on, both
committed) and `<name>.json` (its raw figures, in the ignored raw/; see
bench/table.py). This gathers the tables in a fixed reading order, the headline
(the swarm against llama.cpp) first, says when and where each ran (from the
table, or from the JSON for a table written before it said so), and links the
plots. Results it does not know go last, so none is dropped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from common.launch import ROOT
from bench.table import RESULTS, machine_of, raw_folder, without_machine

# (section title, result names, what it answers), in reading order.
SECTIONS: list[tuple[str, list[str], str]] = [
    ("Agent swarm: ignis vs llama.cpp's llama-server", ["swarm-dense", "swarm-hybrid"],
     "The same seeded agent trace (bench/workload.py) on both servers, same checkpoint, threads and slots: "
     "does a repeated prompt cost a copy instead of a prefill? `python -m bench.swarm`"),
    ("Per-token rates vs llama.cpp, and where ignis' step time goes",
     ["profile-dense", "profile-hybrid", "profile-dense-kv-float16", "profile-hybrid-kv-float16",
      "profile-dense-kv-float16-w-bfloat16", "profile-hybrid-kv-float16-w-bfloat16", "profile-dense-w-bfloat16",
      "profile-hybrid-w-bfloat16", "profile-moe"],
     "Prefill and decode rates of both servers on the swarm's checkpoint and threads, and a torch.profiler "
     "breakdown of ignis' engine step (the slow side of the swarm). `python -m bench.profile`"),
    ("Reuse vs cold", ["reuse"],
     "TTFT of a repeated prompt (a greedy retry, a seeded regenerate, n=4) or an extended one against its cold "
     "prefill (a dense retry computes nothing since its kept end), state clone vs raw copy, "
     "the reuse tax, the hash chain. `python -m bench.reuse`"),
    ("Throughput vs transformers", ["throughput-dense", "throughput-hybrid"],
     "Prefill and decode tokens/s at batch 1, 8, 32 against `transformers.generate`. `python -m bench.throughput`"),
    ("Residency under pressure", ["residency"],
     "Agents filling the KV pool while interactive requests arrive: move-down to KV-RAM vs recompute; the "
     "reuse tax of device-slot and staging-ring captures; decode ITL while a large state spills, on the step "
     "thread vs written ahead by the copy worker; KV pool room with retained states in host vs device slots. "
     "`python -m bench.residency`"),
    ("Short requests beside a long prefill", ["long-prefill"],
     "4-token probes streamed while a 24k-token prompt prefills, their TTFT against the same probes on an "
     "idle engine, and what the long prompt pays: the step time target (engine.step_time_target_ms, auto) "
     "against the token budget alone. `python -m bench.long_prefill`"),
    ("Decode attention on the CPU", ["decode-attention"],
     "The torch reference (gather + SDPA) against the C kernel reading K/V pages in place, in each "
     "engine.kv_dtype, and the model's decode forward before and after, at batch 1 and 8 with 2048-token "
     "contexts on the dense geometry. `python -m bench.decode_attention`"),
    ("Linear paths on the CPU", ["linear-paths-dense", "linear-paths-hybrid",
                                 "linear-paths-dense-fp32-bf16-lib-lib_avx2-onednn-avx2-mkl-avx2"],
     "Each path a CPU linear can take at a decode step's 1-16 rows (MKL's F.linear, oneDNN on a packed weight, "
     "the C kernel; fp32 and bf16 weights), over one decode step's weights of each layer shape, against a streaming "
     "read of as many bytes: which is fastest depends on the CPU's vendor and ISA (issue 50). The third table "
     "emulates an AVX2-only CPU on this one (oneDNN and MKL capped with ONEDNN_MAX_CPU_ISA / MKL_ENABLE_INSTRUCTIONS, "
     "the C kernels built for x86-64-v3). `python -m bench.linear_paths`"),
    ("The engine's Python around the model", ["overhead"],
     "A step at 64 and 256 sequences on a tiny model, cut into the scheduler's plan, the batch build, "
     "the forward pass, sampling and the rest: the same sequences decoding, and under churn (requests "
     "ending and replaced). `python -m bench.overhead`"),
    ("Speculative decoding", ["speculative"],
     "Decode tokens/s with drafts verified in one forward vs plain decoding, by acceptance. "
     "`python -m bench.speculative`"),
    ("LoRA adapters", ["lora"],
     "Decode tokens/s at batch 8 whose rows run 1, 4 or 8 distinct rank-16 adapters against the base model in an "
     "engine with LoRA off, and an adapter's load time. `python -m bench.lora`"),
    ("Images in prompts", ["media"],
     "A 6-turn computer-use conversation, two 1024x768 screenshots a turn: TTFT per turn cold, with the encoder "
     "cache, and with reuse against the same conversation as text; the vision tower's time per image. "
     "`python -m bench.media`"),
    ("Structured outputs", ["structured"],
     "Decode tokens/s with a json_schema grammar vs the same requests unconstrained. `python -m bench.structured`"),
    ("Routing across engines", ["scale"],
     "2 and 3 engines behind one gateway on the agent-swarm trace: round-robin vs affinity vs bounded load, "
     "then one engine killed. `python -m bench.scale`"),
    ("The Responses API with state", ["responses"],
     "A 20-turn tool-call loop: full resend vs previous_response_id vs WebSocket mode. `python -m bench.responses`"),
    ("The Monitor page", ["monitor"],
     "1,000 retained states rendered in headless Chromium. `python -m bench.monitor`"),
    ("Tiers vs raw memcpy and file I/O", ["tiers"],
     "One large state through KV-RAM and KV-disk. `python -m bench.tiers`"),
    ("Gateway overhead", ["gateway"],
     "What the gateway adds on top of the engine's gRPC. `python -m bench.gateway`"),
    ("Chaos: faults under load", ["chaos"],
     "A soak with forced spills and a fault schedule (tierstore and engine kill -9, corrupt and deleted blobs, a "
     "truncated index, a read-only disk, a deleted arena, aborted streams) against the real stack: per fault, "
     "requests tried, failed, lost and wrong (text unlike the reference answer), and the engine's RSS. "
     "`python -m bench.chaos`"),
]


def _provenance(m: dict[str, Any]) -> str:
    parts = [f"run {m['when']}" if m.get("when") else None, m.get("platform"), m.get("cpu"),
             f"torch {m['torch']}" if m.get("torch") else None,
             f"{m['threads']} threads" if m.get("threads") else None, m.get("cuda")]
    return "_" + ", ".join(p for p in parts if p) + "_" if any(parts) else ""


def _machine(results: Path, name: str, table: str | None) -> dict[str, Any]:
    """Where a result ran: its table's machine line, else its raw JSON (raises if that is unreadable)."""
    if table is not None and (machine := machine_of(table)) is not None:
        return machine
    result = json.loads((raw_folder(results) / f"{name}.json").read_text())
    return dict(result.get("machine") or {})


def _entry(results: Path, name: str) -> str:
    """One result: where and when it ran, its table, and its plot if it has one."""
    md_path, png_path = results / f"{name}.md", results / f"{name}.png"
    table = md_path.read_text() if md_path.is_file() else None
    try:
        machine = _machine(results, name, table)
    except (OSError, json.JSONDecodeError) as err:
        if table is None:
            return f"`{name}`: no readable result ({err.__class__.__name__}); run its benchmark."
        machine = {}  # a table from before tables named their machine, without its JSON here
    source = f"{name}.md" if table is not None else f"{name}.json"
    parts = [f"`{source}` — {_provenance(machine)}"]
    parts.append(without_machine(table) if table is not None else f"(no `{name}.md` table)")
    if png_path.is_file():
        parts.append(f"![{name}]({png_path.name})")
    return "\n\n".join(parts)


def _names(results: Path) -> set[str]:
    """Every result in `results`: a table, or raw JSON without one."""
    tables = {p.stem for p in results.glob("*.md") if p.name != "REPORT.md"}
    return tables | {p.stem for p in raw_folder(results).glob("*.json")}


def _shown(folder: Path) -> Path:
    where = folder.resolve()
    return where.relative_to(ROOT) if where.is_relative_to(ROOT) else where


def build(results: Path) -> str:
    known = {n for _, names, _ in SECTIONS for n in names}
    found = _names(results)
    others = sorted(found - known)
    sections = SECTIONS + ([("Other results", others, "Results without a section of their own.")] if others else [])
    out = ["# ignis benchmark report",
           f"Gathered {time.strftime('%Y-%m-%d %H:%M:%S')} by `python -m bench.report` from `{_shown(results)}/*.md` "
           f"(the raw figures: `{_shown(raw_folder(results))}/*.json`); each benchmark measures its baseline in the "
           "same run. `make bench` runs them all."]
    for title, names, what in sections:
        present = [n for n in names if n in found]
        out.append(f"## {title}\n\n{what}")
        if not present:
            out.append("_Not run yet._")
        out += [_entry(results, n) for n in present]
    return "\n\n".join(out) + "\n"


def write(results: Path = RESULTS) -> Path:
    path = results / "REPORT.md"
    path.write_text(build(results))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the benchmarks' results")
    args = parser.parse_args()
    print(f"wrote {write(args.results)}")


if __name__ == "__main__":
    main()
