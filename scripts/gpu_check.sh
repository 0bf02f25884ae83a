#!/usr/bin/env bash
# The prepared device check (issue 20): on a machine with an NVIDIA GPU, one command that
#   1. env      checks the GPU, Python and the tree;
#   2. install  makes sure the venv has CUDA torch (the pinned version, from PyTorch's CUDA
#               wheel index, PyPI as the fallback), Triton and the test extra, and the stubs;
#   3. kernels  runs the `cuda` cases of tests/test_triton_kernels.py (each Triton kernel
#               against its torch reference, compiled);
#   4. cuda     runs tests/test_cuda.py (models vs transformers in fp32 and bf16, batched
#               decode, reuse paths, host slots, tier copies through the registered arena);
#   5. bench    runs python -m bench.gpu (each benchmark beside its baseline);
#   6. report   writes OUT/summary.md and copies the results to bench/results/gpu.md.
# Every stage runs under `timeout`, and the limits (with each one's kill grace) add up to at most
# 8 minutes; a stage that fails or hangs is recorded and the next one runs (the tests and the
# bench need a working env and install). The report stage only writes files.
# Everything it writes goes under OUT (logs/, junit-*.xml, bench/, summary.md; scratch caches
# in OUT/cache, removed at the end unless --keep-cache), except bench/results/gpu.md.
#
#   scripts/gpu_check.sh [--dry-run] [--keep-cache] OUT
#   make gpu-check OUT=DIR [ARGS=--dry-run]
#
# --dry-run lists the stages and checks the environment (runs anywhere, GPU or not).
# Environment: PYTHON (default .venv/bin/python), IGNIS_TORCH_INDEX (the CUDA wheel index).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH_PIN="torch==2.13.0"  # keep in step with pyproject.toml and the Makefile
TORCH_INDEX=${IGNIS_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
VENV="$ROOT/.venv"
PY=${PYTHON:-$VENV/bin/python}
BUDGET_S=480
STAGES=(env install kernels cuda bench report)
declare -A LIMIT=([env]=15 [install]=100 [kernels]=115 [cuda]=115 [bench]=100 [report]=10)
KILL_AFTER=5  # a stage that ignores SIGTERM is killed this much later
declare -A STATUS=()
declare -A SECONDS_TAKEN=()

usage() { echo "usage: $0 [--dry-run] [--keep-cache] OUT" >&2; exit 2; }

DRY=0
KEEP=0
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --keep-cache) KEEP=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "unknown option $arg" >&2; usage ;;
    *) [ -z "$OUT" ] || usage; OUT=$arg ;;
  esac
done
[ -n "$OUT" ] || usage
mkdir -p "$OUT/logs" || { echo "cannot create $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)

# Scratch caches stay under OUT; no interpreted Triton here.
export TRITON_CACHE_DIR="$OUT/cache/triton" IGNIS_CACHE_DIR="$OUT/cache/ignis" HF_HOME="$OUT/cache/hf"
export PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET

PYTEST=(-m pytest -q -rs -p no:cacheprovider -m cuda)
declare -A CMD=(
  [env]="stage_env"
  [install]="stage_install"
  [kernels]="\"$PY\" ${PYTEST[*]} --basetemp \"$OUT/cache/pytest-kernels\" --junitxml \"$OUT/junit-kernels.xml\" tests/test_triton_kernels.py"
  [cuda]="\"$PY\" ${PYTEST[*]} --basetemp \"$OUT/cache/pytest-cuda\" --junitxml \"$OUT/junit-cuda.xml\" tests/test_cuda.py"
  [bench]="\"$PY\" -m bench.gpu --out \"$OUT/bench\" --models \"$OUT/cache/models\""
  [report]="stage_report"
)

stage_env() {
  nvidia-smi -L || { echo "no NVIDIA GPU (nvidia-smi -L failed)"; return 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  command -v python3 && python3 -V
  df -h "$OUT" | tail -1
}

cuda_ready() {
  [ -x "$PY" ] && "$PY" - <<EOF
import torch, triton
assert torch.__version__.split("+")[0] == "${TORCH_PIN#torch==}", torch.__version__
assert torch.version.cuda and torch.cuda.is_available(), "torch has no CUDA here"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__,
      torch.cuda.get_device_name(0))
EOF
}

stage_install() {
  cd "$ROOT" || return 1
  if cuda_ready; then
    echo "CUDA torch and Triton already installed"
  else
    [ -x "$PY" ] || python3 -m venv "$VENV" || return 1
    "$PY" -m pip install -q "$TORCH_PIN" --index-url "$TORCH_INDEX" \
      || "$PY" -m pip install -q "$TORCH_PIN" || return 1  # PyPI's Linux wheel carries CUDA too
    "$PY" -c "import triton" 2>/dev/null || "$PY" -m pip install -q triton || return 1
  fi
  "$PY" -c "import pytest, transformers, engine" 2>/dev/null \
    || "$PY" -m pip install -q -e ".[test]" --config-settings editable_mode=compat || return 1
  "$PY" scripts/gen_protos.py || return 1
  cuda_ready
}

stage_report() {
  {
    echo "### make gpu-check ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
    echo
    echo "| stage | status | seconds | limit | log |"
    echo "|---|---|---|---|---|"
    for s in "${STAGES[@]}"; do
      [ "$s" = report ] && continue
      echo "| $s | ${STATUS[$s]:-not run} | ${SECONDS_TAKEN[$s]:--} | ${LIMIT[$s]} | logs/$s.log |"
    done
    if [ -f "$OUT/bench/gpu.md" ]; then echo; cat "$OUT/bench/gpu.md"; fi
  } > "$OUT/summary.md"
  if [ -f "$OUT/bench/gpu.md" ]; then
    mkdir -p "$ROOT/bench/results" && cp "$OUT/bench/gpu.md" "$ROOT/bench/results/gpu.md"
  fi
  cat "$OUT/summary.md"
}

total=0  # the worst case: every limit, plus the kill grace of each stage run under timeout
for s in "${STAGES[@]}"; do total=$((total + LIMIT[$s])); done
total=$((total + KILL_AFTER * (${#STAGES[@]} - 1)))

if [ "$DRY" = 1 ]; then
  {
    echo "gpu-check plan (dry run), output under $OUT"
    for s in "${STAGES[@]}"; do printf '  %-8s timeout %4ss  %s\n' "$s" "${LIMIT[$s]}" "${CMD[$s]}"; done
    echo "  worst case, limits plus ${KILL_AFTER}s kill grace each: ${total}s (budget ${BUDGET_S}s)"
    echo "environment:"
    ok=1
    command -v timeout >/dev/null && echo "  timeout: $(command -v timeout)" || { echo "  timeout: MISSING"; ok=0; }
    if [ -x "$PY" ]; then echo "  python: $PY ($("$PY" -V 2>&1))"; else echo "  python: $PY absent (install creates the venv)"; fi
    grep -q "\"$TORCH_PIN\"" "$ROOT/pyproject.toml" && echo "  pin: $TORCH_PIN (as pyproject.toml)" \
      || { echo "  pin: $TORCH_PIN differs from pyproject.toml"; ok=0; }
    echo "  CUDA wheel index: $TORCH_INDEX"
    for f in tests/test_triton_kernels.py tests/test_cuda.py bench/gpu.py; do
      [ -f "$ROOT/$f" ] && echo "  found $f" || { echo "  MISSING $f"; ok=0; }
    done
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
      echo "  gpu: $(nvidia-smi -L | head -1)"
    else
      echo "  gpu: none here (a real run stops at the env stage)"
    fi
    [ "$total" -le "$BUDGET_S" ] || { echo "  the limits exceed the budget"; ok=0; }
    [ "$ok" = 1 ] && echo "dry run: ok" || echo "dry run: FAILED"
  } | tee "$OUT/plan.txt"
  grep -q "^dry run: ok" "$OUT/plan.txt"
  exit $?
fi

failed=0
blocked=""
for s in "${STAGES[@]}"; do
  log="$OUT/logs/$s.log"
  if [ -n "$blocked" ] && [ "$s" != report ]; then
    STATUS[$s]="skipped ($blocked failed)"
    continue
  fi
  echo "=== $s (timeout ${LIMIT[$s]}s)"
  began=$(date +%s)
  if [ "$s" = report ]; then
    SECONDS_TAKEN[report]=0
    stage_report
    continue
  fi
  export -f stage_env stage_install cuda_ready
  export OUT ROOT PY VENV TORCH_PIN TORCH_INDEX
  (cd "$ROOT" && timeout -k "$KILL_AFTER" "${LIMIT[$s]}" bash -c "${CMD[$s]}") > "$log" 2>&1
  rc=$?
  SECONDS_TAKEN[$s]=$(( $(date +%s) - began ))
  case $rc in
    0) STATUS[$s]="ok" ;;
    124|137) STATUS[$s]="TIMED OUT"; failed=1 ;;
    *) STATUS[$s]="failed (rc $rc)"; failed=1 ;;
  esac
  echo "    ${STATUS[$s]} in ${SECONDS_TAKEN[$s]}s (log: $log)"
  tail -5 "$log" | sed 's/^/    | /'
  if [ "$rc" != 0 ] && { [ "$s" = env ] || [ "$s" = install ]; }; then blocked=$s; fi
done

[ "$KEEP" = 1 ] || rm -rf "$OUT/cache"
exit $failed
