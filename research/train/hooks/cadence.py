"""Hooks with a cadence: what the loop calls before and after each step, each concern by name, in the order they were
registered (Levanter's `trainer.add_hook(fn, every=N)`). A hook that manages its own frequency (the checkpointer,
the metrics processor) registers with `every=1` and decides itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class StepInfo:
  """What a hook sees after a step.

  Args:
    step: steps done so far (this one included).
    out: the step's outputs, still on the device.
    end: the step this session stops after (--steps, or --stop-at).
    total: --steps, the schedule's length.
    stopping: a signal asked the run to stop after this step.
    shared: values one hook leaves for a later one in the same step (the held-out losses for the mixture's record).
  """
  step: int
  out: dict
  end: int
  total: int
  stopping: bool = False
  shared: dict = dataclasses.field(default_factory=dict)

  @property
  def last(self) -> bool:
    """The schedule's last step."""
    return self.step == self.total

  @property
  def final(self) -> bool:
    """This session's last step: the end, or a stop."""
    return self.step == self.end or self.stopping


@dataclasses.dataclass(frozen=True)
class Hook:
  """One concern the loop calls: `fn(info)` when `due(info)`.

  Args:
    name: what it is (for a reader, and `Hooks.names`).
    fn: called with the `StepInfo` (before a step: with the step about to run).
    every: its cadence in steps (1: every step).
    at_end: also at the schedule's last step.
  """
  name: str
  fn: Callable
  every: int = 1
  at_end: bool = False

  def due(self, info: StepInfo) -> bool:
    return info.step % self.every == 0 or (self.at_end and info.last)


class Hooks:
  """The loop's hooks, before and after each step, in registration order."""

  def __init__(self) -> None:
    self._before: list[Hook] = []
    self._after: list[Hook] = []

  def before(self, name: str, fn: Callable[[int], object]) -> None:
    """Registers a hook called before each step.

    Args:
      name: what it is.
      fn: `fn(step)`, called before the step that will make `step` steps done.
    """
    self._before.append(Hook(name, fn))

  def add(self, name: str, fn: Callable[[StepInfo], object], *, every: int = 1, at_end: bool = False) -> None:
    """Registers a hook called after the steps it is due at (`Hook.due`).

    Args:
      name: what it is.
      fn: `fn(info)`, with the step's `StepInfo`.
      every: its cadence in steps (1: every step; a hook that decides itself registers with 1).
      at_end: also at the schedule's last step.
    """
    self._after.append(Hook(name, fn, every, at_end))

  @property
  def names(self) -> list[str]:
    return [h.name for h in self._before] + [h.name for h in self._after]

  def run_before(self, step: int) -> None:
    for hook in self._before:
      hook.fn(step)

  def run_after(self, info: StepInfo) -> None:
    for hook in self._after:
      if hook.due(info):
        hook.fn(info)
