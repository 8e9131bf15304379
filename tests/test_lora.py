"""LoRA (model.lora, through peft): adapters only in the optimizer, the reference is the base with the
adapters off, engines follow the adapter alone or the merged weights (peft's own merge, on every layer
type it adapts), checkpoints resume exactly (export, merged too: plugins/export/tests)."""

import json
import warnings

import pytest
import torch
from hybridrl_testing import (
    SevensPlugin,
    assert_same_metrics,
    build_tiny_model,
    fixed_batch,
    hf_greedy,
    metrics_rows,
    policy_greedy,
    small_model,
)
from safetensors.torch import load_file

from hybridrl import lora
from hybridrl.config import ConfigError, LoraOptions, load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.models import disable_dropout, load_causal_lm
from hybridrl.passes import response_logprobs
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

pytest.importorskip("peft", reason="peft is not installed: pip install 'hybridrl[lora]'")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def config(model, run_dir, **trainer):
    return {
        "model": {"path": model, "lora": LORA},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"n": 4, "max_tokens": 12},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir), **trainer},
        "logging": {"loggers": ["jsonl"]},
    }


def test_only_adapters_train_and_the_reference_is_the_base(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    t = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "run"))))
    trained = [n for n, p in t.run.policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    in_optimizer = sum(p.numel() for g in t.run.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for n, p in t.run.policy.named_parameters() if p.requires_grad)
    assert t.run.ref is None  # no second copy of the model
    with torch.no_grad():  # make the adapters do something, then check the reference ignores them
        for n, p in t.run.policy.named_parameters():
            if "lora_B" in n:
                p.normal_()
    batch = fixed_batch(t.run.tokenizer, [[3, 5], [4, 2]])
    t.compute_logprobs(batch)
    base = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        want, _ = response_logprobs(base, batch.input_ids, batch.attention_mask, batch["responses"].shape[1])
        with_adapters, _ = response_logprobs(t.run.policy, batch.input_ids, batch.attention_mask, 5)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["ref_logprobs"][mask], want[mask], atol=1e-5, rtol=1e-5)
    assert (with_adapters[mask] - want[mask]).abs().max() > 1e-2


def random_adapters(model):
    """Every LoRA factor random: peft starts B (an embedding's A) at zero, whose merge tests nothing."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


MERGES = [
    ("gpt2", "all-linear"),  # Conv1D (peft's fan_in_fan_out): W is (in, out); c_attn and c_fc are not square
    ("gpt2", ["c_attn", "c_proj", "c_fc", "wpe"]),  # and an embedding (the positions'; wte is tied)
    ("llama", "all-linear"),
    ("llama", ["embed_tokens", "q_proj", "down_proj", "lm_head"]),  # untied: the embedding and the output layer
    ("qwen2", "all-linear"),  # tied embeddings, without adapters
    ("qwen3_moe", "all-linear"),  # fused experts (peft's ParamWrapper, a factor pair per expert) and the router
    ("mixtral", "all-linear"),
]


@pytest.mark.parametrize(("arch", "targets"), MERGES)
def test_merged_weights_are_peft_merge_and_unload(arch, targets):
    options = LoraOptions(r=4, alpha=8, target_modules=targets)
    model = random_adapters(lora.apply_lora(disable_dropout(small_model(arch)), options))
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        policy = model(ids).logits
    stream = reversed(list(model.state_dict().items()))  # any order: a layer's parts arrive apart
    merged = dict(lora.merged_tensors(stream, lora.adapted_layers(model)))
    want = model.merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(merged[key], want[key], atol=1e-6, rtol=0, msg=key)
    engine = disable_dropout(small_model(arch))  # what an engine builds from the merged weights: the policy
    engine.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, policy, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "targets", "layer"),
    [("qwen2", ["embed_tokens"], "model.embed_tokens"), ("gpt2", ["c_fc", "lm_head"], "lm_head")],
)
def test_an_adapter_on_tied_embeddings_is_refused_at_setup(arch, targets, layer):
    """No weights stand for it: the engine ties the output layer to the merged embedding (and peft's
    merge_and_unload changes both too)."""
    with pytest.raises(
        ConfigError, match=rf"adapter on {layer} cannot be merged .* Leave '{layer.split('.')[-1]}' out"
    ):
        lora.apply_lora(small_model(arch), LoraOptions(r=4, alpha=8, target_modules=targets))


class Layers(torch.nn.Module):
    """Layers peft adapts besides linear layers and embeddings."""

    def __init__(self):
        super().__init__()
        self.conv1d = torch.nn.Conv1d(4, 6, 3)
        self.conv2d = torch.nn.Conv2d(6, 5, (2, 3))
        self.pointwise = torch.nn.Conv2d(5, 3, 1)
        self.grouped = torch.nn.Conv1d(4, 4, 3, groups=2)
        self.attention = torch.nn.MultiheadAttention(8, 2)
        self.linear = torch.nn.Linear(8, 8)


def test_convolutions_merge_and_layers_without_a_merge_are_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(Layers(), LoraConfig(r=2, lora_alpha=6, target_modules=["conv1d", "conv2d", "pointwise"]))
    random_adapters(model)
    merged = dict(lora.merged_tensors(model.state_dict().items(), lora.adapted_layers(model)))
    want = model.merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(merged[key], want[key], atol=1e-6, rtol=0, msg=key)
    refused = [  # the options cannot ask for the last two; a peft model built elsewhere could
        ({"target_modules": ["grouped"]}, "cannot merge the adapter on grouped"),  # nor can peft
        ({"target_modules": ["attention"]}, "cannot merge the adapter on attention"),
        ({"target_modules": ["linear"], "use_dora": True}, "adapter on linear is a LoRA variant"),
        ({"target_modules": ["linear"], "lora_bias": True}, "adapter on linear is a LoRA variant"),
    ]
    for options, message in refused:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's own: a grouped convolution cannot be merged
            model = get_peft_model(Layers(), LoraConfig(r=2, **options))
        layer = options["target_modules"][0]
        with pytest.raises(ConfigError, match=rf"{message} .* Leave '{layer}' out of model.lora.target_modules"):
            lora.adapted_layers(model)


class EngineFollows:
    """At the end of training: the engine's greedy output is the merged policy's (the weights the
    loop sends its engine, :meth:`Trainer.policy_tensors`: the test sets ``trainer`` before training)."""

    trainer = None

    @hookimpl
    def on_train_end(self, run):
        prompts = [[5, 6, 7], [9, 10, 11, 12]]
        self.want = policy_greedy(self.trainer, prompts, 8)
        engine = run.engine.model  # the hf engine's own copy
        self.got = hf_greedy(engine, prompts, 8)


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_the_engine_follows_the_adapters_and_a_resume_is_exact(sync, tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    check = register_plugin(EngineFollows(), name="follows")
    straight = tmp_path / "straight"

    def config(*args, **kwargs):
        data = globals()["config"](*args, **kwargs)
        data["model"]["lora"] = LORA | {"sync": sync}
        return data

    check.trainer = Trainer(build_run(load_config(data=config(tiny_model, straight, steps=3))))
    assert check.trainer.run.session.adapters == (sync == "adapter")
    check.trainer.train()
    assert check.got == check.want
    rows = metrics_rows(straight)
    assert rows[-1]["rollout/logprob_diff_max"] < 1e-4  # the engine sampled with the trained adapters

    resumed = tmp_path / "resumed"
    Trainer(build_run(load_config(data=config(tiny_model, resumed, steps=2)))).train()
    checkpoint = resumed / "checkpoints" / "step-000002" / "policy"
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    Trainer(build_run(load_config(data=config(tiny_model, resumed, steps=3, resume=True)))).train()
    assert_same_metrics(metrics_rows(resumed), rows)


def test_an_adapter_sync_sends_the_adapter_alone_over_the_engines_own_base(tiny_model, tmp_path, register_plugin):
    """model.lora.sync adapter with the hf engine: each sync sends the adapter's factors alone; the engine's
    base weights stay the checkpoint's (nothing merged); the adapter saved is peft's own folder."""
    from peft import PeftModel

    register_plugin(SevensPlugin(), name="sevens")
    data = config(tiny_model, tmp_path / "run")
    data["model"]["lora"] = LORA | {"sync": "adapter"}
    t = Trainer(build_run(load_config(data=data)))
    assert t.run.session.adapters
    engine_model = t.run.engine.model  # the engine lets it go at the end of the run
    t.train()
    adapter = lora.adapter(t.run.strategy, t.run.policy, 2)
    layers = t.run.model_config.num_hidden_layers
    assert len(adapter.tensors) == 2 * 3 * layers and adapter.config["r"] == 4
    assert all(
        n.startswith("base_model.model.") and n.endswith((".lora_A.weight", ".lora_B.weight"))
        for n, _ in adapter.tensors
    )
    base = load_causal_lm(tiny_model, torch.float32, torch.device("cpu")).state_dict()
    engine = {n.replace(".base_layer", ""): w for n, w in engine_model.state_dict().items() if ".lora_" not in n}
    assert engine.keys() == base.keys() and all(torch.equal(engine[n], base[n]) for n in base)
    folder = adapter.save(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")), folder)
    # in an engine's 16-bit LoRA dtype (vLLM's on a GPU): the tensors as the engine would cast them
    half = load_file(adapter.save(tmp_path / "bf16", torch.bfloat16) / "adapter_model.safetensors")
    assert half.keys() == dict(adapter.tensors).keys()
    assert all(torch.equal(half[name], tensor.to(torch.bfloat16)) for name, tensor in adapter.tensors)
    batch = fixed_batch(t.run.tokenizer, [[3, 5], [4, 2]])
    with torch.no_grad():
        want, _ = response_logprobs(t.run.policy, batch.input_ids, batch.attention_mask, 5)
        got, _ = response_logprobs(loaded, batch.input_ids, batch.attention_mask, 5)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-6, rtol=1e-6)


def test_an_engine_that_cannot_take_adapters_gets_merged_weights_and_says_why(
    tiny_model, tmp_path, capsys, register_plugin
):
    register_plugin(SevensPlugin(), name="sevens")
    data = config(tiny_model, tmp_path / "run")
    data["rollout"] |= {"fuse_projections": "on"}  # the hf engine's fast path: fused projections
    run = build_run(load_config(data=data))
    run.close()
    assert not run.session.adapters
    why = "its fast path fused the projections that share an input (rollout.options.fuse_projections: off)"
    assert f"LoRA sync: merged weights to rollout engine 'hf' ({why})" in capsys.readouterr().out
    data["model"]["lora"] = LORA | {"sync": "adapter"}
    with pytest.raises(ConfigError, match=r"model.lora.sync is 'adapter', but rollout engine 'hf' cannot take"):
        build_run(load_config(data=data))
    del data["rollout"]["fuse_projections"]
    data["model"]["lora"] = LORA  # auto, an engine in the trainer's process: merged, the faster (BENCHMARKS.md)
    run = build_run(load_config(data=data))
    run.close()
    out = capsys.readouterr().out
    assert not run.session.adapters and "(in the trainer's process the unmerged adapter costs more" in out


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A random 2-layer GPT-2 (Conv1D layers, tied embeddings) with the tiny model's tokenizer."""
    from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"))  # its tokenizer; the Llama gets overwritten
    vocab = AutoConfig.from_pretrained(path).vocab_size
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=None, eos_token_id=1
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def test_auto_merges_for_an_engine_in_the_trainers_process_and_sends_the_adapter_to_one_apart(
    tiny_model, tmp_path, register_plugin
):
    """In the trainer's process a merged sync is a copy on the same device, and generating through the
    unmerged adapter cost more than it saved (the CPU demo; r 32 at 7B on an H100 with hf and vLLM), so
    auto merges there, on any device; an engine apart from the trainer (a server) gets the adapter."""
    from hybridrl import lora

    register_plugin(SevensPlugin(), name="sevens")
    run = build_run(load_config(data=config(tiny_model, tmp_path / "run")))  # the hf engine: merged (above)
    run.close()

    class Apart:  # what choose_sync asks of an engine: a server that takes adapters
        def takes_adapter(self, config):
            return None

        def runs_apart(self):
            return True

    class InProcess(Apart):  # the same engine in the trainer's process, on whatever device (a GPU too)
        def runs_apart(self):
            return False

    options = run.config.model.lora
    adapters, said = lora.choose_sync(options, Apart(), run.policy, "server")
    assert adapters and said.startswith("LoRA sync: the adapter alone")
    adapters, said = lora.choose_sync(options, InProcess(), run.policy, "vllm")
    assert not adapters and f"({lora.IN_PROCESS} (BENCHMARKS.md); model.lora.sync: adapter sends" in said
    adapters, _ = lora.choose_sync(options.model_copy(update={"sync": "adapter"}), InProcess(), run.policy, "vllm")
    assert adapters
    adapters, said = lora.choose_sync(options.model_copy(update={"sync": "merged"}), Apart(), run.policy, "server")
    assert not adapters and said == "LoRA sync: merged weights to rollout engine 'server' (model.lora.sync: merged)"


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_the_engine_follows_adapters_on_gpt2_conv1d_layers(sync, tiny_gpt2, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    check = register_plugin(EngineFollows(), name="follows")
    data = config(tiny_gpt2, tmp_path / "run")
    data["model"]["lora"] = {"r": 4, "alpha": 8, "target_modules": "all-linear", "sync": sync}
    trainer = check.trainer = Trainer(build_run(load_config(data=data)))
    trainer.train()
    moved = [p.abs().max().item() for n, p in trainer.run.policy.named_parameters() if ".lora_B." in n]
    assert len(moved) == 8 and min(moved) > 1e-3  # c_attn, c_proj, c_fc, mlp.c_proj of 2 layers trained
    assert check.got == check.want
    assert metrics_rows(tmp_path / "run")[-1]["rollout/logprob_diff_max"] < 1e-4  # sampled with the trained adapters


def test_target_modules_that_match_nothing_list_the_layers(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    data = config(tiny_model, tmp_path / "run")
    data["model"]["lora"] = {"target_modules": ["query", "value"]}
    with pytest.raises(ConfigError, match=r"match no layer of LlamaForCausalLM. Its linear layers are named: .*q_proj"):
        build_run(load_config(data=data))


def saved_adapter(model_path, folder, r=4, targets=("q_proj", "v_proj", "up_proj"), seed=0):
    """A peft adapter folder as users bring one (peft's own save_pretrained), its factors random."""
    import peft

    torch.manual_seed(seed)
    base = load_causal_lm(model_path, torch.float32, torch.device("cpu"))
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("arch", "sync"), [("llama", "adapter"), ("llama", "merged"), ("gpt2", "adapter")])
def test_a_run_starts_from_a_peft_adapter_folder_as_peft_loads_it(arch, sync, tiny_model, tmp_path, register_plugin,
                                                                     request):  # fmt: skip
    import peft

    register_plugin(SevensPlugin(), name="sevens")
    model = tiny_model if arch == "llama" else request.getfixturevalue("tiny_gpt2")  # GPT-2: Conv1D layers
    targets = ("q_proj", "v_proj", "up_proj") if arch == "llama" else ("c_attn", "c_fc")
    folder = saved_adapter(model, tmp_path / "adapter", r=8, targets=targets)
    data = config(model, tmp_path / "run")
    data["model"]["lora"] = {"path": str(folder), "sync": sync}  # rank, alpha and targets come from the folder
    t = Trainer(build_run(load_config(data=data)))
    loaded = peft.PeftModel.from_pretrained(load_causal_lm(model, torch.float32, torch.device("cpu")), folder)
    batch = fixed_batch(t.run.tokenizer, [[3, 5], [4, 2]])
    with torch.no_grad():
        want, _ = response_logprobs(loaded, batch.input_ids, batch.attention_mask, 5)
        got, _ = response_logprobs(t.run.policy, batch.input_ids, batch.attention_mask, 5)
        base, _ = response_logprobs(load_causal_lm(model, torch.float32, torch.device("cpu")),
                                    batch.input_ids, batch.attention_mask, 5)  # fmt: skip
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-6, rtol=1e-6)
    assert (got[mask] - base[mask]).abs().max() > 1e-3  # the folder's adapter is in, not a fresh one
    assert lora.adapter_config(t.run.policy)["r"] == 8
    t.train()  # and it trains on from there, the engine sampling with the folder's adapter from the first step
    first, last = metrics_rows(tmp_path / "run")[0], metrics_rows(tmp_path / "run")[-1]
    assert last["step"] == 2 and first["rollout/logprob_diff_max"] < 1e-4


def other_base(tmp_path):
    from hybridrl_testing import build_tiny_model

    return str(build_tiny_model(tmp_path / "wider", hidden=96))


def edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return folder


BAD_FOLDERS = {  # each case and the line that says what is wrong
    "another base": r"q_proj.lora_A.weight has 96 inputs where this model's layer has 64: it was trained on another",
    "wrong rank": r"lora_A.weight has rank 4 where its adapter_config.json says 8",
    "targets the base lacks": r"target_modules of the adapter in .* \['query'\] match no layer of LlamaForCausalLM",
    "fewer targets than tensors": r"adapts 4 layers that this model does not have \(first: model.layers.0.mlp.up_proj",
    "pickled weights": r"no adapter_model.safetensors \(adapter_model.bin is pickled: loading it could run code",
    "not a folder": r"has no adapter_config.json: it must be a peft adapter folder",
    "DoRA": r"uses DoRA",
    "a rank of its own": r"model.lora.r is 16 but the adapter in .* has 4: leave model.lora.r out",
}


def bad_folder(case, tiny_model, tmp_path):
    if case == "another base":
        return saved_adapter(other_base(tmp_path), tmp_path / "a")
    if case == "not a folder":
        return tmp_path / "nothing"
    folder = saved_adapter(tiny_model, tmp_path / "a")
    if case == "pickled weights":
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    changes = {"wrong rank": {"r": 8}, "targets the base lacks": {"target_modules": ["query"]},
               "fewer targets than tensors": {"target_modules": ["q_proj"]}, "DoRA": {"use_dora": True}}  # fmt: skip
    return edit_config(folder, **changes.get(case, {}))


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_an_adapter_folder_that_does_not_fit_is_one_line_before_any_step(case, tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    folder = bad_folder(case, tiny_model, tmp_path)
    data = config(tiny_model, tmp_path / "run")
    data["model"]["lora"] = {"path": str(folder)} | ({"r": 16} if case == "a rank of its own" else {})
    with pytest.raises(ConfigError, match=BAD_FOLDERS[case]) as e:
        build_run(load_config(data=data))
    assert "\n" not in str(e.value) and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_call_naming_adapters_answers_each_prompt_with_its_own(tiny_model, tmp_path):
    """Two named adapters over the hf engine, which holds one at a time: a call whose prompts name them in
    turn (a, b, a) is split by the engine session into a call for each adapter's prompts (each seeded as
    in the whole call, the adapter loaded first), and the answers come back in the prompts' order, each
    sampled by its own adapter (its logprobs are that adapter's policy's)."""
    from hybridrl import plugins
    from hybridrl.batch import Batch
    from hybridrl.components import RunContext, SamplingParams
    from hybridrl.config import RolloutConfig
    from hybridrl.models import load_tokenizer
    from hybridrl.session import EngineSession

    tok = load_tokenizer(tiny_model)
    ctx = RunContext(tiny_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path)
    cls = plugins.lookup("rollout engine", "hf")
    loads = []

    class Counted(cls):
        def update_adapter(self, adapter):
            loads.append(adapter.name)
            super().update_adapter(adapter)

    session = EngineSession(Counted(cls.Options(), ctx), RolloutConfig(engine="hf"), pad_id=tok.pad_token_id)
    session.adapters, policies = True, {}
    for seed, name in ((1, "a"), (2, "b")):
        policy = lora.apply_lora(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")), LoraOptions(**LORA))
        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        tensors = [(lora.saved_name(n), p.detach()) for n, p in policy.named_parameters() if lora.adapted_layer_of(n)]
        session.adapter, policies[name] = name, policy
        session.sync(lora.Adapter(lora.adapter_config(policy), tensors), update=False)
    prompts, names = [[5, 6, 7], [9, 10], [11, 12, 13, 14]], ["a", "b", "a"]
    sampling = SamplingParams(n=2, max_tokens=6, temperature=1.0, ignore_eos=True, seeds=[11, 22, 33])
    loads.clear()
    mixed = session.generate(prompts, sampling.model_copy(update={"adapters": names}))
    assert loads == ["a", "b"]  # each adapter loaded once, before its prompts (b was held last)
    for name, rows, seeds in (("a", [0, 2], [11, 33]), ("b", [1], [22])):
        alone = session.generate(
            [prompts[i] for i in rows], sampling.model_copy(update={"seeds": seeds, "adapters": [name] * len(rows)})
        )
        assert [mixed.token_ids[2 * i + j] for i in rows for j in (0, 1)] == alone.token_ids
        assert [mixed.logprobs[2 * i + j] for i in rows for j in (0, 1)] == alone.logprobs
        batch = Batch.from_rollout([prompts[i] for i in rows], alone, 2, tok.pad_token_id)
        with torch.no_grad():
            lp, _ = response_logprobs(policies[name], batch.input_ids, batch.attention_mask, 6)
        assert (lp - batch["rollout_logprobs"]).abs().max().item() < 1e-4  # sampled by this adapter
