"""Every model family users bring, as its checkpoints ship (hybridrl_testing.models), through the
real trainer and the hf engine: two GRPO steps with packed passes, fully trained and with LoRA,
the sync checked after every step; and the errors a user meets first."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hybridrl_testing import SevensPlugin, metrics_rows, torchrun
from hybridrl_testing.models import ARCHITECTURES, MOE, build_checkpoint, two_grpo_steps

from hybridrl.distributed import exit_rank
from hybridrl.engine_weights import checkpoint_tensors
from hybridrl.errors import ConfigError, StageError
from hybridrl.models import load_causal_lm, resolve_model_path
from hybridrl.rope import pin_long_rope

LOGPROB_TOL = 1e-4  # float32 engine and trainer: measured below 2e-6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: build_checkpoint(tmp_path_factory.mktemp(arch), arch) for arch in ARCHITECTURES}


@pytest.mark.parametrize("lora", [False, "adapter", "merged"], ids=["full", "lora-adapter", "lora-merged"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_grpo_steps_keep_engine_and_trainer_equal(arch, lora, checkpoints, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    rows = two_grpo_steps(checkpoints[arch], tmp_path / "run", lora=lora)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the step's responses, scored by the policy the engine had just received
        assert r["rollout/logprob_diff_max"] < LOGPROB_TOL, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < LOGPROB_TOL
    assert rows[0]["rollout/sync_check_baseline"] < LOGPROB_TOL


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_grpo_steps_with_the_gpu_decoding_path_keep_engine_and_trainer_equal(arch, checkpoints, tmp_path,
                                                                                 register_plugin):  # fmt: skip
    """The hf engine as on a GPU (static cache, fused projections, grouped decoding attention, rows
    compacted as responses end) takes each step's weights into its fused layers exactly."""
    register_plugin(SevensPlugin(), name="sevens")
    rows = two_grpo_steps(checkpoints[arch], tmp_path / "run", cache="static")
    for r in rows:
        assert r["rollout/logprob_diff_max"] < LOGPROB_TOL, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < LOGPROB_TOL
    assert min(r["hf/decoded_row_fraction"] for r in rows) < 1, arch  # rows moved as responses ended


@pytest.mark.parametrize("arch", MOE)
def test_checkpoint_format_is_what_the_folder_holds(arch, checkpoints):
    """Experts fused by transformers go to engines one tensor per expert, as the checkpoint has them."""
    from safetensors.torch import load_file

    model = load_causal_lm(resolve_model_path(checkpoints[arch]), torch.bfloat16, torch.device("cpu"))
    got = dict(checkpoint_tensors(model, model.state_dict().items()))
    want = load_file(f"{checkpoints[arch]}/model.safetensors")
    assert any(".experts.gate_up_proj" in name for name in model.state_dict())  # fused in the trainer
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_tied_output_layer_is_sent_once(checkpoints):
    model = load_causal_lm(checkpoints["gemma2"], torch.float32, torch.device("cpu"))
    names = [name for name, _ in checkpoint_tensors(model, model.state_dict().items())]
    assert "lm_head.weight" in model.state_dict() and "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names


@pytest.mark.parametrize("arch", ["phi3", "phi3-su"])
def test_long_rope_uses_one_set_of_factors_for_every_length(arch, checkpoints):
    """transformers picks LongRoPE's factors by each batch's length; pinned, a sequence's logits do
    not depend on a longer one beside it (max_position_embeddings 512 > original 64: the long set)."""
    model = load_causal_lm(resolve_model_path(checkpoints[arch]), torch.float32, torch.device("cpu")).eval()
    short = torch.arange(3, 23)[None]
    with torch.no_grad():
        alone = model(short).logits[0]
        beside_long = model(torch.cat([short, torch.zeros(1, 80, dtype=torch.long)], 1)).logits[0, :20]
    torch.testing.assert_close(alone, beside_long, rtol=1e-5, atol=1e-5)
    assert pin_long_rope(model)


def test_long_rope_follows_the_engines_length(checkpoints):
    """vLLM computes a LongRoPE model with its long factors when it serves past the original length,
    with the short ones within it (its default length for these models: the original). Pinned to an
    engine's length, the trained model computes every sequence as transformers computes a batch on
    that side of the original length (64 here), and pinned again it follows a new length in place."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(checkpoints["phi3"])
    free = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # transformers' per-batch choice
    model = load_causal_lm(path, torch.float32, torch.device("cpu")).eval()
    short = torch.arange(3, 23)[None]
    past = torch.cat([short, torch.zeros(1, 80, dtype=torch.long)], 1)  # 100 positions: the long set
    with torch.no_grad():
        short_set, long_set = free(short).logits[0], free(past).logits[0, :20]
        assert (short_set - long_set).abs().max() > 1e-3  # 100x the tolerance below
        for context, want in ((60, short_set), (512, long_set), (64, short_set), (None, long_set)):
            assert pin_long_rope(model, context)
            torch.testing.assert_close(model(short).logits[0], want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model(past).logits[0, :20], want, rtol=1e-5, atol=1e-5)


def test_phi3s_first_release_loads_from_a_repaired_config(checkpoints):
    """Phi-3's first release gives ``rope_scaling: {type: su}`` and the original length beside it, which
    transformers 5 refuses as it ships (its rename to longrope comes after it gathers the rope keys).
    Resolved as a run resolves model.path, it loads: the same model as Phi-3's longrope release, the
    checkpoint's own files untouched, the repaired folder made once."""
    from transformers import AutoConfig

    shipped = Path(checkpoints["phi3-su"])
    text = (shipped / "config.json").read_text()
    assert json.loads(text)["rope_scaling"]["type"] == "su"
    assert "original_max_position_embeddings" not in json.loads(text)["rope_scaling"]
    path = resolve_model_path(str(shipped))
    assert path != str(shipped) and resolve_model_path(str(shipped)) == path
    assert resolve_model_path(checkpoints["phi3"]) == checkpoints["phi3"]  # Phi-3.5's layout loads as it ships
    assert (shipped / "config.json").read_text() == text
    rope = AutoConfig.from_pretrained(path).rope_parameters
    assert (rope["rope_type"], rope["original_max_position_embeddings"]) == ("longrope", 64)
    su = load_causal_lm(path, torch.float32, torch.device("cpu")).eval()
    longrope = load_causal_lm(resolve_model_path(checkpoints["phi3"]), torch.float32, torch.device("cpu")).eval()
    ids = torch.arange(3, 90)[None]
    with torch.no_grad():
        torch.testing.assert_close(su(ids).logits, longrope(ids).logits, rtol=0, atol=0)


def test_a_repaired_folder_whose_checkpoint_is_gone_is_removed(checkpoints, tmp_path, monkeypatch):
    """The repaired folder links to the checkpoint's files; once the checkpoint is moved or removed, the
    next repair removes it (a test's or a run's checkpoint in a temporary folder left one each time)."""
    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(checkpoints["phi3-su"], first)
    made = Path(resolve_model_path(str(first)))
    shutil.copytree(first, second)
    kept = Path(resolve_model_path(str(second)))
    assert made.is_dir() and kept.is_dir() and made != kept  # both checkpoints there: both kept
    shutil.rmtree(first)
    third = tmp_path / "third"
    shutil.copytree(second, third)
    assert Path(resolve_model_path(str(third))).is_dir()
    assert not made.exists() and kept.is_dir()  # the first's links led nowhere; the second's still lead


@pytest.mark.parametrize("arch", ["phi3", "phi3-su"])
def test_pinned_long_rope_reads_no_position_back_to_the_host(arch, checkpoints):
    """transformers' per-batch choice of LongRoPE's factors branches on the batch's largest position, a
    read back to the host that a CUDA graph capture refuses: Phi-3's decoding on a GPU failed at its
    first capture. Pinned, the rotary embedding is one graph (a branch on a tensor would break it)."""
    model = load_causal_lm(resolve_model_path(checkpoints[arch]), torch.float32, torch.device("cpu")).eval()
    rotary = model.model.rotary_emb
    x, positions = torch.zeros(1, 5, 64), torch.arange(60, 65)[None]
    want = rotary(x, positions)
    torch._dynamo.reset()
    got = torch.compile(rotary, backend="eager", fullgraph=True)(x, positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gemma2s_attention_is_soft_capped_as_vllm_computes_it(checkpoints):
    """transformers' default attention since version 5, SDPA, leaves Gemma-2's soft-cap of the attention
    scores out (3e-3 from vLLM per token on this checkpoint, whose scores reach the cap): the trained
    models load with eager attention, which applies it, and SDPA asked for by name is refused."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(checkpoints["gemma2"])
    model = load_causal_lm(path, torch.float32, torch.device("cpu")).eval()
    assert model.config._attn_implementation == "eager"
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        got = model(ids).logits
        sdpa = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")(ids).logits
    assert (got - sdpa).abs().max() > 1e-3  # the cap acts on this checkpoint
    with pytest.raises(ConfigError, match="soft-caps its scores") as e:
        load_causal_lm(path, torch.float32, torch.device("cpu"), attn_implementation="sdpa")
    assert "\n" not in str(e.value)


def test_a_model_transformers_cannot_load_is_one_error_naming_the_folder(checkpoints, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["llama"], broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "no-such-rope", "factor": 2.0}
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"model.path {broken}: transformers cannot load this model") as e:
        load_causal_lm(str(broken), torch.float32, torch.device("cpu"))
    assert "\n" not in str(e.value)


def static_engine(path, tmp_path, sampling, cache="static", **options):
    """The hf engine on the static cache (its GPU path; or ``cache``) for the run's ``sampling``, on the
    CPU; about a tenth of the sampled tokens (ids 3-12) end a response."""
    from hybridrl import plugins
    from hybridrl.components import RunContext
    from hybridrl.models import load_tokenizer

    cls = plugins.lookup("rollout engine", "hf")
    ctx = RunContext(path, load_tokenizer(path), torch.device("cpu"), torch.float32, 0, tmp_path, sampling=sampling)
    engine = cls(cls.Options(cache=cache, **options), ctx)
    engine.eos_ids = set(range(3, 13))
    return engine


@pytest.mark.parametrize("arch", ["phi3", "phi3-su"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("n", [1, 4])
def test_decoding_past_longropes_original_length_keeps_the_trainers_logprobs(n, cache, arch, checkpoints, tmp_path):
    """Phi-3's generation input preparation drops the KV cache at the first token past the original
    length (64 here, 4,096 for Phi-3.5 and Phi-4-mini), to recompute it with LongRoPE's long
    factors. hybridrl pins those factors (pin_long_rope), so nothing needs recomputing, and
    generate went on from an empty cache: from that token on, other logprobs than the trainer's."""
    from hybridrl.batch import Batch
    from hybridrl.components import Sampling, SamplingParams
    from hybridrl.passes import response_logprobs

    path = resolve_model_path(checkpoints[arch])  # as a run loads it
    engine = static_engine(path, tmp_path, Sampling(ignore_eos=True), cache=cache)
    p = [engine.tokenizer(f"q{i} {'abcdefgh' * 6}"[: 44 + i])["input_ids"] for i in range(4)]
    out = engine.generate(p, SamplingParams(n=n, max_tokens=40, seed=0, ignore_eos=True))
    assert max(map(len, p)) < 64 < max(map(len, p)) + 40  # prompts below the original length, responses past it
    batch = Batch.from_rollout(p, out, n, engine.tokenizer.pad_token_id)
    policy = load_causal_lm(path, torch.float32, torch.device("cpu")).eval()
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1])
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().max() < LOGPROB_TOL


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_gpu_decoding_path_gives_the_trainers_logprobs(arch, checkpoints, fake_cuda_graphs, tmp_path):
    """The hf engine's path on a GPU, for every family: a static cache, the rows still running moved
    to loops of fewer rows as responses end, and at the first call every such loop made, warmed up
    and captured (a graph pool and capture stood in for here, as in test_rollout_hf). Responses of
    many lengths come with the trainer's logprobs, sliding-window families' (Gemma, Mistral: a window
    of 16 here, shorter than the prompts) included."""
    from hybridrl.batch import Batch
    from hybridrl.components import Sampling, SamplingParams
    from hybridrl.passes import response_logprobs

    path = resolve_model_path(checkpoints[arch])  # as a run loads it
    engine = static_engine(path, tmp_path, Sampling())
    captured = fake_cuda_graphs(engine)
    tok = engine.tokenizer
    p = [tok(f"q{i * 37 % 101} {chr(97 + i % 26) * (1 + i % 5 * 20)}")["input_ids"] for i in range(32)]
    assert max(map(len, p)) > 64  # past Phi-3's original length (LongRoPE) and every sliding window
    out = engine.generate(p, SamplingParams(n=1, max_tokens=40, seed=0))
    lengths = sorted(len(t) for t in out.token_ids)
    assert lengths[0] < 16 < lengths[-1], lengths  # some end before the first check, some run on after it
    assert engine._loop_state.smaller and captured  # the loops of fewer rows ran, from graphs
    batch = Batch.from_rollout(p, out, 1, tok.pad_token_id)
    policy = load_causal_lm(path, torch.float32, torch.device("cpu")).eval()
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1])
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().max() < LOGPROB_TOL


def test_compiled_decoding_on_local_and_global_layers_gives_the_eager_loops_responses(checkpoints, tmp_path):
    """Gemma-3's sliding-window and full layers share the compiled decoding step (rows and cache
    length dynamic), in the loops of fewer rows too: the eager loop's greedy tokens and logprobs."""
    from hybridrl.components import Sampling, SamplingParams

    compiled, eager = (
        static_engine(checkpoints["gemma3"], tmp_path, Sampling(top_k=1), compile=c) for c in ("on", "off")
    )
    p = [compiled.tokenizer(f"q{i * 37 % 101} {chr(97 + i % 26)}")["input_ids"] for i in range(16)]
    sp = SamplingParams(n=1, max_tokens=40, seed=0, top_k=1)
    out, want = compiled.generate(p, sp), eager.generate(p, sp)
    assert compiled.metrics()["hf/compile_s"] > 0 and compiled._loop_state.smaller
    assert out.token_ids == want.token_ids and len({len(t) for t in out.token_ids}) > 2
    assert max(abs(a - b) for x, y in zip(out.logprobs, want.logprobs) for a, b in zip(x, y)) < LOGPROB_TOL


class OffsetEngine:
    """Registers 'hf_offset': the hf engine with each logprob 0.5 too high (a wrong convention)."""

    @staticmethod
    def engine():
        from hybridrl.builtin.rollout_hf import HFEngine

        class Offset(HFEngine):
            def generate(self, prompts, sampling):
                out = super().generate(prompts, sampling)
                out.logprobs = [[lp + 0.5 for lp in row] for row in out.logprobs]
                return out

        return Offset

    from hybridrl.hookspecs import hookimpl

    @hookimpl
    def register_rollout_engines(self, register):
        register("hf_offset", self.engine())


def test_a_convention_error_is_not_blamed_on_the_sync_and_keeps_step_1s_metrics(checkpoints, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    register_plugin(OffsetEngine(), name="offset")
    with pytest.raises(StageError, match="before the first update") as e:
        two_grpo_steps(checkpoints["qwen2"], tmp_path / "run", engine="hf_offset")
    assert "The weights are the same on both sides" in str(e.value) and "0.5" in str(e.value)
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["rollout/sync_check_baseline"] == pytest.approx(0.5, abs=1e-3)


# every family, and LoRA where its merge differs (Conv1D, fused experts); a launch each: torch
# cannot set up a second process group in a process that tore one down
FSDP_CASES = [(arch, False) for arch in ARCHITECTURES] + [("gpt2", "adapter"), ("qwen3_moe", "merged")]


@pytest.mark.torchrun
@pytest.mark.parametrize(
    ("arch", "lora"), FSDP_CASES, ids=[f"{a}-{lo and 'lora-' + lo or 'full'}" for a, lo in FSDP_CASES]
)
def test_two_grpo_steps_under_fsdp_on_two_ranks_keep_engine_and_trainer_equal(arch, lora, checkpoints, tmp_path):
    """The FSDP column: sharded over two torchrun ranks (gloo), each rank's engine taking the
    gathered weights."""
    run = tmp_path / "run"
    proc = torchrun([__file__, "fsdp", checkpoints[arch], str(run), str(lora)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < LOGPROB_TOL, (arch, lora, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < LOGPROB_TOL


def fsdp_worker(model: str, run_dir: str, lora: str) -> None:
    from pathlib import Path

    from hybridrl import plugins

    plugins.get_plugin_manager().register(SevensPlugin(), name="sevens")
    plugins.invalidate_registry()
    two_grpo_steps(model, Path(run_dir), lora=lora if lora != "False" else False, strategy="fsdp")


if __name__ == "__main__" and sys.argv[1:2] == ["fsdp"]:
    fsdp_worker(*sys.argv[2:5])
    exit_rank(0)  # the rank's work is done: without the teardown that was seen to abort it
