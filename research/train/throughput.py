"""Throughput and MFU figures that can be believed.

- The peak that MFU divides by is the best fp32 matmul rate this machine has shown: the best of several samples
  taken at start-up and every earlier run's best, kept per machine in `<cache>/peak_flops.json` (one noisy
  start-up sample on a loaded machine can no longer undercut it), or `--peak-flops` when given. If a run's own
  model FLOP rate ever exceeds that peak, the peak is raised to it (and saved): MFU never exceeds 100%.
- A throughput is only reported over a window of at least one whole step after compilation: the step that
  compiles (the first of a run, or of a resume) starts the clock and is never inside a window.

Cache: `$OPTLAB_CACHE` or ~/.cache/optlab (delete it to forget).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from research.data.corpus import default_cache_dir


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of `repeats` calls of `fn` (its result waited for), after one call that compiles."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def measure_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of an n x n x n fp32 matmul on the first device, `repeats` in a row (one sample)."""
  a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.local_devices()[0])
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  t = time.perf_counter()
  for _ in range(repeats):
    f(a).block_until_ready()
  return 2 * n ** 3 * repeats / (time.perf_counter() - t)


def _machine() -> str:
  d = jax.local_devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', '')}:{platform.node()}:{os.cpu_count()}"


def _cache_file() -> str:
  return os.path.join(default_cache_dir(), "peak_flops.json")


def _load() -> dict:
  try:
    return json.load(open(_cache_file()))
  except (OSError, ValueError):
    return {}


def _save(table: dict):
  path = _cache_file()
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".peak_flops.")
    with os.fdopen(fd, "w") as f:
      json.dump(table, f, indent=1)
    os.replace(tmp, path)
  except OSError:  # a read-only home costs only the cache
    pass


class Peak:
  """The FLOP/s MFU is relative to, and how it was obtained (`source`)."""

  def __init__(self, given: float | None = None, samples: int = 5, cache: bool = True):
    self.cache = cache and given is None
    if given is not None:
      self.flops, self.source = float(given), "--peak-flops"
      return
    measured = max(measure_matmul_flops() for _ in range(samples))
    earlier = _load().get(_machine(), 0.0) if self.cache else 0.0
    self.flops = max(measured, earlier)
    self.source = (f"best fp32 matmul rate on this machine ({samples} samples now"
                   f"{', earlier runs' if earlier > measured else ''})")
    if self.cache and measured > earlier:
      _save({**_load(), _machine(): measured})

  def mfu(self, model_flops_per_s: float) -> float:
    """model FLOP/s over the peak; a rate above the peak raises the peak to it (saved), so MFU ≤ 1."""
    if model_flops_per_s > self.flops:
      self.flops = model_flops_per_s
      self.source += "; raised to a step's measured model FLOP rate"
      if self.cache:
        _save({**_load(), _machine(): self.flops})
    return model_flops_per_s / self.flops


class Meter:
  """Tokens/s over whole training steps after compilation: `window` for the last logging interval, `average` over
  every window so far (so the whole run's training time, without evaluations: `restart` after one).

  `compiled(step)` is called once the compiling step is done (its output waited for); until then, and for a
  window holding no whole step since, there is no figure (None)."""

  def __init__(self, tokens_per_step: int):
    self.tokens_per_step = tokens_per_step
    self.t = self.step = None
    self.seconds, self.steps = 0.0, 0

  def compiled(self, step: int):
    self.t, self.step = time.perf_counter(), step

  def window(self, step: int) -> float | None:
    if self.t is None or step <= self.step:
      return None
    now = time.perf_counter()
    seconds, steps = now - self.t, step - self.step
    self.seconds, self.steps = self.seconds + seconds, self.steps + steps
    self.t, self.step = now, step
    return self.tokens_per_step * steps / seconds

  def restart(self):
    """After work that is not training (an evaluation): the next window starts now."""
    if self.t is not None:
      self.t = time.perf_counter()

  def average(self) -> float | None:
    return self.tokens_per_step * self.steps / self.seconds if self.steps else None
