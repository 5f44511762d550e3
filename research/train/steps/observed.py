"""The train step with its observers: the plain program on the steps no observer is due at, and on the others a program
compiled with the due observers (research/train/observers/), built the first time that set is due.

The plain program is the one a run without observers compiles (the same HLO, the same bytes: nothing of any observer is
held on the steps between); an observed program takes the held batch after (state, x, y) when an observer reads it, and
does not donate the state: XLA:CPU (jaxlib 0.10) hung executing some observed steps that donated it (the spectra of the
tiny model's seven matrices, on 1 and 8 devices alike), so an observed step holds the state twice. An observed step also
runs alone: the step before it has finished when it starts, and it has finished when the next one starts (on 8 simulated
devices the small model's first observed step else died in a collective's rendezvous, one device's thread never
arriving). The loop arms the step about to run (`arm`, a before-hook); the program is then called as the plain one is.
The observed steps' numbers reach the record of that step (`records`), which the metrics processor logs
(`MetricsProcessor.due` covers every observer's cadence). The memory pre-flight compiles the plain program only; each
observed program's bytes per device (XLA's memory_analysis) are printed when it compiles, at its first step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from research.train.observers import Active, active, compose
from research.train.runtime.xla import StepBytes, size


class ObservedSteps:
  """A train step that runs the observers due at each step.

  Args:
    plain: the jitted train step without observers, `plain(state, x, y)`.
    build: `build(observe, held_sh)` -> the jitted train step with `observe` (`contract.outputs`), taking
      `*held` after y.
    observers: the run's active observers.
    section: the config's observe section.
    held: the held batch (x, y) on the devices, for an observer that reads "held".
  """

  def __init__(self, plain: Callable, build: Callable, observers: list[Active], section: Any, held: tuple = ()):
    self.plain, self.build, self.observers, self.section = plain, build, observers, section
    self.held = held
    self.programs: dict[frozenset, Callable] = {}
    self.due: list[Active] = []
    self.fresh = False  # the last call compiled a program (its time is not training: the throughput meter skips it)
    self.hosts = {a.observer.name: a.observer.host(section) for a in observers if a.observer.host is not None}
    self.one = jax.make_mesh((1,), ("one",), devices=jax.local_devices()[:1],
                             axis_types=(jax.sharding.AxisType.Explicit,))  # where `post` programs run
    self.posts = {a.observer.name: jax.jit(functools.partial(a.observer.post, section=section))  # type: ignore
                  for a in observers if a.observer.post is not None}

  def replay(self, records: list[dict]) -> None:
    """Feeds the observers' host functions (an EMA) the numbers an interrupted session logged, in step order, so a
    resumed run continues exactly.

    Args:
      records: metrics.jsonl's records up to the resumed step.
    """
    for rec in records:
      self._host(rec)

  def arm(self, step: int) -> None:
    """The before-hook: which observers the step that makes `step` steps done runs."""
    self.due = [a for a in self.observers if a.due(step)]

  def lower(self, *args, **kwargs):
    """The plain program's `lower` (the memory pre-flight and the byte audit read the plain step)."""
    return self.plain.lower(*args, **kwargs)

  def __call__(self, state, x, y):
    self.fresh = False
    if not self.due:
      return self.plain(state, x, y)
    key = frozenset(a.observer.name for a in self.due)
    if key not in self.programs:
      self.fresh = True
      reads = any("held" in a.observer.reads for a in self.due)
      held_sh = tuple(h.sharding for h in self.held) if reads else ()
      program = self.build(compose(self.due, self.section), held_sh)
      compiled = program.lower(state, x, y, *(self.held if reads else ())).compile()
      print(f"memory: the step with {', '.join(sorted(key))} needs {size(StepBytes.of(compiled).peak)} per device "
            f"(compiled at its first step; the pre-flight's estimate is the plain step's)", flush=True)
      self.programs[key] = (compiled, reads)
    program, reads = self.programs[key]
    jax.block_until_ready(state)  # no other program in flight beside an observed one (the module docstring)
    return jax.block_until_ready(program(state, x, y, *(self.held if reads else ())))

  def records(self, out: dict) -> dict:
    """The metrics source: an observed step's numbers as JSON values (a number, or nested lists per layer), and what
    the observers' host functions make of them.

    Args:
      out: the step's outputs.

    Returns:
      {"<observer>/<metric>": value} of the observers that ran at this step ({} at another step).
    """
    names = tuple(f"{a.observer.name}/" for a in self.observers)
    mine = {k: v for k, v in out.items() if k.startswith(names)}
    for name, post in self.posts.items():  # an observer's second program, over what it returned from the step
      values = {k[len(name) + 1:]: mine.pop(k) for k in list(mine) if k.startswith(name + "/")}
      if values:  # on one device (the module docstring)
        here = jax.device_put(jax.device_get(values), self.one.devices.flat[0])
        with jax.set_mesh(self.one):
          mine.update({f"{name}/{k}": v for k, v in post(here).items()})
    got = jax.device_get(mine)
    rec = {k: np.asarray(v).tolist() for k, v in got.items()}
    return {**rec, **self._host(rec)}

  def _host(self, rec: dict) -> dict:
    """The host functions' numbers from a record's raw ones (a replayed record's own host numbers are recomputed)."""
    extra = {}
    for name, after in self.hosts.items():
      raw = {k[len(name) + 1:]: v for k, v in rec.items() if k.startswith(name + "/") and not k.endswith("_ema")}
      if raw:
        extra.update({f"{name}/{k}": v for k, v in after(raw).items()})
    return extra


def wrap(section: Any, plain: Callable, build: Callable, val: list) -> Callable:
  """The train step with the run's observers (`ObservedSteps`), or `plain` itself when none is on.

  Args:
    section: the config's observe section.
    plain: the plain jitted train step.
    build: `build(observe, held_sh)` -> the jitted train step with observers.
    val: the held-out batches on the devices (the first is the observers' held batch).

  Returns:
    The step the loop calls.
  """
  observers = active(section)
  return ObservedSteps(plain, build, observers, section, tuple(val[0])) if observers else plain


def arm(step_fn: Callable | None, step: int) -> None:
  """The loop's before-hook: arms `step_fn` for `step` when it is an `ObservedSteps` (a run with observers).

  Args:
    step_fn: the step the loop calls (the syncer's).
    step: the step about to run (steps done after it).
  """
  if isinstance(step_fn, ObservedSteps):
    step_fn.arm(step)


def records(step_fn: Callable | None, out: dict) -> dict:
  """The metrics source: the observed numbers of a step ({} without observers).

  Args:
    step_fn: the step the loop calls.
    out: the step's outputs.

  Returns:
    `ObservedSteps.records`' entries, or {}.
  """
  return step_fn.records(out) if isinstance(step_fn, ObservedSteps) else {}


def compiled(step_fn: Callable | None) -> bool:
  """Whether the last step compiled an observed program (the throughput meter restarts after it).

  Args:
    step_fn: the step the loop calls.

  Returns:
    True after a step that built a program.
  """
  return isinstance(step_fn, ObservedSteps) and step_fn.fresh
