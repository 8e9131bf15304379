"""In-process mode (``sglang.Engine``): real errors here, and contract tests against a fake engine.

SGLang cannot run on a CPU machine, so the engine object in the contract tests is the
``sglang_module`` contract fake (conftest.py): ``sglang.Engine``'s documented methods over a
real transformers model. What they check is the plugin's side: the engine arguments, the
requests, bucketed in-place updates, and the release/resume cycle around training.
"""

import json
from pathlib import Path

import pytest
import torch
from hybridrl_rollout_sglang.backends import SGLangUnavailableError, engine_kwargs

from hybridrl.components import RunContext, SamplingParams, TrainingMemory
from hybridrl.config import ConfigError, load_config
from hybridrl.models import load_causal_lm


def test_without_a_gpu_the_error_says_so_and_names_the_alternatives(make_engine):
    """Real behaviour on this CPU machine: no fake involved."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SGLangUnavailableError) as e:
        make_engine()
    msg = str(e.value)
    assert "sglang rollout engine" in msg and "needs a CUDA GPU" in msg
    assert "rollout.engine: vllm or hf" in msg and "rollout.base_url" in msg


def test_where_it_cannot_run_the_engine_is_one_error_line_before_any_model_loads(
    tiny_model, tmp_path, monkeypatch, capsys
):
    """Real behaviour: rollout.engine sglang in a run on the CPU, from hybridrl validate and train."""
    import yaml

    import hybridrl.run
    from hybridrl import cli

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
        "rewards": [{"function": "reasoning_gym"}],
        "rollout": {"engine": "sglang"},
        "trainer": {"device": "cpu", "run_dir": str(tmp_path / "run")},
    }))  # fmt: skip
    for command in ("validate", "train"):
        assert cli.main([command, str(config)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: rollout engine 'sglang': the in-process engine ")
        assert "rollout.base_url" in err and "rollout.engine: vllm or hf" in err


def test_check_launch_refuses_a_missing_sglang_before_any_model_loads(sglang_module, tmp_path, monkeypatch):
    """Contract test: CUDA present (faked), but no sglang package: refused with the install command."""
    import sys

    from hybridrl_rollout_sglang import SGLangEngine

    ctx = RunContext("/m", None, torch.device("cuda:0"), torch.float32, 0, tmp_path)
    SGLangEngine.check_launch(SGLangEngine.Options(), ctx)
    monkeypatch.setitem(sys.modules, "sglang", None)  # what an absent package does to import
    with pytest.raises(ValueError, match=r"SGLang is not installed.*hybridrl-rollout-sglang\[gpu\]"):
        SGLangEngine.check_launch(SGLangEngine.Options(), ctx)
    SGLangEngine.check_launch(SGLangEngine.Options(base_url="http://127.0.0.1:30000"), ctx)  # a server


def test_missing_sglang_is_named_with_the_install_command(make_engine, sglang_module, monkeypatch):
    """Contract test: CUDA present (faked), but ``import sglang`` fails."""
    import sys

    monkeypatch.setitem(sys.modules, "sglang", None)  # what an absent package does to import
    with pytest.raises(SGLangUnavailableError, match=r"'import sglang' failed.*hybridrl-rollout-sglang\[gpu\]"):
        make_engine()


def test_engine_start_failure_names_the_options_to_change(make_engine, sglang_module):
    """Contract test: ``sglang.Engine(...)`` raises while starting."""
    sglang_module.Engine.fail_start = RuntimeError("Not enough memory. Please try to increase --mem-fraction-static")
    with pytest.raises(RuntimeError, match=r"sglang.Engine failed to start.*Not enough memory.*mem_fraction_static"):
        make_engine()


def test_engine_arguments_follow_the_options(make_engine, sglang_module, tiny_model):
    """Contract test: the keyword arguments reach ``sglang.Engine`` as its server arguments."""
    make_engine(
        mem_fraction_static=0.35,
        tp_size=1,
        context_length=512,
        attention_backend="triton",
        dtype="bfloat16",
        engine_kwargs={"cuda_graph_max_bs_decode": 256},
    )
    kw = sglang_module.Engine.last.kwargs
    assert kw == {
        "model_path": tiny_model,
        "skip_tokenizer_init": True,
        "mem_fraction_static": 0.35,
        "tp_size": 1,
        "dtype": "bfloat16",
        "random_seed": 0,
        "enable_memory_saver": True,
        "log_level": "warning",
        "trust_remote_code": False,  # model.trust_remote_code
        "context_length": 512,
        "attention_backend": "triton",
        "cuda_graph_max_bs_decode": 256,
    }


def test_engine_kwargs_may_not_override_what_the_plugin_sets(make_engine):
    from hybridrl_rollout_sglang import SGLangEngine

    Ctx = RunContext("/m", None, torch.device("cuda:1"), torch.float32, 0, Path("/unused"))  # noqa: N806

    options = SGLangEngine.Options(engine_kwargs={"enable_deterministic_inference": True})
    assert engine_kwargs(options, Ctx)["base_gpu_id"] == 1  # colocated with the policy's GPU
    assert engine_kwargs(options, Ctx)["enable_deterministic_inference"] is True
    with pytest.raises(ValueError, match="engine_kwargs sets mem_fraction_static, model_path"):
        engine_kwargs(SGLangEngine.Options(engine_kwargs={"mem_fraction_static": 0.9, "model_path": "x"}), Ctx)


def test_generation_returns_n_samples_with_the_trainers_logprobs(
    make_engine, sglang_module, prompts, tiny_model, logprob_gap
):
    """Contract test: n samples per prompt, grouped; logprobs equal the trainer's for the same weights."""
    engine = make_engine()
    s = SamplingParams(n=4, temperature=0.8, top_p=0.9, top_k=20, max_tokens=10, seed=3)
    out = engine.generate(prompts, s)
    assert len(out.token_ids) == 12 and len(out.logprobs) == 12
    for ids, lps, finish in zip(out.token_ids, out.logprobs, out.finish_reasons):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 10
        assert finish == ("stop" if ids[-1] == 1 else "length")  # 1 is the tiny model's EOS
        assert (finish == "length") == (len(ids) == 10 and 1 not in ids)
    assert [sglang_module.Engine.last.core.calls[0]] == [("generate", 12)]  # one call, 3 prompts x 4
    model = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    assert logprob_gap(model, prompts, out, 4, 0.8) < 1e-4


def test_sglangs_garbage_collector_is_frozen_once_after_the_first_generation(make_engine, sglang_module, prompts):
    """Contract test: Engine.freeze_gc, as SGLang advises once it has served requests, is called once."""
    engine = make_engine()
    s = SamplingParams(n=2, max_tokens=4, seed=1)
    assert sglang_module.Engine.last.gc_freezes == 0  # not at start: the first requests create what stays
    engine.generate(prompts, s)
    engine.generate(prompts, s)
    assert sglang_module.Engine.last.gc_freezes == 1


def test_update_weights_in_buckets_changes_the_outputs(make_engine, sglang_module, prompts, tiny_model, logprob_gap):
    """Contract test: bucketed update_weights_from_tensor, one cache flush, the tied head not sent."""
    engine = make_engine(update_bucket_mb=0.06)  # about 63 kB: the tiny model goes in several buckets
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
    engine.update_weights(policy.state_dict().items())

    calls = sglang_module.Engine.last.tensor_calls
    assert len(calls) >= 3
    assert [flush for _, flush in calls] == [False] * (len(calls) - 1) + [True]
    sent = [n for names, _ in calls for n in names]
    assert sorted(sent) == sorted(k for k in policy.state_dict() if k != "lm_head.weight")
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=8))
    original = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    assert logprob_gap(policy, prompts, out, 2, 1.0) < 1e-3  # the engine runs the new weights
    assert logprob_gap(original, prompts, out, 2, 1.0) > 0.1  # and no longer the old ones


def test_sleep_update_wake_cycle_releases_and_reloads(make_engine, sglang_module, prompts, tiny_model, logprob_gap):
    """Contract test: the trainer's order (sleep, update, wake) maps to SGLang's release/resume calls."""
    engine = make_engine()
    core = sglang_module.Engine.last.core
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    s = SamplingParams(n=2, max_tokens=6)
    for _ in range(2):
        engine.wake_up()
        out = engine.generate(prompts, s)
        assert logprob_gap(policy, prompts, out, 2, 1.0) < 1e-4
        engine.sleep()
        engine.update_weights(policy.state_dict().items())
    engine.wake_up()
    tensors = len(policy.state_dict()) - 1  # lm_head.weight is tied to the embeddings
    assert [c for c in core.calls if c[0] in ("release", "resume", "update_weights_from_tensor")] == [
        ("release", ["cuda_graph", "kv_cache", "weights"]),
        ("resume", ["weights"]),
        ("update_weights_from_tensor", tensors, True),
        ("resume", ["cuda_graph", "kv_cache"]),
    ] * 2
    assert logprob_gap(policy, prompts, engine.generate(prompts, s), 2, 1.0) < 1e-4
    engine.close()
    assert sglang_module.Engine.last.is_shutdown


def test_a_skipped_update_after_releasing_the_weights_is_an_error(make_engine, sglang_module, prompts):
    """Contract test: sleep then wake without an update (the trainer skipped the sync) leaves garbage."""
    engine = make_engine()
    engine.sleep()
    engine.wake_up()
    with pytest.raises(RuntimeError, match="released by sleep\\(\\) and no update_weights\\(\\).*weights_cpu_backup"):
        engine.generate(prompts, SamplingParams(n=1, max_tokens=4))


def test_a_skipped_update_is_fine_with_the_cpu_backup(make_engine, sglang_module, prompts, tiny_model, logprob_gap):
    """Contract test: with enable_weights_cpu_backup SGLang restores released weights on resume."""
    engine = make_engine(weights_cpu_backup=True)
    assert sglang_module.Engine.last.kwargs["enable_weights_cpu_backup"] is True
    engine.sleep()
    engine.wake_up()
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=6))
    original = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    assert logprob_gap(original, prompts, out, 2, 1.0) < 1e-4


def test_keeping_the_weights_frees_only_the_caches(make_engine, sglang_module, prompts, tiny_model):
    """Contract test: release_weights false releases and resumes the KV cache and CUDA graphs only."""
    engine = make_engine(release_weights=False)
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    engine.sleep()
    engine.wake_up()  # a skipped update is harmless: the weights never left
    engine.generate(prompts, SamplingParams(n=1, max_tokens=3))
    engine.sleep()
    engine.update_weights(policy.state_dict().items())
    engine.wake_up()
    core = sglang_module.Engine.last.core
    assert [c for c in core.calls if c[0] in ("release", "resume")] == [
        ("release", ["cuda_graph", "kv_cache"]),
        ("resume", ["cuda_graph", "kv_cache"]),
    ] * 2


def test_without_memory_saver_sleep_keeps_everything(make_engine, sglang_module, prompts):
    engine = make_engine(enable_memory_saver=False)
    engine.sleep()
    engine.wake_up()
    assert len(engine.generate(prompts, SamplingParams(n=1, max_tokens=4)).token_ids) == 3
    assert not any(c[0] in ("release", "resume") for c in sglang_module.Engine.last.core.calls)


def test_memory_saver_auto_keeps_the_memory_where_training_still_has_room(tiny_model, tmp_path, monkeypatch, capsys):
    """Contract test for the GPU case (no GPU here: torch is told the GPU's size), with the vllm
    engine's rule: the engine keeps its memory when 0.95 of the GPU minus mem_fraction_static and 16
    bytes a policy parameter leave a quarter of the GPU; off a GPU, auto releases as before."""
    from types import SimpleNamespace

    from hybridrl_rollout_sglang import SGLangEngine
    from hybridrl_rollout_sglang.backends import memory_saver

    params = sum(p.numel() for p in load_causal_lm(tiny_model, torch.float32, torch.device("cpu")).parameters())
    options = SGLangEngine.Options()
    assert options.enable_memory_saver == "auto"
    training = TrainingMemory.of(params, world_size=1)  # 16 bytes a parameter while the policy updates
    ctx = RunContext(tiny_model, None, torch.device("cuda:0"), torch.float32, 0, tmp_path, training_memory=training)

    def saver(total, **opts):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
        return memory_saver(SGLangEngine.Options(**opts), ctx)

    assert saver(80 * params + 100) is False  # mem_fraction_static 0.5: (0.95 - 0.5 - 0.25) x total >= 16 x params
    assert "enable_memory_saver auto: False" in capsys.readouterr().out
    assert saver(80 * params - 100) is True
    assert saver(80 * params + 100, enable_memory_saver=True) is True  # an explicit choice stands
    assert memory_saver(options, RunContext(tiny_model, None, torch.device("cpu"), torch.float32, 0, tmp_path))


def test_dtype_auto_follows_sglangs_rule_and_float32_is_refused(make_engine, sglang_module, tmp_path, capsys):
    """SGLang's ``dtype: auto`` (sglang/srt/configs/model_config.py, 0.5.17) runs a float32 checkpoint
    in float16 (Gemma's in bfloat16) and any other in its own dtype; its CUDA kernels take no float32
    (an H200 run: rmsnorm 'failed to dispatch data type Float'), so that choice is refused up front."""
    from hybridrl_rollout_sglang import SGLangEngine
    from hybridrl_rollout_sglang.backends import engine_dtype
    from pydantic import ValidationError
    from transformers import Gemma2Config, LlamaConfig

    def checkpoint(config_class, dtype):
        folder = tmp_path / f"{config_class.__name__}-{dtype}"
        config = config_class(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, vocab_size=64)  # fmt: skip
        config.dtype = dtype
        config.save_pretrained(folder)
        return RunContext(str(folder), None, torch.device("cuda:0"), torch.float32, 0, tmp_path)

    auto = SGLangEngine.Options()
    assert engine_dtype(auto, checkpoint(LlamaConfig, "float32")) == "float16"
    assert engine_dtype(auto, checkpoint(Gemma2Config, "float32")) == "bfloat16"
    assert engine_dtype(auto, checkpoint(LlamaConfig, "bfloat16")) == "bfloat16"
    assert engine_dtype(SGLangEngine.Options(dtype="float16"), checkpoint(Gemma2Config, "bfloat16")) == "float16"
    with pytest.raises(ValidationError, match="16-bit weights only.*rollout.engine: vllm or hf"):
        SGLangEngine.Options(dtype="float32")

    make_engine()  # the tiny checkpoint is bfloat16, the policy float32: the engine says what it runs
    said = capsys.readouterr().out
    assert "dtype auto: bfloat16, SGLang's choice for this checkpoint, beside a float32 policy" in said
    make_engine(dtype="bfloat16")
    assert "dtype auto" not in capsys.readouterr().out


def test_stop_strings_are_cut_here_when_sglang_has_no_tokenizer(make_engine, sglang_module, prompts, tiny_model):
    """Contract test: with skip_tokenizer_init SGLang refuses ``stop``; the plugin cuts responses itself."""
    from hybridrl.models import load_tokenizer

    tok = load_tokenizer(tiny_model)
    engine = make_engine()
    stops = list("aeiou 0123456789")
    out = engine.generate(prompts, SamplingParams(n=4, max_tokens=12, stop=stops))
    sent = sglang_module.Engine.last.core
    assert sent.calls[0] == ("generate", 12)
    cut = 0
    for ids, finish in zip(out.token_ids, out.finish_reasons):
        text = tok.decode(ids)
        if finish == "stop" and ids[-1] != 1:
            cut += 1
            assert any(s in text for s in stops)  # the last token completes a stop string
        assert not any(s in tok.decode(ids[:-1]) for s in stops)  # and not later than the first one
    assert cut > 0
    with pytest.raises(ValueError, match="stop_in_engine needs SGLang's tokenizer"):
        make_engine(stop_in_engine=True)


def test_original_logprob_mode_with_a_temperature_is_refused(make_engine, sglang_module, prompts, monkeypatch):
    engine = make_engine()
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB is set.*temperature is 0.7"):
        engine.generate(prompts, SamplingParams(temperature=0.7))
    assert len(engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_tokens=2)).token_ids) == 3


def test_options_reject_unknown_keys_and_the_other_modes_options(tiny_model):
    base = {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
        "rewards": [{"function": "format", "pattern": "7"}],
    }
    with pytest.raises(ConfigError, match="Unknown key 'mem_fraction' in rollout.*mem_fraction_static"):
        load_config(data={**base, "rollout": {"engine": "sglang", "mem_fraction": 0.5}})
    with pytest.raises(ConfigError, match="rollout.dtype: .*16-bit weights only"):
        load_config(data={**base, "rollout": {"engine": "sglang", "dtype": "float32"}})
    with pytest.raises(ConfigError, match="rollout.mem_fraction_static: .*in-process engine only; with base_url"):
        load_config(data={**base, "rollout": {"engine": "sglang", "base_url": "http://x", "mem_fraction_static": 0.5}})
    with pytest.raises(
        ConfigError, match="rollout.api_key: .*server mode only(.|\\n)*rollout.timeout: .*server mode only"
    ):
        load_config(data={**base, "rollout": {"engine": "sglang", "api_key": "k", "timeout": 5}})
    cfg = load_config(data={**base, "rollout": {"engine": "sglang", "tp_size": 2, "engine_kwargs": {"a": 1}}})
    assert cfg.rollout.options.tp_size == 2 and cfg.rollout.options.engine_kwargs == {"a": 1}


def test_every_option_is_documented():
    from hybridrl_rollout_sglang import SGLangEngine

    fields = SGLangEngine.Options.model_fields
    assert all(f.description for f in fields.values()), [k for k, f in fields.items() if not f.description]
    assert json.dumps(SGLangEngine.Options.model_json_schema())  # the docs generator can render it


def test_sampler_is_the_config_not_the_generation_config(make_engine, sglang_module, tiny_model):
    """Contract test: the fake, as SGLang with its default --sampling-defaults model, takes every
    field a request leaves out from generation_config.json (top_k 5, min_p 0.2,
    repetition_penalty 1.8, temperature 0.3); the plugin leaves none out."""
    from hybridrl_testing import SAMPLING_GENERATION_CONFIG, sampler_check

    diff, distinct = sampler_check(make_engine(), tiny_model)
    assert diff < 1e-4
    assert distinct > SAMPLING_GENERATION_CONFIG["top_k"]


def test_under_torchrun_each_rank_gets_its_own_engine_ports_and_no_tensor_parallel(sglang_module, tmp_path):
    """Contract test: per-rank engines of one node listen on ports of their own; tp_size > 1 under
    torchrun is refused before any model loads, naming the alternatives."""
    from hybridrl_rollout_sglang import SGLangEngine

    from hybridrl.components import RunContext

    ctx = RunContext(
        "/m", None, torch.device("cuda:1"), torch.bfloat16, 0, tmp_path, rank=1, world_size=2, local_rank=1
    )
    kwargs = engine_kwargs(SGLangEngine.Options(), ctx)
    assert (kwargs["port"], kwargs["nccl_port"], kwargs["base_gpu_id"]) == (30100, 30150, 1)
    SGLangEngine.check_launch(SGLangEngine.Options(), ctx)
    with pytest.raises(ValueError, match="tp_size=2 under torchrun: an in-process SGLang engine cannot span"):
        SGLangEngine.check_launch(SGLangEngine.Options(tp_size=2), ctx)
    SGLangEngine.check_launch(SGLangEngine.Options(base_url="http://127.0.0.1:30000"), ctx)  # a server: fine


def test_cuda_graphs_cover_the_batch_the_trainer_sends(sglang_module, tmp_path):
    """Contract test: SGLang decodes batches above cuda_graph_max_bs_decode without CUDA graphs (its default
    is 256 on an H200, below GRPO's 64 prompts x 8 samples), so the plugin sizes it to the responses
    one generate call asks for, rounded up to a multiple of 8; engine_kwargs still decides."""
    from hybridrl_rollout_sglang import SGLangEngine

    from hybridrl.components import RunContext

    def graphs(responses, **options):
        ctx = RunContext("/m", None, torch.device("cuda:0"), torch.bfloat16, 0, tmp_path, responses_per_call=responses)
        return engine_kwargs(SGLangEngine.Options(**options), ctx).get("cuda_graph_max_bs_decode")

    assert graphs(512) == 512
    assert graphs(60) == 64
    assert graphs(None) is None  # not called by the trainer: SGLang's own default
    assert graphs(512, engine_kwargs={"cuda_graph_max_bs_decode": 128}) == 128


def test_multi_turn_trajectories_keep_the_engines_tokens(make_engine, sglang_module, tiny_model):
    """Contract test: the agent loop on the SGLang plugin, each turn seeded on its own."""
    from hybridrl_testing import agent_check

    engine = make_engine(per_request_seed=True, skip_tokenizer_init=False)
    diff, holes, turns = agent_check(engine, tiny_model, "sglang")
    assert diff < 1e-4 and holes > 0 and turns == 3
    assert engine.seeds_each_request()
