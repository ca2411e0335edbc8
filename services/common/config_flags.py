"""Command-line flags generated from config dataclasses: one source of truth per setting.

Each field of a config dataclass becomes ``--field-name`` with the field's type, its
``metadata["help"]`` and its default shown; a field typed as a dataclass (EngineConfig's
speculative_config) takes a JSON object of its fields, as vLLM's ``--speculative-config``.
Flags default to "not given", so a config built from them keeps the dataclass's own defaults,
and ``config_to_argv`` writes back only what differs from them: that is how `pdserve up`
forwards settings to its children and how Ray actors receive theirs (one serialised form: argv).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any, Iterable

_MISSING = dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return _MISSING


def field_default(cls: type, name: str) -> Any:
    """The default a dataclass declares for one field (a slots dataclass has no class attribute)."""
    return _default(next(f for f in dataclasses.fields(cls) if f.name == name))


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def config_fields(cls: type, exclude: Iterable[str] = ()) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)
            if f.name not in skip and f.init and f.metadata.get("cli", True)]


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    exclude: Iterable[str] = ()) -> None:
    """One flag per field of cls (except exclude)."""
    for f, tp in config_fields(cls, exclude):
        base, optional = _base_type(tp)
        default = _default(f)
        text = f.metadata.get("help", "")
        shown = "none" if default is None else default
        if default is not _MISSING:
            text = f"{text} (default: {shown})" if text else f"(default: {shown})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": text}
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        if base is bool:
            parser.add_argument(flag(f.name), *f.metadata.get("aliases", ()), action=argparse.BooleanOptionalAction,
                                **kwargs)
            continue
        if dataclasses.is_dataclass(base):   # a JSON object of its fields
            kwargs.update(type=_json_of(base), metavar=f.metadata.get("metavar", "JSON"))
            parser.add_argument(flag(f.name), *f.metadata.get("aliases", ()), **kwargs)
            continue
        item = _item_type(base)
        if item is not None:   # tuple[str, ...]: one or more values after the flag, as vLLM's --served-model-name
            kwargs.update(nargs="+", type=item, metavar=f.metadata.get("metavar", item.__name__.upper()))
            parser.add_argument(flag(f.name), *f.metadata.get("aliases", ()), **kwargs)
            continue
        if base in (int, float, str):
            kwargs["type"] = none_or(base) if optional else base
            if "choices" not in kwargs:
                kwargs["metavar"] = f.metadata.get("metavar", base.__name__.upper())
        parser.add_argument(flag(f.name), *f.metadata.get("aliases", ()), **kwargs)


def _item_type(tp: Any) -> type | None:
    """int/float/str for tuple[X, ...] (a field of several values), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float, str):
        return args[0]
    return None


def none_or(base: type):
    """An argparse type: base's value, or None for "none"."""
    def parse(text: str):
        return None if text.lower() == "none" else base(text)
    parse.__name__ = base.__name__
    return parse


def _json_of(cls: type):
    """Parse a flag's JSON object into cls ("none": None)."""
    def parse(text: str):
        if text.strip().lower() == "none":
            return None
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise argparse.ArgumentTypeError(f"a JSON object of {cls.__name__}'s fields, got {text!r}")
        try:
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = cls.__name__
    return parse


def given(args: argparse.Namespace, cls: type, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The fields of cls that were given on the command line."""
    return {f.name: getattr(args, f.name) for f, _ in config_fields(cls, exclude)
            if getattr(args, f.name, None) is not None}


def config_from_args(cls: type, args: argparse.Namespace, exclude: Iterable[str] = (), **fixed: Any) -> Any:
    """cls(**given flags, **fixed); the dataclass validates and names a bad field."""
    return cls(**{**given(args, cls, exclude), **fixed})


def config_to_argv(obj: Any, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that rebuild obj's non-default fields (the inverse of config_from_args)."""
    argv: list[str] = []
    for f, tp in config_fields(type(obj), exclude):
        value = getattr(obj, f.name)
        if value == _default(f):
            continue
        base, _ = _base_type(tp)
        if base is bool:
            argv.append(flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif _item_type(base) is not None and value is not None:
            argv += [flag(f.name), *map(str, value)]
        elif dataclasses.is_dataclass(value):
            argv += [flag(f.name), json.dumps(dataclasses.asdict(value), separators=(",", ":"))]
        else:
            argv += [flag(f.name), "none" if value is None else str(value)]
    return argv


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ValueError(message)


def config_parser(*specs: tuple[type, Iterable[str]]) -> argparse.ArgumentParser:
    """The generated flags of several config classes in one parser (a flag two classes share, like
    --drain-timeout-s, appears once and feeds both). Errors raise ValueError instead of exiting."""
    parser = _RaisingParser(add_help=False, allow_abbrev=False)
    seen: set[str] = set()
    for cls, exclude in specs:
        names = {f.name for f, _ in config_fields(cls, exclude)}
        add_config_args(parser, cls, exclude=(*exclude, *(names & seen)))
        seen |= names
    return parser


def configs_from_argv(argv: list[str], *specs: tuple[type, Iterable[str]], **fixed: Any) -> list[Any]:
    """Rebuild configs from argv made by config_to_argv, with the same generated flags the CLI has
    (how Ray actors read their settings). fixed: fields set for every class that has them."""
    args = config_parser(*specs).parse_args(argv)
    out = []
    for cls, exclude in specs:
        names = {f.name for f in dataclasses.fields(cls)}
        out.append(config_from_args(cls, args, exclude, **{k: v for k, v in fixed.items() if k in names}))
    return out
