"""Throughput and MFU figures that can be believed.

- The peak that MFU divides by (`Peak`): `--peak-flops` when given; else the chip's datasheet peak for the compute
  dtype, dense (research/train/hooks/peaks.py: what MaxText, torchtitan and nanoGPT divide by); else, for a device not
  in that table (a CPU), the best matmul rate in the compute dtype this machine has shown: the best of several samples
  taken at start-up and every earlier run's best, kept per machine and dtype in `<cache>/peak_flops.json`. An earlier
  best is believed only when it is a finite positive number at most `PLAUSIBLE` times this run's own best sample (a
  loaded machine samples low, not several times low); otherwise it is dropped with one warning line, as is a file
  that is not a JSON object, and this run's sample takes its place. The source is recorded with the figure. The
  model's own rate never raises the peak: an MFU above 100% says that a sampled peak was low, and is shown as it is.
- A throughput is only reported over a window of at least one whole step after compilation: the step that
  compiles (the first of a run, of a resume, or on a --switch-at layout) starts the clock and is never inside a
  window. Beside the whole run's average, the steady state: the windows that start at least `STEADY_AFTER` steps
  after a compile (autotuning, the input pipeline's start and the allocator's growth are over by then).

Cache: `$OPTLAB_CACHE` or ~/.cache/optlab (delete it to forget).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from research.data.cache import default_cache_dir
from research.train.hooks.peaks import spec_peak


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of `repeats` calls of `fn` (its result waited for), after one call that compiles."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def measure_matmul_flops(n: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
  """FLOP/s of an n x n x n matmul in `dtype` on the first device, `repeats` in a row (one sample)."""
  a = jax.device_put(jnp.ones((n, n), dtype), jax.local_devices()[0])
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


PLAUSIBLE = 4.0  # an earlier best above this many times this run's own best sample is not this machine's


def _warn(message: str):
  print(f"warning: {_cache_file()}: {message}", file=sys.stderr, flush=True)


def _load() -> dict:
  """The cache's table ({machine:dtype: FLOP/s}); {} when there is none, or (one warning) when it is no JSON object."""
  try:
    with open(_cache_file(), "rb") as f:
      table = json.loads(f.read())
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    table = e
  if not isinstance(table, dict):
    _warn(f"not a JSON object of matmul rates ({' '.join(str(table).split())[:60]}); ignored")
    return {}
  return table


def _earlier(table: dict, key: str, measured: float) -> float:
  """The earlier best for `key` in `table`, or 0.0 when there is none or it cannot be believed (one warning)."""
  value = table.get(key)
  if value is None:
    return 0.0
  try:
    number = type(value) in (int, float) and 0 < float(value) < math.inf  # not a bool, a string, NaN or infinity
  except OverflowError:  # an integer past float's range
    number = False
  if number and value <= PLAUSIBLE * measured:
    return float(value)
  why = (f"{value / measured:.3g}x this run's best sample ({measured:.3g} FLOP/s), more than the {PLAUSIBLE:g}x a "
         "loaded machine explains" if number else "not a finite positive number")
  _warn(f"the earlier best for {key}, {value!r:.40}, is {why}: dropped")
  return 0.0


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
  """The FLOP/s MFU is relative to, and how it was obtained (`source`): see the module's docstring."""

  def __init__(self, given: float | None = None, dtype: str = "float32", devices: int = 1, samples: int = 5,
               cache: bool = True):
    """`given`: the whole run's peak (--peak-flops). Else one chip's, times `devices` (the run's mesh: its tokens/s
    is the global batch's) on an accelerator; on a CPU the simulated devices share the cores one matmul sampled."""
    if given is not None:
      self.flops, self.source = float(given), "--peak-flops"
      return
    device = jax.local_devices()[0]
    precision = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]  # jax.config: flags set at runtime
    spec = spec_peak(getattr(device, "device_kind", ""), dtype, precision)
    chips = 1 if device.platform == "cpu" else devices
    if spec is not None:
      self.flops, self.source = spec[0] * chips, spec[1] + (f"; x {chips} chips" if chips > 1 else "")
      return
    n = 1024 if device.platform == "cpu" else 8192  # large enough to saturate an accelerator
    measured = max(measure_matmul_flops(n, dtype=dtype) for _ in range(samples))
    key = f"{_machine()}:{dtype}"
    table = _load() if cache else {}
    earlier = _earlier(table, key, measured)
    self.flops = max(measured, earlier) * chips
    self.source = (f"best {n}³ {dtype} matmul rate measured on this {device.platform} ({samples} samples now"
                   f"{', earlier runs' if earlier > measured else ''}; no datasheet peak for "
                   f"{getattr(device, 'device_kind', device.platform)!r})"
                   + (f" x {chips} chips" if chips > 1 else "; the simulated devices share these cores"
                      if devices > 1 else ""))
    if cache and measured > earlier:
      _save({**table, key: measured})

  def mfu(self, model_flops_per_s: float) -> float:
    return model_flops_per_s / self.flops


STEADY_AFTER = 10  # steps after a compile that the steady-state figures leave out


class Meter:
  """Tokens/s over whole training steps after compilation: `window` for the last logging interval, `average` over
  every window so far (so the whole run's training time, without evaluations: `restart` after one), `steady` over
  the windows that start at least `steady_after` steps after the last compile.

  `compiled(step)` is called once a compiling step is done (its output waited for); until then, and for a
  window holding no whole step since, there is no figure (None)."""

  def __init__(self, tokens_per_step: int, steady_after: int = STEADY_AFTER):
    self.tokens_per_step, self.steady_after = tokens_per_step, steady_after
    self.t: float | None = None
    self.step = self.warm = 0  # read only once `compiled` set `t`
    self.seconds, self.steps = 0.0, 0
    self.steady_seconds, self.steady_steps = 0.0, 0

  def compiled(self, step: int):
    self.t, self.step = time.perf_counter(), step
    self.warm = step + self.steady_after  # windows from this step on are steady

  def window(self, step: int) -> float | None:
    if self.t is None or step <= self.step:
      return None
    now = time.perf_counter()
    seconds, steps = now - self.t, step - self.step
    self.seconds, self.steps = self.seconds + seconds, self.steps + steps
    if self.step >= self.warm:
      self.steady_seconds, self.steady_steps = self.steady_seconds + seconds, self.steady_steps + steps
    self.t, self.step = now, step
    return self.tokens_per_step * steps / seconds

  def restart(self):
    """After work that is not training (an evaluation): the next window starts now."""
    if self.t is not None:
      self.t = time.perf_counter()

  def average(self) -> float | None:
    return self.tokens_per_step * self.steps / self.seconds if self.steps else None

  def steady(self) -> float | None:
    return self.tokens_per_step * self.steady_steps / self.steady_seconds if self.steady_steps else None

  def record(self, step: int, last: bool, flops_per_token: float, peak: Peak) -> dict:
    """A metrics record's throughput fields: the window's tokens/s and MFU (once a whole step has run after
    compilation); at the last step the run's average, the steady state's (with `steady_after`) and the peak's
    source."""
    rec: dict = {}
    rate = self.window(step)
    if rate is not None:
      rec["tokens_per_s"], rec["mfu"] = rate, peak.mfu(rate * flops_per_token)
    average = self.average() if last else None
    if average is not None:
      rec.update(run_tokens_per_s=average, run_mfu=peak.mfu(average * flops_per_token), peak_source=peak.source)
      steady = self.steady()
      if steady is not None:
        rec.update(steady_tokens_per_s=steady, steady_mfu=peak.mfu(steady * flops_per_token),
                   steady_after=self.steady_after)
    return rec
