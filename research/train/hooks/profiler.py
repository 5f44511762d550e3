"""--profile STEP:COUNT: a `jax.profiler` trace of training steps STEP .. STEP+COUNT-1, in `<out>/profile/`.

Open it with TensorBoard's profile plugin or XProf (`tensorboard --logdir <out>/profile`, the Profile tab: the
trace viewer, the op profile). The run also prints the trace's top operations by device time (`top_ops`, read from
the trace's own `*.trace.json.gz`), so the heaviest kernels are named without leaving the terminal.

The steps are numbered as in metrics.jsonl (step 1 is the first, and compiles: start at 2 or later to see steady
steps). The trace starts before step STEP is dispatched and stops once step STEP+COUNT-1's outputs are ready, so it
holds those steps' whole device work. A run that resumes past STEP traces nothing; one stopped inside the window
keeps what was traced.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
from typing import cast

import jax


class ProfileError(ValueError):
  """A --profile value that names no steps."""


def parse(spec: str | None) -> tuple[int, int] | None:
  """(first step, count) of "STEP:COUNT" or "STEP" (one step); None for no profile."""
  if not spec:
    return None
  head, _, tail = spec.partition(":")
  try:
    first, count = int(head), int(tail or 1)
  except ValueError:
    raise ProfileError(f"--profile {spec!r}: give STEP:COUNT, e.g. 10:3 (steps 10, 11, 12)") from None
  if first < 1 or count < 1:
    raise ProfileError(f"--profile {spec!r}: STEP and COUNT must be at least 1")
  return first, count


class Profiler:
  """Starts and stops the trace around the chosen steps (`before(step)`, `after(step, outputs)`). A failure of the
  profiler (writing or reading the trace) is one warning line: a diagnostic never ends a training run."""

  def __init__(self, spec: str | None, out: str, show: bool = True):
    self.window, self.dir, self.show = parse(spec), os.path.join(out, "profile"), show
    self.tracing = False

  def before(self, step: int):
    """Called before step `step` is dispatched."""
    if self.window is not None and step == self.window[0]:
      try:
        jax.profiler.start_trace(self.dir)
        self.tracing = True
      except Exception as e:  # e.g. another trace already running in this process
        self._warn(f"--profile: the trace did not start ({_line(e)})")

  def after(self, step: int, outputs) -> bool:
    """Called after step `step` was dispatched, with its outputs; True when the trace was just written (the time it
    took, and reading it back, is not training time)."""
    if not (self.tracing and self.window is not None and step == sum(self.window) - 1):
      return False
    jax.block_until_ready(outputs)
    if self.close():
      first, _ = self.window
      try:
        ops = format_top(top_ops(self.dir))
      except Exception as e:  # a trace that cannot be read: the xplane file is still there
        ops = f"not read ({_line(e)})"
      if self.show:
        print(f"profile: steps {first}-{step} traced in {self.dir} (tensorboard --logdir {self.dir}, Profile tab); "
              f"top ops by device time, summed over devices: {ops}", file=sys.stderr, flush=True)
    return True

  def close(self, step: int | None = None) -> bool:
    """Stops a trace still running; with `step`, the run ended or was stopped inside the window (what was traced is
    kept, and said). True when the trace was written."""
    if not self.tracing:
      return False
    self.tracing = False
    try:
      jax.profiler.stop_trace()
    except Exception as e:
      self._warn(f"--profile: the trace could not be written ({_line(e)})")
      return False
    if step is not None:
      assert self.window is not None  # a trace runs only inside the window
      self._warn(f"--profile: the run stopped at step {step}, inside the window {self.window[0]}:{self.window[1]}; "
                 f"the steps traced are in {self.dir}")
    return True

  def _warn(self, text: str):
    if self.show:
      print(f"warning: {text}", file=sys.stderr, flush=True)


def _line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def top_ops(directory: str, n: int = 5) -> list[tuple[str, float]]:
  """The `n` XLA operations with the most total duration (ms) in the newest trace under `directory`: the Chrome
  trace events jax writes beside the xplane file that name their HLO op (a CPU thunk's or a device kernel's), so
  host-side Python, dispatch and compilation are left out."""
  traces = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.trace.json.gz")))
  if not traces:
    return []
  with gzip.open(traces[-1], "rt") as f:
    events = json.load(f).get("traceEvents", [])
  total: collections.Counter[str] = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e and "hlo_op" in e.get("args", {}):  # an XLA operation's execution
      total[e["args"]["hlo_op"]] += e["dur"] / 1e3
  return cast(list[tuple[str, float]], total.most_common(n))  # Counter's stubs type its counts int; these are ms


def format_top(ops: list[tuple[str, float]]) -> str:
  return ", ".join(f"{name} {ms:.2f} ms" for name, ms in ops) or "none found in the trace"
