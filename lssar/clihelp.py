"""Help that teaches: every option of every ``lssar`` command says what it is, its type, its
default and, where it is a choice, the choices.

:class:`Formatter` is the argparse formatter of the commands: it appends ``(type; default: X)``
to each option's one-line help. :func:`keys_help` renders the settings a command takes as
``--key=value`` (``lssar train``) or ``--set key=value`` (``lssar recall``, ``lssar orbits``) from
a dataclass and a table of one-line descriptions, in the same form; :func:`undescribed` is what
the tests check against every table.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

WIDTH = 100
_INDENT = 24  # argparse's column for help text


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def type_name(tp: Any) -> str:
    """``int``, ``float or none``, ``tuple[float, float]``: a field's type as users write it."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        parts = [type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        none = type(None) in typing.get_args(tp)
        return " or ".join(parts) + (" or none" if none else "")
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter with each option's type and default after its help (a flag says
    ``flag``); the description and epilog keep their line breaks."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=_INDENT, width=WIDTH)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return getattr(action.type, "__name__", "str").upper()  # --tokens INT

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").replace("%", "%%")
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._HelpAction):
            return text
        if isinstance(action, argparse.BooleanOptionalAction):
            return f"{text} (flag; default: {'on' if action.default else 'off'})"
        if action.nargs == 0:
            kind = "flag"
        elif isinstance(action, argparse._AppendAction):
            return f"{text} ({getattr(action.type, '__name__', 'str')}, repeatable)"
        else:
            kind = getattr(action.type, "__name__", "str")
        default = "" if kind == "flag" else f"; default: {_show(action.default)}".replace("%", "%%")
        return f"{text} ({kind}{default})"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are ``ValueError``: ``lssar`` prints them as one
    ``error:`` line and exits with 2, as it does for every other bad input."""

    def error(self, message: str) -> typing.NoReturn:
        raise ValueError(f"{self.prog}: {message} (see {self.prog} --help)")


def parser(prog: str, description: str | None = None, **kw: Any) -> Parser:
    """A :class:`Parser` for an ``lssar`` command with :class:`Formatter`."""
    return Parser(
        prog=prog, description=description, formatter_class=Formatter, allow_abbrev=False, **kw
    )


def one_of(names: Sequence[str]) -> str:
    """``{a,b,c}``: a metavar that shows the choices of an option whose value the library
    checks itself (with a message that names them and suggests the closest)."""
    return "{" + ",".join(names) + "}"


def add_preset(ap: argparse.ArgumentParser, presets: Mapping[str, Any]) -> str:
    """Add ``--preset`` (default ``quick``) for ``presets`` (name -> an object with
    ``description`` and ``budget``) to ``ap``; return the epilog's list of them."""
    ap.add_argument("--preset", default="quick", metavar=one_of(list(presets)), help="what to run")
    rows = [
        (n, f"{p.description} ({p.budget})" if p.budget else p.description)
        for n, p in presets.items()
    ]
    return f"presets:\n{entries(rows)}"


def keys_help(
    cls: type,
    descriptions: Mapping[str, str],
    defaults: Any = None,
    choices: Mapping[str, Sequence[str]] | None = None,
    form: str = "--{key}={value}",
    prefix: str = "",
    skip: Sequence[str] = (),
) -> str:
    """One entry per field of dataclass ``cls`` (but ``skip``), in ``form``: the key, its
    choices (``{rope,alibi,nope}``) or type, then its description from ``descriptions`` with the
    type and the default (of ``defaults``, an instance, else the field's own)."""
    hints = typing.get_type_hints(cls)
    choices = choices or {}
    lines: list[tuple[str, str]] = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        kind = type_name(hints[f.name])
        scalar = kind.split(" or ")[0]  # "int or none" -> INT (the type says the rest)
        value = scalar.upper() if scalar in ("int", "float", "str", "bool") else "VALUE"
        if f.name in choices:
            value = "{" + ",".join(choices[f.name]) + "}"
        text = f"{descriptions.get(f.name, '')} ({kind}; default: {_show(default)})"
        lines.append((form.format(key=prefix + f.name, value=value), text))
    return entries(lines)


def entries(rows: Sequence[tuple[str, str]]) -> str:
    """``(name, text)`` rows laid out as argparse lays out options: the name, then the text
    wrapped in a column of its own."""
    lines = []
    for name, text in rows:
        head = "  " + name
        body = textwrap.wrap(text, WIDTH - _INDENT) or [""]
        if len(head) < _INDENT - 1:
            lines.append(head.ljust(_INDENT) + body[0])
        else:
            lines += [head, " " * _INDENT + body[0]]
        lines += [" " * _INDENT + b for b in body[1:]]
    return "\n".join(lines)


def undescribed(cls: type, descriptions: Mapping[str, str], skip: Sequence[str] = ()) -> list:
    """Fields of ``cls`` without a one-line description, and descriptions of no field (both
    should be empty)."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    missing = [n for n in names if not descriptions.get(n, "").strip()]
    bad = [n for n, d in descriptions.items() if n not in names or "\n" in d]
    return missing + bad
