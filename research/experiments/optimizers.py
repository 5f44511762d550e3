"""Which of the optimizers optlab studies reaches the lowest validation loss on the `small` preset at equal
tokens, each at its own best learning rate, and how many steps does each save over AdamW?

  python -m research.experiments.optimizers            # full: writes research/results/optimizers/
  python -m research.experiments.optimizers --smoke    # seconds (tiny model): what the tests and notebook run

Claims it checks at CPU scale (shared/reference/optimizers.md §12, §14): Muon reaches a given loss in fewer steps
than AdamW (modded-nanogpt, Moonlight: ~2× compute efficiency); MGUP-AdamW, Cautious-AdamW and MARS-AdamW each end
slightly below AdamW (MGUP README, C-Optim, MARS README); Muon-MVR / MARS-M improves on Muon; and the 2026 set:
NorMuon and AdaMuon improve on Muon (arXiv 2510.05491: +11% efficiency at 1.1B; 2507.11005), SOAP and PSGD-Kron
come close to Muon (modded-nanogpt's optimization track: steps to 3.28 val loss, Muon 3250-3600, SOAP-H 3125,
PSGD-Kron 3375, NorMuon 3250, Adam 5625), Scion matches Muon, Dion at full rank matches Muon.

Protocol (stages of `research.sweep`, sharing one run directory so no run is repeated and an interrupted study
resumes where it stopped):
  1. tune: every contender (fourteen: Muon-MVR1 and MVR2 both) over a 3-point learning-rate grid, seed 0, centred
     on each family's usual scale: AdamW-like and SOAP 3e-4..3e-3, MARS 3e-4..1e-2, PSGD-Kron 1e-4..1e-3,
     Muon-like (Moonlight scaling: NorMuon, AdaMuon, Dion, Muon) 3e-3..3e-2, Scion (Frank–Wolfe step, radii
     1/3/10) 1e-3..1e-2;
  1b. edges: a contender whose best lr sits at an end of its grid gets one more lr past it (×3 or ÷3; not past a
     diverged end), seed 0 (`common.past_edge`); a best still at the new edge is flagged in the table;
  2. seeds: every contender at its best lr with seeds 0, 1, 2 (seed = initialization and batch order).
Every run: `small` (d 256, 4 layers, 3.5M params), the built-in byte corpus, batch 16 × 128 bytes, 300 steps
(614,400 tokens), cosine schedule with 30-step warmup, clip 1.0, weight decay 0.1 for every contender (the
defaults of MARS, Kron: 0, SOAP, Dion: 0.01; Scion's constrained step shrinks W by itself and takes none), Dion at
full rank with the Moonlight scale so that its AdamW group shares the lr as in every Muon-family contender (the
reference's √(fan_out/fan_in) would need a second lr for AdamW), 1 device, validation on the held-out split every
10 steps. Steps to target = the first validation step at which a contender's mean curve reaches the target loss
(AdamW's final mean unless `--target` fixes it: the modded-nanogpt optimization-track metric); speedup = AdamW's
steps to its own final loss / the contender's.
Length: 300 steps, 3× the first version's 100, where every Muon-family curve was still falling steeply at the end;
the report gives the ranking at half length beside the final one (Kendall τ and the contenders that swap), so a
ranking that is an artifact of early training shows. Muon-MVR2 (the exact mode: a second backward pass per step,
~2× the compute of a run) is compared at equal steps and tokens like the rest, so its speedup is per step, not per
FLOP; SOAP and Kron's preconditioner work is likewise not charged (`python -m research.bench optim` times it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from typing import Annotated

from research import flags
from research.experiments import common
from research.experiments.common import past_edge, smoke_compiles_quickly, write_results
from research.sweep import GRID_ENTRY, SweepConfig, draw_curves, run_grid, summarize
from research.train.config import TrainConfig

GRID = ("adamw=3e-4,1e-3,3e-3", "mgup_adamw=3e-4,1e-3,3e-3", "cautious_adamw=3e-4,1e-3,3e-3",
        "mars[weight_decay=0.1]=3e-4,1e-3,3e-3,1e-2", "muon=3e-3,1e-2,3e-2", "mgup_muon=3e-3,1e-2,3e-2",
        "muon_mvr=3e-3,1e-2,3e-2", "muon_mvr[mode=mvr2]=3e-3,1e-2,3e-2",
        "normuon=3e-3,1e-2,3e-2", "adamuon=3e-3,1e-2,3e-2", "dion[weight_decay=0.1,scale=moonlight]=3e-3,1e-2,3e-2",
        "scion=1e-3,3e-3,1e-2", "soap[weight_decay=0.1]=3e-4,1e-3,3e-3", "kron[weight_decay=0.1]=1e-4,3e-4,1e-3")


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/optimizers"
  grid: Annotated[tuple[str, ...], GRID_ENTRY] = GRID
  """research.sweep grid entries (OPTIMIZER[KEY=VALUE,...]=LRS)."""
  seeds: tuple[int, ...] = (0, 1, 2)
  model: str = "small"
  steps: int = 300
  eval_every: int = 10
  target: float | None = None
  """Validation loss every contender's steps are counted to (None: AdamW's final mean)."""
  extend_edge: bool = True
  """One more lr past the grid's end for a contender whose best sits on it."""
  runs: Annotated[str, flags.OUT_DIR] = "runs/optimizers/runs_300"
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
    tune_cfg = SweepConfig(grid=grid, seeds=(seeds[0],), out=os.path.join(out, "tune"), runs=runs, train=train)
    tune = run_grid(tune_cfg)
    if cfg.extend_edge:
      grid = extended_grid(grid, tune)
      if grid != tune_cfg.grid:
        tune = run_grid(dataclasses.replace(tune_cfg, grid=grid))
    best = {s["label"]: s["best_lr"] for s in summarize(tune, "adamw")[0]}
    final_grid = []
    for entry in grid:
      label = entry.rsplit("=", 1)[0]
      final_grid.append(f"{label}={best[label]:g}")
    rows = run_grid(SweepConfig(grid=tuple(final_grid), seeds=seeds, out=out, runs=runs, train=train))
    summary, target = summarize(rows, "adamw", cfg.target)
    result = {"tune": tune, "rows": rows, "summary": summary, "target": target, "grid": list(grid),
              "ranking": ranking_stability(summary),
              "train": {k: v for k, v in dataclasses.asdict(train).items() if k not in ("out", "progress")}}
    if not cfg.smoke:
      write(cfg, result)
    return result
  finally:
    if tmp:
      shutil.rmtree(tmp, ignore_errors=True)


def extended_grid(grid, tune: list[dict]) -> tuple[str, ...]:
  """The grid with one lr added past the end for every entry whose seed-0 best is at an end (`common.past_edge`)."""
  out = []
  for entry in grid:
    label, lrs = entry.rsplit("=", 1)
    scores = {r["lr"]: math.inf if r["diverged"] else r["final_val_loss"] for r in tune if r["label"] == label}
    edge = past_edge(scores)
    out.append(entry if edge is None or edge in scores else f"{entry},{edge:g}")
  return tuple(out)


def kendall_tau(a: list, b: list) -> float:
  """Kendall's τ between two orderings of the same items (1: same order, −1: reversed)."""
  pos = {x: i for i, x in enumerate(b)}
  pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
  agree = sum(1 if pos[a[i]] < pos[a[j]] else -1 for i, j in pairs)
  return agree / len(pairs) if pairs else 1.0


def ranking_stability(summary: list[dict]) -> dict:
  """The contenders ranked by mean validation loss at the last evaluation at or before half the run, and at the
  end; Kendall τ between the two and the pairs that swap."""
  end = [s["label"] for s in sorted(summary, key=lambda s: s["curve"][-1][1])]
  last = summary[0]["curve"][-1][0]
  half_step = max(step for step, _ in summary[0]["curve"] if step <= last / 2)
  at_half = lambda s: dict(s["curve"])[half_step]
  half = [s["label"] for s in sorted(summary, key=at_half)]
  swaps = [(x, y) for i, x in enumerate(half) for y in half[i + 1:] if end.index(x) > end.index(y)]
  return {"half_step": half_step, "end_step": last, "half": half, "end": end, "tau": kendall_tau(half, end),
          "swaps": swaps}


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
  rank = result["ranking"]
  swaps = ", ".join(f"{x} / {y}" for x, y in rank["swaps"]) or "none"
  findings.append(f"- Ranking by mean val loss at step {rank['half_step']} vs step {rank['end_step']}: Kendall τ = "
                  f"{rank['tau']:.2f}; pairs that swap after half length: {swaps}.")
  write_results(cfg.out, "Optimizers on `small` at equal tokens",
                __doc__.split("\n\n")[0], ["## Stage 1: learning-rate grid", "", *tune_table(result["tune"],
                                                                                           result["grid"]),
                                           "", "## Stage 2: best lr, 3 seeds", "",
                                           *summary_table(summary, result["target"]),
                                           "", "Curves: `curves.png` (stage 2, min–max band over seeds); "
                                           "lr sweep: `tune/lr.png`; every run: `results.csv`, `tune/results.csv`. "
                                           "tokens/s were measured with other runs sharing the machine: not a "
                                           "speed comparison (`python -m research.bench optim` is)."],
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
  common.cli(main, Config, kept=lambda cfg: f"the runs that finished are kept under {cfg.runs}; rerun the same "
                                             f"command to go on")
