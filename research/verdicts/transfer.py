"""The learning-rate optimum per width, and whether it transfers: the numbers behind µP's transfer plot.

Each width's lr grid gives an optimum (a parabola in log lr through the best grid point and its neighbours); the
slope of log lr* on log width says whether the optimum moves: 0 means it transfers across width, −1 is what the
standard parametrization with Adam often shows (lr* ∝ 1/width).

References:
  Yang et al., "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer",
  arXiv 2203.03466 (2022): the lr-vs-width transfer plots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike


@dataclasses.dataclass(frozen=True)
class LrOptimum:
  """The best learning rate of one grid.

  Attributes:
    lr: the optimum: the parabola's vertex where `fitted`, else the best grid point.
    loss: the loss there (the parabola's minimum, or the best grid point's mean loss).
    curvature: d²loss / d(ln lr)² of the parabola (negative: it opens downward); NaN where no parabola was fitted.
    at_edge: the best grid point is the smallest or largest finite lr tried: the true optimum may lie outside.
    fitted: whether `lr` is the vertex of a parabola that opens upward within the tried range.
  """

  lr: float
  loss: float
  curvature: float
  at_edge: bool
  fitted: bool


def _grid_means(lrs: ArrayLike, losses: ArrayLike) -> tuple[np.ndarray, np.ndarray, str | None]:
  """Each distinct lr, ascending, and its mean loss over its finite runs (inf where every run of it diverged).

  The third value says why the grid is refused (mismatched lengths, an lr that is not positive, no finite run at all),
  None where it is not; the caller raises it in its own name.
  """
  lr, y = np.asarray(lrs, np.float64).ravel(), np.asarray(losses, np.float64).ravel()
  if lr.shape != y.shape:
    return lr, y, f"{lr.size} lrs but {y.size} losses"
  if not np.all(lr > 0):
    return lr, y, f"every lr must be positive, got {lr.tolist()}"
  keep = np.isfinite(y)
  if not keep.any():
    return lr, y, "every run diverged (no finite loss)"
  grid = np.unique(lr)
  finite, which = np.unique(lr[keep], return_inverse=True)
  mean = np.full(grid.size, np.inf)
  mean[np.searchsorted(grid, finite)] = np.bincount(which, y[keep]) / np.bincount(which)
  return grid, mean, None


def lr_optimum(lrs: ArrayLike, losses: ArrayLike) -> LrOptimum:
  """The optimal lr of a grid: a parabola in log lr through the best grid point and its neighbours.

  Runs with a non-finite loss (diverged) are dropped; repeated lrs (seeds) are averaged over their finite runs.
  Among the remaining lrs, the parabola passes through the best one and its two neighbours (its two nearest on one
  side where it is at an edge). Where the parabola opens downward or its vertex lies outside the tried lrs, or fewer
  than 3 lrs remain, the best grid point is returned with fitted=False.

  Args:
    lrs: the learning rate of each run (positive).
    losses: each run's final loss, same length (NaN or inf for a diverged run).

  Returns:
    The optimum, flagged `at_edge` and `fitted`.

  Raises:
    ValueError: mismatched lengths, an lr that is not positive, or no run with a finite loss.

  References:
    Yang et al., arXiv 2203.03466 (2022).
  """
  grid, mean, refused = _grid_means(lrs, losses)
  if refused:
    raise ValueError(f"lr_optimum: {refused}")
  keep = np.isfinite(mean)  # an lr every run of which diverged is dropped
  grid, mean = grid[keep], mean[keep]
  i, n = int(np.argmin(mean)), grid.size
  at_edge = i in (0, n - 1)
  best = LrOptimum(float(grid[i]), float(mean[i]), float("nan"), at_edge, False)
  if n < 3:
    return best
  lo = min(max(i - 1, 0), n - 3)
  x = np.log(grid[lo:lo + 3])
  a, b, c = np.polyfit(x, mean[lo:lo + 3], 2)
  best = dataclasses.replace(best, curvature=float(2 * a))
  if a <= 0:
    return best
  vertex = -b / (2 * a)
  if not np.log(grid[0]) <= vertex <= np.log(grid[-1]):
    return best
  return LrOptimum(float(np.exp(vertex)), float(c - b * b / (4 * a)), float(2 * a), at_edge, True)


@dataclasses.dataclass(frozen=True)
class LrBand:
  """The learning rates whose loss lies within a tolerance of a grid's best.

  Attributes:
    low: the band's lower end (interpolated in log lr between the last lr inside and the first outside).
    high: its upper end.
    open_low: the band reaches the smallest lr tried: it may extend below.
    open_high: the band reaches the largest lr tried: it may extend above.
  """

  low: float
  high: float
  open_low: bool
  open_high: bool


def lr_band(lrs: ArrayLike, losses: ArrayLike, tolerance: float) -> LrBand:
  """How sharply a grid pins its optimum down: the lrs around the best whose loss is within `tolerance` of it.

  From the best grid point the band grows to each side while the grid's mean loss stays within best + tolerance; its
  end lies where the straight line in log lr between the last point inside and the first outside crosses that level (a
  diverged point outside ends the band at the last point inside). It reads the measured curve, not a parabola: a
  valley flat on one side and steep on the other gets a band as lopsided. With the seeds' spread at the optimum as
  the tolerance, two widths whose bands overlap are not told apart by their grids.

  Args:
    lrs: the learning rate of each run (positive).
    losses: each run's final loss (NaN or inf for a diverged run); repeated lrs are averaged over their finite runs.
    tolerance: the loss difference (finite, non-negative).

  Returns:
    The band, with each end flagged where it reaches the grid's end.

  Raises:
    ValueError: mismatched lengths, an lr that is not positive, no run with a finite loss, or a tolerance that is
      negative or not finite.

  References:
    Yang et al., arXiv 2203.03466 (2022).
  """
  if not (math.isfinite(tolerance) and tolerance >= 0):
    raise ValueError(f"lr_band: the tolerance must be finite and non-negative, got {tolerance}")
  grid, mean, refused = _grid_means(lrs, losses)
  if refused:
    raise ValueError(f"lr_band: {refused}")
  i = int(np.argmin(mean))
  level = mean[i] + tolerance

  def end(step: int) -> tuple[float, bool]:
    j = i
    while 0 <= j + step < grid.size and mean[j + step] <= level:
      j += step
    k = j + step
    if not 0 <= k < grid.size:
      return float(grid[j]), True
    if not np.isfinite(mean[k]):
      return float(grid[j]), False
    t = (level - mean[j]) / (mean[k] - mean[j])
    return float(np.exp(np.log(grid[j]) + t * (np.log(grid[k]) - np.log(grid[j])))), False

  (low, open_low), (high, open_high) = end(-1), end(1)
  return LrBand(low, high, open_low, open_high)


def optimum_table(results: Mapping[float, Mapping[float, Sequence[float]]]) -> dict[float, LrOptimum]:
  """`lr_optimum` for each width of a ladder.

  Args:
    results: width -> {lr -> final losses over seeds (NaN or inf for a diverged run)}.

  Returns:
    width -> its optimum, in increasing width.

  Raises:
    ValueError: what `lr_optimum` refuses, naming the width.
  """
  table = {}
  for width in sorted(results):
    runs = [(lr, loss) for lr, seeds in results[width].items() for loss in np.ravel(np.asarray(seeds, np.float64))]
    try:
      table[width] = lr_optimum([r[0] for r in runs], [r[1] for r in runs])
    except ValueError as e:
      raise ValueError(f"width {width}: {e}") from e
  return table


def transfer_slope(widths: ArrayLike, optimal_lrs: ArrayLike) -> float:
  """The slope of log lr* on log width (least squares): 0 when the optimum transfers, −1 when lr* ∝ 1/width.

  Args:
    widths: the widths (at least two distinct, positive).
    optimal_lrs: the optimal lr at each width (positive).

  Returns:
    The fitted exponent p of lr* ∝ width^p.

  Raises:
    ValueError: mismatched lengths, fewer than two distinct widths, or a width or lr that is not positive.

  References:
    Yang et al., arXiv 2203.03466 (2022).
  """
  w, lr = np.asarray(widths, np.float64).ravel(), np.asarray(optimal_lrs, np.float64).ravel()
  if w.shape != lr.shape:
    raise ValueError(f"transfer_slope: {w.size} widths but {lr.size} lrs")
  if np.unique(w).size < 2:
    raise ValueError(f"transfer_slope: needs at least two distinct widths, got {w.tolist()}")
  if not (np.all(w > 0) and np.all(lr > 0)):
    raise ValueError(f"transfer_slope: widths and lrs must be positive, got {w.tolist()} and {lr.tolist()}")
  return float(np.polyfit(np.log(w), np.log(lr), 1)[0])
