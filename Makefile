# ckptrun developer tasks. `make test` and `make demo` work on a fresh machine:
# they create .venv, install the CPU torch wheel first (an unpinned torch pulls
# a multi-GB CUDA build), then the package with its test extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
# the suite's two workers (pytest-xdist), one per core: most of an end-to-end test's time is a rank waiting (torchrun
# start-up, heartbeats, rendezvous), so two files at once take 0.63x the serial time (12m52s against 20m31s, quiet).
# Whole files per worker (loadfile): module- and session-scoped reference runs are made once per worker. 0: serial.
TEST_WORKERS ?= 2

.PHONY: setup test test-fast demo bench bench-quick matrix gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" -e ".[test]"  # torch named again: lightning/transformers keep it
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e" tests

demo: $(STAMP)
	$(BIN)/ckptrun demo

clean:
	rm -rf $(VENV) runs build *.egg-info

bench: $(STAMP)
	$(BIN)/python bench/run.py --full

# the scenario matrix's cover (about an hour on 2 cores), or `make matrix CELLS=2x2/fsdp2/memory-replica/lose-node,...`
matrix: $(STAMP)
	$(BIN)/python bench/matrix.py $(if $(CELLS),--cells "$(CELLS)")

bench-quick: $(STAMP)
	$(BIN)/python bench/run.py --quick

gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py
