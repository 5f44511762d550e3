"""What the experiments' reports are built of: mean ± std over seeds, each arm against a baseline (the per-seed
differences, their mean ± std, the 2-std verdict and the sign count) and markdown tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from research.bench.report import table


def mean_std(xs) -> tuple[float, float]:
  xs = np.asarray(list(xs), np.float64)
  return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def pm(ms: tuple[float, float], sign: bool = False, digits: int = 4) -> str:
  """A (mean, std) pair as "mean ± std" (mean with its sign when `sign`)."""
  return f"{ms[0]:{'+' if sign else ''}.{digits}f} ± {ms[1]:.{digits}f}"


def _field(key) -> Callable[[dict], float]:
  return key if callable(key) else (lambda r: r[key])


def seed_stat(result: dict, arm: str, key="final") -> tuple[float, float]:
  """Mean ± std over result["seeds"] of an arm's `key` (a record key, or a function of the arm's record)."""
  get = _field(key)
  return mean_std([get(r["arms"][arm]) for r in result["seeds"].values()])


def seed_paired(result: dict, arm: str, base: str, key="final") -> tuple[float, float]:
  """Mean ± std over the seeds of the per-seed difference arm − base of `key`."""
  return versus(result, arm, base, key).d


def resolved(d: tuple[float, float]) -> str:
  """A paired (mean, std) difference read at 2 std: "level" (not resolved), "lower" or "higher"."""
  return "level" if abs(d[0]) <= 2 * d[1] else "lower" if d[0] < 0 else "higher"


@dataclasses.dataclass(frozen=True)
class Versus:
  """An arm against a baseline, paired by seed: `diffs` = arm − base of one measure, one per seed.

  `d` is their (mean, std) (std with ddof 1; 0 for one seed), `verdict` reads it at 2 std (`resolved`: "level",
  "lower" or "higher"), `lower` counts the seeds where the arm is below the baseline, of `n`.
  """
  diffs: tuple[float, ...]

  @property
  def d(self) -> tuple[float, float]:
    return mean_std(self.diffs)

  @property
  def verdict(self) -> str:
    return resolved(self.d)

  @property
  def lower(self) -> int:
    return sum(x < 0 for x in self.diffs)

  @property
  def n(self) -> int:
    return len(self.diffs)

  def pm(self, digits: int = 4) -> str:
    """The difference as "+mean ± std" (`pm` with its sign), `digits` decimals."""
    return pm(self.d, sign=True, digits=digits)


def versus(result: dict, arm: str, base: str, key: str | Callable[[dict], float] = "final") -> Versus:
  """One arm against a baseline, paired by seed.

  Args:
    result: an experiment's result, {"seeds": {seed: {"arms": {arm: record}}}}.
    arm: the arm compared.
    base: the baseline arm.
    key: a record key, or a function of an arm's record (default "final", the final val loss).

  Returns:
    The per-seed differences arm − base, in result["seeds"]' order.
  """
  get = _field(key)
  return Versus(tuple(get(r["arms"][arm]) - get(r["arms"][base]) for r in result["seeds"].values()))


def against(result: dict, base: str, key: str | Callable[[dict], float] = "final",
            arms: Iterable[str] | None = None) -> dict[str, Versus]:
  """Each arm but the baseline against the baseline (`versus`).

  Args:
    result: an experiment's result, {"seeds": {seed: {"arms": {arm: record}}}}.
    base: the baseline arm (skipped among `arms`).
    key: a record key, or a function of an arm's record (default "final").
    arms: the arms, in the order wanted (default: every arm of the first seed, in its order).

  Returns:
    {arm: Versus} in the order of `arms`.
  """
  arms = next(iter(result["seeds"].values()))["arms"] if arms is None else arms
  return {arm: versus(result, arm, base, key) for arm in arms if arm != base}


def delta_cell(vs: dict[str, Versus], arm: str) -> str:
  """A table's "Δ vs baseline" cell.

  Args:
    vs: what `against` returns.
    arm: the row's arm.

  Returns:
    The arm's difference as "+mean ± std", or "–" for the baseline (absent from `vs`).
  """
  return vs[arm].pm() if arm in vs else "–"


def band(curves) -> tuple[np.ndarray, np.ndarray]:
  """(steps, losses[seed, point]) of per-seed curves that share their steps."""
  return np.array([p[0] for p in curves[0]], float), np.array([[p[1] for p in c] for c in curves])


def curves_plot(ax, seeds: list[dict], label: Callable[[str], str], lrs: dict):
  """Each arm's val-loss curve (mean ± std over the seeds' `arms[arm]["curve"]`) on `ax`, labelled with its lr."""
  for i, arm in enumerate(seeds[0]["arms"]):
    x, y = band([s["arms"][arm]["curve"] for s in seeds])
    ax.plot(x, y.mean(0), "-o", ms=3, color=f"C{i}", label=f"{label(arm)} (lr {lrs[arm]:g})")
    ax.fill_between(x, y.mean(0) - y.std(0), y.mean(0) + y.std(0), color=f"C{i}", alpha=0.15)
  ax.legend(fontsize=8)


def timing_lines(result: dict) -> list[str]:
  """The results table's closing run-time line (none without result["timing"])."""
  t = result.get("timing")
  return [] if not t else ["", f"Run time: {t['wall_s']:.0f} s wall, {t['cpu_s']:.0f} s CPU on the shared 2-core VM."]


def lr_grid_table(grid: dict, label: Callable[[str], str], caption: str, note: str = "") -> list[str]:
  """Markdown lines of an lr grid ({arm: {lr: final val loss}}) under `caption`, then the arms whose best lr sits at
  the grid's edge (their loss could fall with a wider grid), `note` appended to that sentence."""
  lrs = list(next(iter(grid.values())))
  lines = ["", caption, "", *table(["arm", *(f"lr {lr}" for lr in lrs)],
                                   [[label(a), *(f"{v:.4f}" for v in t.values())] for a, t in grid.items()])]
  ends = (min(map(float, lrs)), max(map(float, lrs)))
  edge = [label(a) for a, t in grid.items() if float(min(t, key=t.get)) in ends]
  if edge and len(lrs) > 1:
    lines += ["", f"The best lr sits at the grid's edge for: {', '.join(edge)}; a wider grid could lower those arms' "
                  f"losses{note}."]
  return lines


__all__ = ["mean_std", "pm", "seed_stat", "seed_paired", "resolved", "Versus", "versus", "against", "delta_cell",
           "table", "timing_lines", "lr_grid_table", "band", "curves_plot"]
