"""One definition per command-line flag, checked before any work: the benches (`python -m research.bench`), the run
tools (`sample`, `export`, `quantize`, `plot`), `sweep`, `soak` and the experiments read their flags' rules here.

A flag's rule is, in order: a `Rule` in its annotation (`Annotated[tuple[str, ...], one_of(*METHODS)]`: a flag only
one command has), the shared table `SHARED` by the flag's name (`--steps`, `--batch-size`, `--mesh`, `--out`, ...:
the same meaning everywhere), or its type's default (`by_type`: an integer is a count >= 1, a seed >= 0; a float is a
finite number >= 0; a bool or a `Literal` is checked by tyro). A string flag has no default rule: it is declared (a
choice set, a path, a mesh spec, or `FREE` text), and `tests/research/test_flags.py` holds every command line to that.

`check(values, annotations)` refuses the first value that breaks its rule with `entry.UsageError`, one line naming the
flag: the command line prints it and exits 2. A tuple's rule holds for each element (and a tuple is not empty unless
the rule says `empty=True`); None passes (an optional flag left unset takes its default)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import typing
from collections.abc import Callable, Iterable
from typing import Any

from research import entry


@dataclasses.dataclass(frozen=True)
class Rule:
  """What one flag's value must be.

  Args:
    lo: the smallest number allowed (None: no bound).
    hi: the largest number allowed (None: no bound).
    open_lo: `lo` itself is refused (a positive number: lo=0, open_lo=True).
    choices: the allowed strings, or a function returning them (read at check time: a registry, the presets).
    parse: a function that raises ValueError (one line) for a value it cannot use (a mesh spec).
    path: "out-file", "out-dir" (can be written), "file", "dir" or "exists" (read: must exist, of that kind).
    empty: a tuple flag may be empty.
    blank: an empty (or all-space) string is a value (free text); else it is refused (an unset shell variable).
  """
  lo: float | None = None
  hi: float | None = None
  open_lo: bool = False
  choices: tuple[str, ...] | Callable[[], Iterable[str]] | None = None
  parse: Callable[[str], Any] | None = None
  path: str | None = None
  empty: bool = False
  blank: bool = False

  def refuse(self, flag: str, value) -> None:
    """Raises entry.UsageError (one line naming `flag`) unless `value` keeps this rule; None passes."""
    if isinstance(value, (tuple, list)):
      if not value and not self.empty:
        raise entry.UsageError(f"{flag}: give at least one value")
      for v in value:
        self.refuse(flag, v)
      return
    if value is None or isinstance(value, bool):
      return
    if isinstance(value, numbers.Real):
      self._number(flag, value)
    elif isinstance(value, str):
      self._text(flag, value)

  def _allowed(self) -> tuple:
    return tuple(self.choices() if callable(self.choices) else self.choices or ())

  def _number(self, flag: str, value):
    if not math.isfinite(value):
      raise entry.UsageError(f"{flag} must be a finite number, got {value}")
    if self.choices is not None and value not in self._allowed():
      raise entry.UsageError(f"{flag} {value} is not one of {', '.join(map(str, self._allowed()))}")
    low = self.lo is not None and (value < self.lo or self.open_lo and value == self.lo)
    if low or self.hi is not None and value > self.hi:
      raise entry.UsageError(f"{flag} must be {_span(self)}, got {value}")

  def _text(self, flag: str, value: str):
    if not value.strip() and not self.blank:
      raise entry.UsageError(f"{flag} is empty (an unset shell variable?): give a value, or leave the flag out")
    if self.choices is not None and value not in self._allowed():
      raise entry.UsageError(f"{flag} {value!r} is not one of {', '.join(map(str, self._allowed()))}")
    if self.parse is not None:
      try:
        self.parse(value)
      except ValueError as e:
        raise entry.UsageError(f"{flag} {value!r}: {str(e).splitlines()[0] if str(e) else 'malformed'}") from None
    if self.path is not None:
      _path(flag, value, self.path)


def _span(rule: Rule) -> str:
  if rule.hi is None:
    return f"{'>' if rule.open_lo else '>='} {rule.lo:g}"
  return f"in {'(' if rule.open_lo else '['}{rule.lo:g}, {rule.hi:g}]"


def _path(flag: str, value: str, kind: str):
  if kind == "out-file":
    entry.writable_file(value, flag)
  elif kind == "out-dir":
    entry.writable_dir(value, flag)
  elif not os.path.exists(value):
    what = {"file": "file", "dir": "directory"}.get(kind, "file or directory")
    raise entry.UsageError(f"{flag} {value}: no such {what}")
  elif kind == "file" and not os.path.isfile(value):
    raise entry.UsageError(f"{flag} {value} is a directory; give a file")
  elif kind == "dir" and not os.path.isdir(value):
    raise entry.UsageError(f"{flag} {value} is a file; give a directory")


def one_of(*choices: str) -> Rule:
  """A flag whose value (or each of its values) is one of `choices`.

  Args:
    *choices: the allowed strings.

  Returns:
    The rule.
  """
  return Rule(choices=choices)


def presets() -> tuple[str, ...]:
  """The model presets' names (read when a flag is checked: a plugin may have added some)."""
  from models import PRESETS
  return tuple(sorted(PRESETS))


def _optimizers() -> Iterable[str]:
  from optim import OPTIMIZERS
  return sorted(OPTIMIZERS)


def _mesh(spec: str):
  """A mesh spec's form (known axes, sizes positive or one -1); whether it fits the devices is the command's check."""
  from sharding.mesh import parse_mesh_spec
  parse_mesh_spec(spec, None)


COUNT = Rule(lo=1)  # a number of things or steps
NONNEGATIVE = Rule(lo=0)
POSITIVE = Rule(lo=0, open_lo=True)
FRACTION = Rule(lo=0, hi=1, open_lo=True)  # a share of something: (0, 1]
FREE = Rule(blank=True)  # free text (a prompt, a label): any string
MESH = Rule(parse=_mesh)
PRESET = Rule(choices=presets)
OPTIMIZER = Rule(choices=_optimizers)
DTYPE = one_of("float32", "bfloat16")  # a compute dtype every command supports on every backend
OUT_FILE = Rule(path="out-file")
OUT_DIR = Rule(path="out-dir")
EXISTING = Rule(path="exists")  # a file or directory to read

# The flags several command lines share: one meaning, one rule.
SHARED: dict[str, Rule] = {
    **dict.fromkeys(("steps", "batch_size", "seq_len", "repeats", "rounds", "devices", "rank", "matmul_n",
                     "loader_batches", "small_mb", "d_model", "n_layers", "n_heads", "d_ff", "vocab", "layers",
                     "batch", "seq", "prompt", "d", "f"), COUNT),
    **dict.fromkeys(("warmup", "workers", "seed", "step", "process_id"), NONNEGATIVE),
    **dict.fromkeys(("gb", "budget_gib", "device_gb", "memory_budget_gib"), POSITIVE),
    "lr": NONNEGATIVE,  # 0 trains nothing (an evaluation-only run); an experiment's tuned grids need more: its own
    "bias_rate": NONNEGATIVE,
    **dict.fromkeys(("mesh", "meshes", "src", "dst", "layouts"), MESH),
    **dict.fromkeys(("model", "preset", "presets", "kernel_model", "train_model", "context_model"), PRESET),
    **dict.fromkeys(("dtype", "compute_dtype"), DTYPE),
    "optimizers": OPTIMIZER,
    "out": OUT_FILE,
    **dict.fromkeys(("work", "tmp_dir"), OUT_DIR),
    "rank_fractions": FRACTION,
}


def by_type(name: str, annotation) -> Rule | None:
  """The rule a flag with no rule of its own takes from its type; None for a string, which must declare one.

  Args:
    name: the flag's parameter name (a seed may be 0).
    annotation: its type annotation.

  Returns:
    A count (>= 1; a seed >= 0) for an integer, a finite number >= 0 for a float, an empty rule for a bool or a
    `Literal` (tyro checks those), else None.
  """
  kinds = _kinds(annotation)
  if kinds <= {bool, type(None)} or "literal" in kinds:
    return Rule()
  if int in kinds and not kinds & {str, float}:
    return NONNEGATIVE if "seed" in name else COUNT
  if float in kinds and str not in kinds:
    return NONNEGATIVE
  return None


def _kinds(annotation) -> set:
  """The scalar types a flag's annotation admits (a tuple's elements', Annotated and Positional unwrapped)."""
  origin = typing.get_origin(annotation)
  if origin is typing.Annotated:
    return _kinds(typing.get_args(annotation)[0])
  if origin is typing.Literal:
    return {"literal"}
  if origin is not None:  # a union, tuple[...], Positional[...]
    return set().union(*(_kinds(a) for a in typing.get_args(annotation) if a is not Ellipsis))
  return {annotation}


def rule_for(name: str, annotation) -> Rule | None:
  """A flag's rule: its annotation's `Rule`, else `SHARED[name]`, else `by_type` (None: a string left undeclared).

  Args:
    name: the parameter or field name.
    annotation: its (resolved) type annotation.

  Returns:
    The rule, or None when the flag has none.
  """
  for meta in _metadata(annotation):
    if isinstance(meta, Rule):
      return meta
  shared = SHARED.get(name)
  numeric = shared is not None and (shared.lo is not None or shared.hi is not None)
  if shared is not None and numeric == bool(_kinds(annotation) & {int, float}):  # the same kind of value: a prompt
    return shared  # length (bench sample) is a count, a prompt text (research.sample) is not
  return by_type(name, annotation)


def _metadata(annotation) -> tuple:
  if typing.get_origin(annotation) is typing.Annotated:
    args = typing.get_args(annotation)
    return (*args[1:], *_metadata(args[0]))
  return ()


def flag_name(name: str) -> str:
  """`--batch-size` for `batch_size`: the flag tyro makes of a parameter."""
  return "--" + name.replace("_", "-")


def check(values: dict[str, Any], annotations: dict[str, Any]) -> None:
  """Checks each value against its flag's rule (`rule_for`), before the command does any work.

  Args:
    values: {parameter name: value} as parsed.
    annotations: {parameter name: resolved type annotation}.

  Raises:
    entry.UsageError: one line naming the first flag whose value breaks its rule.
  """
  for name, value in values.items():
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a nested config: its own fields
      check_config(value)
      continue
    hint = annotations.get(name, type(value))
    rule = rule_for(name, hint)
    if rule is not None:  # a positional argument is named by its field in capitals (PATH), a flag as --flag
      rule.refuse(name.upper() if "Positional" in str(hint) else flag_name(name), value)


def check_config(cfg, skip: Iterable[str] = ()) -> None:
  """`check` over a config dataclass's fields (a tool's or an experiment's flags).

  Args:
    cfg: a dataclass instance.
    skip: fields the command checks itself (an experiment's --out: a directory, written only by a full run).

  Raises:
    entry.UsageError: one line naming the first field whose value breaks its rule.
  """
  hints = typing.get_type_hints(type(cfg), include_extras=True)
  check({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}, hints)
