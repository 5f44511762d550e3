"""Plot a run's curves: training and validation loss, learning rate, throughput.

  python -m research.plot runs/default            # writes runs/default/curves.png and prints its path
  python -m research.plot runs/a runs/b --out cmp.png

Reads each run's metrics.jsonl (one record per logged step, see docs/watching-runs.md); runs share the axes, so
several runs compare at a glance.
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


def main(argv=None):
  cfg = tyro.cli(PlotConfig, args=argv, prog="python -m research.plot")
  with entry.one_line_errors(OSError, ValueError):
    flags.check_config(cfg)
    runs = {os.path.basename(os.path.normpath(r)) or r: read_metrics(r) for r in cfg.runs}  # a bad run first
    out = cfg.out or os.path.join(cfg.runs[0], "curves.png")
    entry.writable_file(out)
    print(plot(runs, entry.parent_made(out)))


if __name__ == "__main__":
  entry.command(main)
