"""`rlhflab config`: show a command's config schema, or print a resolved config.

    rlhflab config show ppo                         every key: type, default, help
    rlhflab config resolve ppo --config configs/ppo_debug.yaml ppo.kl_coeff=0.1
                                                    the merged, resolved, validated YAML

Schemas are named as "module:attr" strings and imported only when asked for, so this
command does not load the trainers (or torch) it is not asked about.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import types
import typing
from typing import Any, Literal, Union

from rlhflab.config.methods import METHODS
from rlhflab.errors import UserError

# command -> the root dataclass of its config: every training method (the one registry,
# rlhflab/config/methods.py) and tpo.
SCHEMAS: dict[str, str] = {**{m.command: m.schema_path for m in METHODS}, "tpo": "rlhflab.tpo:TPORunConfig"}


def schema_for(command: str) -> type:
    """Import and return the root config dataclass of `command`."""
    if command not in SCHEMAS:
        raise UserError(f"no config schema for command {command!r}; choose one of {', '.join(SCHEMAS)}")
    module_name, _, attr = SCHEMAS[command].partition(":")
    try:
        schema = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"the config schema of `rlhflab {command}` ({SCHEMAS[command]}) cannot be "
                        f"loaded: {exc}") from None
    if not dataclasses.is_dataclass(schema):
        raise UserError(f"{SCHEMAS[command]} (config of `rlhflab {command}`) is not a dataclass")
    return schema


def _type_name(tp: Any) -> str:
    """A short, YAML-minded name for a field's type: `float`, `int | null`, `k1|k2|k3`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names + (["null"] if type(None) in args else []))
    if origin in (list, tuple):
        return f"list[{_type_name(args[0]) if args else 'any'}]"
    if origin is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _default(fl: dataclasses.Field) -> str:
    if fl.default is not dataclasses.MISSING:
        value = fl.default
    elif fl.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = fl.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    return _value_text(value)


def _value_text(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    elif isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return json.dumps(value)  # JSON is YAML flow style: null, true, "text", [..]


def _doc(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


def schema_rows(cls: type, prefix: str = "", instance: Any = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every key of `cls`, sections expanded in order.

    A section gives a row of its own (type "section", help its docstring); a list of
    sections gives a row for the list and rows `key[].field` for its items. Defaults are
    read from `instance` (by default `cls()`), so a run config that builds a section with
    its own values (`rlhflab sft`'s training.output_dir is outputs/sft) shows those.
    """
    rows: list[tuple[str, str, str, str]] = []
    hints = typing.get_type_hints(cls)
    if instance is None:
        try:
            instance = cls()
        except TypeError:  # a field without a default: each field's own default below
            instance = None
    for fl in dataclasses.fields(cls):
        key = f"{prefix}{fl.name}"
        tp = hints[fl.name]
        help_ = fl.metadata.get("help", "")
        if dataclasses.is_dataclass(tp):
            rows.append((key, "section", "", help_ or _doc(tp)))
            rows.extend(schema_rows(tp, key + ".", getattr(instance, fl.name, None)))
            continue
        default = _value_text(getattr(instance, fl.name)) if instance is not None else _default(fl)
        rows.append((key, _type_name(tp), default, help_))
        item = typing.get_args(tp)[0] if typing.get_origin(tp) in (list, tuple) and typing.get_args(tp) else None
        if item is not None and dataclasses.is_dataclass(item):
            rows.extend(schema_rows(item, key + "[]."))
    return rows


def add_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="{show,resolve}")
    show = sub.add_parser("show", help="every key of a command's config: type, default, help")
    show.add_argument("command", choices=list(SCHEMAS), help="the command whose config to show")
    resolve = sub.add_parser("resolve", help="print the merged, resolved, validated YAML of a config")
    resolve.add_argument("command", choices=list(SCHEMAS), help="the command the config is for")
    # argparse (3.11) spends an empty `nargs="*"` positional before it reaches --config, so
    # overrides written after `--config FILE` are taken by --config itself.
    resolve.add_argument("--config", nargs="+", default=None, metavar=("FILE", "KEY=VALUE"),
                         help="YAML config file, then dotted overrides; omit to start from the schema's defaults")
    resolve.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                         help="dotted overrides, e.g. ppo.kl_coeff=0.1")


def run(args: argparse.Namespace) -> int:
    schema = schema_for(args.command)
    if args.action == "show":
        rows = schema_rows(schema)
        widths = [min(max(len(r[i]) for r in rows), 40) for i in range(3)]  # a long default overflows
        print(f"# {_doc(schema)}  ({SCHEMAS[args.command]})")
        print(f"# {'key':<{widths[0]}}  {'type':<{widths[1]}}  {'default':<{widths[2]}}  help")
        for key, type_, default, help_ in rows:
            if type_ == "section":
                print(f"\n{key}:  # {help_}")
            else:
                print(f"  {key:<{widths[0]}}  {type_:<{widths[1]}}  {default:<{widths[2]}}  {help_}")
        from rlhflab.config.loader import ALIASES
        keys = {r[0] for r in rows}
        notes = [f"#   {old} is the old name of {new}; it still works" for old, new in ALIASES.items() if new in keys]
        if notes:
            print("\n# old names\n" + "\n".join(notes))
        return 0
    from omegaconf import OmegaConf

    from rlhflab.config.loader import load_config

    path, *after = args.config or [None]
    _, effective = load_config(path, schema, [*args.overrides, *after])
    print(OmegaConf.to_yaml(effective), end="")
    return 0
