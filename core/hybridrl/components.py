"""Base classes of the components that plugins provide, and the types they exchange.

Every component class has an ``Options`` pydantic model (unknown keys rejected) that the
core validates its YAML section against, and is built as ``cls(options, ctx)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from hybridrl.batch import Batch, RolloutOutput  # noqa: F401 (RolloutOutput: part of the contract)
from hybridrl.context import PassRunner, RunContext, TrainingMemory  # noqa: F401 (the contract's)
from hybridrl.functional import LossAggregation
from hybridrl.options import INPUT_PATH, ConfigModel, Options, literal_choices  # noqa: F401 (the contract's)
from hybridrl.sampling import NEUTRAL_SAMPLING, Sampling, SamplingParams  # noqa: F401 (the contract's)


class Component:
    Options: ClassVar[type[Options]] = Options

    def __init__(self, options: Options, ctx: RunContext):
        self.options, self.ctx = options, ctx


# --- rollout -----------------------------------------------------------------------------


class RolloutEngine(Component):
    """Generates responses and receives new policy weights in place.

    Lifecycle: awake (as built) or asleep. Its one caller, the engine session, alone changes the
    state, and calls ``generate`` and ``sleep`` awake, ``wake_up`` asleep, and ``update_weights`` and
    the rest in either state, which they leave as it is (asleep, ``update_weights`` maps the weights
    alone: vLLM's ``wake_up(tags=["weights"])``, SGLang's resume of ``weights``). The session puts
    the engine to sleep only for training and syncs it still asleep (the KV cache stays freed while
    the trainer gathers the full tensors); between a ``sleep`` and the next ``wake_up`` it sends the
    whole policy, so ``sleep`` may drop the weights (vLLM's level 2). Engines never wake themselves.
    """

    #: what :meth:`update_weights` receives: ``"checkpoint"``, the names and layouts of the model
    #: folder's safetensors, each tensor once (for engines that load checkpoints), or
    #: ``"transformers"``, the trainer's transformers state dict (see :mod:`hybridrl.engine_weights`)
    weight_format: str = "checkpoint"

    @classmethod
    def check_launch(cls, options: Options, ctx: RunContext) -> None:
        """Raise ValueError naming the option and the fix when the engine cannot run in this launch
        (``ctx.world_size`` ranks under torchrun, on ``ctx.device``, the model at ``ctx.model_path``).
        Called on every rank before any model loads; the engine itself is built after the policy."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        """``sampling.n`` responses to each prompt, with each sampled token's logprob; called awake."""
        raise NotImplementedError

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) policy tensors, in :attr:`weight_format`, in place (buckets of whole
        decoder layers may arrive over several calls of one sync); awake or asleep, in that state."""
        raise NotImplementedError

    def takes_adapter(self, config: dict) -> str | None:
        """None where :meth:`update_adapter` serves LoRA adapters of peft's ``config`` (LoraConfig.to_dict())
        over the engine's own frozen base (kept through sleep), else why not: the run syncs merged weights."""
        return "it loads full weights only"

    def update_adapter(self, adapter) -> None:
        """Generate with the policy's adapter (:class:`hybridrl.lora.Adapter`) from now on; awake or asleep.
        An engine that mixes adapters (:meth:`adapters_per_call`) keeps it beside the others of other names."""
        raise NotImplementedError

    def adapters_per_call(self) -> int:
        """How many adapters one ``generate`` may mix, prompt i answered by the one named
        ``sampling.adapters[i]``, all held at once (vLLM's max_loras); 1: the one loaded last."""
        return 1

    def memory_options(self, half_prompts: int) -> str:
        """The options that bound the engine's memory, for an out-of-memory error's fix ("Lower ..."; a
        value to suggest: ``half_prompts``, half the prompts of the call that ran out)."""
        return "the engine's memory options"

    def context_length(self) -> int | None:
        """The longest prompt + response the engine serves, as it settled it (vLLM's max_model_len);
        None where it has no limit of its own. Where a model computes positions by that length
        (LongRoPE: Phi-3, Phi-3.5, Phi-4-mini; :mod:`hybridrl.rope`), the trainer's models follow it."""
        return None

    def runs_apart(self) -> bool:
        """Whether the engine generates on other devices or in another process than training (a
        server), so that it can generate the next batch while the policy trains (rollout.async)."""
        return False

    def updates_in_flight(self) -> bool:
        """Whether :meth:`update_weights` may run during a :meth:`generate` of another thread, whose
        requests go on under the new weights, saying per token which sampled it (``token_versions``)."""
        return False

    def seeds_each_request(self) -> bool:
        """Whether ``generate`` seeds each prompt on its own (``SamplingParams.seeds``), so that what a
        prompt samples does not depend on the other prompts of the call (vllm, sglang)."""
        return False

    def holds_latest_weights(self) -> bool:
        """Whether, after :meth:`update_weights`, the engine computes with the weights it was sent (False for
        a server that syncs every few updates, or never): the trainer then skips ``rollout.sync_check``."""
        return True

    def sleep(self) -> None:
        """Free accelerator memory before training (awake; may drop the weights, unless it takes adapters)."""

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed (and ``update_weights`` did not), before generation; asleep."""

    def metrics(self) -> dict[str, float]:
        """The engine's own figures of the latest step (timings, sizes), logged with the step's
        metrics under the engine's prefix (``vllm/sync_mib``); called after each weight sync."""
        return {}

    def close(self) -> None:
        """Release the engine at the end of the run."""


# --- reward ------------------------------------------------------------------------------


class RewardFunction(Component):
    """Scores each response of a batch.

    ``batch["prompt_text"]``, ``batch["response_text"]``, ``batch["answer"]`` (the row's
    ``data.answer_column``), ``batch["metadata"]`` and ``batch["row"]`` (the prompt source's whole
    row: every field, nested ones included) are lists with one entry per response.
    """

    @classmethod
    def needs(cls, options: Options) -> set[str]:
        """The row fields :meth:`score` reads beside the prompt and the response, with these ``options``: ``"answer"``
        (the ground truth), ``"metadata"``. Checked against each set's first row before any model loads."""
        return set()

    def score(self, batch: Batch) -> torch.Tensor | list[float]:
        """Return one scalar per response, shape (B,)."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Figures of the latest :meth:`score` call, logged as ``reward/<name>/<key>`` (a failure rate, the mean
        of a sub-score); ranks' values are averaged, so give means over this rank's responses, not sums."""
        return {}

    def close(self) -> None:
        """Called once at the end of the run."""


# --- algorithm ---------------------------------------------------------------------------


@dataclass
class Trainable:
    """A model the update stage trains, and how."""

    name: str  # metric prefix: "actor" (the policy), "critic", ...
    label: str  # what messages call it: "policy (algorithm 'grpo')", "critic (algorithm 'ppo')"
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: a micro-batch -> (its loss, aggregated with ``aggregation``; metrics to log, floats or tensors);
    #: token statistics among the metrics are weighted by the micro-batch's response tokens
    loss: Callable[[Batch], tuple[torch.Tensor, dict[str, Any]]]
    aggregation: LossAggregation
    epochs: int = 1
    mini_batch_size: int | None = None  # responses per optimizer step over all ranks; None: the whole batch
    micro_batch_size: int | None = None  # responses per pass; None: the trainer's micro-batches
    max_grad_norm: float = 1.0
    scheduler: Any = None  # stepped once per update stage


class Algorithm(Component):
    """Turns rewards into advantages and gives the policy loss of a minibatch."""

    #: how :meth:`loss` reduces tokens (its mode and normaliser); the trainer weighs micro-batches
    #: and ranks with it so that the update's gradient is that of the loss over the mini-batch.
    loss_aggregation: LossAggregation = LossAggregation("token-mean")

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must compute ``batch["ref_logprobs"]`` with a frozen copy."""
        return False

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether ``batch["old_logprobs"]`` must exist before :meth:`compute_advantages`; otherwise the trainer
        computes them only when a step makes several updates (taking them from the first pass when it makes one)."""
        return False

    @property
    def needs_entropy_grad(self) -> bool:
        """Whether ``entropy`` passed to :meth:`loss` must carry gradients (an entropy bonus)."""
        return False

    def filter_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Drop responses after scoring (e.g. DAPO's groups whose rewards are all equal): the rows kept and
        the filter's metrics (``dynamic_sampling/kept_groups``). The metrics travel with the batch: with
        ``rollout.async`` the filter runs on the prefetch thread, steps ahead of the update, and they are logged
        with the step that trains on these rows, so keep no state between calls. With ``rollout.refill_rounds``
        the trainer calls it again on every round of the step together, so decide each group from its own rows;
        the last call's metrics are the step's. A bare ``Batch`` returned is read as ``(batch, {})``."""
        return batch, {}

    def trained_models(self) -> list[Trainable]:
        """Models the algorithm trains besides the policy (PPO's critic), each with its loss: the trainer
        trains them after the policy, on the same batch, with the same update loop (:func:`hybridrl.update.run_update`:
        mini- and micro-batches, loss weighting across micro-batches and ranks, clipping, ``trainer.on_nonfinite``)."""
        return []

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        """Set ``batch["advantages"]`` (B, T) from ``batch["scores"]`` (B,) and the masks; returns metrics to log.
        Not called when the caller brings its own advantages (:meth:`hybridrl.trainer.Trainer.train_on`)."""
        raise NotImplementedError

    def loss(self, batch: Batch, logprobs: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Loss of a minibatch and its metrics.

        :param batch: the minibatch; ``old_logprobs``, ``advantages``, ``response_mask`` and,
            when :attr:`needs_reference`, ``ref_logprobs``, all (B, T).
        :param logprobs: (B, T) logprobs of the responses under the current policy, with grad.
        :param entropy: (B, T) token entropies of the current policy.
        """
        raise NotImplementedError


# --- sharding ----------------------------------------------------------------------------


class ShardingOptions(Options):
    ref_device: str | None = Field(
        None,
        description="Device of the frozen reference model, e.g. 'cuda:1' to keep it off the policy's GPU "
        "(beside a reward model); default: the policy's device (trainer.device).",
    )


class ShardingStrategy(Component):
    """Places models on devices for training and streams their full weights out.

    Under torchrun every rank builds the same strategy; a strategy with :attr:`multi_process`
    keeps the ranks' models in step (synchronised gradients), and every method below is then
    called on every rank in the same order (they may run collectives).
    """

    Options: ClassVar[type[Options]] = ShardingOptions

    #: whether it trains one model across the processes of a torchrun launch (else: one process)
    multi_process: ClassVar[bool] = False
    #: bytes of logits the output layer may hold at once when the pass runner computes it in compiled
    #: chunks (the single strategy's ``compile``); None: the model's own output layer
    fused_head_bytes: int | None = None
    #: the dtype passes compute in under :meth:`autocast` (mixed precision); None: the parameters'
    compute_dtype: torch.dtype | None = None
    #: tokens of every packed row of the run (the longest prompt and response, rounded up), where the
    #: strategy compiles its models' blocks for one width; None: each batch's own width
    pack_width: int | None = None

    def checkpoints_activations(self) -> bool:
        """Whether trained models recompute their activations in the backward pass (activation
        checkpointing): a pass then keeps a layer's input alone, and its token budget grows."""
        return False

    def wrap(self, model: torch.nn.Module, trainable: bool = True) -> torch.nn.Module:
        raise NotImplementedError

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place the frozen reference policy: on ``ref_device`` when the options set one, else
        like the policy (``wrap(model, trainable=False)``)."""
        ref_device = getattr(self.options, "ref_device", None)
        if ref_device:
            from hybridrl.devices import resolve_device

            return model.to(resolve_device(ref_device, "sharding.ref_device"))
        return self.wrap(model, trainable=False)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward pass of the policy and the reference model runs in (the
        backward pass follows it): ``torch.autocast`` for mixed precision, else a no-op."""
        return contextlib.nullcontext()

    def input_device(self, model: torch.nn.Module) -> torch.device:
        """The device that ``model``'s inputs must be on: where its parameters are."""
        for p in model.parameters():
            return p.device
        return self.ctx.device

    def full_tensors(self, model: torch.nn.Module, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full (unsharded) named tensors, a bounded amount of extra memory at a time; ``keep(name)``:
        those alone (the others are never gathered). Names: the HF state dict's, tied weights under each."""
        raise NotImplementedError

    def save_model(self, model: torch.nn.Module, path: Path) -> None:
        """Write the full model as a plain HF folder (config + safetensors) at ``path``."""
        model.save_pretrained(path)

    def load_model(self, model: torch.nn.Module, path: Path) -> None:
        """Load weights written by :meth:`save_model` into ``model`` in place."""
        from safetensors.torch import load_file

        state = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(f))
        if (Path(path) / "adapter_config.json").is_file():  # a LoRA policy's checkpoint: the adapters
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(model, state)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"Adapter weights in {path} do not fit the model: {result.unexpected_keys[:5]}")
            return
        own = model.state_dict()
        loaded = {own[k].data_ptr() for k in state if k in own}
        missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded]  # tied weights are fine
        unexpected = [k for k in state if k not in own]
        if missing or unexpected:
            raise ValueError(
                f"Weights in {path} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        model.load_state_dict(state, strict=False)

    def save_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> bool:
        """Write the model's and optimizer's state as shards (every rank its own) under ``path``; False
        where the strategy keeps none (the checkpoint then holds ``optimizer.pt`` and ``policy/``)."""
        return False

    def load_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """Load what :meth:`save_sharded` wrote, in place."""
        raise NotImplementedError(f"{type(self).__name__} keeps no sharded checkpoint state.")

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the gradients to a total norm; returns the norm before clipping (over all ranks)."""
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def all_reduce_mean(self, value: float) -> float:
        """Mean of a scalar over ranks (identity on one process)."""
        from hybridrl.distributed import mean_over_ranks

        return mean_over_ranks(value)


# --- agents: environments, tools, tool-call parsers ------------------------------------------


@dataclass
class Observation:
    """What an environment answers to a sampled assistant turn."""

    messages: list[dict] = field(default_factory=list)  # chat messages to append (role "tool" or "user")
    done: bool = False  # the trajectory ends here (no more turns)
    reward: float | None = None  # a reward for this turn, summed into the trajectory's ``env_reward``
    info: dict = field(default_factory=dict)  # counts for the metrics: tool_calls, tool_errors, ...


class Tool(Component):
    """A function the model can call; an environment runs it and shows the model its result."""

    name: ClassVar[str] = ""  # set from the registered name

    def schema(self) -> dict:
        """The function schema shown in the chat template's tools block (OpenAI's format)."""
        raise NotImplementedError

    def __call__(self, arguments: dict) -> str:
        """Run with the call's arguments; the text result. Raise to report an error to the model."""
        raise NotImplementedError


@dataclass
class ToolCall:  # a call read from a turn
    name: str
    arguments: dict
    error: str | None = None  # why the call could not be read (malformed JSON, no name...)


class ToolParser(Component):
    """Reads tool calls out of a sampled turn, in the format the chat template teaches."""

    def parse(self, turn: str) -> list[ToolCall]:
        raise NotImplementedError

    def content(self, turn: str) -> str:  # the text outside its calls: an OpenAI reply's content
        return turn


class Environment(Component):
    """Multi-turn rollouts: a state per trajectory, and an :class:`Observation` per sampled turn.

    ``step`` runs in worker threads, several trajectories at once: keep what a trajectory needs in
    its state. The core sets ``tools`` (the :class:`Tool` of ``rollout.agent.tools``) and ``parser``.
    """

    tools: dict[str, Tool] = {}
    parser: ToolParser | None = None
    schemas: list[dict] = []  # the schemas of tools it brings itself, shown to the model beside ``tools``'
    drives: bool = False  # True: it runs its agent itself (rollout), not turn by turn (step)

    def reset(self, row: dict, messages: list[dict]) -> Any:
        """The state of a new trajectory for a prompt-source ``row`` and its chat ``messages``."""
        return None

    def step(self, state: Any, turn: str) -> Observation:
        """Answer the sampled assistant ``turn`` (its text, special tokens removed)."""
        raise NotImplementedError

    def rollout(self, rows: list[dict], messages: list[list[dict]], sampling: SamplingParams, loop, train=False):
        """With ``drives``: ``sampling.n`` episodes (``hybridrl.agents.Trajectory``) per row, through
        ``loop.session``; a training call (``train``) may get fewer, or earlier rows' (docs/plugins.md)."""
        raise NotImplementedError

    def release(self, states: list) -> None:
        """A training call's trajectories (``states``) are scored or dropped: what it keeps for them may go."""

    def close(self) -> None:
        """Release what it started (servers, processes); the run calls it once, at its end."""


# --- data and logging --------------------------------------------------------------------


class PromptSource(Component):
    """A sized collection of rows (dicts); the core shuffles, batches and builds prompts."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict:
        raise NotImplementedError


class Logger(Component):
    """Receives each step's metrics."""

    def open(self, total_steps: int, start_step: int) -> None:
        """Called once before the first step (``start_step`` > 0 when resuming)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Rollout samples (prompt, response, rewards, advantage), every few steps."""

    def close(self) -> None:
        """Called once at the end of the run."""
