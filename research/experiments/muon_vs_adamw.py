"""Does Muon reach a lower validation loss than AdamW on the `small` preset at equal steps, each at
its best learning rate from a small grid?

  python -m research.experiments.muon_vs_adamw                 # full: writes research/results/muon_vs_adamw/
  python -m research.experiments.muon_vs_adamw --smoke         # seconds: the tests run this

Both use the train CLI's defaults otherwise (cosine schedule, 10% warmup, clip 1.0, weight decay
0.1, same seed, data, batches and mesh). Muon uses Moonlight scaling, so its lr lives on AdamW's
scale; its non-matrix parameters use AdamW at the same lr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile

import tyro

from research.train import TrainConfig, run


@dataclasses.dataclass
class Config:
  smoke: bool = False
  steps: int = 200
  seeds: tuple[int, ...] = (0,)
  adamw_lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3, 1e-2)
  muon_lrs: tuple[float, ...] = (3e-3, 1e-2, 3e-2)
  out: str = "research/results/muon_vs_adamw"


def main(cfg: Config) -> list[dict]:
  # One device: the question is the optimizers' progress per step, not a layout (on 8 simulated CPU devices
  # every device would repeat Muon's Newton-Schulz work until it is distributed).
  base = dict(model="small", steps=cfg.steps, eval_every=cfg.steps // 4, progress=False, log_every=cfg.steps // 4,
              devices=1, mesh="data=1")
  grid = [("adamw", lr) for lr in cfg.adamw_lrs] + [("muon", lr) for lr in cfg.muon_lrs]
  if cfg.smoke:
    base = dict(model="tiny", steps=6, batch_size=8, seq_len=32, eval_every=3, log_every=3, eval_batches=2,
                progress=False)
    grid = [("adamw", 3e-3), ("muon", 1e-2)]
  rows = []
  done = os.path.join(cfg.out, "results.json")
  if not cfg.smoke and os.path.exists(done):  # resumable: finished (optimizer, lr, seed) runs are kept
    with open(done) as f:
      rows = [r for r in json.load(f)["runs"] if r["seed"] in cfg.seeds]
  with tempfile.TemporaryDirectory() as tmp:
    for seed in cfg.seeds:
      for name, lr in grid:
        if any((r["optimizer"], r["lr"], r["seed"]) == (name, lr, seed) for r in rows):
          continue
        records = run(TrainConfig(optimizer=name, lr=lr, seed=seed, out=os.path.join(tmp, f"{name}-{lr}-{seed}"),
                                  **base))
        evals = [r for r in records if "val_loss" in r]
        rows.append({"optimizer": name, "lr": lr, "seed": seed, "final_val_loss": evals[-1]["val_loss"],
                     "val_curve": [(r["step"], r["val_loss"]) for r in evals],
                     "tokens_per_s": records[-1]["tokens_per_s"]})
        if not cfg.smoke:
          write(cfg, rows, base)  # after every run, so an interrupted grid resumes
  return rows


def write(cfg: Config, rows: list[dict], base: dict):
  os.makedirs(cfg.out, exist_ok=True)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  best = {}
  for r in rows:
    if r["optimizer"] not in best or r["final_val_loss"] < best[r["optimizer"]]["final_val_loss"]:
      best[r["optimizer"]] = r
  rows = sorted(rows, key=lambda r: (r["optimizer"], r["lr"], r["seed"]))
  lines = ["| optimizer | lr | seed | final val loss | tokens/s |", "|---|---|---|---|---|"]
  lines += [f"| {r['optimizer']} | {r['lr']:g} | {r['seed']} | {r['final_val_loss']:.4f} | {r['tokens_per_s']:.0f} |"
            for r in rows]
  lines += ["", "Best per optimizer: " + ", ".join(f"{k} lr {v['lr']:g} -> {v['final_val_loss']:.4f}"
                                                   for k, v in best.items())]
  with open(os.path.join(cfg.out, "results.md"), "w") as f:
    f.write(f"Command: `python -m research.experiments.muon_vs_adamw` (commit {commit}); "
            f"run settings {json.dumps(base)}\n\n" + "\n".join(lines) + "\n")
  with open(os.path.join(cfg.out, "results.json"), "w") as f:
    json.dump({"commit": commit, "settings": base, "runs": rows}, f, indent=1)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for r in rows:
    steps, losses = zip(*r["val_curve"])
    is_best = r is best[r["optimizer"]]
    ax.plot(steps, losses, ("-" if r["optimizer"] == "muon" else "--"), alpha=1.0 if is_best else 0.3,
            label=f"{r['optimizer']} lr={r['lr']:g}")
  ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title="small preset: Muon vs AdamW")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(cfg.out, "val_loss.png"), dpi=120)
  print("\n".join(lines))


if __name__ == "__main__":
  main(tyro.cli(Config))
