"""Config sections derived from a library config's schema (models/schema.py), so that a model field is declared once.

`flags_of(TransformerConfig)` is a dataclass with one optional flag per documented field (its help the field's doc,
a string field's choices its `Literal`, an on/off field a switch: `--qk-norm`, `--moe.pad`, or `--qk-norm False`);
unset (None), a flag leaves the preset's (or checkpoint's) value alone.
`ModelSection` and `MoEFlags` (research/train/config/sections.py, prefixed.py) are made this way.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

import tyro
from tyro.constructors import PrimitiveConstructorSpec

from models.schema import schema


def _switch(args: list[str]) -> bool:
  """A switch's value: given bare (`--moe.pad`) it is on; `--moe.pad True` / `False` as before."""
  if not args:
    return True
  if args[0].lower() not in ("true", "false"):
    raise ValueError(f"{args[0]!r} is not True or False")
  return args[0].lower() == "true"


# An unset-unless-given on/off flag: `--flag` turns it on, `--flag False` off, and left out it keeps the preset's (or
# checkpoint's) value: three states, so there is no `--no-flag` (tyro's pairs are for a plain bool with a default).
SWITCH = PrimitiveConstructorSpec(nargs=(0, 1), metavar="[True|False]", instance_from_str=_switch,
                                  is_instance=lambda x: x is None or isinstance(x, bool),
                                  str_from_instance=lambda x: [str(x)])


def optional_flag(name: str, kind: Any, doc: str) -> tuple:
  """One flag that is unset (None) unless given: (name, `kind | None` with its help, a None default), as
  `dataclasses.make_dataclass` takes a field.

  Args:
    name: the field's name (the flag's, with underscores).
    kind: its type.
    doc: its help.

  Returns:
    The (name, type, field) triple.
  """
  if kind is bool:  # a switch (`SWITCH`): --flag, or --flag True / False
    return name, Annotated[bool | None, SWITCH, tyro.conf.arg(help=doc)], dataclasses.field(default=None)
  return name, Annotated[kind | None, tyro.conf.arg(help=doc)], dataclasses.field(default=None)


def flags_of(cls: type, name: str, module: str, *, first: tuple = (), last: tuple = (), namespace: dict | None = None,
             doc: str | None = None) -> Any:
  """A dataclass with one optional flag per documented field of a config class.

  Args:
    cls: the library config (`TransformerConfig`, `MoEConfig`).
    name: the new class's name.
    module: the module that binds it to `name` (its instances pickle by that name).
    first: (name, type, `dataclasses.field`) triples placed before the derived flags (the section's own flags).
    last: the same, after them.
    namespace: class attributes and methods of the new class (`RANGES`, `PREFIX`, helpers).
    doc: the class docstring (the help's group title).

  Returns:
    The dataclass: each derived flag typed `T | None` (a `Literal` of the field's `choices` for a string field),
    default None, its help the field's doc.
  """
  hints = typing.get_type_hints(cls)
  derived = []
  for field, s in schema(cls).items():
    if s["doc"] is None:
      continue
    kind: Any = Literal.__getitem__(s["choices"]) if s["choices"] else hints[field]
    derived.append(optional_flag(field, kind, s["doc"]))
  made = dataclasses.make_dataclass(name, [*first, *derived, *last], namespace=dict(namespace or {}))
  made.__doc__ = doc or made.__doc__
  made.__module__ = module
  return made
