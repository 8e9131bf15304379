"""``hybridrl import verl|trl``: a verl or TRL config as a hybridrl config, with what has no
equivalent said on stderr (docs/migrating.md).

    hybridrl import verl ppo.yaml data.train_batch_size=256 -o run.yaml
    hybridrl import trl grpo.yaml per_device_train_batch_size=4 --world-size 8 -o run.yaml

:func:`translate` returns a :class:`~hybridrl_migrate.common.Translation`: the config as a mapping
(``load_config(data=...)`` takes it) and its report. The command comes through this plugin's
``register_commands``, as any third party's would.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import yaml

from hybridrl.config_files import load_yaml
from hybridrl.errors import ConfigError
from hybridrl.hookspecs import hookimpl
from hybridrl_migrate import trl, verl
from hybridrl_migrate.common import Translation, apply_items, flatten

__all__ = ["Translation", "add_parser", "command", "translate"]
__version__ = "0.1.0"

FILE_SUFFIXES = (".yaml", ".yml", ".json")


def translate(
    framework: str, items: list[str], *, train_rows: int | None = None, world_size: int | None = None
) -> Translation:
    """``items``: config files (YAML or JSON) and ``key=value`` settings, in order (later ones win).
    verl: its nested config and Hydra overrides. trl: GRPOConfig's arguments (and the ``trl grpo``
    script's: model_name_or_path, dataset_name, reward_funcs...)."""
    files = [i for i in items if "=" not in i and not i.startswith("~")]
    settings = [i for i in items if i not in files]
    data: dict = {}
    for name in files:
        data |= read_file(name)
    if framework == "verl":
        if "defaults" in data:
            raise ConfigError(
                "the config has Hydra 'defaults' (it composes verl's ppo_trainer.yaml); give the settings it "
                "changes as overrides, or verl's generated config (_generated_ppo_trainer.yaml) with them applied."
            )
        added = frozenset(i.split("=", 1)[0].lstrip("+").strip() for i in settings if i.startswith("+"))
        return verl.translate(apply_items(flatten(data), settings), train_rows=train_rows, added=added)
    if framework == "trl":
        given = dict(data)
        for key, value in apply_items({}, settings).items():  # script keyword arguments: flat names
            given[key.split(".", 1)[0]] = _nest(key, value, given)
        return trl.translate(given, train_rows=train_rows, world_size=world_size)
    raise ConfigError(f"Unknown framework '{framework}'. Available: trl, verl.")


def _nest(key: str, value, given: dict):
    """``model_init_kwargs.dtype=bfloat16`` into the mapping under model_init_kwargs."""
    if "." not in key:
        return value
    top, rest = key.split(".", 1)
    node = dict(given.get(top) or {})
    node[rest] = value
    return node


def read_file(name: str) -> dict:
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"Config file not found: {name} (settings are key=value).")
    if path.suffix != ".json":  # YAML read with limits (aliases, nesting, numbers): hybridrl's own reader
        data = load_yaml(path.read_text(), name)
    else:
        try:  # no setting takes a number over 100 digits (int() stops at 4300, with a traceback) or infinite
            data = json.loads(path.read_text(), parse_float=_number, parse_int=_number, parse_constant=_number)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"{name} is not valid JSON: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must hold a mapping of settings.")
    return data


def _number(text: str):
    """A JSON number, refused (ValueError) over 100 characters or when not finite (1e400, NaN, Infinity)."""
    if len(text) > 100 or not math.isfinite(float(text)):
        raise ValueError(f"the number {text[:20]} is out of range")
    return int(text) if text.lstrip("-").isdigit() else float(text)


@hookimpl
def register_commands(subparsers) -> None:
    add_parser(subparsers)


def add_parser(subparsers) -> None:
    """The ``import`` subcommand of the ``hybridrl`` command line."""
    p = subparsers.add_parser(
        "import", help="Translate a verl or TRL config into a hybridrl config (docs/migrating.md)."
    )
    p.add_argument("framework", choices=["verl", "trl"])
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="CONFIG | key=value",
        help="Config files (YAML/JSON) and settings: verl's Hydra overrides (data.train_batch_size=256), TRL's "
        "GRPOConfig arguments (per_device_train_batch_size=4).",
    )
    p.add_argument("-o", "--output", help="Write the hybridrl config here (default: standard output).")
    p.add_argument(
        "--train-rows",
        type=int,
        help="Rows of the training data, which turn epochs into steps (default: counted where the files are here).",
    )
    p.add_argument("--world-size", type=int, help="trl: processes of the accelerate launch (default 1).")
    p.set_defaults(func=command)


def command(args) -> int:
    from hybridrl import preflight
    from hybridrl.config import load_config

    t = translate(args.framework, args.overrides, train_rows=args.train_rows, world_size=args.world_size)
    text = t.yaml()
    if args.output:
        out = Path(args.output)
        out.write_text(text)
    else:
        sys.stdout.write(text)
    report = t.report.text()
    if report:
        print(report, file=sys.stderr)
    where = args.output or "the config above"
    try:  # as hybridrl validate checks it; relative paths are looked up beside the written file, as a run will
        cfg = load_config(out) if args.output else load_config(data=yaml.safe_load(text))
        preflight.check(cfg)
    except preflight.FAILURES as e:
        print(f"error: {where} does not validate: {e}", file=sys.stderr)
        return 1
    print(
        f"{where}: valid (algorithm '{cfg.algorithm.name}', rollout '{cfg.rollout.engine}', "
        f"sharding '{cfg.sharding.strategy}', {cfg.trainer.steps} steps of {cfg.trainer.prompts_per_step} prompts)",
        file=sys.stderr,
    )
    return 0
