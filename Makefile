# kvlayout: `make test` sets everything up on a fresh machine and runs every check;
# `make demo` runs the walkthrough. Both create .venv on first use.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TOOLS := $(VENV)/.tools-installed
NIXL := $(VENV)/.nixl-installed
BUILT := $(VENV)/.kvlayout-built
# The editable install maps the modules it saw, so a new module under src/ reinstalls too.
PACKAGE_SOURCES := $(shell find csrc src -type f -not -path '*/__pycache__/*') CMakeLists.txt pyproject.toml
NVCC ?= $(shell command -v nvcc 2>/dev/null)
# Every kernel source the register budget holds (tests/transfer/test_ptxas_budget.py checks
# that this is all of csrc/cuda/*.cu).
CUDA_KERNELS := csrc/cuda/transfer_kernels.cu csrc/cuda/run_kernels.cu
# pip's expected noise on a fresh machine: find-links folders this machine does not have,
# and the resolver listing the dependencies vLLM is installed without on purpose. Real
# errors still print, and pipefail keeps pip's exit status.
QUIET_PIP := 2>&1 | { grep -v -e "is ignored: it is neither a file nor a directory" -e "^vllm 0.33.0 requires " -e "^ERROR: pip's dependency resolver does not currently take into account" || true; }

.PHONY: test demo setup build lint typecheck codegen codegen-check pytest nvcc-check bench bench-core bench-detection bench-transfer bench-maps bench-pd bench-soak clean

test: build lint typecheck codegen-check pytest nvcc-check

demo: build
	$(PY) -m kvlayout demo

setup: $(TOOLS)

$(TOOLS): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	# torch==2.13.0 is the CPU wheel on this machine's disk; any other spec pulls CUDA builds.
	$(PIP) install torch==2.13.0 $(QUIET_PIP)
	$(PIP) install -r requirements-dev.txt $(QUIET_PIP)
	# vLLM's real KV cache spec classes, for the integration tests: never without --no-deps
	# (it would pull a CUDA torch); these three are all the spec classes import.
	$(PIP) install numpy packaging regex $(QUIET_PIP)
	$(PIP) install --no-deps vllm==0.33.0 $(QUIET_PIP)
	touch $@

# kvlayout[nixl] (pyproject.toml says why CUDA 12), so the NIXL tests run for real: torch is
# already installed (nixl-cu12 requires some torch and must not pull one), and the `nixl`
# meta package goes in without its dependencies (it would pull the CUDA 13 build as well).
$(NIXL): $(TOOLS)
	$(PIP) install nixl-cu12==1.5.1 $(QUIET_PIP)
	$(PIP) install --no-deps nixl==1.5.1 $(QUIET_PIP)
	touch $@

build: $(BUILT) $(NIXL)

$(BUILT): $(TOOLS) $(PACKAGE_SOURCES)
	$(PIP) install --no-build-isolation --no-deps -e . $(QUIET_PIP)
	touch $@

lint: $(TOOLS)
	$(PY) -m ruff check src codegen tests benchmarks scripts
	$(PY) -m ruff format --check src codegen tests benchmarks scripts

typecheck: $(TOOLS)
	$(PY) -m mypy

codegen: $(TOOLS)
	PYTHONPATH=src:. $(PY) -m codegen

codegen-check: $(TOOLS)
	PYTHONPATH=src:. $(PY) -m codegen --check

pytest: build
	$(PY) -m pytest -q

# Compile-only: the generated indexers and the CUDA kernels must be valid CUDA (no GPU
# needed; `make build` also links kvlayout._cuda when CMake finds the toolkit), and every
# kernel (block transfer, run copy) must fit 64 registers without spilling, on Ampere and
# Hopper.
nvcc-check: $(TOOLS)
ifneq ($(NVCC),)
	$(NVCC) -std=c++17 -Icsrc/include -x cu -c tests/transfer/cuda/compile_indexers.cu -o /dev/null
	for cu in $(CUDA_KERNELS); do \
		$(PY) scripts/ptxas_budget.py 64 -- $(NVCC) -std=c++17 -gencode arch=compute_80,code=sm_80 \
			-gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc -c $$cu -o /dev/null || exit 1; \
	done
	@echo "nvcc: generated indexers, transfer and run-copy kernels compile as CUDA, kernels within 64 registers"
else
	@echo "nvcc not found: skipping the CUDA compile check"
endif

# Benchmarks (not part of the tests): each prints ours beside its baseline, with ratios.
bench: bench-core bench-detection bench-transfer bench-maps

bench-core: build
	$(PY) benchmarks/bench_core.py

bench-detection: build
	$(PY) benchmarks/bench_detection.py

# BENCH_ARGS=--huge-pages allocates every tensor on 2 MiB pages.
bench-transfer: build
	$(PY) benchmarks/bench_transfer.py $(BENCH_ARGS)

# Two processes over loopback NIXL: a few seconds of transfers per scenario.
# BENCH_ARGS="--device cuda --tls ''" puts the caches and staging buffers on a GPU.
bench-pd: build
	$(PY) benchmarks/bench_pd.py $(BENCH_ARGS)
bench-maps: build
	$(PY) benchmarks/bench_maps.py

# A connector's loop of requests between two processes, both sides' RSS every 100
# (BENCH_ARGS="--trace": tracemalloc's growth too): does memory grow with the requests?
bench-soak: build
	$(PY) benchmarks/soak_pd.py $(BENCH_ARGS)

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
