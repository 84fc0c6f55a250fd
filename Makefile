# ckptrun developer tasks. `make test` and `make demo` work on a fresh machine:
# they create .venv, install the CPU torch wheel first (an unpinned torch pulls
# a multi-GB CUDA build), then the package with its test extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo bench bench-quick gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" -e ".[test]"  # torch named again: lightning/transformers keep it
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e" tests

demo: $(STAMP)
	$(BIN)/ckptrun demo

clean:
	rm -rf $(VENV) runs build *.egg-info

bench: $(STAMP)
	$(BIN)/python bench/run.py --full

bench-quick: $(STAMP)
	$(BIN)/python bench/run.py --quick

gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py
