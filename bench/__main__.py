"""`make bench`: every benchmark in one run; each prints its table and writes bench/results/."""

from __future__ import annotations

import subprocess
import sys

SUITES = [
    ["bench.throughput", "--kind", "dense"],
    ["bench.throughput", "--kind", "hybrid"],
    ["bench.reuse"],
]


def main() -> int:
    extra = sys.argv[1:]
    failed = 0
    for suite in SUITES:
        print(f"\n=== python -m {' '.join(suite)} {' '.join(extra)}", flush=True)
        failed |= subprocess.call([sys.executable, "-m", *suite, *extra])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
