"""Which of the optimizers optlab studies reaches the lowest validation loss on the `small` preset at equal
tokens, each at its own best learning rate, and how many steps does each save over AdamW?

  python -m research.experiments.optimizers            # full: writes research/results/optimizers/
  python -m research.experiments.optimizers --smoke    # seconds (tiny model): what the tests and notebook run

Claims it checks at CPU scale (shared/reference/optimizers.md §12): Muon reaches a given loss in fewer steps than
AdamW (modded-nanogpt, Moonlight: ~2× compute efficiency); MGUP-AdamW, Cautious-AdamW and MARS-AdamW each end
slightly below AdamW (MGUP README, C-Optim, MARS README); Muon-MVR / MARS-M improves on Muon.

Protocol (two stages of `research.sweep`, sharing one run directory so no run is repeated):
  1. tune: every contender (eight: Muon-MVR1 and MVR2 both) over a 3-point learning-rate grid, seed 0, centred on
     each family's usual scale: AdamW-like 3e-4..3e-3, MARS 1e-3..1e-2 (3e-4 added when 1e-3 won), Muon-like
     (Moonlight scaling) 3e-3..3e-2;
  2. seeds: every contender at its stage-1 best lr with seeds 0, 1, 2 (seed = initialization and batch order).
Every run: `small` (d 256, 4 layers, 3.5M params), the built-in byte corpus, batch 16 × 128 bytes, 100 steps
(204,800 tokens), cosine schedule with 10-step warmup, clip 1.0, weight decay 0.1 for every contender (MARS's own
default is 0), 1 device, validation on the held-out split every 20 steps. Speedup = steps AdamW's mean curve takes
to reach its own final loss / steps the contender's mean curve takes (`research.sweep.summarize`). A best lr at the
edge of its grid is flagged in the table. Muon-MVR2 (the exact mode: a second backward pass per step, ~2× the
compute of a run) is compared at equal steps and tokens like the rest, so its speedup is per step, not per FLOP.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import tyro

from research.experiments.common import smoke_compiles_quickly, write_results
from research.sweep import SweepConfig, draw_curves, run_grid, summarize
from research.train import TrainConfig

GRID = ("adamw=3e-4,1e-3,3e-3", "mgup_adamw=3e-4,1e-3,3e-3", "cautious_adamw=3e-4,1e-3,3e-3",
        "mars[weight_decay=0.1]=3e-4,1e-3,3e-3,1e-2", "muon=3e-3,1e-2,3e-2", "mgup_muon=3e-3,1e-2,3e-2",
        "muon_mvr=3e-3,1e-2,3e-2", "muon_mvr[mode=mvr2]=3e-3,1e-2,3e-2")


@dataclasses.dataclass
class Config:
  smoke: bool = False
  grid: tuple[str, ...] = GRID
  """research.sweep grid entries (OPTIMIZER[KEY=VALUE,...]=LRS)."""
  seeds: tuple[int, ...] = (0, 1, 2)
  model: str = "small"
  steps: int = 100
  eval_every: int = 20
  out: str = "research/results/optimizers"
  runs: str = "runs/optimizers/runs"
  """Run directories (checkpoints, metrics); rerunning skips finished runs."""


@smoke_compiles_quickly
def main(cfg: Config) -> dict:
  train = TrainConfig(model=cfg.model, steps=cfg.steps, eval_every=cfg.eval_every, log_every=10, devices=1,
                      mesh="data=1", progress=False)
  grid, seeds = cfg.grid, cfg.seeds
  tmp = None
  if cfg.smoke:  # the same two stages on the tiny preset, in a temporary directory
    tmp = tempfile.mkdtemp(prefix="optlab-optimizers-")
    # on whatever devices the process already has (8 under the tests' conftest), data-parallel
    train = dataclasses.replace(train, model="tiny", steps=8, batch_size=8, seq_len=32, eval_every=4, log_every=4,
                                eval_batches=2, devices=8, mesh="data=-1")
    grid, seeds = ("adamw=3e-3,1e-2", "muon=1e-2"), (0, 1)
    out, runs = tmp, os.path.join(tmp, "runs")
  else:
    out, runs = cfg.out, cfg.runs
  try:
    tune = run_grid(SweepConfig(grid=grid, seeds=(seeds[0],), out=os.path.join(out, "tune"), runs=runs, train=train))
    best = {s["label"]: s["best_lr"] for s in summarize(tune, "adamw")[0]}
    final_grid = []
    for entry in grid:
      label = entry.rsplit("=", 1)[0]
      final_grid.append(f"{label}={best[label]:g}")
    rows = run_grid(SweepConfig(grid=tuple(final_grid), seeds=seeds, out=out, runs=runs, train=train))
    summary, target = summarize(rows, "adamw")
    result = {"tune": tune, "rows": rows, "summary": summary, "target": target, "grid": list(grid),
              "train": {k: v for k, v in dataclasses.asdict(train).items() if k not in ("out", "progress")}}
    if not cfg.smoke:
      write(cfg, result)
    return result
  finally:
    if tmp:
      shutil.rmtree(tmp, ignore_errors=True)


def tune_table(tune: list[dict], grid) -> list[str]:
  """Markdown: seed-0 final val loss of every (contender, lr); the best of each row in bold, '(edge)' if it is at
  an end of the grid."""
  lines = ["| contender | final val loss at each lr (seed 0) | best lr |", "|---|---|---|"]
  for entry in grid:
    label = entry.rsplit("=", 1)[0]
    mine = sorted((r for r in tune if r["label"] == label), key=lambda r: r["lr"])
    ok = [r for r in mine if not r["diverged"]]
    best = min(ok, key=lambda r: r["final_val_loss"])
    cells = [f"{r['lr']:g}: " + ("diverged" if r["diverged"] else
                                 (f"**{r['final_val_loss']:.4f}**" if r is best else f"{r['final_val_loss']:.4f}"))
             for r in mine]
    edge = " (edge)" if best in (mine[0], mine[-1]) and len(mine) > 1 else ""
    lines.append(f"| {label} | {' · '.join(cells)} | {best['lr']:g}{edge} |")
  return lines


def summary_table(summary: list[dict], target: float) -> list[str]:
  fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
  base = next(s for s in summary if s["label"] == "adamw")
  lines = [f"| contender | lr | val loss, mean ± std ({summary[0]['seeds']} seeds) | vs AdamW | "
           f"steps to {target:.4f} | speedup vs AdamW | tokens/s |", "|---|---|---|---|---|---|---|"]
  for s in summary:
    lines.append(f"| {s['label']} | {s['best_lr']:g} | {s['final_mean']:.4f} ± {s['final_std']:.4f} | "
                 f"{s['final_mean'] - base['final_mean']:+.4f} | {fmt(s['steps_to_target'], '.0f')} | "
                 f"{'<1' if s['speedup'] is None else format(s['speedup'], '.2f') + '×'} | {s['tokens_per_s']:.0f} |")
  return lines


def write(cfg: Config, result: dict):
  summary = result["summary"]
  base = next(s for s in summary if s["label"] == "adamw")
  findings = ["Reading (generated from the numbers above):"]
  for s in summary:
    if s["label"] == "adamw":
      continue
    diff = s["final_mean"] - base["final_mean"]
    noise = max(s["final_std"], base["final_std"])
    verdict = (f"below AdamW by more than twice the larger std, {noise:.4f}" if diff < -2 * noise else
               f"above AdamW by more than twice the larger std, {noise:.4f}" if diff > 2 * noise else
               f"within twice the larger std, {noise:.4f}, of AdamW")
    findings.append(f"- {s['label']}: {diff:+.4f} nats/byte vs AdamW ({verdict}).")
  write_results(cfg.out, "Optimizers on `small` at equal tokens",
                __doc__.split("\n\n")[0], ["## Stage 1: learning-rate grid", "", *tune_table(result["tune"],
                                                                                           result["grid"]),
                                           "", "## Stage 2: best lr, 3 seeds", "",
                                           *summary_table(summary, result["target"]),
                                           "", "Curves: `curves.png` (stage 2, min–max band over seeds); "
                                           "lr sweep: `tune/lr.png`; every run: `results.csv`, `tune/results.csv`. "
                                           "tokens/s were measured while other jobs shared the 2 cores: not a speed "
                                           "comparison (`python -m research.bench optim` is)."],
                findings=findings, settings=result["train"],
                data={"summary": [{k: v for k, v in s.items() if k != "spread"} for s in summary],
                      "tune": result["tune"], "rows": result["rows"]})


def plot(result: dict):
  """Validation loss vs step of each contender at its best lr (mean over seeds, min–max band)."""
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 4))
  draw_curves(ax, result["summary"])
  fig.tight_layout()
  return fig


if __name__ == "__main__":
  main(tyro.cli(Config))
