"""`TrainConfig`: every `python -m research.train` flag, in sections (research/train/config/sections.py).

A function of the trainer receives the section(s) it reads (`cfg.optim`, `cfg.data`, ...) and the run's plan
(research/train/setup/plan.py); the whole config goes only to the entry points (the loop, the flag checks, the run's
construction, a vmapped group). Flags keep their spelling (`--lr`, `--model`, `--moe.top-k`), and so
does Python: `TrainConfig(model="tiny", lr=1e-2)` builds a config from keywords named as the flags are (their
underscores), `dataclasses.replace(cfg, lr=...)` changes some, and `cfg.flags()` gives them back flat. config.json
stores the sections; `flat_record` reads the "train" record of every layout (runs written before the sections stored
it flat, and before `finetune` was split into `weights` and `trains`), which is how a resumed run compares its
settings with its checkpoint's.

Beside it: the sections with a prefix of their own (prefixed.py), the sections derived from a library config's schema
(derived.py), the observers' section (observe.py), the paths a run records, absolute and fingerprinted (paths.py), what
a run trains (trainable.py). The flag checks run before anything starts and what does not combine are
research/train/setup/checks.py and clashes.py. This room imports no other room of the trainer
(tests/test_imports.py).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any

import tyro

from research.train.config.observe import ObserveSection
from research.train.config.prefixed import DataFlags, MoEFlags, PeftFlags
from research.train.config.sections import (
  CheckpointSection,
  DataSection,
  DistributedSection,
  HealthSection,
  LoggingSection,
  MeshSection,
  ModelSection,
  OptimSection,
  RuntimeSection,
  SyncSection,
  TrainingSection,
  TrainsSection,
  WeightsSection,
)

_Section = tyro.conf.OmitArgPrefixes  # a section's flags carry no prefix; --help groups them under its name


def _section(cls):
  return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(init=False)
class TrainConfig:
  """Train a decoder-only transformer on a named device mesh."""

  model: Annotated[ModelSection, _Section] = _section(ModelSection)
  moe: MoEFlags = _section(MoEFlags)
  """Mixture of experts (--moe.num-experts 8 --moe.top-k 2 ...): each flag overrides one field of the preset's.
  Expert parallelism comes from an `expert` mesh axis; router metrics go to metrics.jsonl as moe/*."""
  optim: Annotated[OptimSection, _Section] = _section(OptimSection)
  training: Annotated[TrainingSection, _Section] = _section(TrainingSection)
  data: Annotated[DataSection, _Section] = _section(DataSection)
  data_options: Annotated[DataFlags, tyro.conf.arg(name="data")] = _section(DataFlags)
  """How the data is read and laid into rows (--data.field text --data.layout pack ...)."""
  mesh: Annotated[MeshSection, _Section] = _section(MeshSection)
  sync: Annotated[SyncSection, _Section] = _section(SyncSection)
  weights: Annotated[WeightsSection, _Section] = _section(WeightsSection)
  trains: Annotated[TrainsSection, _Section] = _section(TrainsSection)
  peft_options: Annotated[PeftFlags, tyro.conf.arg(name="peft")] = _section(PeftFlags)
  """Adapter settings (--peft.rank 8 --peft.alpha 16 --peft.targets REGEX ...); each method reads its own."""
  checkpoint: Annotated[CheckpointSection, _Section] = _section(CheckpointSection)
  logging: Annotated[LoggingSection, _Section] = _section(LoggingSection)
  observe: Annotated[ObserveSection, _Section] = _section(ObserveSection)
  health: Annotated[HealthSection, _Section] = _section(HealthSection)
  runtime: Annotated[RuntimeSection, _Section] = _section(RuntimeSection)
  distributed: Annotated[DistributedSection, _Section] = _section(DistributedSection)

  def __init__(self, **given: Any):
    """A config from whole sections and from keyword arguments named as the flags are; the rest at their defaults.

    `dataclasses.replace(cfg, lr=...)` works the same way.

    Args:
      **given: whole sections (`optim=OptimSection(lr=1e-2)`, as tyro builds it) and flags
        (`TrainConfig(model="tiny", lr=1e-2, moe=MoEFlags(top_k=1))`: the flag names with underscores, `data_options`
        and `peft_options` for --data.* and --peft.*), the flags applied over the sections. A name that is both
        (`model`, `data`, `mesh`, `sync`, `distributed`) is the section when the value is one, else the flag.

    Raises:
      TypeError: a keyword that is neither a section nor a flag.
    """
    sections: dict[str, Any] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # their classes
    flags = {}
    for name, value in given.items():
      if name in sections and isinstance(value, sections[name]):
        setattr(self, name, value)
      elif name in FLAGS:
        flags[name] = value
      else:
        raise TypeError(f"TrainConfig has no section or flag {name!r}")
    for name, cls in sections.items():
      if not hasattr(self, name):
        setattr(self, name, cls())
    changed: dict[str, dict[str, Any]] = {}
    for flag, value in flags.items():
      section, attr = FLAGS[flag]
      if attr is None:
        setattr(self, section, value)
      else:
        changed.setdefault(section, {})[attr] = value
    for section, values in changed.items():
      setattr(self, section, dataclasses.replace(getattr(self, section), **values))

  def flags(self) -> dict:
    """Every flag's value, flat.

    Returns:
      {flag: value}, keyed as the constructor takes them and as config.json stored them before the sections.
    """
    return {flag: (getattr(getattr(self, s), a) if a else getattr(self, s)) for flag, (s, a) in FLAGS.items()}

  def features(self) -> dict[str, str | None]:
    """The run features its sections declare, by research/train/setup/clashes.py's names.

    Each section's `features()`: --sync, --zero1, --peft, observers, ...

    Returns:
      {feature: how a message names it when the run has it, else None}.
    """
    out: dict[str, str | None] = {}
    for f in dataclasses.fields(self):
      out.update(getattr(getattr(self, f.name), "features", dict)())
    return out


def _nested() -> type:
  """`TrainConfig` as a field of another tool's config (the sweep's `train`: `--train.lr`, `--train.moe.top-k`).

  The same class with each section's flags under that field's prefix (a section's own prefix still left out).
  """
  unboxed = lambda f: Annotated[f.default_factory, tyro.conf.arg(name="")]  # its flags under the field's prefix
  fields = [(f.name, unboxed(f) if f.name in _SECTIONS else _HINTS[f.name],
             dataclasses.field(default_factory=f.default_factory)) for f in dataclasses.fields(TrainConfig)]
  return dataclasses.make_dataclass("TrainConfig", fields, bases=(TrainConfig,), init=False)


def _flag_name(section: type, field: str) -> str:
  """The flag a section's field is spelled as.

  Its own name, or the name its annotation gives tyro (`--model` for `ModelSection.preset`).
  """
  hint = typing.get_type_hints(section, include_extras=True)[field]
  return next((m.name for m in getattr(hint, "__metadata__", ()) if getattr(m, "name", None)), field)


_HINTS = typing.get_type_hints(TrainConfig, include_extras=True)
# the sections whose flags carry no prefix (the others, --moe.*, --data.*, --peft.*, are one flag group each)
_SECTIONS = {name for name, hint in _HINTS.items() if _Section in getattr(hint, "__metadata__", ())}
# flag -> (section, field); field None: the flag is the whole section (`moe`, `data_options`, `peft_options`)
FLAGS: dict[str, tuple[str, str | None]] = {}
for _f in dataclasses.fields(TrainConfig):
  if _f.name not in _SECTIONS:
    FLAGS[_f.name] = (_f.name, None)
  else:
    _cls: typing.Any = _f.default_factory  # the section's class
    for _g in dataclasses.fields(_cls):
      FLAGS[_flag_name(_cls, _g.name)] = (_f.name, _g.name)


NestedTrainConfig = _nested()


def flat_record(train: dict) -> dict:
  """config.json's "train" record, flag by flag.

  Args:
    train: the record: by section, or flat (runs written before the sections).

  Returns:
    {flag: value}: a sectioned record flattened, a flat one as it is.
  """
  if not isinstance(train.get("optim"), dict):  # the flat layout had no "optim" flag
    return dict(train)
  out: dict[str, Any] = {}
  for section in _SPLIT:  # a section of an earlier layout, since split: its fields are flags of their own name
    out.update(train.get(section) or {})
  for flag, (section, attr) in FLAGS.items():
    if section in train:
      value = train[section] if attr is None else train[section].get(attr, _MISSING)
      if value is not _MISSING:
        out[flag] = value
  return out


_MISSING = object()
_SPLIT = ("finetune",)  # runs before 2026-12-06: --init-from and what trains in one section (now weights, trains)


def flat_meta(meta: dict) -> dict:
  """A config.json (or a checkpoint's metadata) with its "train" record flat, whichever layout wrote it.

  Args:
    meta: the config.json or checkpoint metadata.

  Returns:
    A copy of `meta` whose "train" is `flat_record`'s.
  """
  return {**meta, "train": flat_record(meta.get("train") or {})}


class RunError(ValueError):
  """A run that cannot start as configured."""
