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

import jax


class ProfileError(ValueError):
  """A --profile value that names no steps."""


def parse(spec: str | None) -> tuple[int, int] | None:
  """(first step, count) of "STEP:COUNT" or "STEP" (one step); None for no profile."""
  if not spec:
    return None
  first, _, count = spec.partition(":")
  try:
    first, count = int(first), int(count or 1)
  except ValueError:
    raise ProfileError(f"--profile {spec!r}: give STEP:COUNT, e.g. 10:3 (steps 10, 11, 12)") from None
  if first < 1 or count < 1:
    raise ProfileError(f"--profile {spec!r}: STEP and COUNT must be at least 1")
  return first, count


class Profiler:
  """Starts and stops the trace around the chosen steps (`before(step)`, `after(step, outputs)`)."""

  def __init__(self, spec: str | None, out: str, show: bool = True):
    self.window, self.dir, self.show = parse(spec), os.path.join(out, "profile"), show
    self.tracing = False

  def before(self, step: int):
    """Called before step `step` is dispatched."""
    if self.window is not None and step == self.window[0]:
      jax.profiler.start_trace(self.dir)
      self.tracing = True

  def after(self, step: int, outputs):
    """Called after step `step` was dispatched, with its outputs."""
    if self.tracing and step == sum(self.window) - 1:
      jax.block_until_ready(outputs)
      self.close()
      if self.show:
        first, count = self.window
        print(f"profile: steps {first}-{step} traced in {self.dir} (tensorboard --logdir {self.dir}, Profile tab); "
              f"top ops by device time: {format_top(top_ops(self.dir))}", file=sys.stderr, flush=True)

  def close(self):
    """Stops a trace still running (a run that ended or was stopped inside the window): what was traced is kept."""
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False


def top_ops(directory: str, n: int = 5) -> list[tuple[str, float]]:
  """The `n` XLA operations with the most total duration (ms) in the newest trace under `directory`: the Chrome
  trace events jax writes beside the xplane file that name their HLO op (a CPU thunk's or a device kernel's), so
  host-side Python, dispatch and compilation are left out."""
  traces = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.trace.json.gz")))
  if not traces:
    return []
  with gzip.open(traces[-1], "rt") as f:
    events = json.load(f).get("traceEvents", [])
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e and "hlo_op" in e.get("args", {}):  # an XLA operation's execution
      total[e["args"]["hlo_op"]] += e["dur"] / 1e3
  return total.most_common(n)


def format_top(ops: list[tuple[str, float]]) -> str:
  return ", ".join(f"{name} {ms:.2f} ms" for name, ms in ops) or "none found in the trace"
