"""Data-matched speedup: how much more data the baseline needs to reach a contender's loss.

The baseline's final losses at several token budgets (each run its own schedule, ended at its budget) are fitted by
L(D) = α·D^(−B) + β; a contender that ends at loss L after D tokens has speedup D_baseline(L) / D, where
D_baseline(L) = ((L − β) / α)^(−1/B) inverts the fit. A speedup of 1.3 means the baseline needs 30% more data.

References:
  Wen, Hall, Ma, Liang, "Fantastic Pretraining Optimizers and Where to Find Them", arXiv 2509.02046 (2025): the
  AdamW baseline fitted across 1–8× Chinchilla budgets, speedup as the ratio of data to equal loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, stats

_EXPONENTS = np.geomspace(1e-3, 10.0, 241)  # the grid the fit profiles before refining B


@dataclasses.dataclass(frozen=True)
class PowerLaw:
  """L(D) = alpha·D^(−exponent) + floor: the final loss after D tokens.

  Attributes:
    alpha: the scale α (in the tokens' own units).
    exponent: B > 0, how fast the loss falls with data.
    floor: β, the loss no amount of data goes below.
    tokens_range: the smallest and largest token counts the law was fitted on (None for a law written by hand);
      `extrapolates` reads it.
  """

  alpha: float
  exponent: float
  floor: float
  tokens_range: tuple[float, float] | None = None

  def loss(self, tokens: ArrayLike) -> np.ndarray:
    """The loss after `tokens` tokens.

    Args:
      tokens: a token count or an array of them.

    Returns:
      alpha·tokens^(−exponent) + floor, shaped like `tokens`.
    """
    return self.alpha * np.power(np.asarray(tokens, np.float64), -self.exponent) + self.floor

  def data_for(self, loss: ArrayLike) -> float | np.ndarray:
    """The tokens the law needs to reach `loss`: the inverse of `loss`.

    Args:
      loss: a loss or an array of them.

    Returns:
      ((loss − floor) / alpha)^(−1/exponent), a float for a number; inf where loss ≤ floor (NaN for NaN).
    """
    excess = np.asarray(loss, np.float64) - self.floor
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
      d = np.where(excess > 0, np.power(np.maximum(excess, 0.0) / self.alpha, -1.0 / self.exponent),
                   np.where(np.isnan(excess), np.nan, np.inf))
    return float(d) if d.ndim == 0 else d


def _profile(x: np.ndarray, y: np.ndarray, ceiling: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """For each row of x (one exponent each), the least-squares scale c ≥ 0 and floor in [0, ceiling] of y ≈ c·x + floor.

  For a fixed exponent the model is linear in (c, floor), and the sum of squares minimised over c is convex in the
  floor, so the bounded floor is the unbounded one clipped.

  Args:
    x: (exponents, points) the normalised tokens to the power −B.
    y: (points,) the losses.
    ceiling: the floor's upper bound.

  Returns:
    (c, floor, sum of squared residuals), one per row.
  """
  xm, ym = x.mean(1, keepdims=True), y.mean()
  var = ((x - xm) ** 2).sum(1)
  c = ((x - xm) * (y - ym)).sum(1) / np.where(var > 0, var, 1.0)
  floor = np.clip(ym - c * xm[:, 0], 0.0, ceiling)
  c = np.maximum(((y - floor[:, None]) * x).sum(1) / (x * x).sum(1), 0.0)  # refit the scale at the clipped floor
  flat = c == 0  # the data does not fall with tokens: a constant at the (clipped) mean
  floor = np.where(flat, min(max(ym, 0.0), ceiling), floor)
  sse = ((c[:, None] * x + floor[:, None] - y) ** 2).sum(1)
  return c, floor, sse


def fit_power_law(tokens: ArrayLike, losses: ArrayLike) -> PowerLaw:
  """Least-squares fit of L(D) = α·D^(−B) + β to final losses at several token budgets.

  Tokens are normalised by their geometric mean D0, so the fit works on numbers near 1 (α = c·D0^B). For a fixed B
  the model is linear in (c, β), solved exactly with β in [0, min(losses)) and c ≥ 0; the sum of squares over B is
  profiled on a log grid (241 starting points over [1e-3, 10]) and the best refined by bounded Brent's method on
  log B. Repeated token counts (several seeds at one budget) are separate points.

  Args:
    tokens: the token budget of each run (positive).
    losses: each run's final loss (finite), same length.

  Returns:
    The fitted law, with `tokens_range` the fitted budgets' extent.

  Raises:
    ValueError: fewer than 3 distinct token counts, mismatched lengths, a token count that is not positive, or a
      loss that is not finite.

  References:
    Wen et al., arXiv 2509.02046 (2025): the baseline's scaling law in data.
  """
  d, y = np.asarray(tokens, np.float64).ravel(), np.asarray(losses, np.float64).ravel()
  if d.shape != y.shape:
    raise ValueError(f"fit_power_law: {d.size} token counts but {y.size} losses")
  if not (np.all(np.isfinite(d)) and np.all(d > 0)):
    raise ValueError(f"fit_power_law: every token count must be positive and finite, got {d.tolist()}")
  if not np.all(np.isfinite(y)):
    raise ValueError(f"fit_power_law: every loss must be finite (drop diverged runs first), got {y.tolist()}")
  if np.unique(d).size < 3:
    raise ValueError(f"fit_power_law: needs at least 3 distinct token budgets, got {np.unique(d).tolist()}")
  d0 = float(np.exp(np.log(d).mean()))
  logd = np.log(d / d0)
  ceiling = float(np.nextafter(y.min(), -np.inf)) if y.min() > 0 else 0.0

  def sse(log_b: float) -> float:
    return float(_profile(np.exp(-np.exp(log_b) * logd)[None], y, ceiling)[2][0])

  grid = np.log(_EXPONENTS)
  i = int(np.argmin(_profile(np.exp(-_EXPONENTS[:, None] * logd[None]), y, ceiling)[2]))
  lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
  best = optimize.minimize_scalar(sse, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
  log_b = float(best.x) if best.fun <= sse(grid[i]) else float(grid[i])
  b = float(np.exp(log_b))
  c, floor, _ = _profile(np.exp(-b * logd)[None], y, ceiling)
  return PowerLaw(alpha=float(c[0]) * d0**b, exponent=b, floor=float(floor[0]),
                  tokens_range=(float(d.min()), float(d.max())))


def speedup(law: PowerLaw, loss: float, tokens: float) -> float:
  """The data-matched speedup of a run that ended at `loss` after `tokens`: law.data_for(loss) / tokens.

  Above 1 the baseline needs more data than the contender to reach its loss; below 1, less. Where the baseline needs
  more (or less) data than any budget it was fitted on, the value extrapolates the fit: it is returned all the same,
  and `extrapolates(law, loss)` says so for the report. A loss at or below the fitted floor gives inf.

  Args:
    law: the baseline's fitted law (`fit_power_law`).
    loss: the contender's final loss.
    tokens: the contender's token budget.

  Returns:
    The speedup (inf where the baseline never reaches the loss).

  References:
    Wen et al., arXiv 2509.02046 (2025).
  """
  return float(law.data_for(loss)) / float(tokens)


def extrapolates(law: PowerLaw, loss: float) -> bool:
  """Whether reaching `loss` on `law` takes a token count outside the budgets it was fitted on.

  Args:
    law: a fitted law (`tokens_range` set; a hand-written law without it never counts as extrapolating).
    loss: the loss to reach.

  Returns:
    True where law.data_for(loss) is below the smallest or above the largest fitted budget.
  """
  if law.tokens_range is None:
    return False
  d = law.data_for(loss)
  return not law.tokens_range[0] <= d <= law.tokens_range[1]


def interpolated_data(tokens: ArrayLike, means: ArrayLike, loss: float) -> float:
  """The data at which the baseline first reaches `loss`, read between its measured budgets, no law assumed.

  Between two adjacent budgets the mean loss is taken as linear in log tokens; the first budget whose mean is at or
  below `loss` and the one before it bracket the answer (so a mean that rises again later does not count).

  Args:
    tokens: the baseline's budgets, ascending (positive, at least two).
    means: its mean final loss at each budget.
    loss: the loss to reach.

  Returns:
    The tokens; 0.0 where the smallest budget's mean is already below `loss` (the answer lies below the measured
    range), inf where no budget reaches it (above it).

  Raises:
    ValueError: fewer than two budgets, budgets not ascending and positive, or mismatched lengths.
  """
  d, m = np.asarray(tokens, np.float64).ravel(), np.asarray(means, np.float64).ravel()
  if d.size < 2 or d.shape != m.shape or not (np.all(d > 0) and np.all(np.diff(d) > 0)):
    raise ValueError(f"interpolated_data: needs at least two ascending positive budgets with a mean each, got "
                     f"{d.tolist()} and {m.tolist()}")
  if m[0] <= loss:
    return float(d[0]) if m[0] == loss else 0.0
  for i in range(d.size - 1):
    if m[i + 1] <= loss:
      frac = (m[i] - loss) / (m[i] - m[i + 1])
      return float(np.exp(np.log(d[i]) + frac * (np.log(d[i + 1]) - np.log(d[i]))))
  return float("inf")


def _budget_seeds(baseline: Mapping[float, Sequence[float]],
                  who: str = "fit_check") -> tuple[np.ndarray, list[np.ndarray]]:
  """The baseline's budgets ascending and its losses at each as arrays; `who` names the caller in the error."""
  budgets = sorted(baseline)
  seeds = [np.asarray(baseline[b], np.float64).ravel() for b in budgets]
  empty = [b for b, s in zip(budgets, seeds) if s.size == 0]
  if empty:
    raise ValueError(f"{who}: no losses at baseline budget(s) {empty}")
  return np.asarray(budgets, np.float64), seeds


@dataclasses.dataclass(frozen=True)
class FitCheck:
  """How far a fitted L(D) misses the baseline's own runs: the lack-of-fit F-test with replicates.

  Attributes:
    tokens: the baseline's budgets, ascending.
    means: its mean final loss at each budget.
    fitted: the law's loss at each budget.
    stds: the seeds' standard deviation at each budget (ddof 1; NaN for one seed): where it differs much between
      budgets, the pooled test (and an unweighted fit) hides a miss at the quiet budgets.
    z: each budget's miss (mean − fitted) over the standard error of its mean from the pooled within-budget variance.
    z_own: each budget's miss over its own seeds' standard error of the mean (NaN for one seed).
    f_statistic: the lack-of-fit mean square over the pooled seeds' mean square (0: the law goes through every mean).
    df: (budgets − fitted parameters, runs − budgets), the F distribution's degrees of freedom: 3 parameters, 2 where
      the floor sits at a bound.
    p_value: the chance of an F this large if the law were right and the seeds' noise normal and alike at every
      budget (NaN without a degree of freedom on either side).
    p_own: the smallest of the budgets' two-sided t-test p-values of their miss against their own seeds (n − 1
      degrees of freedom), Bonferroni-adjusted over the budgets: where the seeds' noise differs between budgets, a
      miss at a quiet budget shows here and not in the pooled F.
    floor_bound: "zero" where the fitted floor sits at its lower bound 0, "lowest loss" at its upper bound, else None:
      a fit pinned at a bound does not reach the shape it was given.
    null_rates: how often `p_value` and `p_own` fall below 0.05 when the law holds: over runs drawn from the fitted
      law with each budget's own seed spread (taken as the truth) and refitted on their means. They can lie far from
      0.05 where the spreads differ between budgets (the pooled F assumes them alike; the per-budget tests ignore the
      fit's own error, which the noisy budgets push onto the quiet ones): read the two p-values beside these.
      (NaN, NaN) where not drawn.
  """

  tokens: tuple[float, ...]
  means: tuple[float, ...]
  fitted: tuple[float, ...]
  stds: tuple[float, ...]
  z: tuple[float, ...]
  z_own: tuple[float, ...]
  f_statistic: float
  df: tuple[int, int]
  p_value: float
  p_own: float
  floor_bound: str | None
  null_rates: tuple[float, float] = (math.nan, math.nan)


def _spreads(groups: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """Each group's variance of one seed (ddof 1) and its degrees of freedom.

  A group of one seed takes the largest of the others' on their smallest degrees of freedom (where one seed is left,
  its others diverged: likely a noisy one).

  Raises:
    ValueError: no group of two seeds or more.
  """
  ss = np.array([float(np.var(g - g[0])) * g.size for g in groups])  # shifted: equal seeds give exactly 0
  k = np.array([g.size - 1 for g in groups])
  if not np.any(k):
    raise ValueError("needs two seeds in at least one group to estimate the spread")
  var = np.where(k > 0, ss / np.maximum(k, 1), 0.0)
  return np.where(k > 0, var, var[k > 0].max()), np.where(k > 0, k, k[k > 0].min())


def _null_rates(budgets: np.ndarray, seeds: Sequence[np.ndarray], law: PowerLaw, n: int,
                seed: int) -> tuple[float, float]:
  """`FitCheck.null_rates`: runs drawn from `law` with each budget's own spread, refitted on their means, checked."""
  try:
    sd = np.sqrt(_spreads(seeds)[0])
  except ValueError:
    return math.nan, math.nan
  rng, fitted, hits, done = np.random.default_rng(seed), law.loss(budgets), np.zeros(2), np.zeros(2)
  for _ in range(n):
    fake = {float(d): fitted[i] + sd[i] * rng.standard_normal(s.size) for i, (d, s) in enumerate(zip(budgets, seeds))}
    try:
      c = fit_check(fit_power_law(list(fake), [f.mean() for f in fake.values()]), fake)
    except ValueError:  # a fit that fails is left out
      continue
    p = np.array([c.p_value, c.p_own])
    hits, done = hits + (p < 0.05), done + np.isfinite(p)  # a test without a p (no df) counts in neither
  rates = np.where(done > 0, hits / np.maximum(done, 1), np.nan)
  return float(rates[0]), float(rates[1])


def fit_check(law: PowerLaw, baseline: Mapping[float, Sequence[float]], *, n_resamples: int = 0,
              seed: int = 0) -> FitCheck:
  """Whether a fitted L(D) follows the runs it was fitted on, beyond what their seeds' noise explains.

  The textbook lack-of-fit test for a model fitted to replicated points: F = [Σᵢ nᵢ (ȳᵢ − L(Dᵢ))² / (k − 3)] /
  [Σᵢⱼ (yᵢⱼ − ȳᵢ)² / (N − k)] over k budgets and N runs, F(k − 3, N − k) under the law (three parameters: α, B, β).
  A small p says the law's shape is wrong for these budgets, so a speedup read off it is the shape's error as much as
  the contender's gain. The pooled variance assumes the seeds' noise alike at every budget; `p_own` tests each
  budget against its own seeds instead.

  Where the seeds' noise differs between budgets both tests lose their level; with `n_resamples` a parametric
  simulation (Efron & Tibshirani ch. 16) measures how often they reject when the law holds (`null_rates`).

  Args:
    law: the fitted law (`fit_power_law` on these runs' means, as `null_rates` refits it).
    baseline: token budget -> the baseline's final losses over seeds (finite; at least one at each budget).
    n_resamples: the simulated ladders for `null_rates` (default 0: not drawn; at least 0).
    seed: their random seed.

  Returns:
    FitCheck with the misses per budget, the F statistic and its p-value, the per-budget tests' adjusted p-value,
    whether the floor sits at a bound, and with `n_resamples` each test's false-alarm rate under the law (each rate
    over the simulated ladders where that test has a p-value; NaN where none has).

  Raises:
    ValueError: an empty budget, a loss that is not finite, or a negative n_resamples.

  References:
    Draper & Smith, "Applied Regression Analysis", 3rd ed. (1998), §2.1: lack of fit and pure error.
    Efron & Tibshirani, "An Introduction to the Bootstrap" (1993), ch. 16: hypothesis testing with the bootstrap.
  """
  budgets, seeds = _budget_seeds(baseline)
  if not all(np.all(np.isfinite(s)) for s in seeds):
    raise ValueError("fit_check: every baseline loss must be finite (drop diverged runs first)")
  if n_resamples < 0:
    raise ValueError(f"fit_check: n_resamples must be at least 0, got {n_resamples}")
  n = np.array([s.size for s in seeds])
  means, fitted = np.array([s.mean() for s in seeds]), law.loss(budgets)
  at = lambda x: bool(np.isclose(law.floor, x, rtol=1e-9, atol=0))  # the fit's ceiling: the lowest seed or mean
  bound = "zero" if law.floor <= 0 else "lowest loss" if at(min(s.min() for s in seeds)) or at(means.min()) else None
  pure = float(sum(((s - s.mean()) ** 2).sum() for s in seeds))
  df = (budgets.size - (2 if bound else 3), int(n.sum()) - budgets.size)  # a floor held at a bound is not fitted
  mse = pure / df[1] if df[1] > 0 else float("nan")
  with np.errstate(divide="ignore", invalid="ignore"):
    z = (means - fitted) / np.sqrt(mse / n)
    f = float(np.sum(n * (means - fitted) ** 2) / df[0] / mse) if df[0] > 0 and df[1] > 0 else float("nan")
    stds = np.array([s.std(ddof=1) if s.size > 1 else np.nan for s in seeds])
    z_own = (means - fitted) / (stds / np.sqrt(n))
  p = float(stats.f.sf(f, *df)) if np.isfinite(f) else float("nan")
  p_each = 2 * stats.t.sf(np.abs(z_own), n - 1)  # NaN for one seed or a std of 0 with no miss
  p_own = float(min(1.0, np.nanmin(p_each) * budgets.size)) if np.any(np.isfinite(p_each)) else float("nan")
  return FitCheck(tuple(budgets.tolist()), tuple(means.tolist()), tuple(np.asarray(fitted).tolist()),
                  tuple(stds.tolist()), tuple(z.tolist()), tuple(z_own.tolist()), f, df, p, p_own, bound,
                  _null_rates(budgets, seeds, law, n_resamples, seed) if n_resamples else (math.nan, math.nan))
