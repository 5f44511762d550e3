"""The data-matched speedup's interval over seeds: each group's mean drawn from its Student-t posterior, or resampled.

With three seeds per run the percentile bootstrap's resampled means spread by √((n − 1)/n) of the standard error
and take at most 10 distinct values, so its 95% interval covers the truth far less often (the calibration test of
`bootstrap_speedup` measures it); drawing each mean from t on n − 1 degrees of freedom restores the coverage. For
weighing estimates against each other, `Interval.se_log` is the delta method's standard error of the log estimate.

References:
  Efron & Tibshirani, "An Introduction to the Bootstrap" (1993), ch. 13 (the percentile interval).
  Gelman et al., "Bayesian Data Analysis", 3rd ed. (2013), §3.2: under a normal model with the noninformative prior
  the mean's marginal posterior is t on n − 1 degrees of freedom, centred on the sample mean, scaled by s/√n.
  Casella & Berger, "Statistical Inference", 2nd ed. (2002), §5.5.4: the delta method.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from research.verdicts.scaling import _budget_seeds, _spreads, extrapolates, fit_power_law, interpolated_data


@dataclasses.dataclass(frozen=True)
class Interval:
  """A point estimate with an interval over seeds.

  Attributes:
    estimate: the statistic on the full data.
    low: the interval's lower end.
    high: the interval's upper end.
    n_resamples: how many draws made the interval.
    extrapolated: whether the estimate extrapolates the baseline's fit (`extrapolates`) or its measured budgets.
    se_log: the standard error of the estimate's log by the delta method at each mean's own standard error (no t
      widening: the interval carries that), for weighting estimates against each other (`speedup_slope`); one-sided
      where one standard error up or down reaches past the measured budgets (interpolate) or the fit's floor (fit),
      inf where both do, NaN where not computed.
  """

  estimate: float
  low: float
  high: float
  n_resamples: int
  extrapolated: bool = False
  se_log: float = math.nan


def _mean_draws(groups: list[np.ndarray], n: int, rng: np.random.Generator, draws: str) -> np.ndarray:
  """(n, groups) draws of each group's mean.

  "seeds": each group's seeds resampled with replacement (same count). "t": each group of k seeds on its own spread,
  mean + s/√k · t(k − 1), its mean's marginal posterior under a normal model with the prior p(μ, σ²) ∝ 1/σ²; a group
  of one seed as `scaling._spreads` says. Own spreads, not one pooled: a baseline's seed spread can differ between its
  budgets many-fold, and one pooled spread then misjudges the budget that brackets the contender.
  """
  if draws == "seeds":
    return np.stack([np.stack([rng.choice(g, g.size).mean() for g in groups]) for _ in range(n)])
  try:
    var, dof = _spreads(groups)
  except ValueError as e:
    raise ValueError(f"bootstrap_speedup: draws='t' {e}") from None
  return np.stack([g.mean() + math.sqrt(v / g.size) * rng.standard_t(k, n) for g, v, k in zip(groups, var, dof)], 1)


def _se_log(stat: Callable[[Sequence[float], float], float], means: np.ndarray, errors: np.ndarray,
            estimate: float) -> float:
  """The standard error of log stat by the delta method.

  Each mean (the baseline's, then the contender's last) is moved by its standard error `errors` up and down, and the
  central differences of log stat add in quadrature (secants, so a kink between two budgets is crossed, not
  differentiated); where one move leaves the measured range (0 or inf) the other's one-sided difference stands in
  (so an estimate near the range's edge keeps its weight, against `estimate`, stat at the unmoved means), inf where
  both do.
  """
  centre, total = math.log(estimate), 0.0
  for j, h in enumerate(errors):
    ends = []
    for sign in (1, -1):
      moved = means.copy()
      moved[j] += sign * h
      ends.append(stat(moved[:-1].tolist(), float(moved[-1])))
    kept = [math.log(e) for e in ends if 0 < e < math.inf]
    if not kept:
      return math.inf
    total += ((kept[0] - kept[1]) / 2 if len(kept) == 2 else kept[0] - centre) ** 2
  return math.sqrt(total)


def bootstrap_speedup(baseline: Mapping[float, Sequence[float]], contender: ArrayLike | None, tokens: float, *,
                      n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
                      relative: bool = False, method: str = "fit", draws: str = "t") -> Interval:
  """The data-matched speedup with an interval over seeds.

  The estimate fits the baseline's mean loss per budget and reads the contender's mean loss on it. Each draw takes a
  new mean for each baseline budget and for the contender (`draws`), refits, and recomputes; the interval is the
  draws' percentiles (the empirical quantiles, no interpolation, so an inf speedup at the top stays inf). Seeded and
  deterministic.

  Args:
    baseline: token budget -> the baseline's final losses over seeds at that budget (at least 3 budgets).
    contender: the contender's final losses over seeds at `tokens`; None: the baseline's own runs there (a budget of
      `baseline`), drawn once for both roles, so the interval says how far the baseline's own point sits off its
      reading (on the fit: its bias there), not the noise of two independent copies.
    tokens: the contender's token budget.
    n_resamples: draws (default 1000).
    confidence: the interval's coverage (default 0.95).
    seed: the draws' random seed (default 0).
    relative: divide by the baseline's own point on its fit: the data the fit needs for the contender's mean loss over
      the data it needs for the baseline's mean loss at `tokens` (a budget of `baseline`), so the fit's miss at
      `tokens` cancels (at the baseline's own loss; a fit whose shape is wrong still errs where the contender's loss
      lies further along it: `fit_check`); drawn jointly. False: over `tokens` itself.
    method: "fit" (the baseline's `fit_power_law`, as Wen et al.) or "interpolate" (`interpolated_data` between its
      measured budgets, no law: 0 or inf outside them, flagged as extrapolated; `relative` has no meaning there, as
      the baseline's own point is its own mean).
    draws: "t" (default: each group's mean from its Student-t posterior, mean + s/√k · t(k − 1) over its own k seeds;
      a baseline budget of one seed takes the largest of the others' spreads; on the safe side at 3 seeds) or "seeds"
      (the percentile bootstrap: seeds resampled with replacement within each group, same counts; short of its
      coverage at a few seeds).

  Returns:
    Interval(estimate, low, high, n_resamples, extrapolated, se_log); se_log with draws='t' only.

  Raises:
    ValueError: an empty budget or contender, a contender loss that is not finite, None with `tokens` not a budget,
      confidence outside (0, 1), n_resamples < 1, an unknown method or one with `relative`, an unknown `draws`, "t" with
      one contender seed or no budget of two seeds, or what `fit_power_law` refuses (a baseline loss that is not finite
      among them).

  References:
    Wen et al., arXiv 2509.02046 (2025); Efron & Tibshirani (1993), ch. 13; Gelman et al., "Bayesian Data
    Analysis", 3rd ed. (2013), §3.2.
  """
  if not 0 < confidence < 1:
    raise ValueError(f"bootstrap_speedup: confidence must be in (0, 1), got {confidence}")
  if n_resamples < 1:
    raise ValueError(f"bootstrap_speedup: n_resamples must be at least 1, got {n_resamples}")
  budgets, seeds = _budget_seeds(baseline, "bootstrap_speedup")
  own = int(np.flatnonzero(budgets == tokens)[0]) if np.any(budgets == tokens) else None
  if contender is None and own is None:
    raise ValueError(f"bootstrap_speedup: contender=None reads the baseline's own runs at {tokens}, not a budget of it")
  pick = own if contender is None and own is not None else -1  # the budget read as the contender, or none (−1)
  mine = seeds[pick] if pick >= 0 else np.asarray(contender, np.float64).ravel()
  if mine.size == 0:
    raise ValueError("bootstrap_speedup: no contender losses")
  if not np.all(np.isfinite(mine)):
    raise ValueError(f"bootstrap_speedup: every contender loss must be finite, got {mine.tolist()}")
  if method not in ("fit", "interpolate") or method == "interpolate" and relative:
    raise ValueError(f"bootstrap_speedup: method must be 'fit' or 'interpolate' (not with relative), got {method!r}")
  if draws not in ("t", "seeds"):
    raise ValueError(f"bootstrap_speedup: draws must be 't' or 'seeds', got {draws!r}")
  if draws == "t" and mine.size < 2:
    raise ValueError(f"bootstrap_speedup: draws='t' needs two contender seeds or more, got {mine.size}")
  at = own if relative else None
  if relative and at is None:
    raise ValueError(f"bootstrap_speedup: relative needs the baseline at the contender's budget {tokens}")

  def stat(means: Sequence[float], loss: float) -> float:
    if method == "interpolate":
      return interpolated_data(budgets, means, loss) / tokens
    law = fit_power_law(budgets, means)
    with np.errstate(divide="ignore", invalid="ignore"):  # a draw far out: x/0 is inf, 0/0 NaN (left out below)
      return float(np.float64(law.data_for(loss)) / (law.data_for(means[at]) if at is not None else tokens))

  means = [float(s.mean()) for s in seeds]
  estimate = float(stat(means, float(mine.mean())))
  rng = np.random.default_rng(seed)
  base = _mean_draws(seeds, n_resamples, rng, draws)
  theirs = base[:, pick] if pick >= 0 else _mean_draws([mine], n_resamples, rng, draws)[:, 0]
  drawn = np.array([stat(b, float(c)) for b, c in zip(base, theirs)])
  # a draw whose fit goes flat reads 0/0: it is left out
  low, high = np.nanquantile(drawn, [(1 - confidence) / 2, (1 + confidence) / 2], method="inverted_cdf")
  outside = estimate in (0.0, math.inf) if method == "interpolate" else extrapolates(
      fit_power_law(budgets, means), float(mine.mean()))
  se = math.nan
  if draws == "t" and 0 < estimate < math.inf:
    var = np.concatenate([_spreads(seeds)[0], _spreads([mine])[0]])
    errors = np.sqrt(var / [g.size for g in [*seeds, mine]])
    if pick >= 0:  # one group in both roles: moved once, the contender's slot held still
      se = _se_log(lambda m, _: stat(m, m[pick]), np.array([*means, 0.0]), np.append(errors[:-1], 0.0), estimate)
    else:
      se = _se_log(stat, np.array([*means, mine.mean()]), errors, estimate)
  return Interval(estimate, float(low), float(high), n_resamples, outside, se)
