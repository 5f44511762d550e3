"""Verdicts: the statistics that turn a ladder of optimizer runs into claims, in numpy and scipy only.

- `scaling.py`: data-matched speedup (Wen et al. 2025): `fit_power_law` fits the baseline's final losses L(D) =
  α·D^(−B) + β over token budgets (`PowerLaw`), `speedup` reads a contender's loss on it, `extrapolates` says when
  that leaves the fitted budgets, `fit_check` says how far the fit misses the runs it was fitted on (`FitCheck`),
  `interpolated_data` reads the data between the measured budgets instead, no law assumed.
- `intervals.py`: `bootstrap_speedup` gives the speedup an `Interval` over seeds by either, each mean drawn from its
  Student-t posterior (conservative at 3 seeds) or resampled (the percentile bootstrap).
- `trends.py`: `speedup_slope`, the speedup's trend along the ladder, each width weighted by its standard error
  (`SpeedupSlope`); `speedup_trend` separates its trend with width from its trend with tokens per parameter
  (`SpeedupTrend`).
- `transfer.py`: the learning-rate optimum per width (µP's transfer plot): `lr_optimum` (`LrOptimum`, a parabola in
  log lr), `lr_band` (`LrBand`: the lrs within a tolerance of the best), `optimum_table` over a width ladder,
  `transfer_slope` of log lr* on log width.
- `significance.py`: `compare` (Welch's t-test over seeds, a `Comparison`), `pairwise` (every pair, Holm-adjusted
  by `holm`: a `Pair` each), `spread_ratio` (the F-test of two seed spreads pooled over groups, a `SpreadRatio`),
  `performance_profile` (Dolan & Moré) and `profile_area` (AlgoPerf's score).

Imports nothing of the project: any room may use it.
"""

from research.verdicts.intervals import Interval, bootstrap_speedup
from research.verdicts.scaling import (
  FitCheck,
  PowerLaw,
  extrapolates,
  fit_check,
  fit_power_law,
  interpolated_data,
  speedup,
)
from research.verdicts.significance import (
  Comparison,
  Pair,
  SpreadRatio,
  compare,
  holm,
  pairwise,
  performance_profile,
  profile_area,
  spread_ratio,
)
from research.verdicts.transfer import LrBand, LrOptimum, lr_band, lr_optimum, optimum_table, transfer_slope
from research.verdicts.trends import SpeedupSlope, SpeedupTrend, speedup_slope, speedup_trend

__all__ = [
    "Comparison",
    "FitCheck",
    "Interval",
    "LrBand",
    "LrOptimum",
    "Pair",
    "PowerLaw",
    "SpeedupSlope",
    "SpeedupTrend",
    "SpreadRatio",
    "bootstrap_speedup",
    "compare",
    "extrapolates",
    "fit_check",
    "fit_power_law",
    "holm",
    "interpolated_data",
    "lr_band",
    "lr_optimum",
    "optimum_table",
    "pairwise",
    "performance_profile",
    "profile_area",
    "speedup",
    "speedup_slope",
    "speedup_trend",
    "spread_ratio",
    "transfer_slope",
]
