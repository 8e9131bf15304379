"""TRL's reward functions and loss settings (reward_funcs, beta, epsilon, loss_type,
scale_rewards, vLLM importance sampling) as hybridrl's ``rewards`` and ``algorithm`` sections: the
part of :class:`hybridrl_migrate.trl.TrlTranslation` that reads them (docs/migrating.md,
docs/algorithms.md)."""

from __future__ import annotations

from typing import Any

from hybridrl.errors import ConfigError
from hybridrl_migrate.common import Translator

#: loss_type -> loss_agg_mode (docs/algorithms.md, loss aggregation)
LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
#: vllm_importance_sampling_mode -> (option, level)
IS_MODES = {
    "token_truncate": ("rollout_correction", "token"),
    "sequence_truncate": ("rollout_correction", "sequence"),
    "token_mask": ("rollout_mask", "token"),
    "sequence_mask": ("rollout_mask", "sequence"),
}
#: trl.rewards' think_format_reward: the response opens with one <think>...</think> block
THINK_FORMAT = r"^<think>(?!.*<think>)(.*?)</think>.*$"
#: the placeholder reward file where TRL's settings name none (GRPOTrainer's reward_funcs)
REWARD_FILE = "REWARD_FILE.py"


class TrlAlgorithm(Translator):
    """Reads TRL's rewards and loss settings; the subclass sets ``self.n``, ``self.per_step``,
    ``self.iterations`` and the data section before :meth:`rewards` runs."""

    def rewards(self) -> None:
        g = self.src.get
        funcs = g("reward_funcs") or []
        funcs = [funcs] if isinstance(funcs, str) else list(funcs)
        entries = []  # TRL's reward functions in order, None where one becomes an algorithm option
        if g("reward_model_name_or_path"):  # the trl grpo script puts the reward model first
            entries.append({"function": "reward_model", "model": g("reward_model_name_or_path")})
        entries += [self.reward(f) for f in funcs]
        weights = g("reward_weights")
        if weights:
            if len(weights) != len(entries):
                raise ConfigError(f"reward_weights has {len(weights)} weights for {len(entries)} reward functions.")
            for entry, weight in zip(entries, weights):
                if entry is None:  # the soft overlong punishment: its weight scales the penalty
                    self.overlong_factor = float(weight)
                else:
                    entry["weight"] = float(weight)
        rewards = [r for r in entries if r]
        if not rewards:
            self.report.add(
                "note",
                "reward_funcs",
                f"not given (GRPOTrainer's reward_funcs): set rewards[0].path to the file of your reward function "
                f"({REWARD_FILE}; the python reward calls it as TRL does, docs/rewards.md)",
            )
            rewards = [{"function": "python", "path": REWARD_FILE, "function_name": "reward", "style": "trl"}]
        self.out["rewards"] = rewards

    def reward(self, name: str) -> dict | None:
        """One of trl grpo's reward_funcs: a trl.rewards name or a dotted import path."""
        if name in ("accuracy_reward", "reasoning_accuracy_reward"):
            self.out["data"]["answer_column"] = "solution"  # what TRL passes as solution=
            self.report.add(
                "lost",
                "reward_funcs",
                "math_verify's LaTeX equivalence: answer_match compares the last \\boxed{} answer with the "
                "solution column as numbers. To keep TRL's rule, point the python reward (style trl) at a file "
                f"that imports trl.rewards.{name}",
                name,
            )
            return {"function": "answer_match", "name": name, "extract": "boxed", "compare": "numeric"}
        if name == "think_format_reward":
            return {"function": "format", "name": name, "pattern": THINK_FORMAT}
        if name == "get_soft_overlong_punishment":  # the script's: max_completion_len 1280, cache 256
            self.overlong = (256, 1280)
            return None
        if "." in name:
            module, _, func = name.rpartition(".")
            self.report.add(
                "note",
                "reward_funcs",
                "your reward function runs as it is: the python reward (style trl) imports it from the file of "
                "its module, looked up beside the config, then in the current directory",
                name,
            )
            return {
                "function": "python",
                "name": func,
                "path": module.replace(".", "/") + ".py",
                "function_name": func,
                "style": "trl",
            }
        self.report.add("lost", "reward_funcs", "not a reward function of trl.rewards; left out", name)
        return None

    def algorithm(self) -> None:
        g, src = self.src.get, self.src
        out: dict[str, Any] = {"name": "grpo", "estimator": "grpo"}
        scale = g("scale_rewards")
        scale = {True: "group", False: "none"}.get(scale, scale)
        if scale == "batch":
            self.lost("scale_rewards", "the group std divides advantages, never the batch's; group used")
        out["norm_adv_by_std"] = scale != "none"
        out["eps"] = 1e-4  # TRL divides by std + 1e-4
        epsilon = float(g("epsilon"))
        high = g("epsilon_high")
        out["clip_low"], out["clip_high"] = epsilon, float(epsilon if high is None else high)
        if g("importance_sampling_level") == "sequence":
            out["policy_loss"] = "gspo"
        loss = g("loss_type")
        if loss not in LOSS_TYPES:
            self.lost("loss_type", "losses: grpo, bnpo, dapo, dr_grpo; dapo (token-mean) used")
        out["loss_agg_mode"] = LOSS_TYPES.get(loss, "token-mean")
        if loss == "bnpo":
            self.report.add(
                "note",
                "loss_type",
                "bnpo's token mean over each process's micro-batch is token-mean over the whole mini-batch here",
                loss,
            )
        if loss == "dr_grpo":
            out["loss_norm_length"] = int(g("max_completion_length"))
        out["kl_coef"] = float(g("beta"))
        out["kl_kind"] = "k3"  # TRL's per-token KL is exp(ref - logp) - (ref - logp) - 1
        out["entropy_coeff"] = float(g("entropy_coef"))
        if out["entropy_coeff"] and out["loss_agg_mode"] != "token-mean":
            self.report.add(
                "note",
                "entropy_coef",
                f"TRL averages the entropy over tokens; here it is aggregated with {out['loss_agg_mode']}",
                out["entropy_coeff"],
            )
        if self.per_step != 1 or self.iterations > 1:
            self.report.add(
                "note",
                "epsilon",
                "TRL has no dual clip; hybridrl's clip_c (3) bounds the loss of negative advantages whose ratio "
                "exceeds 3, which only several updates per generation batch can reach",
            )
        self.correction(out)
        buffer, length = getattr(self, "overlong", (0, 0))
        if buffer:
            factor = getattr(self, "overlong_factor", 1.0)
            out |= {"overlong_buffer_len": buffer, "overlong_max_length": length, "overlong_penalty_factor": factor}
        src.mark("vllm_importance_sampling_cap")
        self.out["algorithm"] = out

    def correction(self, out: dict) -> None:
        """TRL's importance sampling of vLLM's samples (on by default with use_vllm)."""
        g, src = self.src.get, self.src
        keys = (
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
        )
        if not (g("use_vllm") and g("vllm_importance_sampling_correction")):
            src.mark(*keys)
            return
        mode = g("vllm_importance_sampling_mode")
        cap = g("vllm_importance_sampling_cap") or g("vllm_importance_sampling_clip_max")
        low = g("vllm_importance_sampling_clip_min")
        option, level = IS_MODES.get(mode, (None, None))
        if option is None:
            self.lost("vllm_importance_sampling_mode", "modes: token/sequence _truncate/_mask")
        elif option == "rollout_correction":
            out |= {"rollout_correction": level, "rollout_correction_cap": float(cap)}
            if low is not None:
                self.lost("vllm_importance_sampling_clip_min", "truncation bounds the ratios from above only")
        else:  # TRL masks above the cap only unless clip_min is set
            out |= {"rollout_mask": level, "rollout_mask_high": float(cap or 1e9), "rollout_mask_low": low or 1e-9}
