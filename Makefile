# Two entry points on a fresh machine: `make run` (the pipeline) and `make test` (the tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= all
# An offline or institutional MNIST mirror, e.g. MIRROR=file:///data/mnist/
MIRROR ?=
SNAKEMAKE_ARGS ?=
MIRROR_ARG := $(if $(MIRROR),--config 'task_args={mirrors: [$(MIRROR)]}',)

.PHONY: run test test-quick test-gpu env system-deps lint clean

# constraints.txt pins torch to the version the training image ships (containers/ddppipe.def).
$(BIN)/ddppipe: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --constraint constraints.txt -e '.[dev]'
	touch $@

env: $(BIN)/ddppipe

run: env
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --cores $(CORES) $(MIRROR_ARG) $(SNAKEMAKE_ARGS)

# SLURM, Apptainer and headless Chromium for the tests that need them (root on Debian 12; idempotent).
system-deps:
	bash .ci/install_system_deps.sh

# Two pytest workers (the 2 cores): the SLURM test cluster's tests, mostly waiting for SLURM,
# beside the rest, mostly computing (tests/conftest.py groups them); then, alone, the tests
# whose slots train until a time limit's warning (marked solo: beside others, each slot
# trains less and they need several times the slots).
test: env system-deps lint
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -n 2 -m "not solo"
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -m solo

# The inner loop while editing (docs/tests.md): the tests without the `slow` marker (no SLURM,
# Apptainer, Snakemake DAG or multi-process training run: tests/conftest.py marks them), on the
# two workers, in at most 5 minutes on CI's 2 cores. TESTS narrows it to files (and pytest's
# options), run in one process: e.g. TESTS=tests/test_config.py or TESTS='tests/test_idx.py -k bad'.
TESTS ?=
test-quick: env
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -n $(if $(TESTS),0,2) -m "not slow" $(TESTS)

# The GPU suite (docs/tests.md): every GPU test in one session planned to 8 minutes on one GPU,
# its report in results/gpu-suite/; without a CUDA GPU one line and exit 2, nothing run.
GPU_SUITE_ARGS ?=
test-gpu: env
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m tests.gpu_suite $(GPU_SUITE_ARGS)

# ruff; the packages' layering (import-linter, pyproject.toml); Snakemake's lint (only the
# documented finding) and snakefmt (tests/test_lint.py).
lint: env
	$(BIN)/ruff check src tests workflow bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/lint-imports
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_lint.py

clean:
	rm -rf results logs benchmarks .snakemake report.html
