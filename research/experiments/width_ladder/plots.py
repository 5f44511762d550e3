"""The width ladder's plots, from `report.verdicts`: speedup.png (speedup vs width), transfer.png (final loss vs lr per
width), speedup_budget.png (stage D's speedup vs tokens per parameter), profile.png (performance profiles)."""

from __future__ import annotations

import math
import os

import numpy as np

from research.experiments.width_ladder.report import FULL, KEYS, META, WAYS, costs, usable
from research.verdicts import performance_profile


def plots(cfg, done: dict, v: dict, out: str) -> list[str]:
  """speedup.png (speedup vs width with intervals: on AdamW's fit, and read between its runs), transfer.png (final loss
  vs lr per width, one panel a contender), speedup_budget.png, profile.png."""
  from matplotlib.figure import Figure
  from matplotlib.ticker import NullFormatter
  made = []
  fig = Figure(figsize=(10, 4))
  panels = fig.subplots(1, 2, sharey=True, sharex=True)
  tops = [x for k in FULL.values() for r in v["widths"].values() for n in r if n not in META and usable(r[n], k[:2])
          for x in (r[n][k[0]], r[n][k[2]]) if math.isfinite(x)]
  top = 1.1 * max(tops, default=2.0)  # an interval open above (∞) is drawn to here, with an arrow
  for ax, keys, title in zip(panels, FULL.values(),
                             ("on AdamW's fitted L(D), ÷ its own", "read between AdamW's runs (a bound left out)")):
    for name in cfg.contenders:
      pts = [(w, r[name]) for w, r in v["widths"].items() if name in r and usable(r[name], keys[:2])]
      if pts:
        s = np.array([p[keys[0]] for _, p in pts])
        hi = np.maximum(np.minimum([p[keys[2]] for _, p in pts], top), s)
        err = np.array([s - np.minimum([p[keys[1]] for _, p in pts], s), hi - s])  # an end past its point: 0
        line = ax.errorbar([w for w, _ in pts], s, yerr=err, marker="o", capsize=3, label=name)
        up = [w for w, p in pts if p[keys[2]] == math.inf]
        if up:
          ax.plot(up, [top] * len(up), marker="^", ls="none", color=line[0].get_color())
    ax.axhline(1, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="d_model", title=title)
    ax.set_xticks(list(v["widths"]), [str(w) for w in v["widths"]])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if ax.get_legend_handles_labels()[0]:  # none before a width has its AdamW fit
      ax.legend(fontsize=7, loc="lower right")
  panels[0].set_ylabel("data-matched speedup over AdamW")
  fig.text(0.5, 0.01, "▲: an interval open above (its draws reach past AdamW's runs or its fit's floor)", fontsize=8,
           ha="center")
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  made.append(os.path.join(out, "speedup.png"))
  fig.savefig(made[-1], dpi=120)
  names = [n for n in cfg.contenders if n in v["transfer"]]
  fig = Figure(figsize=(3.2 * max(1, len(names)), 3.2))
  axes = np.atleast_1d(fig.subplots(1, max(1, len(names))))
  for ax, name in zip(axes, names):
    for w, rung in done.items():
      scan = rung.get(name, {}).get("scan", {})
      if scan and None not in scan.values():
        lrs = sorted(scan)
        ax.plot(lrs, [min(scan[x], 10.0) for x in lrs], marker="o", label=f"d {w}")
    ax.set(xscale="log", xlabel="peak lr", title=name)
    ax.xaxis.set_minor_formatter(NullFormatter())  # the decades only: minor labels overlap on a short range
  axes[0].set_ylabel("final held-out loss")
  if axes[0].get_legend_handles_labels()[0]:
    axes[0].legend(fontsize=7)
  fig.tight_layout()
  made.append(os.path.join(out, "transfer.png"))
  fig.savefig(made[-1], dpi=120)
  if any(v["budgets"].values()):
    made.append(_budget_plot(v, os.path.join(out, "speedup_budget.png")))
  cost = costs(v)
  if any(cost.values()):
    taus = np.linspace(1, 4, 200)
    fig = Figure(figsize=(5, 3.5))
    ax = fig.subplots()
    for name, rho in performance_profile({n: c for n, c in cost.items() if c}, taus).items():
      ax.step(taus, rho, where="post", label=name)
    ax.set(xlabel="τ (cost / the best at that width; cost = 1 / speedup between AdamW's runs)",
           ylabel="share of widths",
           title="performance profile over the widths")
    ax.legend(fontsize=7)
    fig.tight_layout()
    made.append(os.path.join(out, "profile.png"))
    fig.savefig(made[-1], dpi=120)
  return made


def _budget_plot(v: dict, path: str) -> str:
  """speedup_budget.png: stage D's speedup against tokens per parameter, one column a contender, one line a width, on
  AdamW's fit (÷ its own, top) and read between its runs (bottom, finite only): where lines of different widths meet
  at equal tokens per parameter, width alone does not move it."""
  from matplotlib.figure import Figure
  from matplotlib.ticker import NullFormatter
  names = sorted({n for row in v["budgets"].values() for n in row})
  fig = Figure(figsize=(3.4 * len(names), 6.2))
  axes = np.array(fig.subplots(2, len(names), sharey=True, squeeze=False))
  for row_axes, way in zip(axes, KEYS):
    for ax, name in zip(row_axes, names):
      for w, row in v["budgets"].items():
        pts = sorted((r["tokens_per_param"], r) for r in row.get(name, {}).values() if usable(r, KEYS[way]))
        if pts:
          x, s = [p[0] for p in pts], np.array([p[1][KEYS[way][0]] for p in pts])
          lo, hi = (np.array([p[1][KEYS[way][i]] for p in pts]) for i in (1, 2))
          err = np.array([s - np.minimum(lo, s), np.maximum(hi, s) - s])  # an end past its point: 0
          ax.errorbar(x, s, yerr=err, marker="o", capsize=3, label=f"d {w}")
      ax.axhline(1, color="gray", lw=0.8)
      ax.set(xscale="log", xlabel="tokens per parameter", title=f"{name}\n{WAYS[way]}")
      ax.xaxis.set_minor_formatter(NullFormatter())
    row_axes[0].set_ylabel("speedup over AdamW")
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path
