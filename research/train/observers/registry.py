"""The observers' registry: `Observer` (what one reads, costs, and computes), `register`, the run's `active` ones and
their `compose`d function (research/train/observers/__init__.py says what an observer is)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from research.train.config import RunError

# what an observer may read: the step's trees (`StepResult`), the step's batch and loss function (`Probe`), the
# first held-out batch (passed to the observed program)
READS = frozenset({"params", "grads", "updates", "opt_state", "batch", "loss", "held"})


@dataclasses.dataclass(frozen=True)
class Observer:
  """A diagnostic inside the step.

  Args:
    name: its name (the prefix of its metrics, and --observe's NAME).
    reads: what it reads, a subset of `READS` ("held": the program takes the held batch).
    cost: what it costs per observed step, in words (docs/diagnostics.md's table measures it).
    every: its cadence from the config's observe section (0: off); None: only --observe NAME:EVERY turns it on.
    observe: `observe(result, held, section) -> {metric: array}`, traced inside the step (`held`: (x, y) of the held
      batch when it reads "held", else ()).
    host: a factory `host(section)` of `after(values) -> {metric: number}`, called with each observed step's numbers
      in step order (those of an interrupted session's records first), for what needs the steps before (an EMA); its
      metrics are named with the suffix "_ema" (a replayed record's are recomputed, not read). None: none.
    check: `check(section, batch_size)`, raising ValueError (one line) for flags it cannot use (its value is not
      read); None: none.
    post: `post(values, section) -> {metric: array}`, a program of its own (jitted apart from the step) over what
      `observe` returned, for work that must not sit in the step's program; None: `observe`'s numbers are the record.
  """
  name: str
  reads: frozenset[str]
  cost: str
  observe: Callable[[Any, tuple, Any], dict]
  every: Callable[[Any], int] | None = None
  host: Callable[[Any], Callable[[dict], dict]] | None = None
  check: Callable[[Any, int], object] | None = None
  post: Callable[[dict, Any], dict] | None = None

  def __post_init__(self):
    unknown = set(self.reads) - READS
    if unknown:
      raise ValueError(f"observer {self.name!r} reads {sorted(unknown)}: not among {sorted(READS)}")


OBSERVERS: dict[str, Observer] = {}


def register(observer: Observer) -> Observer:
  """Adds an observer to the registry (the one line a new diagnostic needs besides its file).

  Args:
    observer: the observer; its name must be new.

  Returns:
    The observer.

  Raises:
    ValueError: a name already registered.
  """
  if observer.name in OBSERVERS and OBSERVERS[observer.name] is not observer:
    raise ValueError(f"an observer named {observer.name!r} is already registered")
  OBSERVERS[observer.name] = observer
  return observer


@dataclasses.dataclass(frozen=True)
class Active:
  """An observer a run turned on, with its cadence."""
  observer: Observer
  every: int

  def due(self, step: int) -> bool:
    return step % self.every == 0


def active(section, batch_size: int | None = None) -> list[Active]:
  """The observers the config's observe section turns on, in registration order.

  Args:
    section: `ObserveSection`.
    batch_size: --batch-size, for the active observers' own checks (None: not checked).

  Returns:
    The active observers and their cadences.

  Raises:
    RunError: an --observe that is not NAME:EVERY with a registered NAME and EVERY >= 1, or a flag an active
      observer's check refuses.
  """
  cadence = {name: o.every(section) for name, o in OBSERVERS.items() if o.every is not None}
  for item in section.observe:
    name, sep, every = item.partition(":")
    if name not in OBSERVERS:
      raise RunError(f"--observe {item!r}: no observer named {name!r}; registered: {', '.join(sorted(OBSERVERS))}")
    if not (sep and every.isdigit() and int(every) >= 1):
      raise RunError(f"--observe {item!r}: give NAME:EVERY with EVERY a whole number of steps >= 1")
    cadence[name] = int(every)
  on = [Active(OBSERVERS[name], cadence[name]) for name in OBSERVERS if cadence.get(name, 0) > 0]
  for a in on:
    if a.observer.check is not None and batch_size is not None:
      try:
        a.observer.check(section, batch_size)
      except ValueError as e:
        raise RunError(str(e)) from None
  return on


def compose(observers: list[Active], section) -> Callable[[Any, tuple], dict]:
  """One function the step calls (`contract.outputs`): every due observer's numbers, under its name.

  Args:
    observers: the observers due in this program.
    section: `ObserveSection` (each observer reads its own flags there).

  Returns:
    `observe(result, held) -> {"<name>/<metric>": array}`.
  """
  def observe(result, held):
    if result.probe is None:
      raise RunError("this step kind offers no observers")
    out = {}
    for a in observers:
      got = a.observer.observe(result, held if "held" in a.observer.reads else (), section)
      out.update({f"{a.observer.name}/{k}": v for k, v in got.items()})
    return out
  return observe


__all__ = ["OBSERVERS", "READS", "Active", "Observer", "active", "compose", "register"]
