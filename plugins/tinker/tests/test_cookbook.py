"""The Tinker Cookbook's own recipes, unmodified, against hybridrl's Tinker server on the embedded
SmolLM2-135M: each runs from its command line (``python -m tinker_cookbook.recipes.NAME key=value``)
with only ``base_url``, ``model_name``, sizes and ``log_path`` set, and learns (its logged loss
falls, or its reward rises). The recipes load their tokenizer and data by hub name; nothing is
downloaded here: stand-ins sit in the Hugging Face caches under those names (SmolLM2's ChatML
tokenizer as the Qwen model the server serves under that name, small datasets of the hub
datasets' schemas)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hybridrl_testing import metrics_rows

pytest.importorskip("tinker_cookbook")

HERE = Path(__file__).parent


def sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"tinker_tests_{name}", HERE / f"{name}.py")
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


stand_ins = sibling("hub_stand_ins")
WORDS = "apple river candle forest yellow window silver garden rocket planet copper meadow".split()


def no_robots_rows(n: int) -> list[dict]:
    """Chats of HuggingFaceH4/no_robots' schema with a pattern a small model learns in a few steps."""
    rows = []
    for i in range(n):
        word = WORDS[i % len(WORDS)]
        messages = [
            {"role": "user", "content": f"Say the word {word} three times."},
            {"role": "assistant", "content": f"{word} {word} {word}"},
        ]
        rows.append({"prompt": messages[0]["content"], "prompt_id": str(i), "messages": messages, "category": "Chat"})
    return rows


@pytest.fixture(scope="module")
def hub(tinker_server, smollm2, tmp_path_factory):
    """A Hugging Face home whose caches hold the recipes' tokenizer and datasets."""
    home = tmp_path_factory.mktemp("hf-home")
    stand_ins.tokenizer(home / "hub", tinker_server.alias, smollm2)
    rows = no_robots_rows(512)  # sl_loop: 64 batches of 8, its linear decay leaves most of its rate to 10 steps
    test = no_robots_rows(32)  # sl_basic's evaluation: two batches of 16
    stand_ins.dataset(home / "datasets", "HuggingFaceH4/no_robots", "default", {"train": rows, "test": test})
    return home


def run_recipe(name: str, hub: Path, served, log_path: Path, **options) -> list[dict]:
    """The recipe's own command line, its metrics as it logged them (log_path/metrics.jsonl)."""
    env = os.environ | {
        "HF_HOME": str(hub),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TINKER_API_KEY": served.token,
        "TINKER_TELEMETRY": "0",
    }
    args = {"base_url": served.url, "model_name": served.alias, "log_path": str(log_path)} | options
    cmd = [sys.executable, "-m", f"tinker_cookbook.recipes.{name}", *[f"{k}={v}" for k, v in args.items()]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return metrics_rows(log_path)


def test_the_cookbooks_sl_loop_learns(tinker_server, hub, tmp_path):
    metrics = run_recipe("sl_loop", hub, tinker_server, tmp_path / "sl", batch_size=8, max_steps=10, lora_rank=8,
                         save_every=0)  # fmt: skip
    nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(nll) == 10
    assert sum(nll[-3:]) / 3 < 0.8 * sum(nll[:3]) / 3, nll  # each step's batch is new: means of three
    checkpoints = [json.loads(line) for line in (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()]
    assert checkpoints[-1]["name"] == "final" and checkpoints[-1]["state_path"].startswith("tinker://")


def gsm8k_rows(n: int) -> list[dict]:
    """Problems of openai/gsm8k's schema ('question', an 'answer' ending '#### N'), small sums."""
    rows = []
    for i in range(n):
        a, b = 1 + i % 7, 2 + (i * 3) % 5
        rows.append({"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


@pytest.fixture(scope="module")
def gsm8k(hub):
    """openai/gsm8k's stand-in: 16 problems, two batches of rl_basic's 8 groups or rl_loop's 4."""
    stand_ins.dataset(hub / "datasets", "openai/gsm8k", "main", {"train": gsm8k_rows(16), "test": gsm8k_rows(8)})
    return hub


def test_the_cookbooks_rl_loop_runs_its_loop(tinker_server, gsm8k, tmp_path):
    """rl_loop samples groups through the server's engine, trains with GSPO (its sequence ratio over
    the sampled tokens, which the recipe marks in sequence_ratio_mask) and saves. Its default loss,
    stable_reinforce, is not served (its formula is not published); rl_basic trains with importance
    sampling; whether reward rises is measured on the GPU, where a run is long enough (docs/tinker.md)."""
    metrics = run_recipe("rl_loop", gsm8k, tinker_server, tmp_path / "rl", batch_size=4, group_size=4, max_tokens=24,
                         max_steps=2, lora_rank=8, save_every=0, loss_fn="gspo")  # fmt: skip
    reward = [m["reward/total"] for m in metrics if "reward/total" in m]
    assert len(reward) == 2 and all(0.0 <= r <= 1.0 for r in reward)
    final = json.loads((tmp_path / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["name"] == "final" and final["sampler_path"].startswith("tinker://")


def test_the_cookbooks_sl_basic_learns_and_evaluates(tinker_server, hub, tmp_path):
    """sl_basic: the cookbook's supervised trainer (a session closed at its end, its held-out NLL
    scored through a sampling client's compute_logprobs every few steps)."""
    # the recipe fixes its data's batch size (128) in a builder that chz only replaces whole: the same
    # builder class, named on the command line with batches of 16, 2 steps of the stand-in's chats
    common = {"model_name_for_tokenizer": tinker_server.alias, "renderer_name": "qwen3_instruct",
              "max_length": 32768, "batch_size": 16, "train_on_what": "all_assistant_messages"}  # fmt: skip
    builder = {"dataset_builder": "tinker_cookbook.recipes.chat_sl.chat_datasets:NoRobotsBuilder"} | {
        f"dataset_builder.common_config.{k}": v for k, v in common.items()
    }
    metrics = run_recipe("sl_basic", hub, tinker_server, tmp_path / "slb", lora_rank=8, max_steps=2, eval_every=1,
                         save_every=0, **builder)  # fmt: skip
    nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(nll) == 2 and nll[1] < nll[0], nll
    held_out = [m["test/nll"] for m in metrics if "test/nll" in m]  # before each step, through compute_logprobs
    assert len(held_out) == 2 and held_out[1] < held_out[0], held_out


def test_the_cookbooks_rl_basic_runs_its_trainer(tinker_server, gsm8k, tmp_path):
    """rl_basic: the cookbook's RL trainer (rl/train.py) on its GSM8K environment, with its defaults
    (importance sampling, a few-shot prefix, groups of rollouts scored by its grader) until the
    dataset runs out: two steps of 8 problems."""
    # the recipe fixes its builder's sizes (128 groups of 16) in a value that chz only replaces whole:
    # the same builder class, named on the command line with smaller sizes
    builder = {"dataset_builder": "tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
               "dataset_builder.batch_size": 8, "dataset_builder.group_size": 2,
               "dataset_builder.model_name_for_tokenizer": tinker_server.alias,
               "dataset_builder.renderer_name": "qwen3_instruct"}  # fmt: skip
    metrics = run_recipe("rl_basic", gsm8k, tinker_server, tmp_path / "rlb", lora_rank=8, max_tokens=24,
                         save_every=0, **builder)  # fmt: skip
    steps = [m for m in metrics if "env/all/reward/total" in m]
    assert [m["env/all/total_episodes"] for m in steps] == [16, 16], metrics
    assert all(-1.0 <= m["env/all/reward/total"] <= 1.0 and m["tokens/trained"] > 0 for m in steps)
    # the trainer's own check that what was sampled is what is trained: half the mean squared difference
    # of the sampler's and the trained weights' logprob over every sampled token (RMS under 1.5e-4)
    assert all(m["optim/kl_sample_train_v2"] < 1e-8 for m in steps), [m["optim/kl_sample_train_v2"] for m in steps]
