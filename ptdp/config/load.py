"""From the command line and a TOML file to a :class:`Config`, every value checked against its field's type.

Precedence: the dataclass defaults, then ``--model PRESET``, then the ``--config FILE.toml`` keys (the
flags' names, dashes or underscores), then the flags given. A TOML value of the wrong type (``num-layers =
"4"``), an unknown key, or a table (the file is flat, like the command line) is one line each, all of them
reported together in one :class:`ConfigError`, never a traceback from deep inside the run.

``add_field_arguments`` declares flags from the dataclass fields for other commands (``ptdp plan``,
``ptdp simulate``), so a flag's name, type, choices and help exist once.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from ptdp.config.megatron_flags import MAPPED_FLAGS, add_megatron_arguments, apply_mapped, dest, toml_problem
from ptdp.config.schema import Config, ConfigError, ModelConfig


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of field ``f``: its metadata's, else ``--`` + the name with dashes."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def help_with_default(help_text: str, default: object) -> str:
    """A flag's help with its default said once: not when the text already says it ("default 4h"), and
    not for None (the help says what happens without the flag)."""
    if default is None or re.search(r"\(default[ :]", help_text):
        return help_text
    return f"{help_text} (default: {default})"


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _base_type(f: dataclasses.Field) -> str:
    """The annotation without ``| None``: ``int``, ``float``, ``str``, ``bool`` or ``list[str]``."""
    return str(f.type).replace(" ", "").replace("|None", "").replace("None|", "")


def _scalar_type(f: dataclasses.Field):
    """What argparse converts each value to (``list[int]`` fields take ints)."""
    text = _base_type(f)
    for name, typ in (("int", int), ("float", float), ("str", str)):
        if text.startswith(name) or f"[{name}]" in text:
            return typ
    return str


_TYPES = {  # annotation -> (accepts, what the user must give)
    "int": (lambda x: isinstance(x, int) and not isinstance(x, bool), "an integer"),
    "float": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool), "a number"),
    "str": (lambda x: isinstance(x, str), "a string"),
    "bool": (lambda x: isinstance(x, bool), "true or false"),
    "list[str]": (lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x), "a list of strings"),
    "list[int]": (lambda x: isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x),
                  "a list of integers"),
}


def _given(value: Any) -> str:
    """A value as the user wrote it, and what kind of value that is."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return f"{text} ({kind})"


def value_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why ``value`` does not fit field ``f`` (its type, its choices), or None; the caller names the key."""
    optional = "None" in str(f.type)
    if value is None:
        return None if optional else f"expected {_TYPES.get(_base_type(f), (None, _base_type(f)))[1]}, got none"
    accepts, expected = _TYPES.get(_base_type(f), (lambda x: True, _base_type(f)))
    if not accepts(value):
        return f"expected {expected}, got {_given(value)}"
    choices = f.metadata["argparse"].get("choices")
    if choices and value not in choices:
        return f"expected one of {', '.join(map(str, choices))}, got {_given(value)}"
    return None


def type_problems(config: Config) -> list[str]:
    """Every field of ``config`` whose value does not fit its type, one line naming the flag."""
    problems = []
    for section in config.sections().values():
        values = dataclasses.asdict(section)
        for f in dataclasses.fields(section):
            problem = value_problem(f, values[f.name])
            if problem:
                problems.append(f"{flag_of(f)}: {problem}")
    return problems


def add_field_arguments(parser: Any, section: type, names: tuple[str, ...] | None = None,
                        overrides: dict[str, dict[str, Any]] | None = None, **defaults: Any) -> None:
    """Flags for ``section``'s fields (all, or ``names``) with the names, types, choices and help of
    ``ptdp train``; default None (not given) unless ``defaults`` says otherwise. ``overrides`` changes a
    field's argparse keywords for another command (``ptdp plan``'s extra ``none`` choice)."""
    for f in dataclasses.fields(section):
        if names is not None and f.name not in names:
            continue
        default = defaults.get(f.name)
        help_text = help_with_default(f.metadata["help"], default if f.name in defaults else default_of(f))
        extra = (overrides or {}).get(f.name, {})
        if _base_type(f) == "bool":
            # --no-x, --muon-no-split-qkv; a field may ask for both spellings (argparse.BooleanOptionalAction)
            action = f.metadata["argparse"].get("action") or ("store_false" if default_of(f) is True else "store_true")
            parser.add_argument(flag_of(f), *f.metadata["aliases"], dest=f.name,
                                **{"action": action, "default": default, "help": help_text, **extra})
            continue
        kwargs = {"type": _scalar_type(f), **f.metadata["argparse"], "help": help_text, **extra}
        parser.add_argument(flag_of(f), *f.metadata["aliases"], dest=f.name, default=default, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are None so that a TOML file can sit under the command line."""
    parser.add_argument("--config", help="TOML file with the same keys as the flags")
    from ptdp.config.presets import MODEL_PRESETS

    parser.add_argument("--model", choices=list(MODEL_PRESETS), help="a named model shape (ptdp/config/presets.py); "
                        "flags given explicitly override it")
    for name, section in Config().sections().items():
        add_field_arguments(parser.add_argument_group(name), type(section))
    add_megatron_arguments(parser)  # --use-flash-attn and the like: accepted, or mapped to ptdp's flags


def read_toml(path: str | Path) -> dict[str, Any]:
    """The top-level keys of a TOML file; ConfigError naming ``--config`` if it cannot be read or parsed."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for section in Config().sections().values() for f in dataclasses.fields(section)}


def toml_values(raw: dict[str, Any], path: str) -> tuple[dict[str, Any], list[str]]:
    """The TOML keys as field names (aliases resolved), and one problem line per unknown key, table, or
    value of the wrong type."""
    fields, problems, values = _fields(), [], {}
    aliases = {alias[2:].replace("-", "_"): f.name for f in fields.values() for alias in f.metadata["aliases"]}
    keys = sorted(fields) + ["model"]
    for key, value in raw.items():
        name = key.replace("-", "_")
        name = aliases.get(name, name)
        if isinstance(value, dict):
            problems.append(f"--config {path}: [{key}] is a table, but the file is flat like the command line: "
                            f"move its keys to the top of the file (e.g. num-layers = 4, not [model] num-layers)")
            continue
        if name == "model":
            if not isinstance(value, str):
                problems.append(f"--config {path}: key model: expected a preset name (a string), got {_given(value)}")
            else:
                values[name] = value
            continue
        if name not in fields:
            known, problem = toml_problem(name, value)  # a Megatron-LM flag ptdp ignores, maps or explains
            if known:
                if problem:
                    problems.append(f"--config {path}: key {key}: {problem}")
                else:
                    values[name] = value
                continue
            close = difflib.get_close_matches(name, keys, n=1)
            hint = f"; did you mean {close[0].replace('_', '-')}?" if close else "; see `ptdp train --help`"
            problems.append(f"--config {path}: unknown key {key} (no flag --{key.replace('_', '-')}){hint}")
            continue
        f = fields[name]
        if _base_type(f) == "list[str]" and isinstance(value, str):
            value = [value]  # data-path = "prefix" as well as ["prefix"]
        problem = value_problem(f, value)
        if problem:
            problems.append(f"--config {path}: key {key}: {problem}")
            continue
        values[name] = float(value) if _base_type(f) == "float" else value
    return values, problems


def config_from_args(args: argparse.Namespace) -> Config:
    """Defaults, then ``--model``, then the TOML file, then the command line (``args`` from a parser that
    :func:`add_config_arguments` made); ConfigError with every problem of the TOML file (one line each) if it
    has any."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    if args.config:
        values, problems = toml_values(read_toml(args.config), args.config)
    config = Config()
    preset = args.model or values.pop("model", None)
    if preset is not None:  # --model NAME: under the TOML file and the flags
        from ptdp.config.presets import MODEL_PRESETS

        if preset not in MODEL_PRESETS:
            problems.append(f"--model {preset!r} is not a preset; choose one of {', '.join(MODEL_PRESETS)}")
        else:
            for key, value in MODEL_PRESETS[preset].items():
                setattr(config.model, key, value)
            from ptdp.config.presets import MOE_PRESETS

            for key, value in MOE_PRESETS.get(preset, {}).items():  # a mixture of experts' --num-experts etc.
                setattr(config.moe, key, value)
    if problems:
        raise ConfigError(*problems)
    given = vars(args)  # the flags by field name, as add_field_arguments declared them
    explicit: dict[str, Any] = {}  # the fields given on the command line or in the file
    for section in config.sections().values():
        for f in dataclasses.fields(section):
            if given.get(f.name) is not None:
                explicit[f.name] = given[f.name]
            elif f.name in values:
                explicit[f.name] = values[f.name]
            if f.name in explicit:
                setattr(section, f.name, explicit[f.name])
    mapped = {d: given[d] if given.get(d) is not None else values.get(d) for d in map(dest, MAPPED_FLAGS)}
    problems = apply_mapped(config, mapped, explicit)  # --recompute-activations, --lr-warmup-fraction
    if problems:
        raise ConfigError(*problems)
    return config


def model_config(values: dict[str, Any], preset: str | None = None) -> ModelConfig:
    """A ``ModelConfig`` from ``preset`` (``ptdp.config.presets``) with ``values`` (None: not given) over it."""
    from ptdp.config.presets import MODEL_PRESETS

    model = ModelConfig(**MODEL_PRESETS[preset]) if preset else ModelConfig()
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return dataclasses.replace(model, **{k: v for k, v in values.items() if k in names and v is not None})
