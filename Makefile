# Two entry points: `make demo` (run the default model) and `make test` (the test suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: demo test lint install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e .

# torch 2.13.0 first: its CPU wheel is what the oracle tests need (a newer one is GBs of CUDA).
install-test: $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'

demo: install
	$(BIN)/jaxinfer generate --chat --prompt "$(PROMPT)" --max-new-tokens 64

lint: install-test
	$(BIN)/ruff check .

test: install-test lint
	$(BIN)/python scripts/run_tests.py -q -n 2 --dist loadfile --max-worker-restart=0 --durations=15 tests

clean:
	rm -rf $(VENV)
