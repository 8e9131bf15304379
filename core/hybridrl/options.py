"""The base of every model a YAML section is validated against, and of every component's options.

Unknown keys and NaN/Inf are errors; YAML's booleans are read as the on/off words of options
that take them; fields that name a file the run reads are marked :data:`INPUT_PATH`, model folders
:data:`MODEL_PATH`; a secret option is a :class:`Secret`.
"""

from __future__ import annotations

import typing

from pydantic import BaseModel, ConfigDict, SecretStr, field_validator
from pydantic_core import core_schema

from hybridrl.config_files import REDACTED


def literal_choices(annotation) -> set | None:
    """The strings a field accepts when it is a ``Literal`` (possibly in a union with None or
    others), or None when it also accepts booleans or is no Literal at all."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return set(args)
    choices = set()
    for arg in args:
        if arg is bool:
            return None
        choices |= literal_choices(arg) or set()
    return choices or None


#: marks a config field as a file or folder the run reads: a relative path is looked up beside the
#: config file first (``Field(..., json_schema_extra=INPUT_PATH)``; see :func:`hybridrl.config.load_config`)
INPUT_PATH = {"input_path": True}
#: marks a field as a model folder the run loads, as model.path names one (a Hugging Face folder or
#: ``package:NAME``; no GGUF): checked before any model loads (:func:`hybridrl.preflight.check`)
MODEL_PATH = {"input_path": True, "model_path": True}


class Secret(SecretStr):
    """A secret option (``api_key: Secret | None``): pydantic's SecretStr, which every dump, repr and log
    shows as ``<redacted>`` (config.yaml too, or as the ``${env:VAR}`` it was given as); the code that
    sends it reads ``.get_secret_value()``."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        schema = super().__get_pydantic_core_schema__(source, handler)
        schema["serialization"] = core_schema.plain_serializer_function_ser_schema(lambda s: s._display())
        return schema

    def _display(self) -> str:
        return REDACTED if self.get_secret_value() else ""


class ConfigModel(BaseModel):
    """Base of every model a YAML section is validated against: unknown keys and NaN/Inf are errors,
    and YAML's booleans are read as the ``on``/``off`` of an option that takes those words (YAML
    1.1 reads ``compile: off`` as false)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_switches(cls, value, info):
        if not isinstance(value, bool) or info.field_name not in cls.model_fields:
            return value
        choices = literal_choices(cls.model_fields[info.field_name].annotation)
        word = "on" if value else "off"
        return word if choices and value not in choices and word in choices else value


class Options(ConfigModel):
    """Base of every component's options: unknown keys are errors."""

    def changed(self, name: str) -> bool:
        """Whether option ``name`` holds another value than its default. A run's config.yaml writes
        every option out, defaults included, so ask this rather than whether a key was given."""
        return getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)
