"""Plot a run's curves: training and validation loss, learning rate, throughput.

  python -m research.plot runs/default            # writes runs/default/curves.png and prints its path
  python -m research.plot runs/a runs/b --out cmp.png
  python -m research.plot runs/default --heatmap watch/updates/rms   # + runs/default/heatmap_watch_updates_rms.png

Reads each run's metrics.jsonl (one record per logged step, see docs/watching-runs.md); runs share the axes, so
several runs compare at a glance. --heatmap PREFIX draws an in-step diagnostic logged per layer (--watch,
--spectra-every: docs/diagnostics.md) as one heatmap per parameter, layers against steps, for each run.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated

import tyro

from research import entry, flags
from research.train.store.rundir import read_records


@dataclasses.dataclass
class PlotConfig:
  """Plot the loss, validation loss, learning rate and tokens/s of one or more run directories."""
  runs: tyro.conf.Positional[Annotated[tuple[str, ...], flags.Rule(path="dir")]]
  """Run directories (each with a metrics.jsonl)."""
  out: Annotated[str | None, flags.OUT_FILE] = None
  """The image to write (default: <first run>/curves.png)."""
  heatmap: Annotated[str | None, flags.Rule()] = None  # a metric prefix: blank means nothing
  """A per-layer metric's prefix (watch/updates/rms, watch/relative_update, spectra/updates/spectral_norm, ...):
  also <run>/heatmap_<prefix>.png per run, one panel per parameter, its layers (rows) over the logged steps."""


def read_metrics(run_dir: str) -> list[dict]:
  """The run's metrics records (`rundir.read_records`: a last line cut short by a kill is dropped); a file with
  other lines (damaged, or not a metrics file) is refused: the plot would show what the run did not log."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: not found (is {run_dir} a run directory?)")
  records, damaged = read_records(path)
  if damaged:
    raise ValueError(f"{path}: {damaged} line(s) are not metrics records (damaged, or not a run's metrics.jsonl)")
  records = [r for r in records if "loss" in r and "lr" in r]
  if not records:
    raise ValueError(f"{path}: no records yet")
  return records


def plot(runs: dict[str, list[dict]], out: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for name, recs in runs.items():
    steps = [r["step"] for r in recs]
    line, = axes[0].plot(steps, [r["loss"] for r in recs], alpha=0.5, label=f"{name} train")
    ev = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if ev:
      axes[0].plot(*zip(*ev), "o-", color=line.get_color(), label=f"{name} val")
    axes[1].plot(steps, [r["lr"] for r in recs], label=name)
    tp = [(r["step"], r["tokens_per_s"]) for r in recs if "tokens_per_s" in r]
    if tp:
      axes[2].plot(*zip(*tp), label=name)
  for ax, title in zip(axes, ("loss (nats per token)", "learning rate", "tokens/s")):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def per_layer(records: list[dict], prefix: str) -> dict[str, tuple[list[int], list[list[float]]]]:
  """{parameter: (steps, values per step: one per layer)} of the records' per-layer metric `prefix` (an MoE's
  per-expert values averaged over experts)."""
  import numpy as np
  out: dict[str, tuple[list[int], list[list[float]]]] = {}
  for r in records:
    for k, v in r.items():
      if k.startswith(prefix + "/") and isinstance(v, list):
        a = np.asarray(v, dtype=float)
        rows = a.reshape(a.shape[0], -1).mean(axis=1) if a.ndim > 1 else a
        steps, values = out.setdefault(k[len(prefix) + 1:], ([], []))
        steps.append(r["step"])
        values.append(rows.tolist())
  return out


def heatmap(records: list[dict], prefix: str, out: str, title: str = "") -> str:
  """One panel per parameter: `prefix`'s value per layer (rows) over the logged steps (columns), log color scale.

  Returns the image's path; ValueError when no record has the metric per layer."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  from matplotlib.colors import LogNorm
  series = per_layer(records, prefix)
  if not series:
    raise ValueError(f"no per-layer {prefix}/... in the records (was the run started with --watch or "
                     f"--spectra-every?)")
  n = len(series)
  cols = min(n, 4)
  fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4 * cols, 2.6 * ((n + cols - 1) // cols)),
                           squeeze=False)
  for ax, (name, (steps, values)) in zip(axes.flat, sorted(series.items())):
    grid = np.asarray(values, dtype=float).T  # (layers, steps)
    positive = grid[grid > 0]
    norm = LogNorm(positive.min(), positive.max()) if positive.size and positive.max() > positive.min() else None
    im = ax.imshow(np.where(grid > 0, grid, np.nan), aspect="auto", origin="lower", norm=norm,
                   extent=(steps[0], steps[-1], -0.5, grid.shape[0] - 0.5), interpolation="nearest")
    ax.set_title(name, fontsize=8)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    fig.colorbar(im, ax=ax)
  for ax in list(axes.flat)[n:]:
    ax.axis("off")
  fig.suptitle(f"{title} {prefix}".strip())
  fig.tight_layout()
  fig.savefig(out, dpi=90)
  plt.close(fig)
  return out


def main(argv=None):
  cfg = tyro.cli(PlotConfig, args=argv, prog="python -m research.plot")
  with entry.one_line_errors(OSError, ValueError):
    flags.check_config(cfg)
    runs = {os.path.basename(os.path.normpath(r)) or r: read_metrics(r) for r in cfg.runs}  # a bad run first
    out = cfg.out or os.path.join(cfg.runs[0], "curves.png")
    entry.writable_file(out)
    print(plot(runs, entry.parent_made(out)))
    if cfg.heatmap:
      for run_dir, name in zip(cfg.runs, runs):
        path = os.path.join(run_dir, f"heatmap_{cfg.heatmap.strip('/').replace('/', '_')}.png")
        print(heatmap(read_records(os.path.join(run_dir, "metrics.jsonl"))[0], cfg.heatmap, path, name))


if __name__ == "__main__":
  entry.command(main)
