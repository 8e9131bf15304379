"""The PPO algorithm: its loss terms, KL control state, critic-free advantages, and the critic."""

import dataclasses
import math

import pytest
import torch
from hybridrl_algo_ppo import PPO

from hybridrl.batch import Batch
from hybridrl.builtin.sharding_single import SingleDevice
from hybridrl.components import RunContext
from hybridrl.config import ConfigError, load_config
from hybridrl.forward import padded_values
from hybridrl.models import load_tokenizer


def make_ppo(ctx=None, **options):
    return PPO(PPO.Options(**options), ctx)


@pytest.fixture(scope="module")
def ctx(tiny_model, tmp_path_factory):
    c = RunContext(
        model_path=tiny_model,
        tokenizer=load_tokenizer(tiny_model),
        device=torch.device("cpu"),
        dtype=torch.float32,
        seed=0,
        run_dir=tmp_path_factory.mktemp("run"),
    )
    return dataclasses.replace(c, strategy=SingleDevice(SingleDevice.Options(), c))


def token_batch(B=4, P=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = Batch()
    b["prompts"] = torch.randint(3, 60, (B, P), generator=g)
    b["prompt_mask"] = torch.ones(B, P, dtype=torch.long)
    b["responses"] = torch.randint(3, 60, (B, T), generator=g)
    b["response_mask"] = torch.tensor([[1] * (T - i % 3) + [0] * (i % 3) for i in range(B)])
    b["scores"] = torch.rand(B, generator=g)
    b["group_ids"] = torch.arange(B) // 2
    return b


# -- loss ------------------------------------------------------------------------------------


def test_loss_adds_entropy_bonus_and_kl_loss():
    algo = make_ppo(critic=False, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k2")
    assert algo.needs_reference and algo.needs_entropy_grad and not algo.needs_old_logprobs
    b = Batch()
    b["response_mask"] = torch.tensor([[1, 1, 0]])
    b["old_logprobs"] = torch.zeros(1, 3)
    b["advantages"] = torch.tensor([[2.0, 2.0, 0.0]])
    b["ref_logprobs"] = torch.tensor([[-1.0, 0.0, 0.0]])
    loss, m = algo.loss(b, torch.zeros(1, 3), torch.tensor([[1.0, 3.0, 50.0]]))
    # pg: -A * 1 = -2 per token; entropy mean 2; k2 = 0.5 (0 - (-1))^2 = 0.5 and 0 -> mean 0.25
    assert m["actor/pg_loss"] == pytest.approx(-2.0)
    assert m["actor/entropy_loss"] == pytest.approx(2.0)
    assert m["actor/kl_loss"] == pytest.approx(0.25)
    assert loss.item() == pytest.approx(-2.0 - 0.01 * 2.0 + 0.5 * 0.25)


def test_dual_clip_bounds_negative_advantage_loss():
    algo = make_ppo(critic=False, clip_c=3.0)
    b = Batch()
    b["response_mask"] = torch.ones(1, 1)
    b["old_logprobs"] = torch.zeros(1, 1)
    b["advantages"] = torch.tensor([[-1.0]])
    loss, m = algo.loss(b, torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1))
    assert loss.item() == pytest.approx(3.0)  # -A * min(r = 5, clip_c = 3)
    assert m["actor/clipfrac_lower"] == 1.0


def test_reference_only_when_a_kl_term_needs_it():
    assert not make_ppo(critic=False).needs_reference
    assert not make_ppo(critic=False, use_kl_loss=True, kl_loss_coef=0.0).needs_reference
    in_reward = make_ppo(critic=False, use_kl_in_reward=True)
    assert in_reward.needs_reference and in_reward.needs_old_logprobs


# -- KL in the reward and its controller state -----------------------------------------------


def kl_batch():
    b = Batch()
    b["response_mask"] = torch.ones(2, 2)
    b["scores"] = torch.tensor([1.0, 0.0])
    b["group_ids"] = torch.tensor([0, 1])
    b["old_logprobs"] = torch.zeros(2, 2)
    b["ref_logprobs"] = torch.full((2, 2), -0.5)  # k1 = 0.5 per token
    return b


def test_adaptive_kl_controller_moves_beta_and_is_checkpointed():
    algo = make_ppo(critic=False, use_kl_in_reward=True, kl_ctrl="adaptive", kl_coef=0.2, kl_target=0.1, kl_horizon=10)
    m = algo.compute_advantages(kl_batch())
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert m["actor/reward_kl_penalty_coeff"] == pytest.approx(0.2)  # the beta used for this step
    # KL 0.5 > target 0.1: error clipped to 0.2; 2 responses over a horizon of 10
    assert algo.kl_coef == pytest.approx(0.2 * (1 + 0.2 * 2 / 10))
    state = algo.state_dict()
    fresh = make_ppo(critic=False, use_kl_in_reward=True, kl_ctrl="adaptive", kl_coef=0.2)
    fresh.load_state_dict(state)
    assert fresh.kl_coef == algo.kl_coef


def test_fixed_kl_controller_keeps_beta():
    algo = make_ppo(critic=False, use_kl_in_reward=True, kl_coef=0.2)
    algo.compute_advantages(kl_batch())
    assert algo.kl_coef == 0.2


# -- without a critic --------------------------------------------------------------------------


def test_critic_free_group_mean_baseline_is_reinforce_pp_baseline():
    algo = make_ppo(critic=False, baseline="group_mean")
    b = Batch()
    b["response_mask"] = torch.tensor([[1, 1], [1, 0], [1, 1]])
    b["scores"] = torch.tensor([1.0, 0.0, 3.0])
    b["group_ids"] = torch.tensor([0, 0, 1])  # the last response is alone: baseline 0
    algo.compute_advantages(b)
    # s - group mean at the last token, gamma 1: returns [0.5, 0.5], [-0.5, -], [3, 3]; whitened
    # over the batch, as verl's REINFORCE++-baseline
    assert b["returns"].tolist() == [[0.5, 0.5], [-0.5, 0.0], [3.0, 3.0]]
    xs = [0.5, 0.5, -0.5, 3.0, 3.0]
    mean, var = sum(xs) / 5, sum((x - 1.3) ** 2 for x in xs) / 4
    w = [(x - mean) / math.sqrt(var + 1e-8) for x in xs]
    expected = torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], w[4]]])
    torch.testing.assert_close(b["advantages"], expected)
    assert algo.critic is None and algo.trained_models() == []


def test_critic_free_reinforce_pp_returns_are_discounted():
    algo = make_ppo(critic=False, gamma=0.5)
    b = Batch()
    b["response_mask"] = torch.tensor([[1, 1, 1], [1, 1, 0]])
    b["scores"] = torch.tensor([4.0, 2.0])
    b["group_ids"] = torch.tensor([0, 1])
    algo.compute_advantages(b)
    assert b["returns"].tolist() == [[1.0, 2.0, 4.0], [1.0, 2.0, 0.0]]


def test_baseline_with_critic_is_a_config_error():
    cfg = {
        "model": {"path": "unused"},
        "data": {"source": "reasoning_gym", "task": "chain_sum"},
        "rewards": [{"function": "answer_match"}],
        "algorithm": {"name": "ppo", "baseline": "group_mean"},
    }
    with pytest.raises(ConfigError, match="algorithm.baseline: .*set critic: false"):
        load_config(data=cfg)


# -- the critic ------------------------------------------------------------------------------


def train_critic(algo, batch):
    """The critic's update as the trainer runs it (hybridrl.update.run_update)."""
    from hybridrl.update import run_update

    (critic,) = algo.trained_models()
    return run_update(critic, batch, 1, algo.ctx.strategy)


@pytest.mark.parametrize("arch", ["value_head", "token_classification"])
def test_critic_value_of_token_t_does_not_see_token_t(ctx, arch):
    algo = make_ppo(ctx, critic_arch=arch)
    b = token_batch()
    T = b["responses"].shape[1]
    with torch.no_grad():
        torch.nn.init.normal_((algo.critic.head or algo.critic.backbone.score).weight)  # non-zero values
        before = padded_values(algo.critic, b.input_ids, b.attention_mask, T)
        b["responses"][:, 2] = (b["responses"][:, 2] + 1) % 60 + 3
        after = padded_values(algo.critic, b.input_ids, b.attention_mask, T)
    assert before.shape == (4, T)
    torch.testing.assert_close(after[:, :3], before[:, :3])  # V(s_t) reads tokens before t only
    assert (after[:, 3] - before[:, 3]).abs().max() > 1e-6


def test_value_head_starts_at_zero_so_explained_variance_starts_at_zero(ctx):
    algo = make_ppo(ctx)
    b = token_batch()
    m = algo.compute_advantages(b)
    assert b["values"].abs().max().item() == 0.0
    assert abs(m["critic/explained_var"]) < 0.01  # 1 - Var(R) / (Var(R) + 1e-5)


def test_critic_micro_batches_accumulate_the_full_gradient(ctx):
    grad_norms = []
    for micro in (None, 1):
        algo = make_ppo(ctx, critic_micro_batch_size=micro, critic_lr=1e-3)
        b = token_batch()
        algo.compute_advantages(b)
        grad_norms.append(train_critic(algo, b)["critic/grad_norm"])
    assert grad_norms[0] > 0 and grad_norms[1] == pytest.approx(grad_norms[0], rel=1e-4)


def test_critic_state_round_trip(ctx):
    algo = make_ppo(ctx, critic_lr=1e-2)
    b = token_batch()
    algo.compute_advantages(b)
    metrics = train_critic(algo, b)
    assert {"critic/value_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"} <= metrics.keys()
    restored = make_ppo(ctx, critic_lr=1e-2)
    restored.load_state_dict(algo.state_dict())
    with torch.no_grad():
        T = b["responses"].shape[1]
        torch.testing.assert_close(
            padded_values(restored.critic, b.input_ids, b.attention_mask, T),
            padded_values(algo.critic, b.input_ids, b.attention_mask, T),
        )
    assert restored.critic_optimizer.state_dict()["state"].keys() == algo.critic_optimizer.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="no critic state"):
        restored.load_state_dict({"kl_coef": 0.001})


def test_critic_with_a_smaller_vocabulary_is_refused(ctx, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="vocabulary of 10 tokens, fewer than the policy tokenizer's"):
        make_ppo(ctx, critic_path=str(tmp_path / "small"))


def package(root, name: str, model=None) -> str:
    """``package:NAME``: an installed package (on sys.path) holding ``model``'s files, or a GGUF file alone."""
    import shutil

    folder = root / name
    if model is None:
        folder.mkdir()
        (folder / "m.gguf").write_bytes(b"")
    else:
        shutil.copytree(model, folder)
    (folder / "__init__.py").write_text("")
    return f"package:{name}"


def test_critic_path_is_checked_before_any_model_loads(tiny_model, tmp_path, monkeypatch, capsys):
    """As model.path is, by hybridrl validate and train, one error line; a package of GGUF files alone is
    refused (the critic loads Hugging Face folders only; model.path's GGUF file starts it from the policy)."""
    import yaml

    import hybridrl.run
    from hybridrl import cli

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "run.yaml"

    def one_error(command, critic_path):
        config.write_text(yaml.safe_dump({
            "model": {"path": tiny_model},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
            "rewards": [{"function": "reasoning_gym"}],
            "algorithm": {"name": "ppo", "critic_path": critic_path},
            "trainer": {"device": "cpu", "run_dir": str(tmp_path / "run")},
        }))  # fmt: skip
        assert cli.main([command, str(config)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: algorithm.critic_path ") and err.count("\n") == 1, err
        return err

    gguf = package(tmp_path, "hybridrl_test_gguf_critic")
    for command in ("validate", "train"):
        assert f"'{gguf}' holds GGUF files only (m.gguf)" in one_error(command, gguf)
    assert "'package:hybridrl_test_gguf_critc': package 'hybridrl_test_gguf_critc' is not installed. Did you mean " \
        "'package:hybridrl_test_gguf_critic'?" in one_error("validate", "package:hybridrl_test_gguf_critc")  # fmt: skip
    assert f"'{tmp_path / 'nowhere'}' does not exist" in one_error("train", str(tmp_path / "nowhere"))


def test_a_critic_from_a_package_loads_from_its_folder(ctx, tiny_model, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    algo = make_ppo(ctx, critic_path=package(tmp_path, "hybridrl_test_critic", tiny_model))
    assert algo.critic is not None


def test_critic_dropout_is_off_like_the_policys(ctx, tmp_path):
    """A GPT-2 critic has dropout 0.1 in three places; with model.dropout false (the default) its
    values in train mode (the update) equal those in eval mode (the values pass)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128)).save_pretrained(tmp_path / "gpt2")
    algo = make_ppo(ctx, critic_path=str(tmp_path / "gpt2"))
    b = token_batch()
    T = b["responses"].shape[1]
    with torch.no_grad():
        torch.nn.init.normal_(algo.critic.head.weight)
        train = padded_values(algo.critic.train(), b.input_ids, b.attention_mask, T)
        evaluated = padded_values(algo.critic.eval(), b.input_ids, b.attention_mask, T)
    torch.testing.assert_close(train, evaluated)


def test_nonfinite_value_loss_follows_on_nonfinite(tiny_model, tmp_path, monkeypatch):
    """A NaN value loss goes through trainer.on_nonfinite like the policy's: abort names the critic,
    skip leaves the critic as it was and counts the skipped step."""
    import hybridrl_algo_ppo.functional as PF

    from hybridrl.errors import NonFiniteError
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    real = PF.value_loss
    monkeypatch.setattr(PF, "value_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), torch.tensor(0.0)))
    data = {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
        "rollout": {"n": 4, "max_tokens": 8},
        "rewards": [{"function": "format", "pattern": "7"}],
        "algorithm": {"name": "ppo"},
        "trainer": {"steps": 1, "prompts_per_step": 2, "run_dir": str(tmp_path / "abort")},
        "logging": {"loggers": []},
    }
    with pytest.raises(NonFiniteError, match=r"step 1: the loss of the critic \(algorithm 'ppo'\) is nan"):
        Trainer(build_run(load_config(data=data))).train()
    data["trainer"] |= {"on_nonfinite": "skip", "run_dir": str(tmp_path / "skip")}
    trainer = Trainer(build_run(load_config(data=data)))
    metrics = trainer.train()
    assert metrics["critic/skipped_updates"] == 1.0
    assert all(torch.isfinite(p).all() for p in trainer.run.algorithm.critic.parameters())


def ragged_batch():
    """Left-padded prompts of 6, 2, 4, 1, 3, 5 tokens and right-padded responses of 8, 1, 3, 2, 1,
    6 tokens: packed rows of 16 hold them in fewer tokens than the padded 6 x 14."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [6, 2, 4, 1, 3, 5], [8, 1, 3, 2, 1, 6]
    b = Batch()
    b["prompt_mask"] = torch.tensor([[0] * (6 - p) + [1] * p for p in prompts])
    b["prompts"] = torch.randint(3, 60, (6, 6), generator=g) * b["prompt_mask"]
    b["response_mask"] = torch.tensor([[1] * r + [0] * (8 - r) for r in responses])
    b["responses"] = torch.randint(3, 60, (6, 8), generator=g) * b["response_mask"]
    b["scores"] = torch.rand(6, generator=g)
    b["group_ids"] = torch.arange(6) // 2
    return b


@pytest.mark.parametrize("arch", ["value_head", "token_classification"])
def test_packed_critic_passes_give_the_padded_values_and_gradients(ctx, arch, monkeypatch):
    """The critic's values pass and its value-loss pass run packed like the policy's (the trainer's
    pass runner, trainer.pack_sequences): the padded passes' values and gradients from fewer tokens."""
    import dataclasses

    from hybridrl_testing import embedded_tokens

    from hybridrl import packing
    from hybridrl.passes import PACKED, PADDED, Planner, Runner

    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 4)
    algo = make_ppo(ctx, critic_arch=arch)
    with torch.no_grad():
        torch.nn.init.normal_((algo.critic.head or algo.critic.backbone.score).weight)  # values that vary
    b = ragged_batch()
    algo.compute_advantages(b)  # values and returns, padded (no runner in this context)
    mask = b["response_mask"].bool()
    runs = {}
    for pack in (False, True):
        runner = Runner(Planner(pack_sequences=pack), ctx.strategy, ctx.device)
        algo.ctx = dataclasses.replace(ctx, passes=runner)
        runner.handle(algo.critic, values=True).can_pack()  # its probe, before the tokens are counted
        values, tokens = embedded_tokens(algo.critic.backbone, lambda: algo._values(b))  # noqa: B023
        (part,) = runner.parts(algo.critic, b)
        assert part.planned.layout == (PACKED if pack else PADDED)
        algo.critic.zero_grad()
        loss, _ = algo.value_loss(part)
        loss.backward()
        runs[pack] = values, tokens, loss.detach(), {n: p.grad.clone() for n, p in algo.critic.named_parameters()}
    (want, padded, want_loss, want_grad), (got, packed, got_loss, grad) = runs[False], runs[True]
    assert packed < padded == 6 * 14
    scale = want[mask].abs().max()  # float32 rounding, relative to the values' size
    assert want[mask].std() > 0.01 and (got[mask] - want[mask]).abs().max() <= 1e-5 * scale
    assert (got_loss - want_loss).abs() <= 1e-6 * want_loss.abs()
    for n in want_grad:
        assert (grad[n] - want_grad[n]).abs().max() <= 1e-5 * want_grad[n].abs().max().clamp(min=1e-12), n
