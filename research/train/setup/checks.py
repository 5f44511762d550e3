"""Checks of the train CLI's flags that need nothing but the flags, run before JAX starts or anything is written:
every count positive, every rate a finite number in its range, a run directory that can be created and written.
Each failure is a `PreflightError` with one line naming the flag (the CLI prints it and exits 2)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing

from research import entry, flags
from research.train.config.prefixed import PAD_BATCHES
from research.train.hooks import profiler, trackers


class PreflightError(ValueError):
  """A flag value no run can use."""


def _flag(section, name: str) -> str:
  return "--" + getattr(section, "PREFIX", "") + name.replace("_", "-")


def check_section(section) -> None:
  """A section's own checks: paths not empty, counts positive, rates finite and in range (None = unset, which takes a
  default), a flag given only with the flag it needs.

  Args:
    section: a config section; its `PATHS`, `POSITIVE` counts, `RANGES` (research/train/config/sections.py) and
      `NEEDS` ({flag: the flag it needs}) are checked, the flags named with its `PREFIX` (--moe.*).

  Raises:
    PreflightError: one line naming the first flag that fails.
  """
  for name in getattr(section, "PATHS", ()):
    if getattr(section, name) is not None and not str(getattr(section, name)).strip():
      raise PreflightError(f"{_flag(section, name)} is empty (an unset shell variable?): give a path, or leave the "
                           f"flag out")
  for name in getattr(section, "POSITIVE", ()):
    if getattr(section, name) is not None and getattr(section, name) <= 0:
      raise PreflightError(f"{_flag(section, name)} must be positive, got {getattr(section, name)}")
  for name, (lo, hi, closed) in getattr(section, "RANGES", {}).items():
    value = getattr(section, name)
    if value is None:
      continue
    if not math.isfinite(value):
      raise PreflightError(f"{_flag(section, name)} must be a finite number, got {value}")
    if value < lo or (value == lo and not closed) or (hi is not None and value > hi):
      low, high = "[" if closed else "(", "inf)" if hi is None else f"{hi}]"
      raise PreflightError(f"{_flag(section, name)} must lie in {low}{lo}, {high}, got {value}")
  for name, needed in getattr(section, "NEEDS", {}).items():
    if getattr(section, name) is not None and not getattr(section, needed):
      raise PreflightError(f"{_flag(section, name)} needs {_flag(section, needed)}")
  _shared(section)


def _shared(section) -> None:
  """The numeric flags every command shares (`research.flags.SHARED`: --steps, --seed, --lr, ...), by their one rule;
  a flag the section declares itself (`POSITIVE`, `RANGES`) keeps its own."""
  own = {*getattr(section, "POSITIVE", ()), *getattr(section, "RANGES", {})}
  hints = typing.get_type_hints(type(section), include_extras=True)
  for f in dataclasses.fields(section):
    rule = flags.rule_for(f.name, hints[f.name]) if f.name in flags.SHARED and f.name not in own else None
    if rule is not None and (rule.lo is not None or rule.hi is not None):
      try:
        rule.refuse(_flag(section, f.name), getattr(section, f.name))
      except entry.UsageError as e:
        raise PreflightError(str(e)) from None


def check_numbers(sections, optim, training, logging, moe):
  """Every section's own checks (`check_section`), then those across sections.

  Args:
    sections: every section of the run's config.
    optim: its optim section (--warmup-steps).
    training: its training section (--steps, --stop-at).
    logging: its logging section (--profile).
    moe: its --moe.* section (--moe.pad-batches).

  Raises:
    PreflightError: one line: a section's check, a warmup outside [0, --steps], a --stop-at below 1, a --profile
      window that is malformed or reaches past --steps, PAD-Net scoring more batches at step 0 than the run trains
      on (beyond --moe.pad-batches' default, which a run of fewer steps may still score).
  """
  for section in sections:
    check_section(section)
  if optim.warmup_steps is not None and not 0 <= optim.warmup_steps <= training.steps:
    raise PreflightError(f"--warmup-steps ({optim.warmup_steps}) must lie in [0, --steps={training.steps}]")
  if training.stop_at is not None and training.stop_at <= 0:
    raise PreflightError(f"--stop-at must be positive, got {training.stop_at}")
  if moe.pad_batches is not None and moe.pad_batches > max(training.steps, PAD_BATCHES):
    raise PreflightError(f"--moe.pad-batches {moe.pad_batches}: PAD-Net's partition scores at most as many batches at "
                         f"step 0 as the run trains on (--steps {training.steps}), or {PAD_BATCHES}")
  try:
    window = profiler.parse(logging.profile)
  except profiler.ProfileError as e:
    raise PreflightError(str(e)) from None
  if window is not None and sum(window) - 1 > training.steps:
    raise PreflightError(f"--profile {logging.profile}: steps {window[0]}-{sum(window) - 1} are not all within "
                         f"--steps {training.steps}")


def check_out(out: str):
  """A run directory that exists and is a writable directory, or whose nearest existing parent is one."""
  path = os.path.abspath(out)
  if os.path.exists(path) and not os.path.isdir(path):
    raise PreflightError(f"--out {out} is a file, not a run directory")
  parent = entry.nearest_existing(path)
  if not os.path.isdir(parent):
    raise PreflightError(f"--out {out} cannot be created: {parent} is a file")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise PreflightError(f"--out {out} {'is not writable' if parent == path else f'cannot be created in {parent}'}")
  for sub in ("ckpt", "metrics.jsonl", "config.json"):  # a resumed run writes into each
    p = os.path.join(path, sub)
    if os.path.exists(p) and not os.access(p, os.W_OK):
      raise PreflightError(f"--out {out}: {p} is not writable")
  ckpt = os.path.join(path, "ckpt")
  if os.path.lexists(ckpt) and not os.path.isdir(ckpt):  # it would train from step 0 and then fail to save
    raise PreflightError(f"--out {out}: {ckpt} is not a directory (a run directory's checkpoints live there); move "
                         f"it aside")
  for sub in ("metrics.jsonl", "config.json"):
    if os.path.isdir(os.path.join(path, sub)):
      raise PreflightError(f"--out {out}: {os.path.join(path, sub)} is a directory, not the run's file; move it aside")


def check(cfg):
  """Every check of the flags alone (module docstring).

  Args:
    cfg: the run's config.

  Raises:
    PreflightError: one line naming the first flag that fails.
    RunError: --tracker's package is missing.
  """
  check_numbers([getattr(cfg, f.name) for f in dataclasses.fields(cfg)], cfg.optim, cfg.training, cfg.logging,
                cfg.moe)
  check_out(cfg.checkpoint.out)
  trackers.check(cfg.logging.tracker)  # a RunError: --tracker's package is missing
