"""Config files as text: dotted command-line overrides, ``${env:VAR}`` references, secrets
redacted when a run writes its config, and pydantic's validation errors said in words.

Nothing here knows the run config's sections (:mod:`hybridrl.config` does): these work on any
mapping or pydantic model.
"""

from __future__ import annotations

import copy
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
        value = yaml.safe_load(raw) if raw else None
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
            lines.append(f"{dotted}: {err['msg']} (got {err.get('input')!r}).")
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
        else:
            lines.append(f"{where}.{key}: {err['msg']} (got {err.get('input')!r}).")
    return "\n".join(lines)


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
SECRET_WORDS = {"token", "key", "apikey", "secret", "password", "passwd", "credential", "credentials"}


def interpolate_env(value, path: tuple, refs: dict):
    """``value`` with each ``${env:VAR}`` in its strings replaced by the environment variable VAR; the
    path of each string that had one goes into ``refs`` with its text. An unset variable, or the
    ``<redacted>`` that dump_config writes in place of a secret, is a ConfigError naming the key."""
    if isinstance(value, dict):
        return {k: interpolate_env(v, (*path, k), refs) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate_env(v, (*path, i), refs) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    where = ".".join(str(p) for p in path)
    if value == REDACTED:
        raise ConfigError(
            f"{where} is '{REDACTED}': the run wrote its config.yaml without this secret. Give it as "
            "'${env:VAR}' (an environment variable that holds it) or with an override."
        )
    missing = [m.group(1) for m in ENV_REF.finditer(value) if m.group(1) not in os.environ]
    if missing:
        raise ConfigError(f"{where} is '{value}', but the environment variable {missing[0]} is not set.")
    if ENV_REF.search(value):
        refs[path] = value
        return ENV_REF.sub(lambda m: os.environ[m.group(1)], value)
    return value


def is_secret(name) -> bool:
    """Whether a key names a secret: its last word (of snake_case, kebab-case or camelCase) is token, key,
    secret, password... (``api_key``, ``hf_token``, ``clientSecret``; not ``max_tokens``, ``token_env``)."""
    words = re.findall(r"[a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower())
    return bool(words) and words[-1] in SECRET_WORDS


def redact(value, secret: bool = False):
    """``value`` with every string under a key that :func:`is_secret` replaced by ``<redacted>``."""
    if isinstance(value, dict):
        return {k: redact(v, secret or is_secret(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secret) for v in value]
    return REDACTED if secret and isinstance(value, str) and value else value


def write_config(path, cfg) -> None:
    """The run's config (:func:`dump_config`) in ``path``, readable and writable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(dump_config(cfg))


def dump_config(cfg) -> str:
    """The run config as YAML, every default written out (``cfg.complete()``), without secrets:
    strings under secret keys (:func:`is_secret`) become ``<redacted>``, and values given as
    ``${env:VAR}`` are written as that again."""
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
