"""Hyperparameter search spaces and their proposals: quasi-random trials (AlgoPerf's scrambled Halton sequence) over a
box of named dimensions, and the flags a best trial sits too close to the box's edge on.

A dimension is NAME=SCALE:LOW:HIGH, SCALE one of
  log      log-uniform in [LOW, HIGH] (a learning rate, an epsilon)
  linear   uniform in [LOW, HIGH] (a weight decay)
  beta     1 − x log-uniform, x in [1 − HIGH, 1 − LOW] (a momentum or β2: 0.9 .. 0.999 spread evenly in "memory")
NAME is a flag of the trainer (lr, weight_decay, b1, b2) or an optimizer's --opt key.

  python -m research.sweep --search --space lr=log:1e-4:1e-2 weight_decay=linear:0:0.2 --trials 8 ...

References:
  Dahl et al., "Benchmarking Neural Network Training Algorithms" (AlgoPerf), 2023, arXiv 2306.07179, §4.2 (quasi-random
    search with a fixed budget of trials).
  Bousquet et al., "Critical Hyper-Parameters: No Random, No Cry", 2017, arXiv 1706.03200 (quasi-random search).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from scipy.stats import qmc

SCALES = ("log", "linear", "beta")
_DIM = re.compile(r"^([A-Za-z_]\w*)=(\w+):([^:]+):([^:]+)$")
PREFIXED = re.compile(r"^[^=:]+:[A-Za-z_]\w*=")  # CONTENDER:NAME=SCALE:LOW:HIGH


class SearchError(ValueError):
  """A search space that cannot be searched."""


@dataclasses.dataclass(frozen=True)
class Dim:
  """One dimension of a search box: `at(u)` maps u in [0, 1] onto [low, high] on its scale."""
  name: str
  scale: str
  low: float
  high: float

  def at(self, u: float) -> float:
    if self.scale == "log":
      return float(math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low))))
    if self.scale == "beta":
      a, b = math.log(1 - self.high), math.log(1 - self.low)  # 1 - x from small (x high) to large
      return float(1 - math.exp(b + u * (a - b)))
    return float(self.low + u * (self.high - self.low))

  def position(self, value: float) -> float:
    """Where `value` sits in the box, 0 at `low` and 1 at `high`, on the dimension's scale (`at`'s inverse)."""
    if self.scale == "log":
      return (math.log(value) - math.log(self.low)) / (math.log(self.high) - math.log(self.low))
    if self.scale == "beta":
      a, b = math.log(1 - self.high), math.log(1 - self.low)
      return (math.log(1 - value) - b) / (a - b)
    return (value - self.low) / (self.high - self.low)


def parse_dim(text: str) -> Dim:
  """A `Dim` from NAME=SCALE:LOW:HIGH; SearchError (one line) for anything else."""
  m = _DIM.match(text.strip())
  if not m:
    raise SearchError(f"search dimension {text!r} is not NAME=SCALE:LOW:HIGH (SCALE one of {', '.join(SCALES)})")
  name, scale, low_s, high_s = m.groups()
  if scale not in SCALES:
    raise SearchError(f"search dimension {text!r}: scale {scale!r} is not one of {', '.join(SCALES)}")
  try:
    low, high = float(low_s), float(high_s)
  except ValueError:
    raise SearchError(f"search dimension {text!r}: LOW and HIGH must be numbers") from None
  if not (math.isfinite(low) and math.isfinite(high) and low < high):
    raise SearchError(f"search dimension {text!r}: needs finite LOW < HIGH")
  if scale == "log" and low <= 0:
    raise SearchError(f"search dimension {text!r}: a log scale needs LOW > 0")
  if scale == "beta" and not (0 <= low and high < 1):
    raise SearchError(f"search dimension {text!r}: a beta scale needs 0 <= LOW < HIGH < 1")
  return Dim(name, scale, low, high)


def quasi_random(dims: list[Dim], n: int, seed: int = 0) -> list[dict[str, float]]:
  """`n` trials spread over the box: a scrambled Halton sequence (scipy.stats.qmc), the same for the same seed.

  Args:
    dims: the box's dimensions (distinct names).
    n: the number of trials.
    seed: the scrambling's seed.

  Returns:
    One {name: value} per trial, each value rounded to 4 significant digits (a run's name stays readable).
  """
  names = [d.name for d in dims]
  if len(set(names)) != len(names) or not dims:
    raise SearchError(f"a search box needs distinct dimensions, got {names}")
  if n < 1:
    raise SearchError(f"a search needs at least one trial, got {n}")
  points = qmc.Halton(d=len(dims), scramble=True, seed=seed).random(n)
  return [{d.name: float(f"{d.at(float(u)):.4g}") for d, u in zip(dims, row)} for row in points]


def edge_flags(dims: list[Dim], best: dict[str, float], margin: float = 0.1) -> list[str]:
  """The dimensions the best trial lies within `margin` (a share of the box, on its scale) of an end on: the
  optimum may lie outside the box there.

  Args:
    dims: the box.
    best: the best trial's values.
    margin: how close to an end counts as at it.

  Returns:
    "NAME (low)" / "NAME (high)" per such dimension.
  """
  out = []
  for d in dims:
    p = d.position(best[d.name])
    if p <= margin or p >= 1 - margin:
      out.append(f"{d.name} ({'low' if p <= margin else 'high'})")
  return out


def grid_edge(values: list[float], best: float) -> str | None:
  """"low" / "high" when `best` is the smallest / largest of a grid's `values` (the optimum may lie past it)."""
  finite = sorted(v for v in values if np.isfinite(v))
  if len(finite) < 2:
    return None
  return "low" if best == finite[0] else "high" if best == finite[-1] else None


def search_boxes(space: tuple[str, ...], contenders: dict[str, list[float]]) -> dict[str, list[Dim]]:
  """Each contender's search box: the `space` entries for all and its own (prefixed CONTENDER:), and its lr
  log-uniform over its lrs' range unless `space` gives an lr dimension.

  Args:
    space: entries [CONTENDER:]NAME=SCALE:LOW:HIGH.
    contenders: {label: its grid's learning rates}.

  Returns:
    {label: its dimensions, lr first}.
  """
  for e in space:
    if PREFIXED.match(e) and e.partition(":")[0] not in contenders:
      raise SearchError(f"--space {e!r}: {e.partition(':')[0]!r} is not a contender of the grid "
                        f"({', '.join(contenders)})")
  boxes = {}
  for label, lrs in contenders.items():
    dims = [parse_dim(e.partition(":")[2]) for e in space if PREFIXED.match(e) and e.partition(":")[0] == label]
    own = {d.name for d in dims}
    dims += [d for d in map(parse_dim, (e for e in space if not PREFIXED.match(e))) if d.name not in own]
    if "lr" not in {d.name for d in dims}:
      if len(set(lrs)) < 2:
        raise SearchError(f"--search: {label} needs an lr range: two lrs in its grid entry or an lr dimension "
                          f"in --space ({label}:lr=log:LOW:HIGH)")
      dims.insert(0, Dim("lr", "log", min(lrs), max(lrs)))
    boxes[label] = dims
  return boxes
