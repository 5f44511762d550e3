"""The optimizer comparison harness: optimizers × learning rates × seeds at a fixed token (or FLOP) budget.

  python -m research.sweep --grid adamw=3e-4,1e-3,3e-3 muon=3e-3,1e-2 --seeds 0 1 2 --out runs/sweep
  python -m research.sweep --grid "muon_mvr[mode=mvr2]=1e-2" --tokens 409600 --train.model small
  python -m research.sweep ... --flops 3e13 --workers 2          # steps from the model's FLOPs; 2 processes
  python -m research.sweep --grid adamw=3e-4,3e-3 muon=3e-3,3e-2 --search --trials 8 --seeds 0 1 2 \
      --space weight_decay=linear:0:0.2 adamw:b2=beta:0.9:0.999 muon:beta=beta:0.8:0.98   # quasi-random search

A grid entry is `OPTIMIZER=LR,LR,...` or `OPTIMIZER[KEY=VALUE,...]=LRS` (hyperparameters as in `--opt`; the
bracketed form is also the contender's label). Every run is `research.train` with the shared `--train.*`
settings, in OUT/runs/<label>_lr<lr>_s<seed>/ (or --runs DIR/...; its config.json, metrics.jsonl and checkpoints
are kept): a finished run is skipped and an interrupted one resumes from its checkpoint, so rerunning the command
completes a grid.

Writes OUT/results.csv (one row per run: final and best val loss, steps to the target loss, tokens/s),
OUT/summary.md (per contender at its best lr: mean ± std over seeds, speedup), OUT/curves.png (val loss of each
contender at its best lr, mean and min–max over seeds) and OUT/lr.png (final val loss vs lr).

--search (research/search.py): each contender gets the same budget of --trials quasi-random points (a scrambled
Halton sequence, the same on every rerun) over its box — its lr log-uniform over its entry's lrs (or an lr dimension of
--space), and every --space dimension, for all contenders or prefixed CONTENDER: for one — at the first seed, in
OUT/runs/<label>_t<trial>_lr<lr>_s<seed>/; then its best trial at every other seed. summary.md names each best trial's
values and the dimensions it lies near an end of (the optimum may be outside the box). Interrupted, it resumes as a
grid does.

Speedup over the baseline = steps the baseline (at its best lr, mean curve over seeds) takes to reach its own
final loss / steps the contender's mean curve takes to reach that loss; steps between evaluations are linearly
interpolated, and a contender that never reaches it has no speedup (printed as "<1").
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Annotated

import numpy as np
import tyro

from research import entry, flags
from research.search import PREFIXED, SearchError, edge_flags, parse_dim, quasi_random, search_boxes
from research.train.command import USER_ERRORS
from research.train.config import NestedTrainConfig, TrainConfig
from research.train.store.rundir import read_records

_ENTRY = re.compile(r"^(\w+)(?:\[(.*)\])?=([^=\[\]]+)$")


class SweepError(ValueError):
  """A grid or budget that cannot run."""


def _grid_entry(entry: str):
  parse_grid([entry])


GRID_ENTRY = flags.Rule(parse=_grid_entry)  # OPTIMIZER[KEY=VALUE,...]=LRS (parse_grid's SweepError: a ValueError)
SPACE_ENTRY = flags.Rule(parse=lambda e: parse_dim(e.partition(":")[2] if PREFIXED.match(e) else e), empty=True)


@dataclasses.dataclass
class SweepConfig:
  """Optimizers × learning rates × seeds at one budget; resumable."""

  grid: Annotated[tuple[str, ...], GRID_ENTRY] = ("adamw=1e-3,3e-3", "muon=3e-3,1e-2")
  """Entries OPTIMIZER=LRS or OPTIMIZER[KEY=VALUE,...]=LRS."""
  seeds: tuple[int, ...] = (0,)
  tokens: int | None = None
  """Token budget per run (steps = tokens / (batch_size × seq_len)); default: --train.steps."""
  flops: Annotated[float | None, flags.POSITIVE] = None
  """FLOP budget per run, counted as model FLOPs (6·params + attention per token; optimizer work not counted)."""
  baseline: Annotated[str, flags.FREE] = "adamw"
  """The contender (label) speedups are measured against."""
  target_loss: float | None = None
  """Loss for the steps-to-target column (default: the baseline's final loss at its best lr)."""
  search: bool = False
  """Quasi-random search instead of the grid: --trials points per contender over --space (its lr over the entry's
  lrs' range unless --space gives one), at the first seed; then the best trial per contender at every other seed."""
  space: Annotated[tuple[str, ...], SPACE_ENTRY] = ()
  """Search dimensions [CONTENDER:]NAME=SCALE:LOW:HIGH (SCALE log, linear or beta; NAME lr, weight_decay, b1, b2 or
  an --opt key), for every contender or, prefixed, for one."""
  trials: Annotated[int, flags.COUNT] = 8
  """Trials per contender in --search: the same budget for each."""
  workers: Annotated[int, flags.COUNT] = 1
  """Runs at once, each in its own process (1 = in this process, one after another)."""
  out: Annotated[str, flags.OUT_DIR] = "runs/sweep"
  runs: Annotated[str | None, flags.OUT_DIR] = None
  """Where the run directories live (default OUT/runs); sweeps that share it share their finished runs."""
  train: NestedTrainConfig = dataclasses.field(default_factory=lambda: NestedTrainConfig(
      devices=1, mesh="data=1", progress=False, log_every=25, eval_every=25))
  """Settings shared by every run (--train.model, --train.batch-size, --train.mesh, ...)."""


@dataclasses.dataclass(frozen=True)
class Run:
  label: str
  optimizer: str
  opt: tuple[str, ...]
  lr: float
  seed: int
  trial: int | None = None  # --search: the trial's index
  values: tuple[tuple[str, float], ...] = ()  # --search: the trial's point but lr (also in `opt`, as the run takes it)

  @property
  def name(self) -> str:
    safe = re.sub(r"[^\w.=-]+", "-", self.label).strip("-")
    return f"{safe}{'' if self.trial is None else f'_t{self.trial}'}_lr{self.lr:g}_s{self.seed}"


def parse_grid(entries) -> list[tuple[str, str, tuple[str, ...], list[float]]]:
  """[(label, optimizer, opt KEY=VALUE items, lrs)] from the --grid entries; SweepError on a malformed one."""
  from optim import OPTIMIZERS
  out = []
  for e in entries:
    m = _ENTRY.match(e.strip())
    if not m:
      raise SweepError(f"grid entry {e!r} is not OPTIMIZER=LR,LR or OPTIMIZER[KEY=VALUE,...]=LR,LR")
    name, hp, lrs = m.groups()
    if name not in OPTIMIZERS:
      raise SweepError(f"grid entry {e!r}: unknown optimizer {name!r}; registered: {', '.join(sorted(OPTIMIZERS))}")
    opt = tuple(s.strip() for s in hp.split(",") if s.strip()) if hp else ()
    try:
      lr_values = [float(x) for x in lrs.split(",")]
    except ValueError:
      raise SweepError(f"grid entry {e!r}: learning rates must be numbers") from None
    if not lr_values or any(not (x > 0 and math.isfinite(x)) for x in lr_values):
      raise SweepError(f"grid entry {e!r}: learning rates must be positive")
    label = f"{name}[{','.join(opt)}]" if opt else name
    out.append((label, name, opt, lr_values))
  labels = [o[0] for o in out]
  if len(set(labels)) != len(labels):
    raise SweepError(f"grid names a contender twice: {labels}")
  return out


def budget_steps(cfg: SweepConfig) -> int:
  """Steps per run from --tokens, --flops or --train.steps."""
  tokens_per_step = cfg.train.training.batch_size * cfg.train.training.seq_len
  if cfg.tokens is not None and cfg.flops is not None:
    raise SweepError("give --tokens or --flops, not both")
  if cfg.tokens is not None:
    steps = cfg.tokens // tokens_per_step
  elif cfg.flops is not None:
    from models import flops_per_token
    from research.train.setup.build import model_config, optimizer_needs
    t = cfg.train
    mcfg = model_config(t.model, t.moe, t.weights.init_from, optimizer_needs(t.optim))
    steps = int(cfg.flops // (flops_per_token(mcfg, t.training.seq_len) * tokens_per_step))
  else:
    steps = cfg.train.training.steps
  if steps < 1:
    raise SweepError(f"the budget is less than one step of {tokens_per_step} tokens")
  return steps


def _run_one(train_kwargs: dict) -> None:
  """One training run; a run that diverges (research.train.steps.health stops it after --max-bad-steps non-finite steps)
  is recorded as diverged in its directory instead of ending the sweep."""
  from research.train.loop import run
  from research.train.steps.health import BadStepsError
  try:
    run(TrainConfig(**train_kwargs))
  except BadStepsError as e:
    with open(os.path.join(train_kwargs["out"], "diverged"), "w") as f:
      f.write(f"{e}\n")
    print(f"{os.path.basename(train_kwargs['out'])} diverged: {e}", file=sys.stderr)


def _records(path: str) -> list[dict]:
  """A run's metrics records (`rundir.read_records`: a last line a kill cut short is dropped); none before it logs."""
  return read_records(path)[0] if os.path.exists(path) else []


def _finished(run_dir: str, steps: int) -> bool:
  if os.path.exists(os.path.join(run_dir, "diverged")):
    return True
  recs = _records(os.path.join(run_dir, "metrics.jsonl"))
  return any(r["step"] == steps and "val_loss" in r for r in recs)


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
  """First step at which a val curve reaches `target`, interpolated linearly between evaluations."""
  prev = None
  for step, loss in curve:
    if loss <= target:
      if prev is None or prev[1] == loss:
        return float(step)
      (s0, l0) = prev
      return s0 + (step - s0) * (l0 - target) / (l0 - loss)
    prev = (step, loss)
  return None


def _mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
  steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
  return [(s, statistics.fmean(dict(c)[s] for c in curves)) for s in steps]


def run_grid(cfg: SweepConfig) -> list[dict]:
  """Runs what is missing, then returns one row per run (and writes the results); see the module docstring."""
  grid = parse_grid(cfg.grid)
  if cfg.baseline not in [g[0] for g in grid]:
    raise SweepError(f"--baseline {cfg.baseline!r} is not in the grid ({', '.join(g[0] for g in grid)})")
  if cfg.workers < 1:
    raise SweepError(f"--workers must be ≥ 1, got {cfg.workers}")
  steps = budget_steps(cfg)
  runs_dir = cfg.runs or os.path.join(cfg.out, "runs")
  base = cfg.train.flags()  # shallow: keeps nested configs
  base.update(steps=steps, stop_at=None)
  if base["eval_every"] > steps:
    base["eval_every"] = steps
  boxes = {}
  if cfg.search:
    boxes = search_boxes(cfg.space, {label: lrs for label, _, _, lrs in grid})
    runs = [Run(label, name, opt + _opt_items(point), point["lr"], cfg.seeds[0], i,
                tuple((k, v) for k, v in point.items() if k != "lr"))
            for label, name, opt, _ in grid for i, point in enumerate(quasi_random(boxes[label], cfg.trials))]
    _execute(cfg, runs, base, runs_dir, steps)
    best = {s["label"]: s for s in summarize(_rows(runs, runs_dir, steps), cfg.baseline, cfg.target_loss)[0]}
    runs += [dataclasses.replace(r, seed=seed) for r in runs for seed in cfg.seeds[1:]
             if r.label in best and r.trial == best[r.label]["trial"]]
  else:
    runs = [Run(label, name, opt, lr, seed) for seed in cfg.seeds for label, name, opt, lrs in grid for lr in lrs]
  _execute(cfg, runs, base, runs_dir, steps)
  rows = _rows(runs, runs_dir, steps)
  write_results(cfg, rows, boxes)
  return rows


def _opt_items(point: dict) -> tuple[str, ...]:
  """A trial's values but lr as --opt items (weight_decay, b1, b2 and optimizer keys alike: `opt_hparams`)."""
  return tuple(f"{k}={v!r}" for k, v in point.items() if k != "lr")


def _execute(cfg: SweepConfig, runs: list[Run], base: dict, runs_dir: str, steps: int):
  """Trains the runs that have not finished, one after another or in --workers processes."""
  todo = []
  for r in runs:
    kw = dict(base, optimizer=r.optimizer, lr=r.lr, seed=r.seed, opt=tuple(base["opt"]) + r.opt,
              out=os.path.join(runs_dir, r.name))
    if not _finished(kw["out"], steps):
      todo.append(kw)
  print(f"sweep: {len(runs)} runs of {steps} steps, {len(runs) - len(todo)} already finished", file=sys.stderr)
  if cfg.workers == 1:
    for i, kw in enumerate(todo):
      print(f"[{i + 1}/{len(todo)}] {os.path.basename(kw['out'])}", file=sys.stderr)
      _run_one(kw)
  else:
    with ProcessPoolExecutor(cfg.workers, mp_context=get_context("spawn")) as pool:
      for f in [pool.submit(_run_one, kw) for kw in todo]:
        f.result()


def _rows(runs: list[Run], runs_dir: str, steps: int) -> list[dict]:
  """One row per run from its directory: final and best val loss, tokens/s, the curve (or diverged)."""
  rows = []
  for r in runs:
    row = {"label": r.label, "optimizer": r.optimizer, "lr": r.lr, "seed": r.seed, "steps": steps, "trial": r.trial,
           "values": dict(r.values)}
    if os.path.exists(os.path.join(runs_dir, r.name, "diverged")):  # listed in results.csv, not ranked
      rows.append({**row, "final_val_loss": math.inf, "best_val_loss": math.inf, "tokens_per_s": math.nan,
                   "curve": [], "diverged": True})
      continue
    recs = _records(os.path.join(runs_dir, r.name, "metrics.jsonl"))
    evals = [(x["step"], x["val_loss"]) for x in recs if "val_loss" in x]
    speeds = [x["tokens_per_s"] for x in recs if "tokens_per_s" in x] or [math.nan]  # none before a whole step
    rows.append({**row, "final_val_loss": evals[-1][1], "best_val_loss": min(v for _, v in evals),
                 "tokens_per_s": statistics.median(speeds), "curve": evals})
  return rows


def summarize(rows: list[dict], baseline: str, target_loss: float | None = None) -> tuple[list[dict], float]:
  """Per contender at its best lr (lowest mean final val loss over seeds): mean/std, steps to target, speedup."""
  by = {}
  for r in rows:
    if r.get("diverged"):
      continue
    by.setdefault(r["label"], {}).setdefault((r["lr"], r.get("trial")), []).append(r)
  best = {}
  for label, lrs in by.items():
    key = min(lrs, key=lambda x: statistics.fmean(r["final_val_loss"] for r in lrs[x]))
    best[label] = (key, lrs[key])
  base_curve = _mean_curve([r["curve"] for r in best[baseline][1]])
  base_final = base_curve[-1][1]
  target = base_final if target_loss is None else target_loss
  base_steps = steps_to(base_curve, base_final)
  summary = []
  for label, ((lr, trial), rs) in best.items():
    finals = [r["final_val_loss"] for r in rs]
    curve = _mean_curve([r["curve"] for r in rs])
    reach = steps_to(curve, base_final)
    summary.append({"label": label, "best_lr": lr, "trial": trial, "values": rs[0].get("values", {}),
                    "seeds": len(rs), "final_mean": statistics.fmean(finals),
                    "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                    "best_val": min(r["best_val_loss"] for r in rs), "steps_to_target": steps_to(curve, target),
                    "speedup": base_steps / reach if reach else None,
                    "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rs), "curve": curve,
                    "spread": [(s, min(dict(r["curve"])[s] for r in rs), max(dict(r["curve"])[s] for r in rs))
                               for s, _ in curve]})
  summary.sort(key=lambda s: s["final_mean"])
  return summary, target


def write_results(cfg: SweepConfig, rows: list[dict], boxes: dict | None = None):
  """OUT/results.csv, summary.md and the plots; with --search (`boxes`: each contender's box) the best trial's values
  and the dimensions it sits near an end of."""
  os.makedirs(cfg.out, exist_ok=True)
  summary, target = summarize(rows, cfg.baseline, cfg.target_loss)
  for r in rows:
    r["steps_to_target"] = steps_to(r["curve"], target)
    r.setdefault("diverged", False)
  cols = ["label", "optimizer", "lr", "seed", "steps", "final_val_loss", "best_val_loss", "steps_to_target",
          "tokens_per_s", "diverged"] + (["trial", "values"] if boxes else [])
  with open(os.path.join(cfg.out, "results.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
  lines = [f"| contender | best lr | val loss (mean ± std, {summary[0]['seeds']} seed(s)) | best val | "
           f"steps to {target:.4f} | speedup vs {cfg.baseline} | tokens/s |", "|---|---|---|---|---|---|---|"]
  lines += [f"| {s['label']} | {s['best_lr']:g} | {s['final_mean']:.4f} ± {s['final_std']:.4f} | "
            f"{s['best_val']:.4f} | {fmt(s['steps_to_target'], '.0f')} | "
            f"{'<1' if s['speedup'] is None else format(s['speedup'], '.2f') + '×'} | {s['tokens_per_s']:.0f} |"
            for s in summary]
  settings = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in cfg.train.flags().items()
              if k not in ("out", "progress")}
  settings["steps"] = rows[0]["steps"]
  if boxes:
    lines += ["", f"Search: {cfg.trials} quasi-random trials per contender (scrambled Halton) at seed {cfg.seeds[0]}, "
              "then the best trial at every seed.", "", "| contender | box | best trial | its values | near the box's "
              "edge |", "|---|---|---|---|---|"]
    for s in summary:
      box = boxes[s["label"]]
      best = {"lr": s["best_lr"], **s["values"]}
      lines.append(f"| {s['label']} | {', '.join(f'{d.name} {d.scale} [{d.low:g}, {d.high:g}]' for d in box)} | "
                   f"{s['trial']} | {', '.join(f'{k}={v:.4g}' for k, v in best.items())} | "
                   f"{', '.join(edge_flags(box, best)) or '—'} |")
  with open(os.path.join(cfg.out, "summary.md"), "w") as f:
    f.write(f"Sweep at commit {commit}: grid {list(cfg.grid)}, seeds {list(cfg.seeds)}\n\n"
            f"Run settings: `{json.dumps(settings)}`\n\n" + "\n".join(lines) + "\n")
  print("\n".join(lines))
  _plots(cfg, rows, summary)


def draw_curves(ax, summary: list[dict]):
  """Val loss vs step of each contender at its best lr (`summarize`): the mean over seeds and a min–max band."""
  for s in summary:
    steps, losses = zip(*s["curve"])
    line, = ax.plot(steps, losses, label=f"{s['label']} (lr {s['best_lr']:g})")
    _, lo, hi = zip(*s["spread"])
    ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
  ax.set(xlabel="step", ylabel="validation loss (nats/byte)",
         title="each contender at its best lr (min–max over seeds)")
  ax.legend(fontsize=7)


def _plots(cfg: SweepConfig, rows: list[dict], summary: list[dict]):
  # Figure objects without pyplot: no backend is chosen or changed (a notebook keeps its inline one)
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6.5, 4))
  draw_curves(fig.subplots(), summary)
  fig.tight_layout()
  fig.savefig(os.path.join(cfg.out, "curves.png"), dpi=120)
  fig = Figure(figsize=(6.5, 4))
  ax = fig.subplots()
  ok = [r for r in rows if not r["diverged"]]
  for label in dict.fromkeys(r["label"] for r in ok):
    lrs = sorted({r["lr"] for r in ok if r["label"] == label})
    vals = [[r["final_val_loss"] for r in ok if r["label"] == label and r["lr"] == lr] for lr in lrs]
    ax.errorbar(lrs, [np.mean(v) for v in vals], yerr=[np.std(v) for v in vals], marker="o", capsize=3, label=label)
  ax.set(xscale="log", xlabel="peak learning rate", ylabel="final validation loss", title="final val loss vs lr")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(cfg.out, "lr.png"), dpi=120)


def main(argv=None):
  cfg = tyro.cli(SweepConfig, args=argv)
  with entry.one_line_errors(SweepError, SearchError, *USER_ERRORS):
    flags.check_config(cfg, skip=("train",))  # the runs' settings are the trainer's to check, as each starts
    run_grid(cfg)


if __name__ == "__main__":
  entry.command(main, interrupted="the runs that finished are kept; rerun the same command to go on")
