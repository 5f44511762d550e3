"""What the in-step diagnostics show: AdamW vs Muon vs NorMuon on `small`, read from inside the step.

Question: how big is each layer's update relative to its weights, how orthogonal is it, how sharp is the loss against
the edge of stability 2/lr, and how noisy is the gradient (the noise scale B_simple), for an elementwise optimizer and
two orthogonalizing ones at their tuned learning rates (research/results/optimizers: AdamW 1e-3, Muon 1e-2, NorMuon
3e-3)? And what does watching cost: the default run's throughput with observers off, --watch every 10 steps and
--sharpness-every 100 (on all 16 rows of the held batch, and on 4), side by side, each in a fresh process.

Each contender is one run of the train CLI (`research.train.run`) with --watch params,grads,updates every 10 steps,
--spectra-every 25, --sharpness-every 25 (10 power iterations on 8 held-out rows) and --gns-every 10 (2 groups); the
run directories under OUT/runs resume when interrupted (rerun the same command). The cost runs are the default run
(`make run`'s config) at --steps 200 and --log-every 1, four times (`COST`), each measured afresh in a child process:
tokens/s over the run (the observed steps included, the compilation of their programs not), each observed step's
extra time in plain steps (its step time over the median plain step's, less one), the process's peak RSS.

  python -m research.experiments.diagnostics           # full size: writes research/results/diagnostics/
  python -m research.experiments.diagnostics --smoke   # seconds; writes nothing (the tests run this)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np

from research.bench.report import run_child
from research.experiments import common
from research.train import TrainConfig, run

NAME = "diagnostics"
CONTENDERS = {"adamw": 1e-3, "muon": 1e-2, "normuon": 3e-3}
OBSERVERS = dict(watch=("params,grads,updates",), watch_every=10, spectra_every=25, sharpness_every=25,
                 sharpness_iters=10, sharpness_rows=8, gns_every=10, gns_groups=2)
SMOKE_CONTENDERS = ("adamw", "muon")
COST = {"off": [], "watch every 10": ["--watch", "params,grads,updates", "--watch-every", "10"],
        "sharpness every 100, all 16 rows": ["--sharpness-every", "100", "--sharpness-rows", "16"],
        "sharpness every 100, 4 rows (the default)": ["--sharpness-every", "100", "--sharpness-rows", "4"]}
"""The cost runs: the default run (`make run`'s config) with these flags, each in a fresh process."""


@dataclasses.dataclass
class Config(common.Base):
  """What the in-step diagnostics show for AdamW, Muon and NorMuon, and what watching costs."""
  smoke: bool = False
  """The tiny model for a few steps into a temporary directory: seconds, writes nothing here."""
  out: str = "research/results/diagnostics"
  """Where results.md, results.json, the plots and the run directories go."""
  steps: int = 200
  """Steps per contender (the default run's length)."""
  cost_steps: int = 200
  """Steps of each cost run (the default run's length)."""
  cost: bool = True
  """Measure the observers' cost (--no-cost: the contenders' record alone)."""


def _train(cfg: Config, out: str, name: str, lr: float, **observe) -> list[dict]:
  size = dict(model="tiny", n_layers=2, batch_size=8, seq_len=32, eval_batches=1, mesh="data=2,fsdp=2,tensor=2") \
      if cfg.smoke else dict(model="small")
  steps = 4 if cfg.smoke else cfg.steps
  if cfg.smoke:  # every observer within the 4 steps, sharpness once and cheap (its program is the slowest to compile)
    observe = {**observe, "watch_every": 2, "spectra_every": 2, "gns_every": 2, "sharpness_every": 4,
               "sharpness_iters": 2, "sharpness_rows": 4}
  return run(TrainConfig(out=os.path.join(out, "runs", name), optimizer=name.split("-")[0], lr=lr, steps=steps,
                         log_every=10, eval_every=25 if not cfg.smoke else 2, progress=False, tracker=("none",),
                         **size, **observe))


def _series(records: list[dict], key: str) -> tuple[list[int], list]:
  got = [(r["step"], r[key]) for r in records if key in r]
  return [s for s, _ in got], [v for _, v in got]


def _matrix_mean(record: dict, prefix: str) -> float:
  """The mean over the hidden matrices (and their layers) of a per-layer metric."""
  vals = [np.mean(v) for k, v in record.items() if k.startswith(prefix + "/blocks/") and isinstance(v, list)
          and not k.endswith(("norm", "_norm_D", "norm_D"))]
  return float(np.mean(vals)) if vals else float("nan")


def summarize(name: str, records: list[dict], lr: float) -> dict:
  """One contender's numbers: final validation loss, update RMS / lr and ||dW||/||W|| of the hidden matrices, the
  update spectra, sharpness against 2/lr and the noise scale, early and late."""
  watched = [r for r in records if any(k.startswith("watch/") for k in r)]
  spec = [r for r in records if any(k.startswith("spectra/") for k in r)]
  sharp = [r for r in records if "sharpness/lambda_max" in r]
  gns = [r for r in records if "gns/b_simple_ema" in r]
  pick = lambda rs: (rs[0], rs[len(rs) // 2], rs[-1]) if rs else ()
  row = {"name": name, "lr": lr, "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-1]}
  for tag, r in zip(("early", "mid", "late"), pick(watched)):
    row[f"update_rms_over_lr_{tag}"] = _matrix_mean(r, "watch/updates/rms") / max(r["lr"], 1e-12)
    row[f"relative_update_{tag}"] = _matrix_mean(r, "watch/relative_update")
    row[f"step_{tag}"] = r["step"]
  for tag, r in zip(("early", "mid", "late"), pick(spec)):
    row[f"orthogonality_error_{tag}"] = _matrix_mean(r, "spectra/updates/orthogonality_error")
    sv = [np.asarray(v) for k, v in r.items() if k.startswith("spectra/updates/sv_quantiles/")]
    row[f"sv_max_over_median_{tag}"] = float(np.mean([np.mean(a[..., -1] / np.maximum(a[..., 2], 1e-30))
                                                      for a in sv])) if sv else float("nan")
  for tag, r in zip(("early", "mid", "late"), pick(sharp)):
    row[f"lambda_max_{tag}"] = r["sharpness/lambda_max"]
    row[f"two_over_lr_{tag}"] = 2 / max(r["lr"], 1e-12)
    row[f"overlap_{tag}"] = r["sharpness/overlap"]
  for tag, r in zip(("early", "mid", "late"), pick(gns)):
    row[f"b_simple_{tag}"] = r["gns/b_simple_ema"]
  return row


def _plots(out: str, runs: dict[str, list[dict]]) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from research.plot import heatmap
  made = []
  fig, axes = plt.subplots(1, 4, figsize=(20, 4))
  for name, recs in runs.items():
    s, lam = _series(recs, "sharpness/lambda_max")
    line, = axes[0].plot(s, lam, "o-", label=f"{name} λ_max")
    s2, lr = _series([r for r in recs if "sharpness/lambda_max" in r], "lr")
    axes[0].plot(s2, [2 / max(v, 1e-12) for v in lr], "--", color=line.get_color(), label=f"{name} 2/lr")
    s, b = _series(recs, "gns/b_simple_ema")
    axes[1].plot(s, b, label=name)
    watched = [r for r in recs if any(k.startswith("watch/updates/rms/") for k in r)]
    axes[2].plot([r["step"] for r in watched], [_matrix_mean(r, "watch/relative_update") for r in watched],
                 label=name)
    spec = [r for r in recs if any(k.startswith("spectra/") for k in r)]
    axes[3].plot([r["step"] for r in spec], [_matrix_mean(r, "spectra/updates/orthogonality_error") for r in spec],
                 label=name)
  for ax, title, log in zip(axes, ("top Hessian eigenvalue vs 2/lr (held batch)", "noise scale B_simple (EMA)",
                                   "||dW||/||W||, hidden matrices (mean)", "update orthogonality error (mean)"),
                            (True, True, True, False)):
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    if log:
      ax.set_yscale("log")
    ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out, "diagnostics.png")
  fig.savefig(path, dpi=90)
  plt.close(fig)
  made.append(path)
  for name, recs in runs.items():
    for prefix in ("watch/relative_update", "watch/updates/rms"):
      made.append(heatmap(recs, prefix, os.path.join(out, f"heatmap_{name}_{prefix.replace('/', '_')}.png"), name))
  return made


def _cost_run(cfg: Config, out: str, label: str, extra: list[str]) -> dict:
  """One cost run in a fresh process (its peak RSS its own): the run's tokens/s (every step, the observers' included,
  their programs' compilation not), the plain steps' median seconds, and the observed steps' extra seconds each."""
  run_dir = os.path.join(out, "runs", "cost-" + re.sub(r"[^\w]+", "-", label))
  if os.path.exists(run_dir):  # measured again, never resumed (a resumed run's throughput is another run's)
    shutil.rmtree(run_dir)
  code, rss, _, err, wall = run_child([sys.executable, "-m", "research.train", "--steps", str(cfg.cost_steps),
                                      "--log-every", "1", "--no-progress", "--tracker", "none", "--out", run_dir,
                                      *extra], os.path.join(out, "runs", "cost-logs", label.replace(" ", "-")))
  if code:
    raise RuntimeError(f"cost run {label!r} failed: {err[-2000:]}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  tokens = recs[-1]["run_tokens_per_s"]
  per_step = {r["step"]: 1 / r["tokens_per_s"] for r in recs if "tokens_per_s" in r}  # seconds per token
  observed = sorted(s for r in recs for s in [r["step"]] if any(k.startswith(("watch/", "sharpness/")) for k in r))
  plain = float(np.median([v for s, v in per_step.items() if s not in observed]))
  extra_s = [(per_step[s] - plain) / plain for s in observed if s in per_step]  # in plain steps
  return {"tokens_per_s": tokens, "observed_steps": observed, "extra_plain_steps": extra_s, "peak_rss": rss,
          "wall_s": wall}


def main(cfg: Config) -> dict:
  out = tempfile.mkdtemp() if cfg.smoke else cfg.out
  contenders = {k: CONTENDERS[k] for k in SMOKE_CONTENDERS} if cfg.smoke else CONTENDERS
  runs = {name: _train(cfg, out, name, lr, **OBSERVERS) for name, lr in contenders.items()}
  rows = [summarize(name, recs, CONTENDERS[name]) for name, recs in runs.items()]
  cost = {label: _cost_run(cfg, out, label, extra) for label, extra in COST.items()} \
      if cfg.cost and not cfg.smoke else {}
  result = {"rows": rows, "cost": cost}
  if cfg.smoke:
    return result
  plots = _plots(out, runs)
  table = ["| optimizer | lr | val loss | update RMS / lr (early, mid, late) | ‖ΔW‖/‖W‖ (early, late) | "
           "orthogonality error (early, late) | σ_max/σ_median of the update (late) | λ_max (early, late) | "
           "2/lr (late) | overlap with top eigenvector (late) | B_simple EMA, sequences (early, late) |",
           "|" + "---|" * 11]
  f = lambda v: f"{v:.3g}"
  for r in rows:
    table.append(f"| {r['name']} | {r['lr']:g} | {r['val_loss']:.4f} | {f(r['update_rms_over_lr_early'])}, "
                 f"{f(r['update_rms_over_lr_mid'])}, {f(r['update_rms_over_lr_late'])} | "
                 f"{f(r['relative_update_early'])}, {f(r['relative_update_late'])} | "
                 f"{f(r['orthogonality_error_early'])}, {f(r['orthogonality_error_late'])} | "
                 f"{f(r['sv_max_over_median_late'])} | {f(r['lambda_max_early'])}, {f(r['lambda_max_late'])} | "
                 f"{f(r['two_over_lr_late'])} | {f(r['overlap_late'])} | {f(r['b_simple_early'])}, "
                 f"{f(r['b_simple_late'])} |")
  if cost:
    base = cost["off"]["tokens_per_s"]
    table += ["", f"| default run ({cfg.cost_steps} steps, a fresh process each) | tokens/s | vs off | an observed "
              "step's extra time, in plain steps (median) | process peak RSS |", "|---|---|---|---|---|"]
    table += [f"| {k} | {v['tokens_per_s']:.0f} | {v['tokens_per_s'] / base:.3f} | "
              f"{np.median(v['extra_plain_steps']) if v['extra_plain_steps'] else float('nan'):.2g} | "
              f"{v['peak_rss'] / 2**30:.2f} GiB |" for k, v in cost.items()]
  common.write_results(out, "In-step diagnostics: AdamW, Muon, NorMuon", __doc__.split("\n\n")[1], table,
                       settings={"steps": cfg.steps, "observers": OBSERVERS, "lrs": CONTENDERS},
                       data={**result, "plots": [os.path.basename(p) for p in plots]})
  return result


if __name__ == "__main__":
  common.cli(main, Config)
