"""The built-in hf rollout engine: grouping, logprobs that match the trainer's, weight sync, and
its fast path (static KV cache, compiled decoding) against the plain dynamic-cache path."""

import os
import sys

import pytest
import torch

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.builtin import hf_fast_path
from hybridrl.builtin.hf_fast_path import GROUPED_ATTENTION, FusedGroup, grouped_decode_attention
from hybridrl.builtin.rollout_hf import compacted_rows
from hybridrl.compile import _keyed as KEYED
from hybridrl.components import RunContext, Sampling, SamplingParams
from hybridrl.config import ConfigError, load_config
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.passes import response_logprobs

TEXTS = ["abc", "a much longer prompt", "hello world, how are you?"]  # different lengths: left padding matters


@pytest.fixture(autouse=True)
def no_saved_steps(monkeypatch):
    """Compiled decoding compiles in each test: no compile cache folder, so nothing another test saved
    is loaded and the graphs counted are this test's (saving and loading: tests/test_compile_cache.py)."""
    from hybridrl import compile

    monkeypatch.setattr(compile, "_keyed", lambda *args: None)


@pytest.fixture
def make_engine(tiny_model, tmp_path):
    tok = load_tokenizer(tiny_model)
    ctx = RunContext(tiny_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path)
    cls = plugins.lookup("rollout engine", "hf")
    return lambda **options: cls(cls.Options(**options), ctx)


@pytest.fixture
def engine(make_engine):
    return make_engine()  # on the CPU: dynamic cache, no compile, the policy's float32


def prompts(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def test_cpu_defaults_are_the_plain_path(engine):
    assert not engine.static and not engine.compile and engine.pad_multiple == 1
    assert engine.model.dtype == torch.float32


def test_n_samples_grouped_by_prompt_and_reproducible(engine):
    p = prompts(engine.tokenizer, ["abc", "hello world"])
    sp = SamplingParams(n=3, max_tokens=8, seed=1)
    out = engine.generate(p, sp)
    assert len(out.token_ids) == 6 and len(out.finish_reasons) == 6
    assert all(len(t) == len(lp) <= 8 for t, lp in zip(out.token_ids, out.logprobs))
    assert engine.generate(p, sp).token_ids == out.token_ids  # same seed, same samples
    assert engine.generate(p, SamplingParams(n=3, max_tokens=8, seed=2)).token_ids != out.token_ids


def test_the_cpu_path_prefills_each_prompt_once_for_its_samples(engine):
    """generate's dynamic-cache path: the prompts' forward pass runs on one row per prompt (all
    but the last token, which generate then runs for each sample), not on n rows each."""
    p = prompts(engine.tokenizer, TEXTS)
    fed = []
    hook = engine.model.get_input_embeddings().register_forward_hook(lambda m, a, out: fed.append(tuple(a[0].shape)))
    try:
        out = engine.generate(p, SamplingParams(n=4, max_tokens=5, seed=0, ignore_eos=True))
    finally:
        hook.remove()
    P = max(map(len, p))
    assert fed[0] == (3, P - 1)  # the shared prefill
    assert fed[1] == (12, 1)  # then every sample, one token at a time
    assert len(out.token_ids) == 12 and all(len(t) == 5 for t in out.token_ids)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_trainer_logprobs(make_engine, tiny_model, cache, temperature):
    engine = make_engine(cache=cache)  # static: prompts left-padded to a multiple of 64 tokens
    tok = engine.tokenizer
    p = prompts(tok, TEXTS)
    out = engine.generate(p, SamplingParams(n=2, max_tokens=10, temperature=temperature, seed=0))
    batch = Batch.from_rollout(p, out, 2, tok.pad_token_id)
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = response_logprobs(
            policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], temperature
        )
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item() < 1e-4


def assert_same_rollout(a, b):
    assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons
    diff = max(abs(x - y) for la, lb in zip(a.logprobs, b.logprobs) for x, y in zip(la, lb))
    assert diff < 1e-4


WARPED = dict(temperature=0.7, top_k=20, top_p=0.8)


@pytest.mark.parametrize("sampling", [dict(top_k=1), dict(temperature=1e-4), dict(temperature=1.0), WARPED])
def test_static_cache_samples_equal_dynamic_cache(make_engine, sampling):
    """The static cache runs our decoding loop, the dynamic one transformers' generate: the same
    seed gives the same samples, with generate's temperature, top-k and top-p."""
    dynamic, static = make_engine(cache="dynamic"), make_engine(cache="static", pad_prompts_to_multiple=16)
    p = prompts(dynamic.tokenizer, TEXTS)
    sp = SamplingParams(n=2, max_tokens=24, seed=3, **sampling)  # at temperature 1: same seed, same samples
    assert_same_rollout(static.generate(p, sp), dynamic.generate(p, sp))


def test_a_one_token_call_keeps_the_rollouts_decoding_state(make_engine):
    """The sync check's probe (one token) runs the prefill alone: the same samples as generate, and
    the rollout's static cache (and on CUDA its captured graphs) stays for the next rollout."""
    dynamic, static = make_engine(cache="dynamic"), make_engine(cache="static", pad_prompts_to_multiple=16)
    p = prompts(static.tokenizer, TEXTS)
    rollout = SamplingParams(n=2, max_tokens=12, seed=1)
    static.generate(p, rollout)
    state = static._loop_state
    probe = SamplingParams(n=8, max_tokens=1, seed=4, **WARPED)
    assert_same_rollout(static.generate(p[:1], probe), dynamic.generate(p[:1], probe))
    assert static._loop_state is state
    assert_same_rollout(static.generate(p, rollout), dynamic.generate(p, rollout))


def test_compiled_decoding_equals_eager(make_engine):
    """compile 'on' on the CPU (inductor, no CUDA graphs); a short last chunk is filled up."""
    eager, compiled = make_engine(batch_size=2), make_engine(batch_size=2, compile="on", compile_after=1)
    assert compiled.static and compiled.compile
    p = prompts(eager.tokenizer, TEXTS)  # 3 prompts in chunks of 2: the second is filled with a copy
    sp = SamplingParams(n=2, max_tokens=16, top_k=1, seed=0)
    out = compiled.generate(p, sp)
    assert len(out.token_ids) == 6
    assert_same_rollout(out, eager.generate(p, sp))
    assert compiled._compiled_step is not None  # the decoding loop took the compiled step


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("fails_at", ["begin", "step"])
def test_decoding_that_cannot_be_captured_goes_on_without_cuda_graphs(make_engine, monkeypatch, capsys, fails_at, mode):
    """Contract test (no CUDA here): on CUDA the static cache captures decoding steps, eager or compiled,
    as CUDA graphs, on a side stream, without emptying torch's memory caches first (as torch.cuda.graph
    does). Where a capture fails (a forward that syncs with the host, which capturing does not
    permit: on an H200, Qwen3-MoE's float32 experts, compiled or not), the capture raises: the steps
    then run as they are, the same tokens as without graphs, and the run decodes without them from
    then on, said once. (Compiled, it raised: the rollout failed.) The failed capture is followed by an
    empty one that ends: the device's failure skipped torch's capture epilogue, which left the CUDA
    generator in capture mode, and the next random draw raised (seen on an H200). The compiled step
    here is the eager one, named compiled (torch.compile is not what this tests)."""
    import contextlib

    from hybridrl.builtin import rollout_hf

    class Eager:  # the compiled step, run eagerly
        load_s = 0.0

        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, model, loop, *rest):
            engine._step(loop, *rest[:2])

    monkeypatch.setattr(rollout_hf, "Precompiled", Eager)
    reference = make_engine(cache="static", pad_prompts_to_multiple=16, graph_tokens=0)
    compiled = {"compile": "on", "compile_after": 1} if mode == "compiled" else {"compile": "off"}
    engine = make_engine(cache="static", pad_prompts_to_multiple=16, **compiled)
    loop = engine._loop

    def loop_with_a_pool(*args):  # a CUDA loop's graph pool, which DecodeState takes on CUDA only
        state = loop(*args)
        state.pool = "pool"
        return state

    captures, ended = [], []  # the pools of the captures begun, and of those that ended

    error = RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    step, capturing = engine._step, []

    class FailingGraph:  # the first capture fails: at its start, or at a step that syncs with the host
        def capture_begin(self, pool=None):
            self.pool, self.failed = pool, not captures
            captures.append(pool)
            if fails_at == "begin" and self.failed:
                raise error
            capturing.append(True)

        def capture_end(self):
            capturing.clear()
            if self.failed:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            ended.append(self.pool)

    def syncing_step(*args):  # raises before it changes anything, as the device would refuse the sync
        if capturing:
            raise error
        return step(*args)

    class Stream:  # the capture's side stream, waited on both ways
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(engine, "_loop", loop_with_a_pool)
    monkeypatch.setattr(engine, "_step", syncing_step)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FailingGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(hf_fast_path, "_capture_stream", Stream)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("a capture emptied the allocator's cache"))
    p = prompts(engine.tokenizer, TEXTS)
    sp = SamplingParams(n=2, max_tokens=40, seed=5, ignore_eos=True)  # runs of 16, 16 and 7 steps
    for _ in range(2):
        assert_same_rollout(engine.generate(p, sp), reference.generate(p, sp))
    assert captures == ["pool", None] and ended == [None]  # the second run of 16 steps, once; then an empty one
    assert engine._uncapturable == {mode == "compiled"}
    graphs = engine._graphs.metrics()  # hf/graph_* (reported on CUDA): the warm-up runs, the capture tried
    assert graphs["hf/graph_warmups"] == 3 and graphs["hf/graph_captures"] == 1  # 3 numbers of steps a run
    assert graphs["hf/graph_new_loops"] == 0 and graphs["hf/graph_capture_s"] >= 0
    assert engine._graphs.metrics()["hf/graph_captures"] == 0  # read once per step
    said = capsys.readouterr().out
    assert said.count(f"{mode} decoding cannot be captured as CUDA graphs") == 1
    assert "operation not permitted when stream is capturing)" in said


def test_the_first_call_captures_every_loop_a_later_call_can_reach(untied_model, tmp_path, fake_cuda_graphs):
    """Contract test (no CUDA here): on CUDA each run of a number of steps, in each loop (the
    call's, and those of fewer rows that compact_rows moves to), first runs as it is and then is
    captured as a CUDA graph. At the step where responses first ended sooner or later than before,
    that was a stall. With the run's own sampling setting the first call captures each run right
    after its first, then makes, warms up and captures every loop compaction can reach: later
    calls, whatever their lengths, only replay graphs. The responses are those without graphs."""
    tok = load_tokenizer(untied_model)
    cls = plugins.lookup("rollout engine", "hf")
    ctx = RunContext(untied_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path, sampling=Sampling(top_k=1))
    engine = cls(cls.Options(cache="static"), ctx)
    engine.eos_ids = set(range(3, 30))
    captured = fake_cuda_graphs(engine)
    without_graphs = untied_engine(untied_model, tmp_path, graph_tokens=0)
    sp = SamplingParams(n=1, max_tokens=40, seed=0, top_k=1)  # the run's setting: runs of 15, 16 and 8 steps
    first, later = prompts(tok, MANY), prompts(tok, [m + " and more" for m in MANY[::-1]])
    assert_same_rollout(engine.generate(first, sp), without_graphs.generate(first, sp))
    assert sorted(engine._loop_state.smaller) == [4, 8, 16, 32]  # 64 rows halved down to a sixteenth
    smaller = [(rows, steps) for rows in (4, 8, 16, 32) for steps in (8, 16)]  # they begin after a check
    assert sorted(captured) == sorted([(64, 8), (64, 15), (64, 16)] + smaller)  # each once
    graphs = engine._graphs.metrics()
    assert graphs["hf/graph_captures"] == graphs["hf/graph_warmups"] == 11 and graphs["hf/graph_new_loops"] == 4
    for _ in range(2):
        assert_same_rollout(engine.generate(later, sp), without_graphs.generate(later, sp))
        graphs = engine._graphs.metrics()
        assert graphs["hf/graph_warmups"] == graphs["hf/graph_captures"] == graphs["hf/graph_new_loops"] == 0
    assert engine.metrics()["hf/decoded_row_fraction"] < 0.6  # the calls ran in the smaller loops


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_responses_end_at_the_first_eos_or_at_max_tokens(make_engine, cache):
    engine = make_engine(cache=cache)
    out = engine.generate(prompts(engine.tokenizer, ["x"]), SamplingParams(n=64, max_tokens=40, seed=0))
    eos = {0, 1}  # the end ids of the model's generation_config: <|im_end|> and the padding token
    reasons = set(out.finish_reasons)
    assert reasons == {"stop", "length"}  # with ~2% end ids per token, both occur in 64 samples
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] in eos and not eos & set(ids[:-1])
        else:
            assert len(ids) == 40 and not eos & set(ids)


def test_decoding_stops_once_every_sequence_has_ended(make_engine):
    """With every token an end token, each sequence ends at its first; the loop notices and stops."""
    static, dynamic = make_engine(cache="static"), make_engine(cache="dynamic")
    vocab = static.model.config.vocab_size
    static.eos_ids = dynamic.eos_ids = set(range(vocab))
    p = prompts(static.tokenizer, TEXTS)
    out = static.generate(p, SamplingParams(n=2, max_tokens=40, seed=5))
    assert [len(t) for t in out.token_ids] == [1] * 6 and set(out.finish_reasons) == {"stop"}
    assert_same_rollout(out, dynamic.generate(p, SamplingParams(n=2, max_tokens=40, seed=5)))


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    """A tiny model whose greedy responses differ in length (with tied embeddings a random model
    repeats its last token)."""
    from hybridrl_testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("untied"), tie=False, seed=1)


def untied_engine(untied_model, tmp_path, ends=range(3, 30), **options):
    tok = load_tokenizer(untied_model)
    cls = plugins.lookup("rollout engine", "hf")
    engine = cls(cls.Options(cache="static", **options), RunContext(untied_model, tok, torch.device("cpu"),
                                                                      torch.float32, 0, tmp_path))  # fmt: skip
    engine.eos_ids = set(ends)  # by default about a quarter of the tokens end a response
    return engine


MANY = [f"q{i * 37 % 101} {chr(97 + i % 26)}" for i in range(64)]


def test_compacted_decoding_gives_the_same_greedy_responses(untied_model, tmp_path):
    """Once half of the rows have ended, the rest go on in a loop of half as many rows (64 -> 8 -> 4
    here): the same greedy tokens and logprobs as every row running to the end, for fewer row-steps."""
    on, off = untied_engine(untied_model, tmp_path), untied_engine(untied_model, tmp_path, compact_rows=False)
    p = prompts(on.tokenizer, MANY)
    sp = SamplingParams(n=1, max_tokens=80, seed=0, top_k=1)
    a, b = on.generate(p, sp), off.generate(p, sp)
    lengths = sorted(len(t) for t in a.token_ids)
    assert lengths[0] < 16 < lengths[-1]  # some end before the first check, some go on after it
    assert_same_rollout(a, b)
    assert sorted(on._loop_state.smaller) == [4, 8] and not off._loop_state.smaller
    saved, whole = on.metrics()["hf/decoded_row_fraction"], off.metrics()["hf/decoded_row_fraction"]
    assert saved < 0.5 and whole == 1.0
    assert on.metrics() == {}  # read once per step
    assert_same_rollout(on.generate(p, sp), b)  # the smaller loops serve the next call too


def test_compiled_compacted_decoding_equals_eager_whole_rows(untied_model, tmp_path):
    """compile 'on' on the CPU: the loops of fewer rows take the compiled step too, and the greedy
    responses are those of the eager loop that keeps every row (the call of 64 rows goes down to
    8 and 4)."""
    eager = untied_engine(untied_model, tmp_path, compact_rows=False)
    compiled = untied_engine(untied_model, tmp_path, compile="on", compile_after=1)
    p = prompts(eager.tokenizer, MANY)
    sp = SamplingParams(n=1, max_tokens=48, seed=0, top_k=1)
    assert_same_rollout(compiled.generate(p, sp), eager.generate(p, sp))
    assert sorted(compiled._loop_state.smaller) == [4, 8] and compiled._compiled_step is not None


def test_decoding_in_cuda_graphs_keeps_one_prompt_width_and_its_loop(untied_model, tmp_path):
    """Contract test (no CUDA here): a loop's captured CUDA graphs hold the addresses of its cache, so
    a call of another prompt width would rebuild the loop, and each of its sizes would run once
    without graphs and capture them again. Eager decoding in CUDA graphs therefore pads prompts to
    the widest bucket from the data's longest on,
    as compiled decoding does: calls of short and long prompts keep one loop (and its graphs), and
    the responses are those of a loop padded for each call."""
    from hybridrl.builtin.hf_fast_path import keeps_prompt_width

    assert keeps_prompt_width(False, True, True, 16)  # eager, static cache, CUDA graphs
    assert keeps_prompt_width(True, True, False, 0)  # compiled: one width, graphs or not
    assert not keeps_prompt_width(False, True, True, 0) and not keeps_prompt_width(False, True, False, 16)
    assert not keeps_prompt_width(False, False, True, 16)  # generate's dynamic cache: nothing kept

    tok = load_tokenizer(untied_model)
    long = [("x" * 70) + m for m in MANY[:8]]
    cls = plugins.lookup("rollout engine", "hf")
    width = max(len(p) for p in prompts(tok, long))
    ctx = RunContext(untied_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path, prompt_tokens=width)
    kept = cls(cls.Options(cache="static", pad_prompts_to_multiple=16), ctx)
    assert not kept._keeps_width and kept._width == 0  # on the CPU, no graphs: each call its own width
    kept._keeps_width = True  # as on CUDA with graph_tokens (keeps_prompt_width above)
    kept._width = -(-width // 16) * 16
    kept.eos_ids = set(range(3, 30))
    per_call = untied_engine(untied_model, tmp_path, pad_prompts_to_multiple=16)
    sp = SamplingParams(n=2, max_tokens=24, seed=0, top_k=1)
    loops = set()
    for texts in (MANY[:8], long, MANY[:8]):  # short prompts, long ones (the data's longest), short again
        assert_same_rollout(kept.generate(prompts(tok, texts), sp), per_call.generate(prompts(tok, texts), sp))
        loops.add(id(kept._loop_state))
        assert kept._loop_key[1] == kept._width  # the cache of the data's longest prompt, every call
    assert len(loops) == 1  # one loop, whose graphs a CUDA run keeps


def test_an_evaluation_between_rollouts_keeps_the_rollouts_loop(untied_model, tmp_path):
    """The loops of two shapes are kept: an evaluation's call of other rows (its last call, of fewer
    prompts) leaves the rollouts' loop, its smaller loops and on CUDA their graphs, to the next
    rollout, which would otherwise make and capture them all again; a third shape frees the one
    used least recently. The responses are those of an engine that decoded nothing before."""
    engine = untied_engine(untied_model, tmp_path)
    tok = engine.tokenizer
    rollouts, evaluation, other = (prompts(tok, MANY[a:b]) for a, b in ((0, 16), (16, 22), (22, 25)))
    sp, greedy = SamplingParams(n=2, max_tokens=40, seed=0), SamplingParams(n=1, max_tokens=40, top_k=1)
    engine.generate(rollouts, sp)
    loop, smaller = engine._loop_state, dict(engine._loop_state.smaller)
    assert smaller  # some rows ended early: the rollouts' loop made smaller ones
    assert_same_rollout(
        engine.generate(evaluation, greedy), untied_engine(untied_model, tmp_path).generate(evaluation, greedy)
    )
    assert_same_rollout(engine.generate(rollouts, sp), untied_engine(untied_model, tmp_path).generate(rollouts, sp))
    assert engine._loop_state is loop and loop.smaller == smaller  # the same loops, not made again
    engine.generate(other, greedy)
    width = engine._loop_key[1]  # every prompt here pads to one width
    assert list(engine._loops) == [(32, width, 40), (3, width, 40)]  # the evaluation's, least recent: freed


def test_compiled_decoding_compiles_once_for_every_row_count_and_prompt_width(untied_model, tmp_path):
    """One compiled step serves the loops of every row count (rows and cache length dynamic) and
    calls of shorter prompts (padded to the widest so far, from the data's longest): a run whose
    response and prompt lengths vary compiles once, not at the step where a new shape first
    appears. The time it took is reported (hf/compile_s); the responses are the eager loop's."""
    from torch._dynamo.utils import counters

    tok = load_tokenizer(untied_model)
    long = [("x" * 70) + m for m in MANY]
    width = max(len(p) for p in prompts(tok, long))
    cls = plugins.lookup("rollout engine", "hf")
    ctx = RunContext(untied_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path, prompt_tokens=width)
    compiled = cls(cls.Options(cache="static", compile="on", batch_size=32, compile_after=1), ctx)
    eager = untied_engine(untied_model, tmp_path, compact_rows=False)
    compiled.eos_ids = set(range(3, 30))
    sp = SamplingParams(n=1, max_tokens=48, seed=0, top_k=1)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for texts in (MANY, long, MANY[:20], long):  # rows 32 down to 2; two prompt buckets; a short call
        assert_same_rollout(compiled.generate(prompts(tok, texts), sp), eager.generate(prompts(tok, texts), sp))
    assert sorted(compiled._loop_state.smaller) == [2, 4]  # the compacted loops ran
    assert counters["stats"]["unique_graphs"] - before == 1
    assert compiled.metrics()["hf/compile_s"] > 0


def test_compiling_in_the_background_decodes_eagerly_until_ready_and_samples_the_same(
    untied_model, tmp_path, capsys, monkeypatch
):
    """compile: background. The first call decodes eagerly while a process of its own compiles the step
    into the compile cache; the calls after it is done load it and decode compiled, the loops of fewer
    rows too, with nothing compiled in this process. Every call samples the eager engine's tokens. Closed
    while it compiles, the engine leaves it to finish."""
    from torch._dynamo.utils import counters

    from hybridrl import compile

    monkeypatch.setattr(compile, "_keyed", KEYED)  # the compile cache is how the step arrives
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    background = untied_engine(untied_model, tmp_path, compile="background", compile_after=1, batch_size=32)
    eager = untied_engine(untied_model, tmp_path)
    assert background.static and background.compile
    p = prompts(background.tokenizer, MANY)
    sampled = lambda seed: SamplingParams(n=2, max_tokens=48, seed=seed, temperature=1.0)  # noqa: E731
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    assert_same_rollout(background.generate(p[:32], sampled(0)), eager.generate(p[:32], sampled(0)))
    child = background._background.child
    assert child is not None and "compiling the decoding step in the background" in capsys.readouterr().out
    background._background.close()  # the engine's close: a child still compiling goes on, for the next run
    assert child.poll() is None and f"(process {child.pid}) goes on after the run" in capsys.readouterr().out
    assert child.wait(timeout=600) == 0 and not background._precompiled.variants
    calls = []
    assert_same_rollout(background.generate(p[32:], sampled(1)), eager.generate(p[32:], sampled(1)))
    for variant in background._precompiled.variants:  # loaded at this call (the child's loop of one row has its own)
        variant.fn = lambda *args, fn=variant.fn: calls.append(args[1].rows) or fn(*args)
    assert_same_rollout(background.generate(p[:32], sampled(2)), eager.generate(p[:32], sampled(2)))
    assert 64 in calls and background._loop_state.smaller  # the loaded step ran; the loops of fewer rows too,
    assert counters["stats"]["unique_graphs"] == before  # as nothing compiled in this process
    metrics = background.metrics()
    assert metrics["hf/eager_calls"] == 1 and metrics["hf/compile_s"] > 0  # loading it
    assert "compiled in the background, loaded in" in capsys.readouterr().out


def test_background_compiling_without_room_for_the_child_on_the_gpu_stays_eager(monkeypatch, capsys):
    """A GPU without room for the compiling process (the engine's weights again, and a GiB for its cache and
    context) starts none: every call decodes eagerly, none compiles in the run's process, and it says so."""
    from types import SimpleNamespace

    from hybridrl.builtin.hf_background import Background

    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 + 2**21, 80 * 2**30))  # 1 GiB + 2 MiB free
    step = SimpleNamespace(fallback=None, variants=[], folder="cache")
    ctx = SimpleNamespace(device=torch.device("cuda", 1), is_main=True)
    engine = SimpleNamespace(ctx=ctx, model=model, _precompiled=step, _graph_key=lambda *a: "k", _is_end=None, pad_id=0)
    loop = SimpleNamespace(rows=8, lengths=(16, 32))
    background = Background()
    assert [background.compiled_now(engine, loop, None, None) for _ in range(3)] == [False] * 3
    assert background.child is None and background.eager_calls == 3 and not background.room
    said = capsys.readouterr().out
    assert "cuda:1 has 1.0 GiB free, under the 1.0 GiB" in said and "decoding stays eager" in said
    # adapters synced unmerged: the child's model has none, so its step would not fit; the call compiles, no child
    engine.model, background = torch.nn.ModuleDict({"q": torch.nn.Module()}), Background()
    engine.model.q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2)})  # q.lora_A.default.weight
    assert background.compiled_now(engine, loop, None, None) and background.child is None and background.room


def test_the_compiling_child_finds_hybridrl_where_the_run_found_it(monkeypatch, tmp_path):
    """The child imports hybridrl from this process's sys.path (a checkout put on it by a script, as the
    benchmarks do), not only from what the interpreter's own path has: on a GPU machine it failed with
    'No module named hybridrl' and the run fell back to compiling in the call."""
    import subprocess
    from types import SimpleNamespace

    from hybridrl.builtin.hf_background import Background

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, env, **out: started.append(env) or SimpleNamespace())
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "checkout")])
    ctx = SimpleNamespace(device=torch.device("cpu"), is_main=False, model_path="m", dtype=torch.float32,
                          trust_remote_code=False)  # fmt: skip
    options = SimpleNamespace(model_dump=lambda mode: {})
    engine = SimpleNamespace(ctx=ctx, model=torch.nn.Linear(2, 2), options=options)
    sampling = SamplingParams(n=1, max_tokens=4)
    Background().start(engine, SimpleNamespace(rows=4, lengths=(8, 4)), sampling)
    assert started[0]["PYTHONPATH"].split(os.pathsep)[-1] == str(tmp_path / "checkout")


def test_a_sampling_setting_compiles_at_its_third_call(untied_model, tmp_path):
    """compile_after (3): a setting used once or twice (an evaluation's greedy decoding before and after
    training) decodes eagerly and compiles nothing; the training's compiles at its third call. The
    responses are the eager loop's every time."""
    from torch._dynamo.utils import counters

    compiled = untied_engine(untied_model, tmp_path, compile="on")
    eager = untied_engine(untied_model, tmp_path, compact_rows=False)
    p = prompts(compiled.tokenizer, MANY[:16])
    greedy = SamplingParams(n=1, max_tokens=24, top_k=1)
    training = SamplingParams(n=1, max_tokens=24, top_k=1, temperature=0.7, seed=0)  # another setting, exact tokens
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    graphs = []
    for sampling in (greedy, training, training, greedy, training):
        assert_same_rollout(compiled.generate(p, sampling), eager.generate(p, sampling))
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs == [0, 0, 0, 0, 1]  # only the training setting's third call compiled
    # the run's own setting (RunContext.sampling: the rollout section's) compiles at its first call
    cls = plugins.lookup("rollout engine", "hf")
    ctx = RunContext(untied_model, compiled.tokenizer, torch.device("cpu"), torch.float32, 0, tmp_path,
                     sampling=Sampling(n=1, max_tokens=24, top_k=1, temperature=0.7))  # fmt: skip
    run = cls(cls.Options(cache="static", compile="on"), ctx)
    run.eos_ids = compiled.eos_ids
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    assert_same_rollout(run.generate(p, training), eager.generate(p, training))
    assert counters["stats"]["unique_graphs"] - before == 1


def test_compile_auto_compiles_where_the_run_pays_it_back(tmp_path, monkeypatch):
    """On CUDA, compile auto compiles decoding when the run plans two million response tokens or
    more: a 40-step run of 256 responses of up to 32 tokens (328k) stays eager, as measured faster
    end to end on an H200 (BENCHMARKS.md), and so do 200 such steps (1.6M); 300 (2.5M), or a run
    with no planned end, compile (a cold compile cache: a warm one is in test_single_strategy.py)."""
    from hybridrl import compile as compile_module
    from hybridrl.builtin.hf_fast_path import compile_pays

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_module, "_pending", {})

    def ctx(steps):
        return RunContext("", None, torch.device("cuda"), torch.float32, 0, tmp_path, response_tokens=32,
                          responses_per_call=256, steps=steps)  # fmt: skip

    assert not compile_pays("auto", ctx(40)) and not compile_pays("auto", ctx(200))
    assert compile_pays("auto", ctx(300)) and compile_pays("auto", ctx(None))


@pytest.mark.parametrize(
    "rows, running, call_rows, floor, want",
    [
        (512, 20, 512, 64, 64),  # halved while the running rows fill at most half, down to the GPU's 64
        (512, 20, 512, 1, 32),  # a sixteenth of the call's rows at most
        (512, 300, 512, 1, 512),  # more than half running: stay
        (256, 128, 512, 1, 128),  # exactly half
        (64, 5, 64, 64, 64),  # a call of 64 rows on a GPU stays whole
        (64, 5, 64, 1, 8),
        (24, 2, 24, 1, 3),  # odd counts stop halving
    ],
)
def test_compacted_rows(rows, running, call_rows, floor, want):
    assert compacted_rows(rows, running, call_rows, floor) == want


@pytest.mark.parametrize("stop", [[], ["Z"]])
def test_compacted_decoding_logprobs_equal_trainer_logprobs(untied_model, tmp_path, stop):
    """Sampled rows moved between loops keep their cache, positions and masks: their logprobs are
    the trainer's for the tokens they return."""
    engine = untied_engine(untied_model, tmp_path, ends=range(3, 8))
    tok = engine.tokenizer
    p = prompts(tok, MANY[:16])
    out = engine.generate(p, SamplingParams(n=4, max_tokens=60, seed=2, stop=stop))
    assert engine.metrics()["hf/decoded_row_fraction"] < 1.0
    if stop:
        assert any(ids and tok.decode(ids).endswith("Z") for ids in out.token_ids)
    batch = Batch.from_rollout(p, out, 4, tok.pad_token_id)
    policy = load_causal_lm(untied_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1])
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item() < 1e-4


STOPS = ["e", "t", "a"]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_strings_keep_the_fast_path_and_equal_generate(make_engine, ignore_eos):
    """rollout.stop on the static cache runs our decoding loop, not generate, and gives generate's
    samples; a response ends with the token that completes its stop string, or its first end token,
    whichever comes first (generate pads a row after its stop string with the padding token, itself
    an end id here, which must not end up in the response). Without compact_rows: moving the rows
    still running to a smaller loop gives them other random draws than generate's."""
    dynamic = make_engine(cache="dynamic")
    static = make_engine(cache="static", pad_prompts_to_multiple=16, compact_rows=False)
    calls = []
    loop = static._decode
    static._decode = lambda *a: calls.append(1) or loop(*a)
    tok = static.tokenizer
    p = prompts(tok, TEXTS)
    sp = SamplingParams(n=4, max_tokens=30, seed=3, temperature=0.7, stop=STOPS, ignore_eos=ignore_eos)
    out = static.generate(p, sp)
    assert calls and "stop" in out.finish_reasons
    assert_same_rollout(out, dynamic.generate(p, sp))
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        text = tok.decode(ids)
        if reason == "length":
            assert len(ids) == 30 and not any(s in text for s in STOPS)
        elif any(s in text for s in STOPS):  # ended by its stop string: at the token completing it
            assert not any(s in tok.decode(ids[:-1]) for s in STOPS)
        else:  # ended by an end token before any stop string
            assert not ignore_eos and ids[-1] in static.eos_ids


def test_decoding_stops_once_every_sequence_has_met_a_stop_string(make_engine):
    """Every token's text holds a stop string: each response is one token, and the loop ends at the
    first check instead of running to max_tokens."""
    import string

    from hybridrl.builtin.rollout_hf import FINISHED_CHECK_EVERY

    engine = make_engine(cache="static")
    steps = []
    step = engine._step
    engine._step = lambda *a: steps.append(1) or step(*a)
    out = engine.generate(
        prompts(engine.tokenizer, TEXTS), SamplingParams(n=2, max_tokens=200, seed=0, stop=list(string.printable))
    )
    assert [len(t) for t in out.token_ids] == [1] * 6 and set(out.finish_reasons) == {"stop"}
    assert len(steps) == FINISHED_CHECK_EVERY - 1  # the prefill gave the first token


@pytest.mark.parametrize("boolean", [True, False])
def testgrouped_decode_attention_equals_sdpa(boolean):
    """Decoding attention without copying KV heads: the same numbers as transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    keep = torch.rand(2, 1, 1, 12) > 0.3
    mask = keep if boolean else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    ours, _ = grouped_decode_attention(Attention(), q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(Attention(), q, k, v, mask, scaling=0.3)
    assert ours.shape == ref.shape == (2, 1, 6, 8)
    assert (ours - ref).abs().max().item() < 1e-5


def test_static_engine_decodes_with_grouped_attention(make_engine):
    static, dynamic = make_engine(cache="static"), make_engine(cache="dynamic")
    assert static.grouped_attention and static.model.config._attn_implementation == GROUPED_ATTENTION
    assert not dynamic.grouped_attention and dynamic.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_ignore_eos_generates_exactly_max_tokens_from_the_unmasked_distribution(make_engine, tiny_model, cache):
    engine = make_engine(cache=cache)
    p = prompts(engine.tokenizer, ["x"])
    out = engine.generate(p, SamplingParams(n=16, max_tokens=40, seed=0, ignore_eos=True))
    assert [len(t) for t in out.token_ids] == [40] * 16 and set(out.finish_reasons) == {"length"}
    eos = engine.tokenizer.eos_token_id
    assert any(eos in t[:-1] for t in out.token_ids)  # EOS is sampled like any token, and generation goes on
    # the recorded logprobs are those of the model's distribution, EOS included (not renormalised without it)
    batch = Batch.from_rollout(p, out, 16, engine.tokenizer.pad_token_id)
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, 40)
    assert (lp - batch["rollout_logprobs"]).abs().max().item() < 1e-4


def test_update_weights_changes_generation(engine, tiny_model):
    p = prompts(engine.tokenizer, ["abc"])
    sp = SamplingParams(n=1, max_tokens=6, temperature=1e-3, seed=0)  # near greedy
    before = engine.generate(p, sp).token_ids
    other = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    torch.manual_seed(123)
    with torch.no_grad():
        for t in other.parameters():
            t.add_(torch.randn_like(t))
    engine.update_weights(other.state_dict().items())
    after = engine.generate(p, sp).token_ids
    assert after != before
    for name, t in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t)


def test_lower_precision_copy_converts_synced_weights(make_engine, tiny_model):
    engine = make_engine(dtype="bfloat16")
    assert engine.model.dtype == torch.bfloat16
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for t in policy.parameters():
            t.mul_(1.5)
    engine.update_weights(policy.state_dict().items())
    for name, t in policy.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t.to(torch.bfloat16))
    assert len(engine.generate(prompts(engine.tokenizer, ["abc"]), SamplingParams(n=1, max_tokens=4)).token_ids) == 1


def matmuls_of_compiled_forward(model, ids) -> int:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(lambda x: model(x).logits), ids)
    return sum("\n".join(code).count(f"extern_kernels.{op}(") for op in ("mm", "addmm", "bmm"))


def test_fused_projections_run_one_matmul_per_group_with_the_same_outputs(make_engine):
    plain, fused = make_engine(cache="static", fuse_projections="off"), make_engine(cache="static")
    layers = plain.model.config.num_hidden_layers
    assert plain.fused_groups == 0 and fused.fused_groups == 2 * layers  # attention + MLP of each layer
    assert sum(isinstance(m, FusedGroup) for m in fused.model.modules()) == 2 * layers
    assert list(fused.model.state_dict()) == list(plain.model.state_dict())  # same names to sync
    ids = torch.randint(0, plain.model.config.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.allclose(fused.model(ids).logits, plain.model(ids).logits, atol=1e-5)
    # q/k/v: 3 -> 1 and gate/up: 2 -> 1 per layer; o, down and the output layer stay
    assert matmuls_of_compiled_forward(plain.model, ids) - matmuls_of_compiled_forward(fused.model, ids) == 3 * layers
    sp = SamplingParams(n=2, max_tokens=12, seed=0)
    p = prompts(plain.tokenizer, TEXTS)
    assert fused.generate(p, sp).token_ids == plain.generate(p, sp).token_ids


def test_fused_projections_follow_synced_weights(make_engine, tiny_model):
    plain, fused = make_engine(cache="static", fuse_projections="off"), make_engine(cache="static")
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():
        for t in policy.parameters():
            t.add_(0.5 * torch.randn_like(t))
    for engine in (plain, fused):
        engine.update_weights(policy.state_dict().items())
    attn = fused.model.model.layers[0].self_attn
    group = attn.hybridrl_fused_q_proj
    want = torch.cat([policy.model.layers[0].self_attn.get_submodule(n).weight for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(group.weight, want)  # the layers' parameters are views of the concatenation
    ids = torch.randint(0, policy.config.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.allclose(fused.model(ids).logits, policy(ids).logits, atol=1e-4)
    sp = SamplingParams(n=2, max_tokens=12, seed=0)
    p = prompts(plain.tokenizer, TEXTS)
    assert fused.generate(p, sp).token_ids == plain.generate(p, sp).token_ids


def test_update_weights_rejects_unknown_names(engine):
    with pytest.raises(KeyError, match="'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])


def load(rollout):
    base = {"model": {"path": "unused"}, "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 10}}
    return load_config(data={**base, "rewards": [{"function": "reasoning_gym"}], "rollout": rollout})


def test_options_validate_and_name_the_choices():
    assert (
        load({"engine": "hf", "cache": "static", "compile": "off", "dtype": "float16"}).rollout.options.cache
        == "static"
    )
    with pytest.raises(ConfigError, match=r"rollout\.cache: Input should be 'auto', 'dynamic' or 'static'"):
        load({"engine": "hf", "cache": "fast"})
    with pytest.raises(
        ConfigError, match=r"rollout\.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"
    ):
        load({"engine": "hf", "dtype": "fp8"})
    with pytest.raises(ConfigError, match="compile 'on' needs the static cache"):
        load({"engine": "hf", "cache": "dynamic", "compile": "on"})


CUSTOM_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class TinyCustomConfig(LlamaConfig):
    model_type = "tinycustom"


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


def test_model_with_its_own_code_loads_with_trust_remote_code(tiny_model, tmp_path):
    """model.trust_remote_code reaches the engine's copy, not only the trainer's."""
    import json
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(tiny_model, folder)
    (folder / "custom_model.py").write_text(CUSTOM_CODE)
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "model_type": "tinycustom",
        "architectures": ["TinyCustomForCausalLM"],
        "auto_map": {
            "AutoConfig": "custom_model.TinyCustomConfig",
            "AutoModelForCausalLM": "custom_model.TinyCustomForCausalLM",
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    cls = plugins.lookup("rollout engine", "hf")
    ctx = RunContext(str(folder), tok, torch.device("cpu"), torch.float32, 0, tmp_path, trust_remote_code=True)
    engine = cls(cls.Options(), ctx)
    assert type(engine.model).__name__ == "TinyCustomForCausalLM"
    with pytest.raises(ValueError, match="trust_remote_code"):
        cls(cls.Options(), RunContext(str(folder), tok, torch.device("cpu"), torch.float32, 0, tmp_path))


def test_the_trainer_tells_engines_how_many_responses_a_call_holds(tiny_model, tmp_path):
    """Engines size themselves (CUDA graphs, batch slots) by the responses one generate call asks for."""
    from hybridrl.config import load_config
    from hybridrl.run import build_run

    cfg = load_config(data={
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
        "rollout": {"n": 6},
        "rewards": [{"function": "reasoning_gym"}],
        "trainer": {"prompts_per_step": 5, "run_dir": str(tmp_path / "run")},
        "logging": {"loggers": []},
    })  # fmt: skip
    run = build_run(cfg)
    assert run.engine.ctx.responses_per_call == 30  # what SGLang sizes its CUDA graphs by
