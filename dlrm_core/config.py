"""Typed configuration, one source: sections of fields with a docstring each, loaded from TOML
with overrides, and turned into command-line flags.

Precedence: command-line flags > ``--set SECTION.FIELD=VALUE`` > TOML file (``--config``) >
defaults. Unknown keys are errors, with a suggestion when a known key is close. Every scalar
field of every section becomes a flag ``--section.field`` (help from its docstring, as
torchtitan does); a field may also declare a short alias with :func:`flag` (``--hash-size``).
Each flag also reads its ``DLRM_*`` variable (see :mod:`dlrm_core.env`).
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlrm_core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings document the fields."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


def flag(default: Any = ..., alias: str | None = None, **kwargs) -> Any:
    """A pydantic ``Field`` that also names its short command-line alias (``--hash-size``).

    A boolean field whose alias starts with ``--no-`` sets it to False (``--no-progress``).
    """
    extra = {"cli": alias} if alias else None
    return Field(default, json_schema_extra=extra, **kwargs)


# -- loading ---------------------------------------------------------------------------------------


def _suggest(key: str, section: type[BaseModel] | None) -> str:
    if section is None:
        return ""
    close = difflib.get_close_matches(key, list(section.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _section_of(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (for did-you-mean suggestions); a union of
    sections is resolved by the tag pydantic puts in ``loc`` (``features.0.categorical.nme``)."""
    model: type[BaseModel] | None = root
    pending: list[type[BaseModel]] = []
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections
            continue
        tagged = [m for m in pending if _tag(m) == part]
        if tagged:
            model, pending = tagged[0], []
            continue
        if model is None or part not in model.model_fields:
            return None
        pending = _models_in(model.model_fields[part].annotation)
        model = pending[0] if pending else None
    return model


def _tag(model: type[BaseModel]) -> str | None:
    """The ``kind`` a section of a tagged union declares (``Literal["dense"]`` -> ``dense``)."""
    field = model.model_fields.get("kind")
    args = typing.get_args(field.annotation) if field is not None else ()
    return args[0] if len(args) == 1 and isinstance(args[0], str) else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModels inside ``X``, ``list[X]``, ``X | Y`` or ``Annotated[...]``, in order."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The first BaseModel inside ``annotation``."""
    found = _models_in(annotation)
    return found[0] if found else None


def format_validation_error(exc: ValidationError, source: str, root: type[BaseModel]) -> str:
    """The first error as one line: ``<source>: <section.field>: <what is wrong>`` (a misspelt
    key first: it usually explains the missing one)."""
    err = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
    full = tuple(err["loc"])
    loc = tuple(p for p in full if not (isinstance(p, str) and p in ("dense", "categorical")))
    where = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        return (
            f"{source}: {where}: unknown setting{_suggest(str(loc[-1]), _section_of(root, full))}"
        )
    got = err.get("input")
    got_txt = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{source}: {where}: {err['msg']}{got_txt}{more}"


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, merging nested dicts (lists are replaced, not merged)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``section.field=value`` (value in TOML syntax, bare words as strings) -> nested dict."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return nested(key.strip(), value)


def nested(path: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    out: dict[str, Any] = {}
    node = out
    parts = path.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return out


def load_config(
    cls: type[M], path: Path | str | None = None, overrides: list[dict[str, Any]] | None = None
) -> M:
    """Defaults, then the TOML file, then each override (nested dicts), validated.

    Raises:
        ConfigError: naming the file (or ``command line``) and the offending setting.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        try:
            cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source, cls)) from None
    for override in overrides or []:
        data = deep_merge(data, override)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "command line", cls)) from None


# -- flags -----------------------------------------------------------------------------------------


def _scalar_type(annotation: Any) -> tuple[Any, list | None, bool] | None:
    """(argparse type, choices, is_list) of a field that a flag can set, else None."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (
            _scalar_type(args[0])
            if len(args) == 1
            else (str, None, False)
            if all(a in (str, int) for a in args)
            else None
        )
    if origin is Literal:
        choices = list(typing.get_args(annotation))
        return (type(choices[0]), choices, False)
    if origin is list:
        inner = _scalar_type(typing.get_args(annotation)[0])
        return (inner[0], inner[1], True) if inner and not inner[2] else None
    if annotation in (int, float, str, bool):
        return (annotation, None, False)
    return None


def _walk(cls: type[BaseModel], prefix: str = ""):
    """(dotted path, field info, annotation) of every field, sections first-level-first."""
    for name, field in cls.model_fields.items():
        path = f"{prefix}{name}"
        sub = (
            field.annotation
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
            else None
        )
        if sub is not None:
            yield from _walk(sub, path + ".")
        else:
            yield path, field, field.annotation


def add_config_flags(parser: argparse.ArgumentParser, cls: type[BaseModel]) -> None:
    """One flag per scalar field of ``cls`` (nested sections included): ``--section.field``,
    plus the field's short alias unless the parser already uses that name. Flags default to
    None (not given), so that the file and the defaults stay in charge."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    taken = set(parser._option_string_actions)
    for path, field, annotation in _walk(cls):
        kind = _scalar_type(annotation)
        if kind is None:
            continue  # lists of sections (tables, features): --set or the config file
        section = path.rsplit(".", 1)[0] if "." in path else ""
        if section not in groups:
            groups[section] = parser.add_argument_group(
                f"[{section}] settings" if section else "top-level settings"
            )
        group = groups[section]
        typ, choices, is_list = kind
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        alias = extra.get("cli")
        helptext = (field.description or "").split("\n")[0].replace("%", "%%")
        long = f"--{path}"
        if typ is bool:
            group.add_argument(
                long, dest=path, action=argparse.BooleanOptionalAction, default=None, help=helptext
            )
            if alias and alias not in taken:
                group.add_argument(
                    alias,
                    dest=path,
                    action="store_const",
                    const=not alias.startswith("--no-"),
                    default=None,
                    help=f"= {long if not alias.startswith('--no-') else '--no-' + path}",
                )
            continue
        names = [alias, long] if alias and alias not in taken else [long]
        group.add_argument(
            *names,
            dest=path,
            type=typ,
            choices=choices,
            nargs="+" if is_list else None,
            default=None,
            metavar=path.rsplit(".", 1)[-1].upper(),
            help=helptext,
        )


def flag_overrides(args: argparse.Namespace, cls: type[BaseModel]) -> list[dict[str, Any]]:
    """The config fields set by flags (or their ``DLRM_*`` variables), as nested dicts."""
    out = []
    for path, _field, annotation in _walk(cls):
        if _scalar_type(annotation) is None:
            continue
        value = getattr(args, path, None)
        if value is not None:
            out.append(nested(path, value))
    return out
