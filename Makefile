# Two commands do the whole set-up on a fresh machine:
#   make train   creates .venv if needed and trains examples/train_gpt.py on 4 CPU processes
#   make test    creates .venv if needed and runs the test suite
# For the edit loop: make test-fast (pass and kernel unit tests, a few minutes), make lint.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Pinned: an unpinned torch would pull a multi-GB CUDA build; 2.13.0 is the CPU build tested here.
TORCH  ?= torch==2.13.0
NPROC  ?= 4

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test,examples]'
	touch $@

venv: $(STAMP)

train: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) examples/train_gpt.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not distributed and not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

.PHONY: venv train test test-fast lint
