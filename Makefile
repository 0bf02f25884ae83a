# ignis build ground. Needs only python3.11 (or python3 >= 3.11) and make.
#   make test             venv + test extras + stubs, then the test suite (ARGS="-k foo" to select)
#   make run ARGS=...     start gateway + engine + tierstore (scripts/run_all.py); the runtime only
#   make bench ARGS=...   benchmarks (python -m bench; with the test extras: aiohttp, matplotlib, ...)
#   make proto            regenerate ignis/ from protos/ (skips when up to date)
#   make kernels          the C/OpenMP CPU kernels (kernels/cpu/build/; skipped, saying so, without gcc)
#   make lint             mypy
#   make clean            generated files and caches (make distclean: the venv too)

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Keep in step with pyproject.toml. Installed first and pinned: an unpinned
# torch would pull the CUDA build (pip finds the local CPU wheel here).
TORCH  ?= torch==2.13.0
# Two installs: the runtime (make run), and on top of it the test extras (make test, lint, bench:
# mypy, the Helm SDK, langchain, openai-agents, matplotlib, ...). The test stamp
# keeps the name of the single stamp there was: a venv made before the split keeps its extras.
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP    := $(VENV)/.installed
LINT_DIRS := $(foreach d,common engine gateway tierstore kernels,$(if $(wildcard $(d)/*.py $(d)/*/*.py),$(d)))

.PHONY: venv proto kernels test run bench lint gpu-check clean distclean

venv: $(RUNTIME_STAMP)

# Editable install in compat mode puts the project root on sys.path, so the
# generated ignis/ package (and tests/, bench/) import without installing.
$(RUNTIME_STAMP): pyproject.toml
	@set -e; \
	if [ ! -x "$(PY)" ]; then \
	  py="$(PYTHON)"; \
	  "$$py" -c '' >/dev/null 2>&1 || { echo "$$py not usable, falling back to python3"; py=python3; }; \
	  "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	    || { echo "ignis needs Python >= 3.11; $$py is $$("$$py" -V 2>&1)" >&2; exit 1; }; \
	  echo "$$py -m venv $(VENV)"; "$$py" -m venv "$(VENV)"; \
	fi
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e . --config-settings editable_mode=compat
	touch $@

# Order-only on the runtime: in a venv made before the split, the runtime stamp is made (a quick
# pip run: all there) after this one, and that must not reinstall the extras.
$(TEST_STAMP): pyproject.toml | $(RUNTIME_STAMP)
	$(PY) -m pip install -e ".[test]" --config-settings editable_mode=compat
	touch $@

proto: $(RUNTIME_STAMP)
	$(PY) scripts/gen_protos.py

# CPU kernels: plain C + OpenMP over tensor data pointers (no torch headers: about a second to
# build). -march=native: built for the machine that runs them. Without a compiler the engine
# logs that it runs the torch references instead, so a missing gcc is not a build failure.
KERNEL_CC ?= gcc
CPU_KERNEL_LIB := kernels/cpu/build/libignis_cpu.so
kernels: $(CPU_KERNEL_LIB)

$(CPU_KERNEL_LIB): $(wildcard kernels/cpu/*.c kernels/cpu/vendor/*/*.h)
	@if command -v $(KERNEL_CC) >/dev/null 2>&1; then \
	  mkdir -p $(@D) && echo "$(KERNEL_CC) -O3 -march=native -fopenmp -shared -fPIC -o $@ $(filter %.c,$^)" && \
	  $(KERNEL_CC) -O3 -march=native -fopenmp -shared -fPIC -o $@ $(filter %.c,$^); \
	else echo "no C compiler ($(KERNEL_CC)): CPU kernels not built, the engine runs the torch references"; fi

# pytest exits 5 when it collects no tests; like any non-zero status it fails.
test: $(TEST_STAMP) proto kernels
	$(PY) -m pytest -q $(ARGS)

run: proto kernels
	$(PY) scripts/run_all.py $(ARGS)

bench: $(TEST_STAMP) proto kernels
	$(PY) -m bench $(ARGS)

lint: $(TEST_STAMP) proto
	$(PY) -m mypy $(LINT_DIRS) $(ARGS)

# Not on the venv stamp: the script installs the CUDA torch itself (scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh $(ARGS) $(or $(OUT),.cache/gpu-check)

clean:
	rm -rf ignis .pytest_cache .mypy_cache *.egg-info build kernels/cpu/build
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
