"""Config files as text: YAML read with limits, dotted overrides, ``${env:VAR}`` references, secrets
redacted wherever a run writes (config, logs), and pydantic's validation errors said in words.

Nothing here knows the run config's sections (:mod:`hybridrl.config` does): these work on any
mapping or pydantic model.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hybridrl.errors import ConfigError, did_you_mean


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``rollout.n=8`` sets data["rollout"]["n"] = 8; values are parsed as YAML; list items by index."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override '{item}' must look like key.subkey=value (e.g. trainer.steps=5).")
        key, raw = item.split("=", 1)
        value = load_yaml(raw, f"Override '{item}'") if raw else None
        node: Any = data
        parts = key.split(".")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"Override '{key}': '{part}' is not an index of a list of {len(node)}.")
                part = int(part)
            elif not isinstance(node, dict):
                raise ConfigError(f"Override '{key}': '{'.'.join(parts[:i])}' is not a section.")
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return data


# -- reading YAML: PyYAML's SafeLoader has no limits of its own ---------------------------

MAX_YAML_VALUES = 100_000  # a config holds hundreds; a "billion laughs" (aliases of aliases) a billion


class _Loader(yaml.SafeLoader):
    """SafeLoader refusing what no config needs and what would stop the process: aliases that expand a
    document past MAX_YAML_VALUES values or into itself, integers over 100 digits, numbers not finite."""

    def compose_document(self):
        node = super().compose_document()
        if node is not None and _expanded(node, {}, set()) > MAX_YAML_VALUES:
            raise yaml.YAMLError(f"its aliases expand it to more than {MAX_YAML_VALUES:,} values")
        return node

    def construct_number(self, node):
        construct = self.construct_yaml_float if node.tag.endswith("float") else self.construct_yaml_int
        value = construct(node) if len(node.value) <= 100 else math.inf  # int() refuses past 4300 digits
        if not math.isfinite(value):
            raise yaml.constructor.ConstructorError(None, None, f"{node.value[:20]} is out of range", node.start_mark)
        return value


for _tag in ("int", "float"):
    _Loader.add_constructor(f"tag:yaml.org,2002:{_tag}", _Loader.construct_number)


def _expanded(node, sizes: dict, open_: set) -> int:
    """How many values ``node`` holds with its aliases followed (an alias shares its anchor's node)."""
    if id(node) in open_ and id(node) not in sizes:
        raise yaml.YAMLError(f"an alias at line {node.start_mark.line + 1} refers to a value that holds it")
    open_.add(id(node))
    inner = node.value if isinstance(node, yaml.SequenceNode) else []
    inner = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else inner
    return sizes.get(id(node)) or sizes.setdefault(id(node), 1 + sum(_expanded(n, sizes, open_) for n in inner))


def load_yaml(text: str, where: str):
    """``text`` read as YAML by :class:`_Loader`, or a ConfigError of one line naming ``where``."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), " ".join(str(getattr(e, "problem", None) or e).split())
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}.") from None
    except RecursionError:
        raise ConfigError(f"{where} is not valid YAML here: it nests values too deep to read.") from None


def beside_config(cfg: BaseModel, folder: Path) -> None:
    """Make the relative input paths of ``cfg`` that exist under ``folder`` (the config file's) absolute.
    Others stay as given: paths relative to the current directory, hub names, ``package:NAME``."""

    def beside(value):
        if isinstance(value, list):
            return [beside(v) for v in value]
        if isinstance(value, dict):
            return {k: beside(v) for k, v in value.items()}
        if not isinstance(value, str) or ":" in value or Path(value).expanduser().is_absolute():
            return value
        found = folder / value
        return str(found.resolve()) if found.exists() else value

    for model in config_models(cfg):
        for name, field in type(model).model_fields.items():
            if (field.json_schema_extra or {}).get("input_path") and getattr(model, name) is not None:
                setattr(model, name, beside(getattr(model, name)))


def config_models(model: BaseModel):
    """``model`` and every model inside it, plugin options included."""
    yield model
    inner = [getattr(model, name) for name in type(model).model_fields]
    inner += [getattr(model, "_options", None), getattr(model, "_tool_options", None)]
    for value in inner:
        for item in value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                yield from config_models(item)


def keys_of(model: type[BaseModel]) -> list[str]:
    """The keys a config file uses for ``model`` (``async``, not the attribute ``async_``)."""
    return sorted(f.alias or name for name, f in model.model_fields.items())


def format_validation_error(e: ValidationError, root: type[BaseModel]) -> str:
    lines = []
    for err in e.errors():
        loc = err["loc"]
        dotted = ".".join(str(x) for x in loc)
        if err["type"] == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            keys = keys_of(parent) if parent else []
            where = ".".join(str(x) for x in loc[:-1]) or "the top level"
            hint = did_you_mean(loc[-1], keys)
            lines.append(f"Unknown key '{loc[-1]}' in {where}.{hint} Valid keys: {', '.join(keys) or '?'}.")
        elif err["type"] == "missing":
            lines.append(f"Missing required key '{dotted}'.")
        elif err["type"] == "value_error" and not loc:
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{dotted}: {err['msg']} (got {_got(err)}).")
    return "\n".join(lines)


def options_error(e: ValidationError, where: str, component: str, core_keys: list[str], own_keys: list[str]) -> str:
    """A plugin's options that did not validate, in words: an unknown key lists the section's core
    keys (``core_keys``) and the ``component``'s own; a missing or bad one is named with its section."""
    lines = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            mine = ", ".join(own_keys) or "(none)"
            valid = f"{', '.join(core_keys)}; and for {component}: {mine}." if core_keys else f"{mine}."
            hint = did_you_mean(key, [*core_keys, *own_keys])
            lines.append(f"Unknown key '{key}' in {where} ({component}).{hint} Valid keys: {valid}")
        elif err["type"] == "missing":
            lines.append(f"Missing required key '{where}.{key}' for {component}.")
        elif err["type"] == "value_error" and not key:  # the section's own check, over its keys
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}.")
        else:
            lines.append(f"{where}.{key}: {err['msg']} (got {_got(err)}).")
    return "\n".join(lines)


def _got(err) -> str:
    """The value a validation error names, or ``'<redacted>'`` under a secret key (:func:`is_secret`)."""
    return repr(REDACTED if any(is_secret(x) for x in err["loc"]) else err.get("input"))


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", None)
        if args:  # list[RewardConfig] or X | None
            ann = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


# -- secrets ------------------------------------------------------------------------------

ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
REDACTED = "<redacted>"
SECRET_WORDS = {"token", "key", "apikey", "secret", "password", "passwd", "credential", "credentials", "auth", "bearer"}
SECRET_WORDS |= {"authorization", "cookie"}
#: a key ending in one names secrets (``api_keys``, ``hf_tokens``) unless the word before says it counts tokens
PLURALS, COUNTS = {"keys", "tokens", "secrets", "passwords"}, {"max", "min", "num", "new", "batch", "total", "prompt"}
COUNTS |= {"response", "free", "graph", "logit", "special", "stop", "core", "own"}
#: secrets of a known shape in any string: a bearer credential, a URL's user-info, a URL's query value
SECRET_SHAPES = re.compile(
    r"(?i)(?P<bearer>\bbearer\s+)(?=[\w.~+/=-]*\d)[\w.~+/=-]{8,}|(?P<url>\b[a-z][a-z0-9+.-]*://)[^/\s@?#]+@"
    r"|(?P<query>[?&](?P<name>[\w.-]+)=)[^&#\s]+"
)
#: the values of 8 characters or more that a ``${env:VAR}`` read -> that ``${env:VAR}`` (shorter ones,
#: a number or a word, are written back at their own key only, not sought in every text)
ENV_VALUES: dict[str, str] = {}


def interpolate_env(value, path: tuple, refs: dict):
    """``value`` with each ``${env:VAR}`` in its strings replaced by the environment variable VAR; the
    path of each string that had one goes into ``refs`` with its text, and the value into :data:`ENV_VALUES`.
    An unset variable, or a ``<redacted>`` that dump_config wrote in place of a secret, is a ConfigError."""
    if isinstance(value, dict):
        return {k: interpolate_env(v, (*path, k), refs) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate_env(v, (*path, i), refs) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    where = ".".join(str(p) for p in path)
    if REDACTED in value:
        raise ConfigError(
            f"{where} is '{value}': the run wrote its config.yaml without this secret. Give it as "
            "'${env:VAR}' (an environment variable that holds it) or with an override."
        )
    missing = [m.group(1) for m in ENV_REF.finditer(value) if m.group(1) not in os.environ]
    if missing:
        raise ConfigError(f"{where} is '{value}', but the environment variable {missing[0]} is not set.")
    if not ENV_REF.search(value):
        return value
    refs[path] = value
    ENV_VALUES.update({os.environ[m[1]]: m[0] for m in ENV_REF.finditer(value) if len(os.environ[m[1]]) >= 8})
    return ENV_REF.sub(lambda m: os.environ[m.group(1)], value)


def is_secret(name) -> bool:
    """Whether a key names a secret: its last word (of snake_case, kebab-case or camelCase) is token, key,
    secret, password, authorization... (``api_key``, ``hf_token``, ``clientSecret``, ``Authorization``; not
    ``max_tokens``, ``token_env``), or keys, tokens... after another word (``api_keys``, not ``keys``)."""
    words = re.findall(r"[a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower())
    if words and words[-1] in PLURALS:
        return len(words) > 1 and words[-2] not in COUNTS
    return bool(words) and words[-1] in SECRET_WORDS


def scrub_env(text: str) -> str:
    """``text`` with each value that a ``${env:VAR}`` read (:data:`ENV_VALUES`) written as ``${env:VAR}``:
    what the run writes in its logs (samples, metric names) and config.yaml."""
    for value in sorted(ENV_VALUES, key=len, reverse=True):
        text = text.replace(value, ENV_VALUES[value])
    return text


def _hide(m: re.Match) -> str:
    if "${env:" in m.group(0) or (m["query"] and not is_secret(m["name"])):
        return m.group(0)  # a reference, not the secret; a query value of no secret name
    return f"{m['url']}{REDACTED}@" if m["url"] else f"{m['bearer'] or m['query']}{REDACTED}"


def redact(value, secret: bool = False):
    """``value`` without secrets: every string under a key that :func:`is_secret` names becomes
    ``<redacted>``; in the others, bearer credentials, URL user-info (``https://<redacted>@host``) and
    secret query values (``?token=<redacted>``) do, and ``${env:VAR}`` values are the reference again."""
    if isinstance(value, dict):
        return {redact(k): redact(v, secret or is_secret(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secret) for v in value]
    if not isinstance(value, str) or not value:
        return value
    return REDACTED if secret else SECRET_SHAPES.sub(_hide, scrub_env(value))


def private_open(path, mode: str = "w"):
    """``path`` opened as text (``w`` or ``a``), readable and writable by its owner only from its first
    byte on, an existing file included (O_CREAT keeps its mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC), 0o600)
    with contextlib.suppress(OSError):  # another user's file, writable to this one: it keeps its mode
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode, encoding="utf-8")


def write_config(path, cfg) -> None:
    """The run's config (:func:`dump_config`) in ``path``, readable and writable by its owner only."""
    with private_open(path) as f:
        f.write(dump_config(cfg))


def dump_config(cfg) -> str:
    """The run config as YAML, every default written out (``cfg.complete()``), without secrets
    (:func:`redact`; a :class:`~hybridrl.options.Secret` option is ``<redacted>`` already), and values
    given as ``${env:VAR}`` written as that again."""
    data = redact(cfg.complete())
    for path, text in cfg._env_refs.items():
        node, last = data, path[-1]
        try:
            for part in path[:-1]:
                node = node[part]
        except (KeyError, IndexError, TypeError):  # a key validation moved: its value stays redacted or as is
            continue
        present = last in node if isinstance(node, dict) else isinstance(last, int) and last < len(node)
        if present:
            node[last] = text
    return yaml.safe_dump(data, sort_keys=False)
