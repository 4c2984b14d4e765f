"""Recipes: a TOML file read, at the edge, into each component's own Config dataclass.

``load_recipe("recipes/gpt2-tiny.toml", ["training.steps=100"])`` returns a
:class:`lstrain.train.RunConfig`: ``[model]`` into :class:`lstrain.train.ModelConfig` (the
model's family name, a preset, and the family's config fields: ``GPT2Config``'s for
``name = "gpt2"``, ``BertConfig``'s for ``"bert"``, ``LlamaConfig``'s for ``"llama"``), ``[data]`` into
``lstrain.data.DataConfig``, and ``[training]``, ``[optimizer]``, ``[lr_scheduler]``,
``[checkpoint]``, ``[metrics]``, ``[eval]``, ``[sample]`` into the training loop's configs.
Every key is checked against its dataclass's fields: an unknown key is an error that names
it and lists the keys allowed there, a value of the wrong type one that names the type
expected. An override ``section.key=value`` is typed by its field: ``value`` is read as a
TOML value (``3``, ``1e-3``, ``true``, ``[0.9, 0.95]``, ``"text"``) where the field is not a
string, taken as it is where it is; ``none`` sets an optional field to None.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from lstrain.data import DataConfig
from lstrain.train import (
    CheckpointConfig,
    EvalConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SampleConfig,
    TrainingConfig,
)
from lstrain.train.families import FAMILIES

__all__ = ["RecipeError", "load_recipe", "parse_recipe"]

# section -> the dataclass its keys are the fields of ([model] is read apart: see _model)
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "lr_scheduler": LRSchedulerConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "eval": EvalConfig,
    "sample": SampleConfig,
}
_MODEL_OWN_KEYS = ("name", "preset")


class RecipeError(ValueError):
    """A recipe or an override that does not fit the configs; the message says where."""


@dataclasses.dataclass(frozen=True)
class _Override:
    """A ``--set`` value before its field's type is known."""

    text: str


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomllib is 3.11's; tomli is the same parser
        try:
            import tomli as tomllib
        except ImportError:
            raise RecipeError(
                "reading a recipe needs tomllib (Python 3.11+); on Python 3.10 run `pip install tomli`"
            ) from None
    return tomllib


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "none"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _from_override(value: _Override, hint: Any, where: str) -> Any:
    """An override's text as its field's type expects it."""
    if value.text.lower() == "none" and _is_optional(hint):
        return None
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if str in options:
        # a quoted TOML string gives its contents (spaces included: prompt="def "); other text is taken as it is
        try:
            parsed = _toml().loads(f"value = {value.text}")["value"]
        except Exception:  # noqa: BLE001  (not a TOML value: plain text)
            return value.text
        return parsed if isinstance(parsed, str) else value.text
    try:
        return _toml().loads(f"value = {value.text}")["value"]
    except Exception as error:  # not a TOML value: say what the field takes
        raise RecipeError(
            f"{where}: {value.text!r} is not a value of type {_type_name(hint)} (override values are read as TOML: "
            f"numbers, true/false, [lists], quoted strings)"
        ) from error


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the field type ``hint``; ints are accepted for floats and
    lists for tuples."""
    if isinstance(value, _Override):
        value = _from_override(value, hint, where)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and _is_optional(hint):
            return None
        for option in typing.get_args(hint):
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except RecipeError:
                continue  # the next option may take it; if none does, the error below names them all
        raise RecipeError(f"{where}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: expected a list ({_type_name(hint)}), got {type(value).__name__} {value!r}")
        if args and args[-1] is not Ellipsis and len(args) != len(value):
            raise RecipeError(f"{where}: expected {len(args)} values ({_type_name(hint)}), got {len(value)}")
        element = [args[0]] * len(value) if args and args[-1] is Ellipsis else list(args)
        return tuple(_coerce(v, h, f"{where}[{i}]") for i, (v, h) in enumerate(zip(value, element, strict=True)))
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,), dict: (dict,)}.get(hint)
    if expected is None:
        return value  # a type the recipes do not spell (none so far): the dataclass checks it
    if isinstance(value, bool) and hint is not bool:
        ok = False
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise RecipeError(f"{where}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}")
    return float(value) if hint is float else value


def _unknown(section: str, key: str, allowed: list[str]) -> RecipeError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return RecipeError(f"[{section}]: unknown key {key!r}{hint}; allowed: {', '.join(allowed)}")


def _fields(cls: type, section: str, table: dict, skip: tuple[str, ...] = ()) -> dict:
    """``table``'s keys checked and typed as ``cls``'s fields."""
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    out = {}
    for key, value in table.items():
        if key not in allowed:
            raise _unknown(section, key, allowed)
        out[key] = _coerce(value, hints[key], f"[{section}] {key}")
    return out


def _model(table: dict) -> ModelConfig:
    """``[model]``: ``name`` picks the family (its Config dataclass's fields are the other keys)."""
    own = _fields(ModelConfig, "model", {k: v for k, v in table.items() if k in _MODEL_OWN_KEYS})
    rest = {k: v for k, v in table.items() if k not in _MODEL_OWN_KEYS}
    if "vocab_size" in rest:
        raise RecipeError("[model]: vocab_size comes from the data's tokenizer; set [data] vocab_size instead")
    name = own.get("name", "gpt2")
    if name not in FAMILIES:
        raise RecipeError(f"[model]: name must be one of {', '.join(FAMILIES)}; got {name!r}")
    config_cls = FAMILIES[name].config_cls
    allowed = [*_MODEL_OWN_KEYS, *(f.name for f in dataclasses.fields(config_cls) if f.name != "vocab_size")]
    for key in rest:
        if key not in allowed:
            raise _unknown("model", key, allowed)
    fields = _fields(config_cls, "model", rest, skip=("vocab_size",))
    config = ModelConfig(**own, fields=fields)
    # the model's own range checks now rather than after the data is read, over a vocabulary
    # that holds any token id the recipe names (the tokenizer's size is checked at the build)
    ids = [v for k, v in fields.items() if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool)]
    config.build(vocab_size=max([256, *(i + 1 for i in ids)]))
    return config


def parse_recipe(recipe: dict, overrides: list[str] = ()) -> RunConfig:
    """A parsed recipe (TOML's tables) and ``--set`` overrides as a :class:`RunConfig`.

    Args:
        recipe: ``{section: {key: value}}``.
        overrides: ``"section.key=value"`` strings, applied in order.

    Returns:
        The run's configs.

    Raises:
        RecipeError: an unknown section or key, a value of the wrong type, a malformed
            override, or a value a config refuses (its own message, prefixed).
    """
    tables = {}
    for section, table in recipe.items():
        if section not in SECTIONS:
            raise RecipeError(f"unknown section [{section}]; sections: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise RecipeError(f"{section} must be a [{section}] table, got {type(table).__name__} {table!r}")
        tables[section] = dict(table)
    for override in overrides:
        target, sep, text = override.partition("=")
        section, dot, key = target.strip().partition(".")
        if not sep or not dot or not key:
            raise RecipeError(f"--set {override!r}: expected section.key=value, e.g. training.steps=100")
        if section not in SECTIONS:
            raise RecipeError(f"--set {override!r}: unknown section [{section}]; sections: {', '.join(SECTIONS)}")
        tables.setdefault(section, {})[key.strip()] = _Override(text.strip())
    try:
        configs = {"model": _model(tables.get("model", {}))}
        for section, cls in SECTIONS.items():
            if section != "model":
                configs[section] = cls(**_fields(cls, section, tables.get(section, {})))
    except RecipeError:
        raise
    except ValueError as error:  # a config's own range check
        raise RecipeError(str(error)) from error
    return RunConfig(**configs)


def load_recipe(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML recipe and apply ``--set`` overrides.

    Args:
        path: the recipe file.
        overrides: ``"section.key=value"`` strings.

    Returns:
        The run's configs.

    Raises:
        FileNotFoundError: no such file.
        RecipeError: the file is not valid TOML, or see :func:`parse_recipe`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    tomllib = _toml()
    try:
        recipe = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise RecipeError(f"{path}: not valid TOML: {error}") from error
    try:
        return parse_recipe(recipe, overrides)
    except RecipeError as error:
        raise RecipeError(f"{path}: {error}") from error
