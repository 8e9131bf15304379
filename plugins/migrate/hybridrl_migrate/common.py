"""What the verl and TRL translators share: reading their settings, the report, the YAML written.

A translator reads the other framework's settings through a :class:`Source` (the keys the user
gave, dotted, and that framework's defaults for the keys the translator reads), builds a hybridrl
config as a nested mapping, and records in a :class:`Report` every setting that changed units, has
no equivalent, or was left out, so that nothing is dropped silently. A key the other framework does
not have either is refused (:func:`check_keys`: a typo); one it has that no rule read is listed.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from hybridrl.errors import ConfigError

MISSING = object()
INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")


# -- reading the other framework's settings -------------------------------------------------


def parse_value(text: str) -> Any:
    """A value as Hydra's (and HfArgumentParser's) command line reads it: null, true/false (any
    case), numbers (1e-6 included, which YAML 1.1 leaves a string), quoted strings, [a, b] lists,
    {a: 1} mappings; anything else is the string itself."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.startswith(("[", "{")):
        try:
            value = yaml.safe_load(t)
        except (yaml.YAMLError, RecursionError):  # not YAML; or nested deeper than Python reads
            return t
        return _numbers(value)
    low = t.lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            value = kind(t)
        except ValueError:  # not this kind; also an int of more than 4300 digits (then a float: inf)
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"'{t[:40]}' is not a finite number (no setting takes one).")
        return value
    return t


def _numbers(value):
    """Strings inside a YAML list or mapping that Hydra would read as numbers (1e-6)."""
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    return parse_value(value) if isinstance(value, str) else value


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists and empty mappings are values."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def apply_items(given: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """Hydra-style overrides on flattened settings: ``key=value``, ``+key=value`` (add),
    ``++key=value`` (add or replace), ``~key`` (remove the key and everything under it)."""
    out = dict(given)
    for item in items:
        if item.startswith("~"):
            key = item[1:].split("=", 1)[0]
            out = {k: v for k, v in out.items() if k != key and not k.startswith(key + ".")}
            continue
        if "=" not in item:
            raise ConfigError(f"'{item}' is not a key=value setting.")
        key, _, text = item.partition("=")
        key = key.lstrip("+").strip()
        value = parse_value(text)
        # a mapping replaces what was under the key; its own keys become dotted ones
        out = {k: v for k, v in out.items() if not k.startswith(key + ".")}
        out.update(flatten({key: value}) if isinstance(value, dict) and value else {key: value})
    return out


class Source:
    """The settings the user gave (dotted keys) over the framework's ``defaults``. Every read is
    recorded: :meth:`unread` is what no rule looked at."""

    def __init__(self, given: dict[str, Any], defaults: dict[str, Any]):
        self.given = dict(given)
        self.defaults = defaults
        self.read: set[str] = set()

    def get(self, key: str, default: Any = MISSING) -> Any:
        """The value of ``key``: given, else the framework's default (``default`` where the table
        has none); interpolations (``${oc.select:a.b,1}``, ``${a.b}``) resolved."""
        self.read.add(key)
        if key in self.given:
            return self.resolve(key, self.given[key])
        under = {k: v for k, v in self.given.items() if k.startswith(key + ".")}
        if under:  # a mapping given key by key (reward_kwargs.strict=true)
            self.read.update(under)
            tree: dict = {}
            for k, v in under.items():
                set_path(tree, k[len(key) + 1 :], self.resolve(k, v))
            return tree
        if key in self.defaults:
            return self.resolve(key, self.defaults[key])
        if default is MISSING:
            raise KeyError(f"no default for {key}")
        return default

    def has(self, key: str) -> bool:
        """Whether the user gave ``key`` (records it as read)."""
        self.read.add(key)
        return key in self.given

    def mark(self, *prefixes: str) -> None:
        """Record every given key under these prefixes as read (settings with no effect here)."""
        for key in self.given:
            if any(key == p or key.startswith(p + ".") for p in prefixes):
                self.read.add(key)

    def unread(self) -> dict[str, Any]:
        return {k: v for k, v in self.given.items() if k not in self.read}

    def resolve(self, key: str, value: Any, seen: tuple = ()) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value
        if key in seen:
            chain = " -> ".join((*seen, key))
            raise ConfigError(f"{seen[0]} refers to itself through interpolations ({chain}); give one of them a value.")
        whole = INTERPOLATION.fullmatch(value.strip())
        if whole:
            return self._lookup(key, whole.group(1), (*seen, key))
        return INTERPOLATION.sub(lambda m: str(self._lookup(key, m.group(1), (*seen, key))), value)

    def _lookup(self, key: str, expr: str, seen: tuple = ()) -> Any:
        target, fallback = expr, MISSING
        if expr.startswith("oc.select:"):
            target, _, rest = expr[len("oc.select:") :].partition(",")
            fallback = parse_value(rest) if rest else None
        elif ":" in expr:  # oc.env and other resolvers: the run's environment, not ours
            return "${" + expr + "}"
        target = target.strip()
        if target.startswith("."):  # relative to the key's own section
            target = key.rsplit(".", 1)[0] + target
        for table in (self.given, self.defaults):
            if target in table:
                return self.resolve(target, table[target], seen)
        return None if fallback is MISSING else fallback


# -- the report ----------------------------------------------------------------------------

#: report kinds, in the order printed
KINDS = {
    "units": "Units converted",
    "lost": "No equivalent in hybridrl (the run differs here)",
    "note": "Notes",
    "unknown": "Not translated (no rule here reads these)",
    "ignored": "Left out: no effect on what is trained",
}


@dataclass
class Note:
    kind: str  # a key of KINDS
    key: str  # the source setting(s)
    why: str
    value: Any = MISSING

    def line(self) -> str:
        shown = self.key if self.value is MISSING else f"{self.key}={_short(self.value)}"
        return f"{shown}: {self.why}"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    text = text.removesuffix("\n...").strip()
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Report:
    notes: list[Note] = field(default_factory=list)

    def add(self, kind: str, key: str, why: str, value: Any = MISSING) -> None:
        self.notes.append(Note(kind, key, why, value))

    def of(self, kind: str) -> list[Note]:
        return [n for n in self.notes if n.kind == kind]

    def keys(self, kind: str) -> set[str]:
        return {n.key for n in self.of(kind)}

    def text(self, comment: str = "") -> str:
        """The report grouped by kind; ``ignored`` settings grouped by reason, their keys listed."""
        lines = []
        for kind, title in KINDS.items():
            notes = self.of(kind)
            if not notes:
                continue
            lines.append(f"{comment}{title}:")
            if kind == "ignored":
                by_reason: dict[str, list[str]] = {}
                for n in notes:
                    by_reason.setdefault(n.why, []).append(n.key)
                for why, keys in by_reason.items():
                    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
                    lines.append(f"{comment}  {why} ({len(keys)}): {shown}")
            else:
                lines += [f"{comment}  {n.line()}" for n in notes]
        return "\n".join(lines)


NAMES = {"verl": "verl", "trl": "TRL"}
SECTIONS = ("model", "data", "rollout", "rewards", "algorithm", "sharding", "trainer", "logging")


@dataclass
class Translation:
    """A hybridrl config (a mapping ``load_config(data=...)`` takes) and what the translation says."""

    config: dict
    report: Report
    source: str  # "verl" or "trl"

    def __post_init__(self):  # the sections in the order of docs/config.md
        order = {name: i for i, name in enumerate(SECTIONS)}
        self.config = dict(sorted(self.config.items(), key=lambda kv: order.get(kv[0], len(order))))

    def yaml(self) -> str:
        """The config as YAML, the report's notes (not the settings left out) as comments on top."""
        shown = Report([n for n in self.report.notes if n.kind != "ignored"])
        head = [
            f"# Translated from a {self.source} config by 'hybridrl import {self.source}' (docs/migrating.md).",
        ]
        body = shown.text(comment="# ")
        if body:
            head += ["#", body]
        return "\n".join(head) + "\n\n" + yaml.safe_dump(self.config, sort_keys=False, allow_unicode=True)


class Translator:
    """What a translator builds as it reads: the hybridrl config (``out``) and the report. A
    subclass reads ``src`` section by section in ``run`` and ends with :meth:`finish`."""

    framework = ""
    #: the framework's settings with no effect here (prefix: why) and without equivalent (key: (default, why))
    IGNORED: dict[str, str] = {}
    LOST: dict[str, tuple[Any, str]] = {}

    def __init__(self, src: Source):
        self.src = src
        self.report = Report()
        self.out: dict = {}

    def set(self, key: str, value: Any) -> None:
        set_path(self.out, key, value)

    def lost(self, key: str, why: str) -> None:
        """``key``'s behaviour has no equivalent (its value is shown)."""
        self.report.add("lost", key, why, self.src.get(key))

    def warmup(self, key: str, steps: int) -> dict:
        """``trainer.warmup_steps``, with the step hybridrl's warm-up is ahead of the other
        framework's: transformers' and verl's factor at update k (from 0) is k / N, hybridrl's
        (k + 1) / N (hybridrl.run.lr_factor)."""
        fw = NAMES[self.framework]
        self.report.add(
            "note",
            key,
            f"trainer.warmup_steps {steps}: hybridrl's warm-up reaches lr one step earlier than {fw}'s: its first "
            f"step trains at lr/{steps}, {fw}'s first update at 0 (docs/migrating.md)",
            self.src.get(key),
        )
        return {"warmup_steps": steps}

    def precision(self, key: str, dtype: str) -> None:
        """A 16-bit ``dtype`` translated (model.dtype, sharding.mixed_precision): the other framework's
        on its GPUs; trainer.device is left auto, and on a CPU it is slower than float32 and makes the
        trainer's logprobs differ from the rollout's."""
        model = " and model.dtype: float32" if self.out.get("model", {}).get("dtype", "float32") != "float32" else ""
        self.report.add(
            "note",
            key,
            f"{dtype} compute, as {NAMES[self.framework]} on its GPUs (trainer.device auto takes the GPU): on a CPU "
            f"it is slower than float32 and makes the trainer's logprobs differ from the rollout's; for a CPU run "
            f"set sharding.mixed_precision: off{model}",
            self.src.get(key) if self.src.has(key) else MISSING,
        )

    def skip(self, prefix: str, why: str) -> None:
        """The given keys under ``prefix`` that no rule reads have no effect here, for ``why``."""
        for key in list(self.src.unread()):
            if key == prefix or key.startswith(prefix + "."):
                self.src.read.add(key)
                self.report.add("ignored", key, why)

    def finish(self) -> Translation:
        """The translation, with every key the user gave that no rule read reported."""
        unread_keys(self.src, self.report, self.IGNORED, self.LOST)
        return Translation(self.out, self.report, self.framework)


def unread_keys(src: Source, report: Report, ignored: dict[str, str], lost: dict[str, tuple[Any, str]]) -> None:
    """Report the keys the user gave that no rule read: those of ``lost`` (key: (the framework's
    default, why)) when they differ from the default, those under a prefix of ``ignored`` (prefix:
    why; '*.name' matches that part anywhere) as left out, the rest as unknown."""
    for key, value in src.unread().items():
        if key in lost:
            default, why = lost[key]
            if src.resolve(key, value) != default:
                report.add("lost", key, why, value)
            else:
                report.add("ignored", key, "at the default, which needs nothing here")
            continue
        why = next((w for p, w in ignored.items() if _matches(key, p)), None)
        if why is not None:
            report.add("ignored", key, why)
        else:
            report.add("unknown", key, "no rule here reads it; left out", value)


def check_keys(
    keys, known: set[str], open_: tuple[str, ...], what: str, added: frozenset[str] = frozenset(), hint: str = ""
) -> None:
    """Refuse the first of ``keys`` that the other framework does not have either (a typo), with the
    nearest of ``known``: verl's Hydra (struct mode) and TRL's HfArgumentParser refuse them too. A key
    under a prefix of ``open_`` (a free-form mapping, machinery left out whole) passes, and so does
    one under a key of ``added`` (Hydra's ``+key=``, which verl accepts); those are listed. ``hint``
    ends the message where no known key is near."""
    bad = [k for k in keys if k not in known and not any(_matches(k, p) for p in (*open_, *added))]
    if not bad:
        return
    near = nearest(bad[0], known)
    framework = what.split()[0]
    more = f"; also unknown: {', '.join(bad[1:])}" if bad[1:] else ""
    if near:
        raise ConfigError(f"unknown {what} '{bad[0]}'; did you mean '{near}'? ({framework} would refuse it too){more}")
    raise ConfigError(f"unknown {what} '{bad[0]}' ({framework} would refuse it too){hint}{more}")


def _matches(key: str, pattern: str) -> bool:
    """``pattern`` 'a.b' matches a.b and the keys under it; '*.b.c' matches b.c anywhere in the key."""
    if pattern.startswith("*."):
        return f".{pattern[2:].rstrip('.')}." in f".{key}."
    return key == pattern or key.startswith(pattern + ".")


def nearest(key: str, known: set[str]) -> str | None:
    """The key of ``known`` that ``key`` is most likely a typo of: the same name in another section,
    else the closest name under the deepest section they share, else the closest last part anywhere."""
    parts = key.split(".")
    by_name = {k.rsplit(".", 1)[-1]: k for k in sorted(known, reverse=True)}
    if parts[-1] in by_name:
        return by_name[parts[-1]]
    for depth in range(len(parts) - 1, -1, -1):
        section = ".".join(parts[:depth])
        under = {
            k[len(section) + 1 :] if section else k: k for k in known if not section or k.startswith(section + ".")
        }
        if under:
            near = difflib.get_close_matches(".".join(parts[depth:]), under, n=1)
            if near:
                return under[near[0]]
            break
    near = difflib.get_close_matches(parts[-1], by_name, n=1, cutoff=0.8)
    return by_name[near[0]] if near else None


def tree_keys(tree: str) -> set[str]:
    """The dotted keys of a table of keys: lines 'section: name name...' (a dotted name is a key under
    the section), an indented line going on with the one above; a section in capitals is a group of
    names, which later lines name instead of its names."""
    groups: dict[str, list[str]] = {}
    keys = set()
    for entry in re.split(r"\n(?=\S)", tree.strip()):
        head, _, body = entry.partition(": ")
        names = [name for word in body.split() for name in groups.get(word, [word])]
        if head.isupper():
            groups[head] = names
        else:
            keys.update(f"{head}.{name}" for name in names)
    return keys


def set_path(config: dict, key: str, value: Any) -> None:
    """``config[a][b] = value`` for ``key`` 'a.b'."""
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
