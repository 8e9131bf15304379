"""PPO for hybridrl: a critic trained with the clipped value loss, GAE, KL control.

The KL to the reference policy is either a penalty in the token rewards (fixed or adaptive
coefficient) or a loss term, or both. With ``critic: false`` there is no value model and
the advantages are REINFORCE++'s (whitened token returns), optionally with a group-mean
baseline. docs/algorithms.md gives every option's formula.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from hybridrl import distributed
from hybridrl import functional as F
from hybridrl.components import Algorithm, Trainable
from hybridrl.hookspecs import hookimpl
from hybridrl.models import disable_dropout, resolve_model_path
from hybridrl.objective import PolicyLossOptions, PolicyObjective
from hybridrl.options import MODEL_PATH
from hybridrl.passes import runner_of
from hybridrl_algo_ppo import functional as PF
from hybridrl_algo_ppo.critic import load_value_model

KL_KIND = Literal["k1", "abs", "k2", "k3"]
CRITIC = "critic (algorithm 'ppo')"  # how messages name it
CRITIC_PATH = "algorithm.critic_path"


class PPO(Algorithm):
    class Options(PolicyLossOptions):
        # -- policy loss (and clip_c, entropy_coeff, loss_norm_length: PolicyLossOptions)
        clip_low: float = Field(0.2, ge=0, description="Ratio clip below: 1 - clip_low.")
        clip_high: float = Field(0.2, ge=0, description="Ratio clip above: 1 + clip_high.")
        loss_agg_mode: Literal[F.AGG_MODES] = Field("token-mean", description="Token aggregation of the policy loss.")
        # -- advantages
        gamma: float = Field(1.0, ge=0, le=1, description="Discount of GAE (and of the returns without critic).")
        lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
        # -- KL in the reward
        use_kl_in_reward: bool = Field(
            False, description="Subtract beta x KL(old || ref) from each token's reward (loads a reference)."
        )
        kl_penalty: KL_KIND = Field("k1", description="KL estimator of the reward penalty.")
        kl_ctrl: Literal["fixed", "adaptive"] = Field("fixed", description="Reward KL coefficient controller.")
        kl_coef: float = Field(0.001, ge=0, description="Reward KL coefficient beta (its start value if adaptive).")
        kl_target: float = Field(0.1, gt=0, description="adaptive: the KL per token to steer towards.")
        kl_horizon: float = Field(10000, gt=0, description="adaptive: responses over which beta adapts.")
        # -- KL as a loss term
        use_kl_loss: bool = Field(
            False, description="Add kl_loss_coef x KL(policy || ref) to the loss (loads a reference)."
        )
        kl_loss_coef: float = Field(0.001, ge=0, description="Coefficient of the KL loss.")
        kl_loss_type: KL_KIND = Field(
            "k3",
            description="KL estimator of the KL loss: k3 (verl's low_var_kl) or k2; k1 and abs are refused "
            "(their on-policy gradient does not pull towards the reference; docs/algorithms.md).",
        )
        # -- critic
        critic: bool = Field(True, description="Train a value model; false: REINFORCE++ advantages, no critic.")
        critic_path: str | None = Field(
            None,
            description="Hugging Face model folder (or 'package:NAME', a folder in an installed package) to "
            "initialise the critic from, checked before any model loads; no GGUF file. Default: the policy's model "
            "(model.path, GGUF included).",
            json_schema_extra=MODEL_PATH,
        )
        critic_arch: Literal["value_head", "token_classification"] = Field(
            "value_head",
            description="value_head: backbone + new Linear(hidden, 1); token_classification: "
            "AutoModelForTokenClassification with one label (verl's critic).",
        )
        critic_lr: float = Field(1e-5, gt=0, description="Critic AdamW learning rate.")
        critic_weight_decay: float = Field(0.0, ge=0, description="Critic AdamW weight decay.")
        critic_epochs: int = Field(1, gt=0, description="Passes of the critic over each step's responses.")
        critic_mini_batch_size: int | None = Field(
            None, gt=0, description="Responses per critic optimizer step; default: all responses of the step."
        )
        critic_micro_batch_size: int | None = Field(
            None,
            gt=0,
            description="Responses per critic forward/backward (gradient accumulation); default: the trainer's "
            "micro-batches (trainer.micro_batch_size or trainer.micro_batch_tokens).",
        )
        critic_max_grad_norm: float = Field(1.0, gt=0, description="Critic gradient clipping (total norm).")
        cliprange_value: float = Field(0.5, gt=0, description="Clip of the new values around the old ones.")
        critic_loss_agg_mode: Literal[F.AGG_MODES] = Field(
            "token-mean", description="Token aggregation of the value loss."
        )
        trust_remote_code: bool = Field(False, description="Let transformers run code shipped with the critic model.")
        # -- without critic
        baseline: Literal["none", "group_mean"] = Field(
            "none",
            description="critic false: none = REINFORCE++; group_mean = REINFORCE++-baseline "
            "(the mean score of the prompt's responses is subtracted).",
        )

        @field_validator("kl_loss_type")
        @classmethod
        def _kl_loss_kind(cls, v: str) -> str:
            return F.check_kl_loss_kind(v)

        @field_validator("baseline")
        @classmethod
        def _baseline_without_critic(cls, v: str, info: ValidationInfo) -> str:
            if v != "none" and info.data.get("critic", True):
                raise ValueError("a baseline replaces the critic: set critic: false, or baseline: none")
            return v

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        o = options
        self.loss_aggregation = o.aggregation(o.loss_agg_mode, ctx)
        self.value_aggregation = o.aggregation(o.critic_loss_agg_mode, ctx)
        self.objective = PolicyObjective.from_options(
            o,
            self.loss_aggregation,
            clip_low=o.clip_low,
            clip_high=o.clip_high,
            kl_coef=o.kl_loss_coef if o.use_kl_loss else 0.0,
            kl_kind=o.kl_loss_type,
            kl_metric="actor/kl_loss",
        )
        self.kl_coef = options.kl_coef
        self.critic = self.critic_optimizer = None
        world = ctx.world_size if ctx is not None else 1
        if options.critic_mini_batch_size and options.critic_mini_batch_size % world:
            raise ValueError(
                f"algorithm 'ppo': critic_mini_batch_size={options.critic_mini_batch_size} is over all {world} "
                f"processes and must divide by {world}; set it to a multiple of {world}."
            )
        if options.critic and ctx is not None:
            self._build_critic()

    def _build_critic(self) -> None:
        o, ctx = self.options, self.ctx
        path = resolve_model_path(o.critic_path, key=CRITIC_PATH, gguf_key=None) if o.critic_path else ctx.model_path
        model = load_value_model(path, o.critic_arch, ctx.dtype, len(ctx.tokenizer), o.trust_remote_code)
        if not ctx.dropout:  # as the policy's: dropout makes the update's values differ from the old ones
            disable_dropout(model)
        self.critic = ctx.strategy.wrap(model.train(), trainable=True)
        runner_of(ctx).handle(self.critic, values=True)  # its passes pack like the policy's, never share prompts
        self.critic_optimizer = torch.optim.AdamW(
            [p for p in self.critic.parameters() if p.requires_grad], lr=o.critic_lr, weight_decay=o.critic_weight_decay
        )

    # -- what the trainer must provide --------------------------------------------------------

    @property
    def needs_reference(self) -> bool:
        return self.options.use_kl_in_reward or self.objective.needs_reference

    @property
    def needs_old_logprobs(self) -> bool:
        return self.options.use_kl_in_reward  # the reward penalty uses KL(old || ref)

    @property
    def needs_entropy_grad(self) -> bool:
        return self.objective.needs_entropy_grad

    # -- advantages -----------------------------------------------------------------------

    def compute_advantages(self, batch):
        o = self.options
        mask = batch["response_mask"].float()
        scores = batch["scores"].to(mask.device).float()
        # under torchrun: statistics over every rank's batch, so that ranks agree (and match one process)
        mean_var = distributed.masked_mean_var if distributed.world_size() > 1 else None
        metrics = {}
        if o.use_kl_in_reward:
            beta = self.kl_coef
            rewards, row_kl = PF.kl_penalized_rewards(
                scores, batch["old_logprobs"], batch["ref_logprobs"], mask, beta, o.kl_penalty
            )
            real = ~batch["padding_row"].bool() if "padding_row" in batch else torch.ones_like(row_kl, dtype=torch.bool)
            kl_sum, responses = distributed.all_reduce([row_kl[real].sum().item(), float(real.sum())])
            current_kl = kl_sum / max(responses, 1.0)
            if o.kl_ctrl == "adaptive":
                self.kl_coef = PF.adaptive_kl_coef(beta, current_kl, o.kl_target, o.kl_horizon, int(responses))
            metrics |= {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
        else:
            rewards = F.outcome_token_rewards(scores, mask)
        if self.critic is not None:
            values = self._values(batch) * mask
            advantages, returns = PF.gae(rewards, values, mask, o.gamma, o.lam, mean_var)
            batch["values"], batch["returns"] = values, returns
            metrics |= {
                "critic/explained_var": PF.explained_variance(values, returns, mask, mean_var),
                "critic/values_mean": F.masked_mean(values, mask).item(),
                "critic/returns_mean": F.masked_mean(returns, mask).item(),
            }
        else:
            if o.baseline == "group_mean":
                mean, _, _ = F.group_stats(scores, batch["group_ids"].to(mask.device), F.counted_rows(batch))
                rewards = rewards - F.outcome_token_rewards(mean, mask)
            returns = F.discounted_returns(rewards, mask, o.gamma)
            advantages = F.whiten_advantages(returns, mask, mean_var)
            batch["returns"] = returns
        batch["advantages"] = advantages
        return metrics

    @torch.no_grad()
    def _values(self, batch) -> torch.Tensor:
        """The critic's values (B, T) of the batch, in the passes the trainer's runner plans."""
        self.critic.eval()
        values = runner_of(self.ctx).values(self.critic, batch, CRITIC, size=self.options.critic_micro_batch_size)
        self.critic.train()
        return values

    # -- policy loss ----------------------------------------------------------------------

    def loss(self, batch, logprobs, entropy):
        """The shared policy objective (:mod:`hybridrl.objective`), its KL term logged as ``actor/kl_loss``."""
        return self.objective(batch, logprobs, entropy)

    # -- critic update --------------------------------------------------------------------

    def trained_models(self) -> list[Trainable]:
        """The critic, trained by the trainer's update loop after the policy, on the same batch."""
        if self.critic is None:
            return []
        o = self.options
        return [
            Trainable(
                name="critic",
                label=CRITIC,
                model=self.critic,
                optimizer=self.critic_optimizer,
                loss=self.value_loss,
                aggregation=self.value_aggregation,
                epochs=o.critic_epochs,
                mini_batch_size=o.critic_mini_batch_size,
                micro_batch_size=o.critic_micro_batch_size,
                max_grad_norm=o.critic_max_grad_norm,
            )
        ]

    def value_loss(self, part):
        """The clipped value loss of a micro-batch (the rows of a planned pass) and its metrics."""
        mask = part["response_mask"]
        vpreds = runner_of(self.ctx).pass_values(self.critic, part, CRITIC)
        loss, clipfrac = PF.value_loss(
            vpreds, part["returns"], part["values"], mask, self.options.cliprange_value, self.value_aggregation
        )
        metrics = {
            "critic/value_loss": loss.detach(),
            "critic/vf_clipfrac": clipfrac.detach(),
            "critic/vpred_mean": F.masked_mean(vpreds.detach(), mask),
        }
        return loss, metrics

    # -- checkpoint state -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """The reward-KL coefficient (adaptive controller), and the critic with its optimizer."""
        state = {"kl_coef": self.kl_coef}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.kl_coef = float(state["kl_coef"])
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError(
                    "algorithm 'ppo': the checkpoint has no critic state (it was saved with critic: false); "
                    "resume with critic: false or start a new run."
                )
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])


@hookimpl
def register_algorithms(register):
    register("ppo", PPO)
