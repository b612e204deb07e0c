# Quickstart targets; each creates/reuses the virtualenv in $(VENV) and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= output_dir/demo
NUM_GPUS ?= 2

.PHONY: demo test test-fast test-all lint install clean

# Python writes the bytecode of what it imports the first time it imports it, also where the environment sets
# PYTHONDONTWRITEBYTECODE (this machine does): otherwise every process compiles its whole stack again, each time
# (23 s instead of 8 s to import an example's stack). The install imports the stack every rank imports once, so
# that parallel first processes do not each compile it: compiling everything installed (compileall -j 0) took
# 38 s, this import 20 s, and leaving all of it to the tests cost them 53 s (pytest 555 s against 502 s, fresh
# clones, 2 cores, 2026-12-01); pip's own compile (one core) took 54 s of a 109 s install. The checkout's
# __pycache__ directories are ignored by git.
unexport PYTHONDONTWRITEBYTECODE

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)"
	$(BIN)/python -m pip install -q --no-compile -e '.[dev]'
	$(BIN)/python -c "import deepspeed, ds_inference_integration.predict.trainer, ds_inference_integration.tools.cli, ds_inference_integration.serve.app"
	touch $(STAMP)

# The main job: the embedded English->Romanian model, tensor parallel over $(NUM_GPUS) ranks
# (CPU ranks when there is no GPU), then a one-line summary.
demo: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH NUM_GPUS=$(NUM_GPUS) launch/single_node.sh \
		--output_dir $(DEMO_DIR) --do_predict --per_device_eval_batch_size 16 --report_to none
	$(BIN)/ds-inference summary $(DEMO_DIR)

lint: $(STAMP)
	$(BIN)/ruff check .

# Everything but the slow benchmark-command runs; CI runs this (.ci/run). Two pytest workers: a launched test
# spends part of its time waiting (timeouts, a stopped rank, process start-up), which the other worker fills
# (13:33 serial vs 12:07 with -n 2 on this 2-core machine, 2026-12-01, same tree).
test: lint
	$(BIN)/python -m pytest -q tests -n 2 --dist worksteal

# In-process tests only: no launcher, no process started (the others are marked `launched`; conftest.py fails one that is not).
test-fast: lint
	$(BIN)/python -m pytest -q tests -m "not slow and not launched"

test-all: lint  # also the slow runs: benchmark commands, launched variants make test leaves out (docs/testing.md)
	$(BIN)/python -m pytest -q tests -m ""

clean:
	rm -rf output_dir .pytest_cache
