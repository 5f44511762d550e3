"""Observers: diagnostics that run inside the compiled train step, each on the steps of its own cadence.

An observer is one file that registers an `Observer`: what it reads (`READS`), what it costs, how its cadence comes
from the config's observe section, the function the step calls on its `contract.StepResult` (a pure function on
trees: the library's `optim.diagnostics`), and optionally a host-side function over the numbers it logged (an EMA).
The trainer compiles a second program for the steps an observer is due at (research/train/steps/observed.py); the
other steps run the plain program, which holds nothing of any observer. A new diagnostic is its file and its
`register(...)` line, with nothing edited under research/train/: `--observe NAME:EVERY` turns on any registered one.

  registry.py   `Observer`, `register`, the run's active observers and their composed function
  watch.py      per-layer RMS and norms of params, grads, updates, momentum; the relative update; histograms
  spectra.py    spectra of the matrix updates (and momentum): spectral norm, orthogonality error, quantiles, rank
  sharpness.py  the Hessian's top eigenvalue(s) on the held batch, the update's curvature and overlap, the loss along it
  noise.py      the gradient noise scale B_simple from the batch's parts and the whole, with its EMA
"""

from research.train.observers import noise, sharpness, spectra, watch  # noqa: F401  (the built-ins register)
from research.train.observers.registry import OBSERVERS, READS, Active, Observer, active, compose, register

__all__ = ["OBSERVERS", "READS", "Active", "Observer", "active", "compose", "register"]
