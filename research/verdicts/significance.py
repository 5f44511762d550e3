"""Is a difference real, and who wins across problems: Welch's t-tests, Holm, spreads' F-test, performance profiles.

References:
  Welch, "The generalization of 'Student's' problem when several different population variances are involved",
  Biometrika 34 (1947).
  Holm, "A simple sequentially rejective multiple test procedure", Scandinavian Journal of Statistics 6 (1979).
  Snedecor & Cochran, "Statistical Methods", 8th ed. (1989), §6.12: the F-test of two variances.
  Dolan & Moré, "Benchmarking optimization software with performance profiles", Math. Programming 91 (2002).
  Dahl et al., "Benchmarking Neural Network Training Algorithms", arXiv 2306.07179 (2023): AlgoPerf's profiles of
  time-to-target and their integral as the benchmark score.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

_SIDES = {"less": "one-sided", "greater": "one-sided", "two-sided": "two-sided"}


@dataclasses.dataclass(frozen=True)
class Comparison:
  """The outcome of a two-sample test.

  Attributes:
    mean_a: A's mean.
    mean_b: B's mean.
    diff: mean_a − mean_b.
    statistic: the t statistic.
    df: the Welch–Satterthwaite degrees of freedom.
    p_value: the p-value under the test's alternative.
    test: the test's name, e.g. "Welch t, one-sided".
  """

  mean_a: float
  mean_b: float
  diff: float
  statistic: float
  df: float
  p_value: float
  test: str


def compare(a: ArrayLike, b: ArrayLike, *, alternative: str = "less") -> Comparison:
  """Welch's t-test (unequal variances) of A's losses against B's, by default one-sided: are A's lower?

  t = (m_a − m_b) / sqrt(s_a²/n_a + s_b²/n_b), with the Welch–Satterthwaite degrees of freedom
  (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a − 1) + (s_b²/n_b)²/(n_b − 1)); `scipy.stats.ttest_ind(equal_var=False)`.
  Where both samples are constant the statistic and p-value are NaN (scipy's answer).

  Args:
    a: A's values over seeds (at least 2, finite).
    b: B's values over seeds (at least 2, finite).
    alternative: "less" (A's mean is lower; default), "greater" or "two-sided".

  Returns:
    The comparison.

  Raises:
    ValueError: fewer than 2 values in either sample, a non-finite value, or an unknown alternative.

  References:
    Welch, Biometrika 34 (1947).
  """
  if alternative not in _SIDES:
    raise ValueError(f"compare: alternative must be one of {sorted(_SIDES)}, got {alternative!r}")
  x, y = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  if x.size < 2 or y.size < 2:
    raise ValueError(f"compare: Welch's t-test needs at least 2 values per sample, got {x.size} and {y.size}")
  if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
    raise ValueError("compare: every value must be finite (a diverged seed is a result to report, not to average)")
  res = stats.ttest_ind(x, y, equal_var=False, alternative=alternative)
  return Comparison(float(x.mean()), float(y.mean()), float(x.mean() - y.mean()), float(res.statistic),
                    float(res.df), float(res.pvalue), f"Welch t, {_SIDES[alternative]}")


@dataclasses.dataclass(frozen=True)
class Pair:
  """Two methods' losses over seeds against each other, within a family of such pairs.

  Attributes:
    better: the method with the lower mean.
    worse: the other.
    comparison: Welch's two-sided test of `better` against `worse` (its diff is ≤ 0).
    p_holm: its p-value adjusted for every pair of the family (Holm's step-down).
  """

  better: str
  worse: str
  comparison: Comparison
  p_holm: float


def holm(p_values: ArrayLike) -> np.ndarray:
  """Holm's step-down adjustment: the family-wise error held at α over m tests without assuming them independent.

  The i-th smallest p-value (from 1) becomes max over j ≤ i of min(1, (m − j + 1)·p_(j)); a NaN stays NaN and counts
  in m.

  Args:
    p_values: the family's p-values.

  Returns:
    The adjusted p-values, in the order given.

  Raises:
    ValueError: a p-value outside [0, 1].

  References:
    Holm, "A simple sequentially rejective multiple test procedure", Scandinavian Journal of Statistics 6 (1979).
  """
  p = np.asarray(p_values, np.float64).ravel()
  if np.any((p < 0) | (p > 1)):
    raise ValueError(f"holm: p-values must lie in [0, 1], got {p.tolist()}")
  order = np.argsort(np.where(np.isnan(p), np.inf, p), kind="stable")
  m = p.size
  scaled = np.minimum(1.0, (m - np.arange(m)) * np.where(np.isnan(p[order]), 1.0, p[order]))
  out = np.empty(m)
  out[order] = np.maximum.accumulate(scaled)
  return np.where(np.isnan(p), np.nan, out)


def pairwise(samples: Mapping[str, ArrayLike]) -> list[Pair]:
  """Every pair of methods by Welch's two-sided t-test over seeds, Holm-adjusted over the pairs: who beats whom.

  Two-sided because which of a pair is better is read off the data; the family is every pair of `samples`.

  Args:
    samples: method -> its final losses over seeds (at least 2, finite; at least two methods).

  Returns:
    One `Pair` per pair of methods, the better first (by mean; ties by name), ascending in p-value.

  Raises:
    ValueError: fewer than two methods, or what `compare` refuses.

  References:
    Welch, Biometrika 34 (1947); Holm, Scand. J. Statist. 6 (1979).
  """
  names = sorted(samples)
  if len(names) < 2:
    raise ValueError(f"pairwise: needs at least two methods, got {names}")
  mean = {n: float(np.mean(np.asarray(samples[n], np.float64))) for n in names}
  pairs = [(a, b) if (mean[a], a) <= (mean[b], b) else (b, a) for i, a in enumerate(names) for b in names[i + 1:]]
  tests = [compare(samples[a], samples[b], alternative="two-sided") for a, b in pairs]
  adjusted = holm([c.p_value for c in tests])
  out = [Pair(a, b, c, float(h)) for (a, b), c, h in zip(pairs, tests, adjusted)]
  return sorted(out, key=lambda q: (math.inf if math.isnan(q.comparison.p_value) else q.comparison.p_value,
                                    q.better, q.worse))


@dataclasses.dataclass(frozen=True)
class SpreadRatio:
  """Two methods' seed-to-seed spreads against each other, each pooled over groups (e.g. widths).

  Attributes:
    var_a: A's pooled within-group variance, Σ (n_i − 1)·s_i² / Σ (n_i − 1).
    var_b: B's.
    ratio: var_a / var_b, the F statistic.
    df_a: A's degrees of freedom, Σ (n_i − 1).
    df_b: B's.
    p_value: the p-value under the test's alternative.
    test: the test's name, e.g. "F, one-sided".
  """

  var_a: float
  var_b: float
  ratio: float
  df_a: int
  df_b: int
  p_value: float
  test: str


def _pooled(groups: Sequence[ArrayLike], who: str) -> tuple[float, int]:
  """The within-group variance pooled over groups (each about its own mean) and its degrees of freedom."""
  ss, dof = 0.0, 0
  for g in groups:
    x = np.asarray(g, np.float64).ravel()
    if not np.all(np.isfinite(x)):
      raise ValueError(f"spread_ratio: every value of {who} must be finite (a diverged seed is a result to report)")
    if x.size >= 2:
      ss, dof = ss + float(((x - x.mean()) ** 2).sum()), dof + x.size - 1
  if dof == 0:
    raise ValueError(f"spread_ratio: {who} needs a group with at least 2 values")
  return ss / dof, dof


def spread_ratio(a: Sequence[ArrayLike], b: Sequence[ArrayLike], *, alternative: str = "two-sided") -> SpreadRatio:
  """The F-test of two seed spreads: do A's final losses scatter over seeds less (or more) than B's?

  Each method's variance is pooled over its groups, every group about its own mean (a width's seeds about that width's
  mean), so a difference in means between groups does not count as spread; F = var_a / var_b on (df_a, df_b) degrees
  of freedom under equal variances and normal errors (`scipy.stats.f`). A group with fewer than 2 values adds
  nothing. The test leans on normality more than the t-test does: read a small p as "A's seeds agree more", not as a
  bound on a tail.

  Args:
    a: A's values, one sequence per group (finite).
    b: B's values, likewise.
    alternative: "two-sided" (default), "less" (A spreads less) or "greater".

  Returns:
    The ratio and its test.

  Raises:
    ValueError: a non-finite value, a method with no group of 2 or more values, or an unknown alternative.

  References:
    Snedecor & Cochran, "Statistical Methods", 8th ed. (1989), §6.12.
  """
  if alternative not in _SIDES:
    raise ValueError(f"spread_ratio: alternative must be one of {sorted(_SIDES)}, got {alternative!r}")
  (va, da), (vb, db) = _pooled(a, "A"), _pooled(b, "B")
  ratio = va / vb if vb > 0 else (math.inf if va > 0 else math.nan)
  if math.isnan(ratio):
    p = math.nan
  else:
    below, above = float(stats.f.cdf(ratio, da, db)), float(stats.f.sf(ratio, da, db))
    p = {"less": below, "greater": above, "two-sided": min(1.0, 2 * min(below, above))}[alternative]
  return SpreadRatio(va, vb, ratio, da, db, p, f"F, {_SIDES[alternative]}")


def _ratios(costs: Mapping[str, Mapping[str, float]]) -> dict[str, np.ndarray]:
  """Each method's performance ratio on every problem (the sorted union of all methods'); inf where it failed."""
  problems = sorted({p for per in costs.values() for p in per})
  table = np.full((len(costs), len(problems)), np.inf)
  for m, per in enumerate(costs.values()):
    for j, p in enumerate(problems):
      cost = float(per.get(p, math.inf))
      if math.isnan(cost) or math.isinf(cost):
        continue
      if cost <= 0:
        raise ValueError(f"performance profile: costs must be positive, got {cost} on {p!r}")
      table[m, j] = cost
  best = table.min(0)
  with np.errstate(invalid="ignore"):
    ratios = np.where(np.isfinite(table), table / best, np.inf)
  return dict(zip(costs, ratios))


def performance_profile(costs: Mapping[str, Mapping[str, float]], taus: ArrayLike) -> dict[str, np.ndarray]:
  """Dolan–Moré performance profiles: for each method, the share of problems it solves within τ× the best cost.

  On each problem, r = cost / (the lowest cost any method reached); a missing or non-finite cost means the method
  failed the problem (r = inf, never counted). rho(τ) = share of all problems (the union over methods) with r ≤ τ.

  Args:
    costs: method -> {problem -> cost} (positive, lower is better: time or steps to a target, say).
    taus: the ratios τ ≥ 1 at which to read the profiles.

  Returns:
    method -> rho at each τ (an array shaped like `taus`).

  Raises:
    ValueError: a finite cost that is not positive, or no problem at all.

  References:
    Dolan & Moré, Math. Programming 91 (2002); Dahl et al., arXiv 2306.07179 (2023).
  """
  ratios = _ratios(costs)
  t = np.asarray(taus, np.float64)
  if not any(r.size for r in ratios.values()):
    raise ValueError("performance_profile: no problems")
  return {m: (r[None, :] <= t.reshape(-1, 1)).mean(1).reshape(t.shape) for m, r in ratios.items()}


def profile_area(costs: Mapping[str, Mapping[str, float]], tau_max: float = 4.0) -> dict[str, float]:
  """The normalised area under each method's profile over τ in [1, tau_max]: AlgoPerf's benchmark score.

  score = 1/(tau_max − 1) ∫_1^tau_max rho(τ) dτ, exact for the step function rho: a problem solved at ratio r adds
  (tau_max − r) / (tau_max − 1) / (number of problems) when r ≤ tau_max. 1 means best on every problem.

  Args:
    costs: method -> {problem -> cost}, as for `performance_profile`.
    tau_max: the largest ratio that still counts (default 4, AlgoPerf's).

  Returns:
    method -> its score in [0, 1].

  Raises:
    ValueError: tau_max ≤ 1, or what `performance_profile` refuses.

  References:
    Dahl et al., arXiv 2306.07179 (2023): the benchmark score, with r_max = 4.
  """
  if not tau_max > 1:
    raise ValueError(f"profile_area: tau_max must exceed 1, got {tau_max}")
  ratios = _ratios(costs)
  if not any(r.size for r in ratios.values()):
    raise ValueError("profile_area: no problems")
  return {m: float(np.where(r <= tau_max, tau_max - r, 0.0).mean() / (tau_max - 1)) for m, r in ratios.items()}
