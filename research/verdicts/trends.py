"""The speedup's trends with width and with training length.

`speedup_slope`: along a ladder, each width weighted by its standard error. `speedup_trend`: with width and tokens per
parameter apart, a plane over several budgets per width.

References:
  Wen, Hall, Ma, Liang, "Fantastic Pretraining Optimizers and Where to Find Them", arXiv 2509.02046 (2025): the
  speedup over AdamW falls with model size and with the data-to-model ratio.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike


@dataclasses.dataclass(frozen=True)
class SpeedupTrend:
  """log speedup = intercept + width_exponent·log width + data_exponent·log(tokens per parameter), least squares.

  Attributes:
    width_exponent: how the speedup moves with width at fixed tokens per parameter (0: it holds).
    data_exponent: how it moves with tokens per parameter at fixed width.
    intercept: the log speedup at width 1 and 1 token per parameter.
    width_se: the width exponent's standard error (ordinary least squares, residuals taken as independent).
    data_se: the data exponent's standard error.
    points: how many (width, tokens per parameter) points the fit read.
  """

  width_exponent: float
  data_exponent: float
  intercept: float
  width_se: float
  data_se: float
  points: int


def speedup_trend(widths: ArrayLike, tokens_per_param: ArrayLike, speedups: ArrayLike) -> SpeedupTrend:
  """Separates the speedup's trend with width from its trend with training length.

  Along a ladder that fixes the compute per rung, width and tokens per parameter move together, so the speedup's
  change with width alone confounds them. With each contender also run at several budgets per width, a plane in
  (log width, log tokens per parameter) fitted to log speedup gives each trend at the other held fixed.

  Args:
    widths: each point's width (positive).
    tokens_per_param: each point's training tokens per parameter (positive), same length.
    speedups: each point's speedup (positive and finite), same length.

  Returns:
    The fitted exponents with their standard errors (NaN where the fit has no residual degrees of freedom).

  Raises:
    ValueError: mismatched lengths, a value that is not positive and finite, or points that do not vary width and
      tokens per parameter independently (fewer than 3, or all on one line in the log-log plane).

  References:
    Wen et al., arXiv 2509.02046 (2025): the speedup falls with model size and with the data-to-model ratio.
  """
  w, r, s = (np.asarray(a, np.float64).ravel() for a in (widths, tokens_per_param, speedups))
  if not w.shape == r.shape == s.shape:
    raise ValueError(f"speedup_trend: {w.size} widths, {r.size} tokens-per-parameter values, {s.size} speedups")
  if not all(np.all(np.isfinite(a) & (a > 0)) for a in (w, r, s)):
    raise ValueError("speedup_trend: every width, tokens per parameter and speedup must be positive and finite")
  x = np.column_stack([np.ones_like(w), np.log(w), np.log(r)])
  if w.size < 3 or np.linalg.matrix_rank(x) < 3:
    raise ValueError("speedup_trend: the points must vary width and tokens per parameter independently (at least 3 "
                     "points, not all on one line in log width and log tokens per parameter)")
  coef, *_ = np.linalg.lstsq(x, np.log(s), rcond=None)
  dof = w.size - 3
  se = [float("nan")] * 3
  if dof > 0:
    sigma2 = float(np.sum((np.log(s) - x @ coef) ** 2)) / dof
    se = np.sqrt(np.diag(sigma2 * np.linalg.inv(x.T @ x))).tolist()
  return SpeedupTrend(float(coef[1]), float(coef[2]), float(coef[0]), float(se[1]), float(se[2]), int(w.size))


@dataclasses.dataclass(frozen=True)
class SpeedupSlope:
  """log speedup = intercept + exponent·log width, weighted least squares over widths.

  Attributes:
    exponent: how the speedup moves with width (0: it holds; speedup ∝ width^exponent).
    se: the exponent's standard error from the per-width standard errors alone (seed noise, not the scatter about
      the line).
    reduced_chi2: Σ wᵢ·residualᵢ² / (points − 2), about 1 where the widths scatter about the line as their standard
      errors say (above 1 on average where those rest on a few seeds each), further above where something else (the
      tuning, the fit) adds scatter; NaN for two widths.
    points: how many widths the fit read.
  """

  exponent: float
  se: float
  reduced_chi2: float
  points: int

  @property
  def kh_se(self) -> float:
    """The Knapp–Hartung standard error, se·√(reduced χ²), for a t interval on points − 2 df (NaN for two widths).

    The scatter about the line sets the error's scale, up or down, where the per-width errors are themselves rough.

    References:
      Knapp & Hartung, "Improved tests for a random effects meta-regression with a single covariate", Statistics in
      Medicine 22 (2003).
    """
    return self.se * float(np.sqrt(self.reduced_chi2))

  @property
  def scaled_se(self) -> float:
    """The standard error inflated by the scatter the seeds do not explain: se·√max(1, reduced χ²) (Birge)."""
    return self.se * (np.sqrt(max(1.0, self.reduced_chi2)) if np.isfinite(self.reduced_chi2) else 1.0)


def speedup_slope(widths: ArrayLike, speedups: ArrayLike, ses: ArrayLike) -> SpeedupSlope:
  """The speedup's trend with width along a ladder, each width weighted by how sharply its seeds pin it down.

  Each width carries the standard error of its log speedup (`Interval.se_log`: the delta method at its runs' own
  standard errors); the exponent is the inverse-variance weighted least-squares slope of log speedup on log width, and
  its standard error is 1 / √(Σ wᵢ (xᵢ − x̄)²), wᵢ = 1 / seᵢ². It carries the seeds' noise only; the reduced χ² of the
  residuals says whether the widths scatter about the line by more (the tuning or the fit adding noise the seeds do
  not see), and `scaled_se` widens the error by it.

  Args:
    widths: each point's width (positive, at least two distinct).
    speedups: each width's speedup estimate (positive and finite).
    ses: each width's standard error of log speedup (positive and finite).

  Returns:
    SpeedupSlope(exponent, se, reduced_chi2, points).

  Raises:
    ValueError: mismatched lengths, fewer than two distinct widths, or a value that is not positive and finite.

  References:
    Wen et al., arXiv 2509.02046 (2025): the speedup over AdamW falls from ~1.4× at 0.1B to ~1.1× at 1.2B parameters.
  """
  w, s, se = (np.asarray(a, np.float64).ravel() for a in (widths, speedups, ses))
  if not w.shape == s.shape == se.shape:
    raise ValueError(f"speedup_slope: {w.size} widths, {s.size} speedups, {se.size} standard errors")
  if not all(np.all(np.isfinite(a) & (a > 0)) for a in (w, s, se)):
    raise ValueError("speedup_slope: every width, speedup and standard error must be positive and finite")
  if np.unique(w).size < 2:
    raise ValueError(f"speedup_slope: needs at least two distinct widths, got {w.tolist()}")
  x, y = np.log(w), np.log(s)
  weight = 1 / se**2
  dx = x - np.average(x, weights=weight)
  sxx = float(np.sum(weight * dx**2))
  slope = float(np.sum(weight * dx * y) / sxx)
  resid = y - np.average(y, weights=weight) - slope * dx
  chi2 = float(np.sum(weight * resid**2)) / (w.size - 2) if w.size > 2 else float("nan")
  return SpeedupSlope(slope, float(1 / np.sqrt(sxx)), chi2, int(w.size))
