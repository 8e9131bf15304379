"""Config validation: errors name the key and list the valid choices."""

from pathlib import Path

import pytest
import yaml
from pydantic import Field

from hybridrl import plugins
from hybridrl.components import Options
from hybridrl.config import ConfigError, apply_overrides, load_config
from hybridrl.config_files import dump_config
from hybridrl.hookspecs import hookimpl

ROOT = Path(__file__).resolve().parent.parent

BASE = {
    "model": {"path": "unused"},
    "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 10},
    "rewards": [{"function": "reasoning_gym"}],
}


def load(extra=None, overrides=()):
    data = {**BASE, **(extra or {})}
    return load_config(data=data, overrides=list(overrides))


def test_valid_config_resolves_plugin_options():
    cfg = load({"rollout": {"engine": "hf", "n": 4, "batch_size": 2}, "algorithm": {"name": "grpo", "kl_coef": 0.1}})
    assert cfg.rollout.n == 4
    assert cfg.rollout.options.batch_size == 2  # the hf engine's own option
    assert cfg.algorithm.options.kl_coef == 0.1
    assert cfg.data.options.task == "chain_sum"


def test_unknown_top_level_key_lists_sections():
    with pytest.raises(ConfigError) as e:
        load({"trainr": {}})
    assert "Unknown key 'trainr' in the top level" in str(e.value)
    assert "trainer" in str(e.value) and "rollout" in str(e.value)


def test_unknown_core_key_says_did_you_mean_then_lists_valid_keys():
    with pytest.raises(
        ConfigError, match=r"^Unknown key 'stepz' in trainer\. Did you mean 'steps'\? Valid keys: .*steps"
    ):
        load({"trainer": {"stepz": 3}})
    with pytest.raises(ConfigError) as e:  # nothing close: the valid keys alone
        load({"trainer": {"zzzz": 3}})
    assert "Did you mean" not in str(e.value) and "Unknown key 'zzzz' in trainer. Valid keys: " in str(e.value)


def test_did_you_mean_is_one_phrase_for_every_unknown_name():
    from hybridrl.errors import did_you_mean

    assert did_you_mean("vlm", ["hf", "sglang", "vllm"]) == " Did you mean 'vllm'?"
    assert did_you_mean("zzz", ["hf", "vllm"]) == ""
    with pytest.raises(ConfigError, match=r"Unknown key 'consol' in logging\. Did you mean 'console'\? Valid keys"):
        load({"logging": {"loggers": ["console"], "consol": {}}})


def test_unknown_section_key_lists_core_and_plugin_keys():
    with pytest.raises(ConfigError) as e:
        load({"rollout": {"engine": "hf", "temprature": 0.5}})
    msg = str(e.value)
    assert "Unknown key 'temprature' in rollout (rollout engine 'hf'). Did you mean 'temperature'? Valid keys: " in msg
    assert "temperature" in msg and "batch_size" in msg
    assert " async," in msg and "async_" not in msg  # keys as a config file spells them


def test_async_is_read_and_written_under_its_yaml_name():
    cfg = load({"rollout": {"engine": "hf", "async": 2}})
    assert cfg.rollout.async_ == 2
    assert "async: 2" in dump_config(cfg)


def test_unknown_plugin_name_lists_available():
    with pytest.raises(ConfigError) as e:
        load({"rollout": {"engine": "vlm"}})
    engines = sorted(plugins.registry()["rollout engine"])
    hint = " Did you mean 'vllm'?" if "vllm" in engines else ""
    assert f"Unknown rollout engine 'vlm' (rollout.engine).{hint} Available: {', '.join(engines)}." in str(e.value)
    assert "hybridrl plugins" in str(e.value)


def test_unknown_reward_function_lists_available():
    with pytest.raises(
        ConfigError, match=r"Unknown reward function .exact. .*Available: answer_match, .*format, .*reasoning_gym"
    ):
        load({"rewards": [{"function": "exact"}]})
    with pytest.raises(ConfigError, match=r"Unknown reward function 'answer_mach' .*\. Did you mean 'answer_match'\?"):
        load({"rewards": [{"function": "answer_mach"}]})


def test_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.n: Input should be greater than 0"):
        load({"rollout": {"n": 0}})


def test_missing_rewards():
    """A run with data needs a reward, said before any model is looked for; one without (hybridrl tinker) does not."""
    from hybridrl import preflight
    from hybridrl.models import ModelNotFoundError

    with pytest.raises(ConfigError, match=r"rewards: the run scores its responses with at least one"):
        preflight.check(load_config(data={"model": {"path": "x"}, "data": BASE["data"]}))
    with pytest.raises(ConfigError, match=r"data.source is null: a training run needs its prompts"):
        preflight.check(load_config(data=BASE | {"model": {"path": "x"}, "data": {"source": None}}))
    with pytest.raises(ModelNotFoundError, match="model.path 'x' does not exist"):  # past both: the model's check
        preflight.check(load_config(data={"model": {"path": "x"}, "data": {"source": None}}), data=False)


def test_duplicate_reward_names_are_rejected():
    with pytest.raises(ConfigError, match="two rewards share a name"):
        load({"rewards": [{"function": "reasoning_gym"}, {"function": "reasoning_gym"}]})


def test_unknown_logger_option_lists_keys():
    with pytest.raises(ConfigError, match="Unknown key 'colour' in logging.console"):
        load({"logging": {"loggers": ["console"], "console": {"colour": True}}})


def test_overrides_set_nested_values_and_list_items():
    cfg = load(overrides=["trainer.steps=5", "rollout.n=2", "rewards.0.weight=0.5", 'rollout.stop=["\\n"]'])
    assert cfg.trainer.steps == 5 and cfg.rollout.n == 2 and cfg.rewards[0].weight == 0.5
    assert cfg.rollout.stop == ["\n"]


def test_override_errors():
    with pytest.raises(ConfigError, match="must look like key.subkey=value"):
        apply_overrides({}, ["trainer.steps"])
    with pytest.raises(ConfigError, match="not an index"):
        apply_overrides({"rewards": [{}]}, ["rewards.3.weight=1"])


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_missing_plugin_key_names_section_and_plugin():
    with pytest.raises(ConfigError, match=r"Missing required key 'data.path' for dataset 'hf'"):
        load({"data": {"source": "hf"}})


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_is_valid(path):
    """Every key of the examples exists and every plugin they name is installed (no model loaded)."""
    cfg = load_config(path)
    for kind, name in [
        ("rollout engine", cfg.rollout.engine),
        ("algorithm", cfg.algorithm.name),
        ("sharding strategy", cfg.sharding.strategy),
        *[("reward function", r.function) for r in cfg.rewards],
    ]:
        assert plugins.lookup(kind, name)
    # the config.yaml a run writes has every option, the plugins' defaults too, and reads back the same
    written = dump_config(cfg)
    again = load_config(data=yaml.safe_load(written))
    assert dump_config(again) == written
    assert "compile" in yaml.safe_load(written)["rollout"] or cfg.rollout.engine != "hf"


def test_yaml_on_and_off_are_the_words_of_options_that_take_them(tmp_path):
    """YAML 1.1 reads on/off/yes/no as booleans: an option of on/off words takes them as meant."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {path: unused}\n"
        "data: {source: reasoning_gym, task: chain_sum}\n"
        "rewards: [{function: reasoning_gym}]\n"
        "rollout: {engine: hf, compile: off, fuse_projections: on}\n"
        "algorithm: {name: grpo, rollout_correction: off}\n"
    )
    cfg = load_config(path, ["sharding.mixed_precision=off"])
    assert (cfg.rollout.options.compile, cfg.rollout.options.fuse_projections) == ("off", "on")
    assert cfg.algorithm.options.rollout_correction == "off" and cfg.sharding.options.mixed_precision == "off"
    assert load_config(path, ["trainer.share_prompts=off"]).trainer.share_prompts is False  # a true boolean option
    with pytest.raises(ConfigError, match=r"sharding.mixed_precision: Input should be 'auto', 'off' or 'bf16'"):
        load_config(path, ["sharding.mixed_precision=on"])  # no 'on' to read it as


def test_relative_input_paths_are_found_beside_the_config_file(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "train.jsonl").write_text('{"question": "1 + 1", "answer": "2"}\n')
    (project / "run.yaml").write_text(
        "model: {path: HuggingFaceTB/SmolLM2-135M-Instruct}\n"
        "data: {source: hf, path: data/train.jsonl, prompt_column: question, answer_column: answer}\n"
        "rewards: [{function: answer_match}]\n"
        "trainer: {run_dir: runs/x}\n"
    )
    monkeypatch.chdir(tmp_path)  # anywhere but the config's folder
    cfg = load_config("project/run.yaml")
    assert cfg.data.options.path == str((project / "data" / "train.jsonl").resolve())
    assert cfg.model.path == "HuggingFaceTB/SmolLM2-135M-Instruct"  # no such folder there: a hub name, as given
    assert cfg.trainer.run_dir == "runs/x"  # what the run writes stays relative to the current directory


def test_prompts_shared_and_sequences_packed_at_once_is_refused():
    with pytest.raises(ConfigError, match="share_prompts and trainer.pack_sequences are both true"):
        load({"trainer": {"share_prompts": True, "pack_sequences": True}})
    assert load({"trainer": {"share_prompts": True}}).trainer.pack_sequences == "auto"


class ReportOptions(Options):
    every: int = Field(10, gt=0)
    title: str = "run"


class ReportSection:
    """A plugin that owns a top-level section of the run config, as hybridrl-serve owns 'online'."""

    def __init__(self, name="report"):
        self.name = name

    @hookimpl
    def register_config_sections(self, register):
        register(self.name, ReportOptions)


def test_a_plugin_section_is_validated_overridden_and_written_out(register_plugin, tmp_path):
    register_plugin(ReportSection(), name="report-plugin")
    cfg = load({"report": {"every": 5}}, overrides=["report.title=mine"])
    assert (cfg.section("report").every, cfg.section("report").title) == (5, "mine")
    assert cfg.complete()["report"] == {"every": 5, "title": "mine"}
    assert yaml.safe_load(dump_config(cfg))["report"] == {"every": 5, "title": "mine"}  # the run's config.yaml
    assert load().section("report") == ReportOptions()  # left out: the defaults
    assert load_config(data=yaml.safe_load(dump_config(cfg))).section("report").title == "mine"
    with pytest.raises(ConfigError, match=r"^Unknown key 'evry' in report \(plugin 'report-plugin'\)\. Did you mean"):
        load({"report": {"evry": 5}})
    with pytest.raises(ConfigError, match=r"^report.every: Input should be greater than 0"):
        load(overrides=["report.every=0"])


def test_an_unknown_top_level_key_lists_the_core_sections_and_the_plugins(register_plugin):
    register_plugin(ReportSection(), name="report-plugin")
    with pytest.raises(ConfigError) as e:
        load({"reprot": {}})
    msg = str(e.value)
    assert msg.startswith("Unknown key 'reprot' in the top level. Did you mean 'report'? Valid keys: algorithm, ")
    assert "trainer; and the plugins' sections: " in msg and "report (plugin 'report-plugin')" in msg


def test_a_plugin_section_named_as_a_core_section_is_refused(register_plugin):
    register_plugin(ReportSection("trainer"), name="greedy-plugin")
    with pytest.raises(ConfigError, match="'greedy-plugin' .* registers the config section 'trainer', a section of"):
        load()


def test_a_negative_weight_decay_is_refused():
    with pytest.raises(ConfigError, match=r"trainer\.weight_decay"):
        load(overrides=["trainer.weight_decay=-1e9"])
    assert load(overrides=["trainer.weight_decay=0.1"]).trainer.weight_decay == 0.1


def laughs(levels: int) -> str:
    """A "billion laughs": each level a list of ten aliases of the one before (10**levels values)."""
    lines = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_yaml_that_would_stop_the_process_is_one_error_line(tmp_path):
    """Aliases that expand a document (a billion laughs) or make it hold itself, integers longer than
    int() reads, numbers that are not finite and nesting deeper than Python recurses: each one
    ConfigError line naming the file, before anything expands (PyYAML has no such limits of its own)."""
    from hybridrl.config_files import load_yaml

    path = tmp_path / "cfg.yaml"
    cases = [
        (yaml.safe_dump(BASE) + laughs(6), r"its aliases expand it to more than 100,000 values"),
        (yaml.safe_dump(BASE) + "x: &x [*x]\n", r"an alias at line \d+ refers to a value that holds it"),
        (yaml.safe_dump(BASE) + f"trainer: {{steps: {'7' * 100_000}}}\n", r"77777777777777777777 is out of range"),
        (yaml.safe_dump(BASE) + "trainer: {lr: 1.0e+400}\n", r"1\.0e\+400 is out of range \(line \d+, column \d+\)"),
        ("model: " + "[" * 20_000 + "]" * 20_000 + "\n", "it nests values too deep to read"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"^{path} is not valid YAML.*{message}") as e:
            load_config(path)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="Override 'rewards.0.kwargs=.*' is not valid YAML.*out of range"):
        load(overrides=["rewards.0.kwargs={scale: .inf}"])
    with pytest.raises(ConfigError, match="Override 'trainer.x=.*' is not valid YAML.*too deep"):
        load(overrides=["trainer.x=" + "[" * 20_000 + "]" * 20_000])
    with pytest.raises(ConfigError, match="more than 100,000 values"):
        load_yaml(laughs(9), "laughs.yaml")  # a billion, refused as fast as the thousand
    text = "base: &base {n: 4, temperature: 0.7}\nrollout: {<<: *base, n: 8}\n"
    assert load_yaml(text, "ok.yaml")["rollout"] == {"n": 8, "temperature": 0.7}  # aliases a config needs still work


def test_hybridrl_import_reads_files_with_the_same_limits(tmp_path):
    migrate = pytest.importorskip("hybridrl_migrate")
    cases = [
        ("a.yaml", laughs(9), "its aliases expand it to more than 100,000 values"),
        ("b.json", '{"lr": 1e400}', "the number 1e400 is out of range"),
        ("c.json", '{"n": ' + "7" * 100_000 + "}", "the number 77777777777777777777 is out of range"),
        ("d.json", '{"x": NaN}', "the number NaN is out of range"),
        ("e.json", '{"x": ' + "[" * 20_000 + "]" * 20_000 + "}", "not valid JSON: maximum recursion depth"),
        ("f.yaml", "x: " + "[" * 20_000 + "]" * 20_000, "too deep"),
    ]
    for name, text, message in cases:
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=message) as e:
            migrate.read_file(str(tmp_path / name))
        assert "\n" not in str(e.value) and name in str(e.value)
