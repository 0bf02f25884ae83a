"""`make bench`: every benchmark in one run; each prints its table and writes bench/results/,
then bench/results/REPORT.md gathers them all (bench/report.py).

Extra arguments (`make bench ARGS="--hidden 512 --layers 8"`) go to the model benchmarks
(throughput, reuse, residency, swarm and profile), which share the checkpoint geometry flags.
"""

from __future__ import annotations

import subprocess
import sys

from bench import report

# (module and its own arguments, whether it takes the geometry arguments)
SUITES: list[tuple[list[str], bool]] = [
    (["bench.throughput", "--kind", "dense"], True),
    (["bench.throughput", "--kind", "hybrid"], True),
    (["bench.reuse"], True),
    (["bench.structured"], True),  # decode with a json_schema grammar vs unconstrained, batch 1 and 8
    (["bench.lora"], True),  # decode at batch 8 with 1, 4 and 8 distinct adapters vs the base alone; load time
    (["bench.speculative"], True),  # drafts verified in one forward vs plain decoding, dense and hybrid, batch 1 and 8
    (["bench.media"], True),  # a conversation with screenshots: TTFT cold / encoder cache / reused vs as text
    (["bench.responses"], False),  # a 20-turn tool-call loop: full resend vs previous_response_id vs WebSocket
    (["bench.tiers"], False),
    (["bench.residency"], True),  # where state lives under pressure: move-down vs recompute, spills, host slots
    (["bench.long_prefill"], False),  # short probes' TTFT beside a 24k-token prefill: step time target auto vs off
    (["bench.gateway"], False),
    (["bench.overhead"], False),  # the engine's Python around the model at 64 and 256 sequences, tiny model
    (["bench.monitor"], False),  # the Monitor's page with 1,000 retained states in headless Chromium
    (["bench.chaos"], False),  # a soak with forced spills and a fault schedule: wrong / failed / lost per fault, RSS
    (["bench.scale"], False),  # 2 and 3 engines behind one gateway by routing rule, then one engine killed
    (["bench.swarm", "--peer", "llama.cpp"], True),
    (["bench.decode_attention"], False),  # CPU decode attention: torch reference vs the in-place C kernel, per KV dtype
    # each CPU linear path (MKL, oneDNN, the C kernel; fp32 and bf16) per layer shape at decode row counts
    (["bench.linear_paths", "--kind", "dense"], False),
    (["bench.linear_paths", "--kind", "hybrid"], False),
    (["bench.profile", "--peer", "llama.cpp"], True),  # where the step's time goes, per-token rates vs llama.cpp  # ignis alone, and says so, where llama.cpp cannot be built
    # the same with fp16 KV (llama.cpp's default), then also bf16 weights against a bf16 GGUF
    (["bench.profile", "--peer", "llama.cpp", "--kv-dtype", "float16"], True),
    (["bench.profile", "--peer", "llama.cpp", "--kv-dtype", "float16", "--weight-dtype", "bfloat16"], True),
]


def main() -> int:
    extra = sys.argv[1:]
    failed = 0
    for suite, takes_geometry in SUITES:
        cmd = [*suite, *(extra if takes_geometry else [])]
        print(f"\n=== python -m {' '.join(cmd)}", flush=True)
        failed |= subprocess.call([sys.executable, "-m", *cmd])
    print(f"\nwrote {report.write()}", flush=True)  # also after a failed suite: the others' results stand
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
