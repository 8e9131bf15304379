"""``hybridrl export``: a checkpoint's policy as a plain HF folder (a LoRA checkpoint's adapter, or merged),
its files checked as a resume checks them, nothing read from outside it, and one error line and nothing
left behind on a full disk or onto a file."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hybridrl_export.export import export
from hybridrl_testing import SevensPlugin
from hybridrl_testing.runs import checkpointed_run

from hybridrl import checkpoint as ckpt
from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.run import build_run
from hybridrl.trainer import Trainer


def lora_config(model, run_dir):
    """tests/test_lora.py's run: adapters on three layer types, a KL term to the base."""
    return {
        "model": {"path": model, "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"n": 4, "max_tokens": 12},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A run with checkpoints step-000001 and step-000002, and its policy's tensors after the last step."""
    run = tmp_path_factory.mktemp("trained") / "run"
    trainer = Trainer(build_run(load_config(data=checkpointed_run(tiny_model, run))))
    trainer.train()
    return run, {name: tensor.detach().clone() for name, tensor in trainer.run.policy.state_dict().items()}


@pytest.fixture
def run(trained, tmp_path):
    """The trained run, copied afresh for each test."""
    shutil.copytree(trained[0], tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def flip_last_byte(file):
    data = file.read_bytes()
    file.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the same size: only the digest tells


def cli(*args) -> tuple[int, str]:
    """``hybridrl export ARGS`` in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["export", *map(str, args)])
    return code, err.getvalue()


def test_export_writes_the_policy_as_a_plain_hf_folder(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    run, policy = trained
    newest = run / "checkpoints" / "step-000002"
    out = subprocess.run(  # a process of its own: the command is found through the plugin's entry point
        [sys.executable, "-m", "hybridrl.cli", "export", str(newest), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in policy.items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def test_export_writes_the_adapter_and_with_merged_the_whole_model(tiny_model, tmp_path, register_plugin):
    pytest.importorskip("peft", reason="peft is not installed: pip install 'hybridrl[lora]'")
    from transformers import AutoModelForCausalLM

    register_plugin(SevensPlugin(), name="sevens")
    trainer = Trainer(build_run(load_config(data=lora_config(tiny_model, tmp_path / "run"))))
    trainer.train()
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    adapter = export(step, tmp_path / "adapter")
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    full = export(step, tmp_path / "merged", merged=True)
    model = AutoModelForCausalLM.from_pretrained(full).state_dict()
    want = dict(trainer.policy_tensors())
    for key, value in model.items():
        torch.testing.assert_close(value, want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_export_refuses_a_link_in_the_checkpoint(run, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not the model's")
    path = ckpt.latest_checkpoint(run).resolve()
    (path / "policy" / "notes.txt").symlink_to(secret)
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "export", str(path), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"error: {path / 'policy' / 'notes.txt'} is a symbolic link (to {secret})" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "hf" / "notes.txt").exists()


def test_export_checks_the_policy_as_a_resume_does_and_copies_a_hard_link_as_a_new_file(run, tmp_path):
    path = ckpt.latest_checkpoint(run)
    weights, elsewhere = path / "policy" / "model.safetensors", tmp_path / "elsewhere.safetensors"
    os.link(weights, elsewhere)  # the same file under a name outside the checkpoint
    code, err = cli(path, tmp_path / "hf")
    assert code == 0, err
    copied = tmp_path / "hf" / "model.safetensors"
    assert copied.read_bytes() == weights.read_bytes() and copied.stat().st_nlink == 1
    assert copied.stat().st_ino not in {weights.stat().st_ino, elsewhere.stat().st_ino}
    flip_last_byte(elsewhere)  # changed through the other name: the checkpoint's file changed with it
    code, err = cli(path, tmp_path / "hf2")
    assert (
        code == 2
        and err == f"error: {weights} differs from the file its run wrote (SHA-256 in {path / 'meta.json'}).\n"
    )
    assert not (tmp_path / "hf2").exists() and not list(tmp_path.glob(".hf2*"))


def test_export_onto_a_file_is_one_error_line(run, tmp_path):
    (tmp_path / "model.bin").write_text("not a folder")
    code, err = cli(ckpt.latest_checkpoint(run), tmp_path / "model.bin")
    assert (
        code == 2
        and err
        == f"error: {tmp_path / 'model.bin'} is a file; hybridrl export writes a folder. Give a new folder's path.\n"
    )


def test_export_on_a_full_disk_is_one_error_line_and_leaves_no_half_written_folder(run, tmp_path, monkeypatch):
    import errno

    real_copyfile = shutil.copyfile
    copied = []

    def copyfile(src, dst, **kwargs):  # the first file fits, the second fills the disk
        if copied:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        copied.append(real_copyfile(src, dst, **kwargs))
        return dst

    monkeypatch.setattr(shutil, "copyfile", copyfile)
    code, err = cli(ckpt.latest_checkpoint(run), tmp_path / "out" / "hf")
    assert code == 1 and copied and err.count("\n") == 1
    assert err.startswith(f"error: hybridrl export: {tmp_path / 'out'} is full (") and " GiB free" in err
    assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor its temporary sibling


def test_merged_export_on_a_full_disk_is_one_error_line_too(tiny_model, tmp_path, monkeypatch):
    """``export --merged`` writes through safetensors, whose error words a full disk its own way."""
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel

    from hybridrl.checkpoint_files import META, file_list
    from hybridrl.models import load_causal_lm, load_tokenizer

    step = ckpt.checkpoint_dir(tmp_path / "run") / "step-000001"
    model = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    get_peft_model(model, LoraConfig(r=2, target_modules="all-linear")).save_pretrained(step / "policy")
    load_tokenizer(tiny_model).save_pretrained(step / "policy")
    (step / META).write_text(json.dumps({"step": 1, "files": file_list(step)}))

    def full(self, *args, **kwargs):  # the message safetensors gives (its SafetensorError is no OSError)
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, message: "No space left on device" })')

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    code, err = cli(step, tmp_path / "out" / "hf", "--merged")
    last = err.replace("\r", "\n").splitlines()[-1]  # after transformers' loading bar
    assert code == 1 and last.startswith(f"error: hybridrl export: {tmp_path / 'out'} is full (")
    assert list((tmp_path / "out").iterdir()) == []
