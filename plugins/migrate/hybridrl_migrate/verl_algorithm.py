"""verl's reward settings (the reward function, the reward model) and algorithm settings
(adv_estimator, KL, clipping, losses, the critic, DAPO's options) as hybridrl's ``rewards`` and
``algorithm`` sections: the part of :class:`hybridrl_migrate.verl.VerlTranslation` that reads them
(docs/migrating.md, docs/algorithms.md)."""

from __future__ import annotations

import os

from hybridrl_migrate.common import Translator
from hybridrl_migrate.verl_keys import A, C

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
#: the rule of verl's GSM8K scorer (verl/utils/reward_score/gsm8k.py, strict): the last '#### N'
GSM8K_PATTERN = r"#### (\-?[0-9\.\,]+)"


class VerlAlgorithm(Translator):
    """Reads verl's reward, algorithm, actor-loss and critic settings; ``self.n`` and ``self.world``
    are set by the subclass before :meth:`algorithm` runs, and ``self.out['rollout']`` and
    ``self.out['data']`` exist."""

    def rewards(self) -> None:
        g = self.src.get
        if g("reward_model.enable"):
            rm = {"function": "reward_model", "model": expand(g("reward_model.model.path"))}
            rm["trust_remote_code"] = bool(g("reward_model.model.trust_remote_code"))
            if g("reward_model.micro_batch_size_per_gpu"):
                rm["batch_size"] = int(g("reward_model.micro_batch_size_per_gpu"))
            if g("reward_model.max_length"):
                rm["max_length"] = int(g("reward_model.max_length"))
            self.out["rewards"] = [rm]
            self.report.add(
                "note",
                "reward_model.enable",
                "the reward model scores every response (hybridrl-reward-hf's reward_model, docs/rewards.md), as "
                "verl's reward manager uses its scores when it is on; it runs on the policy's device unless "
                "rewards[0].device says otherwise",
                True,
            )
            self.skip("custom_reward_function", "reward_model.enable replaces the reward function")
        else:
            self.skip("reward_model.model", "reward_model.enable is false")
            self.src.mark("reward_model.micro_batch_size_per_gpu", "reward_model.max_length")
            self.out["rewards"] = [self.reward_function()]
        self.src.mark("reward_model.enable")
        manager = g("reward_model.reward_manager")
        if manager not in ("naive", "dapo"):
            self.lost("reward_model.reward_manager", "rewards are scored response by response, summed with weights")

    def reward_function(self) -> dict:
        g = self.src.get
        path = g("custom_reward_function.path")
        if path:
            reward = {"function": "python", "path": expand(path), "function_name": g("custom_reward_function.name")}
            if g("custom_reward_function.reward_kwargs"):
                reward["kwargs"] = dict(g("custom_reward_function.reward_kwargs"))
            self.report.add(
                "note",
                "custom_reward_function.path",
                "your compute_score runs as it is: the python reward (docs/rewards.md) calls it with data_source, "
                "solution_str, ground_truth and extra_info from each row",
                path,
            )
            return reward
        self.src.mark("custom_reward_function")
        files = str(self.out["data"].get("data_files") or self.out["data"].get("path"))
        if "gsm8k" in files.lower():
            self.report.add(
                "note",
                "custom_reward_function.path",
                "unset: verl scores GSM8K rows with its rule (the last '#### N' equals the answer); answer_match "
                "with that pattern is the same rule, comparing numbers where verl compares text (verl's exact rule: "
                "examples/verl_gsm8k_reward.py with function: python)",
                None,
            )
            return {"function": "answer_match", "extract": "regex", "pattern": GSM8K_PATTERN, "compare": "numeric"}
        self.report.add(
            "lost",
            "custom_reward_function.path",
            "unset: verl picks a scorer by each row's data_source (default_compute_score); answer_match (boxed, "
            "tag, 'answer is', last number) is used. To score as verl does, give a file that imports verl's "
            "default_compute_score as compute_score to the python reward",
            None,
        )
        return {"function": "answer_match"}

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
            self.gspo_aggregation(out)
        elif mode != "vanilla":
            self.lost(f"{A}.policy_loss.loss_mode", "policy losses: vanilla, and gspo with grpo; vanilla used")

    def gspo_aggregation(self, out: dict) -> None:
        """verl's GSPO loss is a mean per sequence, then over sequences, whatever loss_agg_mode says
        (compute_policy_loss_gspo, verl/trainer/ppo/core_algos.py); its actor aggregates the entropy and
        KL terms with loss_agg_mode (DataParallelPPOActor.update_policy, verl/workers/actor/dp_actor.py)."""
        given = out["loss_agg_mode"]
        out["loss_agg_mode"] = "seq-mean-token-mean"
        if given == "seq-mean-token-mean":
            return
        self.report.add(
            "note",
            f"{A}.loss_agg_mode",
            "with policy_loss.loss_mode gspo verl aggregates the policy loss per sequence (seq-mean-token-mean) "
            "whatever loss_agg_mode says (compute_policy_loss_gspo): loss_agg_mode seq-mean-token-mean",
            given,
        )
        if out["entropy_coeff"] or self.src.get(f"{A}.use_kl_loss"):
            self.report.add(
                "lost",
                f"{A}.loss_agg_mode",
                f"verl aggregates the entropy and KL terms with {given}; here every term uses seq-mean-token-mean",
                given,
            )

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
        # the overlong punishment of DAPO's recipe (reward_model.overlong_buffer), or of verl's dapo reward
        # manager (reward_kwargs.overlong_buffer_cfg and max_resp_len, verl/workers/reward_manager/dapo.py)
        buffer, kwargs = "reward_model.overlong_buffer", "reward_model.reward_kwargs"
        cfg = g(f"{kwargs}.overlong_buffer_cfg", None) if g("reward_model.reward_manager") == "dapo" else None
        by_manager = isinstance(cfg, dict) and bool(cfg.get("enable"))
        if by_manager:
            self.src.mark(f"{kwargs}.overlong_buffer_cfg", f"{kwargs}.max_resp_len")
        if out["name"] != "grpo":
            for key in ("algorithm.filter_groups.enable", f"{buffer}.enable", f"{kwargs}.overlong_buffer_cfg.enable"):
                if g(key, None):
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
            return
        self.skip(buffer, f"{buffer}.enable is false")
        if by_manager:
            out["overlong_buffer_len"] = int(cfg["len"])
            out["overlong_penalty_factor"] = float(cfg.get("penalty_factor", 1.0))
            out["overlong_max_length"] = int(g(f"{kwargs}.max_resp_len", self.out["rollout"]["max_tokens"]))

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
