"""The observe section: the flags of the diagnostics inside the step (research/train/observers/)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass
class ObserveSection:
  """Diagnostics inside the step (research/train/observers/, docs/diagnostics.md): each runs in the compiled step on
  the steps of its cadence only (a second program; the other steps run the plain one), its numbers in metrics.jsonl
  and the trackers. 0 turns a cadence off."""
  POSITIVE: ClassVar[tuple] = ("watch_every", "sharpness_iters", "sharpness_rows", "gns_groups")
  RANGES: ClassVar[dict] = {"spectra_every": (0, None, True), "sharpness_every": (0, None, True),
                            "gns_every": (0, None, True), "lanczos": (0, None, True), "gns_ema": (0, 1, True)}
  watch: tuple[str, ...] = ()
  """What --watch-every's per-layer statistics (RMS, norm; split along the layers and experts) read, comma- or
  space-separated: params, grads, updates (with it the relative update ||dW||/||W||), momentum (the optimizer's first
  moment, where its state names one "mu" or "momentum")."""
  watch_every: int = 10
  """Steps between --watch's statistics."""
  histograms: bool = False
  """With --watch: a histogram of log10|x| per leaf of each watched tree (32 bins over [1e-8, 1e2])."""
  spectra_every: int = 0
  """Steps between the spectra of the matrix parameters' updates (and of the momentum where --watch names it):
  spectral norm, orthogonality error, singular-value quantiles, effective rank, per layer."""
  sharpness_every: int = 0
  """Steps between the sharpness measurements on the first held-out batch: the Hessian's top eigenvalue (power
  iteration on Hessian-vector products), the update's curvature and its overlap with the top eigenvector, the loss
  along the update."""
  sharpness_iters: int = 10
  """Power iterations per sharpness measurement (one Hessian-vector product each)."""
  sharpness_rows: int | None = None
  """Rows of the held-out batch the sharpness is measured on (unset: 4, rounded up to a multiple of the mesh's batch
  split and at most --batch-size: the cost of one measurement grows with the rows,
  research/results/diagnostics/results.md)."""
  lanczos: int = 0
  """Lanczos iterations beside the power iteration at each sharpness measurement (their top Ritz values; 0: off)."""
  gns_every: int = 0
  """Steps between gradient-noise-scale measurements (B_simple from the gradients of --gns-groups parts of the batch
  and of the whole, McCandlish et al. 2018), with an EMA over the measurements."""
  gns_groups: int | None = None
  """Parts the batch is split into for the noise scale (unset: 2); each part's rows must split over the batch's mesh
  axes (data x fsdp)."""
  gns_ema: float = 0.9
  """The EMA's decay over the noise scale's measurements (of |G|^2 and tr(Sigma) apart, then their ratio)."""
  observe: tuple[str, ...] = ()
  """NAME:EVERY: a registered observer (`research.train.observers.register`) every EVERY steps, repeatable."""

  def features(self) -> dict[str, str | None]:
    """The run features this section turns on, by research/train/setup/clashes.py's names: {feature: flag or None}."""
    on = any((self.watch, self.spectra_every, self.sharpness_every, self.gns_every, self.observe))
    named = "observers (--watch, --spectra-every, --sharpness-every, --gns-every, --observe)"
    return {"observe": named if on else None}
