"""The model config's schema, declared once on its fields: what each field means and how a run may change it.

Every field of `TransformerConfig` and `MoEConfig` (models/config.py) is a `setting`:
- `doc`: the help a command line shows for it; a field with none is not a user setting (its value comes from a
  preset, a checkpoint or a tokenizer: `vocab_size`, `rope_theta`, ...).
- `kind`: `MODEL` (what the model is: a checkpoint holds one, and another value is another model), `COMPUTE` (how
  the same parameters are computed: dtype, attention kernel, routing; a run may change it, as a recorded change of
  its settings) or `LAYOUT` (where and how the same computation is laid out: recomputation, pipeline microbatches;
  free).
- `choices`: the values a string field takes, the library's own tuple (a command line's `Literal` is made of it).
- `state`: for a `COMPUTE` field that still decides part of the saved state, what of its value does (`bias_rate`
  keeps a router bias when positive).

The train CLI's model and --moe.* flags, the run directory's comparisons on resume and `--init-from`'s conflicts are
all derived from these (research/train/config/derived.py, sections.py and prefixed.py; research/train/store/rundir.py;
research/train/setup/resume.py and init_from.py): a new model field is one `setting(...)` line in models/config.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

MODEL, COMPUTE, LAYOUT = "model", "compute", "layout"
KINDS = (MODEL, COMPUTE, LAYOUT)


def setting(default: Any, doc: str | None = None, *, kind: str = MODEL, choices: tuple | None = None,
            state: Callable[[Any], Any] | None = None) -> Any:
  """A config field with its schema (see the module docstring).

  Args:
    default: the field's default value.
    doc: the help a command line shows for it; None: not a user setting.
    kind: `MODEL`, `COMPUTE` or `LAYOUT`.
    choices: the values a string field takes.
    state: for a `COMPUTE` field, what of its value decides the saved state (its entry in `signature`).

  Returns:
    A `dataclasses.field` carrying the schema in its metadata.

  Raises:
    ValueError: an unknown kind.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
  return dataclasses.field(default=default, metadata={"doc": doc, "kind": kind, "choices": choices, "state": state})


def schema(cls: type) -> dict[str, dict]:
  """{field: its schema} of a config class, in field order.

  Args:
    cls: `TransformerConfig` or `MoEConfig` (any dataclass whose fields are `setting`s).

  Returns:
    {name: {"doc", "kind", "choices", "state"}}; a field declared without `setting` is a `MODEL` field with no doc.
  """
  blank = {"doc": None, "kind": MODEL, "choices": None, "state": None}
  return {f.name: {**blank, **f.metadata} for f in dataclasses.fields(cls)}


def names(cls: type, *kinds: str, documented: bool = False) -> tuple[str, ...]:
  """The fields of a config class of the given kinds.

  Args:
    cls: the config class.
    *kinds: the kinds to keep (none given: every kind).
    documented: keep only the user settings (fields with a doc).

  Returns:
    Their names, in field order.
  """
  return tuple(n for n, s in schema(cls).items()
               if (not kinds or s["kind"] in kinds) and (s["doc"] is not None or not documented))


def signature(cls: type, values: dict) -> dict:
  """What of a config decides the shapes and structure of a model's saved state.

  Its `MODEL` fields, and what a `COMPUTE` field's `state` makes of its value; a nested config (`moe`) by its own
  class's schema.

  Args:
    cls: the config class `values` is of.
    values: the config as a dict (`dataclasses.asdict`, or a saved config.json's "model_config"); a field it lacks
      (saved before the field existed) takes its default.

  Returns:
    {field: value}, comparable with `==` between two runs.
  """
  out, kinds = {}, schema(cls)
  for f in dataclasses.fields(cls):
    s = kinds[f.name]
    value = values.get(f.name, f.default)
    nested = _nested(cls, f.name)
    if nested is not None and isinstance(value, dict):
      value = signature(nested, value)
    if s["kind"] == MODEL:
      out[f.name] = value
    elif s["state"] is not None:
      out[f.name] = s["state"](value)
  return out


def changed(cls: type, before: dict, now: dict, kind: str = COMPUTE) -> dict[str, list]:
  """{field: [before, now]} of the fields of one kind that differ between two configs.

  Args:
    cls: the config class.
    before: one config as a dict (a field it lacks takes its default).
    now: the other.
    kind: the kind compared.

  Returns:
    The differences, in field order; a nested config's named "moe.top_k".
  """
  out: dict[str, list] = {}
  kinds = schema(cls)
  for f in dataclasses.fields(cls):
    old, new = before.get(f.name, f.default), now.get(f.name, f.default)
    nested = _nested(cls, f.name)
    if nested is not None:
      inner = changed(nested, old if isinstance(old, dict) else {}, new if isinstance(new, dict) else {}, kind)
      out.update({f"{f.name}.{k}": v for k, v in inner.items()})
    elif kinds[f.name]["kind"] == kind and old != new:
      out[f.name] = [old, new]
  return out


def _nested(cls: type, name: str) -> type | None:
  """The config class of a nested field (`TransformerConfig.moe`: `MoEConfig`), from the class's `NESTED`."""
  return getattr(cls, "NESTED", {}).get(name)
