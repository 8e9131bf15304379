"""verl's algorithm settings (adv_estimator, KL, clipping, losses, the critic, DAPO's options) as
hybridrl's ``algorithm`` section: the part of :class:`hybridrl.migrate.verl.VerlTranslation` that
reads them (docs/migrating.md, docs/algorithms.md)."""

from __future__ import annotations

import os

from hybridrl.migrate.common import Translator
from hybridrl.migrate.verl_keys import A, C

#: verl's adv_estimator -> hybridrl's grpo estimator (gae is ppo with a critic)
ESTIMATORS = {
    "grpo": "grpo",
    "grpo_vectorized": "grpo",
    "rloo": "rloo",
    "rloo_vectorized": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
}
#: verl's KL estimator names (kl_penalty, kl_loss_type) -> hybridrl's
KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


class VerlAlgorithm(Translator):
    """Reads verl's algorithm, actor-loss and critic settings; ``self.n`` and ``self.world`` are
    set by the subclass before :meth:`algorithm` runs, and ``self.out['rollout']`` exists."""

    def algorithm(self) -> None:
        g, src = self.src.get, self.src
        estimator = g("algorithm.adv_estimator")
        kl_in_reward = bool(g("algorithm.use_kl_in_reward"))
        if estimator == "gae":
            self.critic = True
            out = {
                "name": "ppo",
                "critic": True,
                "gamma": float(g("algorithm.gamma")),
                "lam": float(g("algorithm.lam")),
            }
            src.mark("algorithm.norm_adv_by_std_in_grpo")
        elif estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and kl_in_reward:
            self.critic = False  # ppo without critic is REINFORCE++ with the KL penalty in the rewards
            baseline = "group_mean" if estimator.endswith("baseline") else "none"
            out = {"name": "ppo", "critic": False, "baseline": baseline, "gamma": float(g("algorithm.gamma"))}
            src.mark("algorithm.lam", "algorithm.norm_adv_by_std_in_grpo")
        else:
            self.critic = False
            if estimator not in ESTIMATORS:
                self.lost(
                    "algorithm.adv_estimator",
                    "estimators: gae (ppo), grpo, rloo, reinforce_plus_plus(_baseline); grpo used",
                )
            out = {"name": "grpo", "estimator": ESTIMATORS.get(estimator, "grpo")}
            out["norm_adv_by_std"] = bool(g("algorithm.norm_adv_by_std_in_grpo"))
            out["gamma"] = float(g("algorithm.gamma"))
            src.mark("algorithm.lam")
            if kl_in_reward:
                self.lost(
                    "algorithm.use_kl_in_reward",
                    "grpo has no KL penalty in the rewards; its KL term is a loss (kl_coef)",
                )
        self.algo = out
        self.policy_loss(out)
        self.kl(out, kl_in_reward)
        self.correction(out)
        self.dapo(out)
        if self.critic:
            self.critic_options(out)
        else:
            self.skip("critic", "no critic in this run (algorithm.adv_estimator is not gae)")
        self.out["algorithm"] = out

    def policy_loss(self, out: dict) -> None:
        g = self.src.get
        clip = g(f"{A}.clip_ratio")
        low, high = g(f"{A}.clip_ratio_low"), g(f"{A}.clip_ratio_high")
        out["clip_low"] = float(clip if low is None else low)  # verl: clip_ratio where low/high are unset
        out["clip_high"] = float(clip if high is None else high)
        out["clip_c"] = float(g(f"{A}.clip_ratio_c"))
        out["entropy_coeff"] = float(g(f"{A}.entropy_coeff"))
        out["loss_agg_mode"] = g(f"{A}.loss_agg_mode")
        if g(f"{A}.loss_scale_factor"):
            out["loss_norm_length"] = int(g(f"{A}.loss_scale_factor"))
        mode = g(f"{A}.policy_loss.loss_mode")
        if mode == "gspo" and out["name"] == "grpo":
            out["policy_loss"] = "gspo"
        elif mode != "vanilla":
            self.lost(f"{A}.policy_loss.loss_mode", "policy losses: vanilla, and gspo with grpo; vanilla used")

    def kl(self, out: dict, kl_in_reward: bool) -> None:
        g = self.src.get
        use_loss, coef = bool(g(f"{A}.use_kl_loss")), float(g(f"{A}.kl_loss_coef"))
        kind = self.kl_name(f"{A}.kl_loss_type", loss=True) if use_loss else None
        if not use_loss:
            self.src.mark(f"{A}.kl_loss_coef", f"{A}.kl_loss_type")
        if out["name"] == "grpo":
            out["kl_coef"] = coef if use_loss else 0.0
            if kind:
                out["kl_kind"] = kind
        else:
            out["use_kl_loss"] = use_loss
            if use_loss:
                out |= {"kl_loss_coef": coef, "kl_loss_type": kind}
        if out["name"] == "ppo" and kl_in_reward:
            out["use_kl_in_reward"] = True
            out["kl_penalty"] = self.kl_name("algorithm.kl_penalty", loss=False)
            out["kl_ctrl"] = g("algorithm.kl_ctrl.type")
            out["kl_coef"] = float(g("algorithm.kl_ctrl.kl_coef"))
            out["kl_target"] = float(g("algorithm.kl_ctrl.target_kl"))
            out["kl_horizon"] = float(g("algorithm.kl_ctrl.horizon"))
        else:
            if out["name"] == "ppo":
                out["use_kl_in_reward"] = False
            self.skip("algorithm.kl_ctrl", "used only with algorithm.use_kl_in_reward")
            self.src.mark("algorithm.kl_penalty")

    def kl_name(self, key: str, loss: bool) -> str:
        """verl's estimator name as hybridrl's; a '+' (straight-through k2 gradient) is dropped."""
        name = str(self.src.get(key))
        ours = KL_NAMES.get(name.rstrip("+"))
        if ours is None:
            self.lost(key, "KL estimators: k1 (kl), abs, k2 (mse), k3 (low_var_kl); k3 used")
            return "k3"
        if name.endswith("+") and loss and ours != "k2":
            self.lost(key, f"the straight-through gradient of '{name}' is not available; k2 (its gradient) used")
            return "k2"
        if loss and ours in ("k1", "abs"):
            self.lost(key, "as a loss k1 and abs pull nowhere (docs/algorithms.md) and are refused; k3 used")
            return "k3"
        return ours

    def correction(self, out: dict) -> None:
        g = self.src.get
        prefix = "algorithm.rollout_correction"
        level = g(f"{prefix}.rollout_is")
        if level in ("token", "sequence"):
            out["rollout_correction"] = level
            out["rollout_correction_cap"] = float(g(f"{prefix}.rollout_is_threshold"))
        elif level:
            self.lost(f"{prefix}.rollout_is", "levels: token, sequence (and geometric)")
        else:
            self.src.mark(f"{prefix}.rollout_is_threshold")
        mask = g(f"{prefix}.rollout_rs")
        if mask in ("token", "sequence", "geometric"):
            high = g(f"{prefix}.rollout_rs_threshold") or 5.0
            low = g(f"{prefix}.rollout_rs_threshold_lower") or 1 / float(high)
            out |= {"rollout_mask": mask, "rollout_mask_high": float(high), "rollout_mask_low": float(low)}
        elif mask:
            self.lost(f"{prefix}.rollout_rs", "rejection levels: token, sequence, geometric")
        else:
            self.src.mark(f"{prefix}.rollout_rs_threshold", f"{prefix}.rollout_rs_threshold_lower")

    def dapo(self, out: dict) -> None:
        """DAPO's dynamic sampling (filter_groups) and soft overlong punishment: grpo options."""
        g = self.src.get
        buffer = "reward_model.overlong_buffer"
        if out["name"] != "grpo":
            for key in ("algorithm.filter_groups.enable", f"{buffer}.enable"):
                if g(key):
                    self.lost(key, "DAPO's dynamic sampling and overlong punishment are options of grpo")
            self.skip("algorithm.filter_groups", "used only with grpo")
            self.skip(buffer, "used only with grpo")
            return
        if g("algorithm.filter_groups.enable"):
            out["dynamic_sampling"] = True
            batches = int(g("algorithm.filter_groups.max_num_gen_batches"))
            if batches > 0:
                self.out.setdefault("rollout", {})["refill_rounds"] = batches - 1
            else:
                self.lost(
                    "algorithm.filter_groups.max_num_gen_batches",
                    "unlimited rounds are not available: set rollout.refill_rounds",
                )
        else:
            self.skip("algorithm.filter_groups", "algorithm.filter_groups.enable is false")
        if g(f"{buffer}.enable"):
            out["overlong_buffer_len"] = int(g(f"{buffer}.len"))
            out["overlong_penalty_factor"] = float(g(f"{buffer}.penalty_factor"))
            out["overlong_max_length"] = self.out["rollout"]["max_tokens"]
        else:
            self.skip(buffer, f"{buffer}.enable is false")

    def critic_options(self, out: dict) -> None:
        g, src = self.src.get, self.src
        out["critic_arch"] = "token_classification"  # verl's critic: AutoModelForTokenClassification
        if src.has(f"{C}.model.path"):
            out["critic_path"] = expand(g(f"{C}.model.path"))
        else:
            self.report.add("note", f"{C}.model.path", "not set: the critic starts from the policy's model")
        out["critic_lr"] = float(g(f"{C}.optim.lr"))
        out["critic_weight_decay"] = float(g(f"{C}.optim.weight_decay"))
        out["critic_max_grad_norm"] = float(g(f"{C}.grad_clip"))
        out["critic_epochs"] = int(g(f"{C}.ppo_epochs"))
        out["critic_mini_batch_size"] = int(g(f"{C}.ppo_mini_batch_size")) * self.n
        micro = self.micro(C)
        if isinstance(micro, int):
            out["critic_micro_batch_size"] = micro
        out["cliprange_value"] = float(g(f"{C}.cliprange_value"))
        out["critic_loss_agg_mode"] = g(f"{C}.loss_agg_mode")
        out["trust_remote_code"] = bool(g(f"{C}.model.trust_remote_code"))
        src.mark(f"{C}.enable", f"{C}.use_dynamic_bsz", f"{C}.ppo_micro_batch_size", f"{C}.optim.lr")

    def micro(self, role: str) -> int | str | None:
        """Responses per GPU per forward/backward of ``role`` (verl's actor or critic), or 'tokens'
        when verl sizes micro-batches by tokens (use_dynamic_bsz)."""
        g = self.src.get
        dynamic = g(f"{A}.use_dynamic_bsz") if role == A else g(f"{C}.use_dynamic_bsz", g(f"{A}.use_dynamic_bsz"))
        if dynamic:
            return "tokens"
        per_gpu = g(f"{role}.ppo_micro_batch_size_per_gpu", None)
        if per_gpu:
            return int(per_gpu)
        total = g(f"{role}.ppo_micro_batch_size", None)  # deprecated: over all GPUs
        return max(1, int(total) // self.world) if total else None


def expand(path):
    """``~`` and ``$VAR`` as verl's shell would have expanded them."""
    return os.path.expandvars(os.path.expanduser(path)) if isinstance(path, str) else path
