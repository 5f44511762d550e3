"""Tuning an MoE on a mixture of corpora: do dynamic sampling weights, moved by the router's view of each corpus,
beat fixed uniform or size-proportional weights on the corpora's held-out losses?

  python -m research.experiments.data_mixing            # full: writes research/results/data_mixing/
  python -m research.experiments.data_mixing --smoke    # seconds: what the tests and the notebook run

Claim (Zhu, Dong, Qu, Ruan, Chen, Cheng, "Dynamic Data Mixing Maximizes Instruction Tuning for Mixture-of-Experts",
NAACL 2025, arXiv 2406.11256; code Spico197/MoE-SFT): updating the datasets' sampling weights during MoE instruction
tuning from the router's per-dataset expert loads (Algorithm 1: w ← (1 − c)·softmax(log w + ηΔ) + c/|D|, Δ_i the mean
L2 distance of dataset i's loads to the others') improves downstream results over fixed weights at equal budget, on
LLaMA-MoE-3.5B and MoLM with four instruction datasets, 2,000 steps.

Setup (ours: byte-level, ~10^5 tokens, held-out loss instead of downstream tasks):
  a dense `model` (`small` by default) pretrained with the train CLI for `pretrain_steps` steps on the stdlib corpus,
  upcycled into a top-2-of-8 MoE (models.upcycle, random split, LLaMA-MoE's way), then tuned T = `steps` steps on a
  mixture of three corpora: stdlib (Python source, what it was pretrained on), docs (package descriptions:
  `research.data.docs_corpus`) and licenses (the license texts of the same packages: legal prose that repeats itself
  across packages, `docs_corpus.build(kind="licenses")`), with the weights
    uniform:  1/3 each;
    size:     proportional to each corpus's training bytes (the usual concatenation);
    dynamic:  uniform at first, then the paper's rule every `every` steps from the last MoE layer's loads on
              `score_batches` held-out batches per corpus, η = 10, c = 0.05 (the code's defaults).
  Rows are drawn per step from the weights in force (research/data/mixture.py, the trainer's `--mix` sampler).
Honest means: each corpus's held-out split (held-out files / packages), its loss after T steps and their plain mean,
3 seeds with mean ± std and per-seed differences to `uniform`, equal steps and tokens for every arm, the peak lr per
arm picked from `lrs` on seed 0 by the mean held-out loss (grid edges flagged), the weights' trajectory reported.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
from flax import nnx

from models import upcycle
from research.data import docs_corpus, eval_batches, load_corpus
from research.data.loader import Loader
from research.data.mixture import Mixture, dynamic_update, parse_mix
from research.experiments import common
from research.train.config import TrainConfig
from research.train.hooks.source_weights import router_loads, source_loads
from research.train.store.pretrained import load_run

NAME = "data_mixing"
SOURCES = ("stdlib", "docs", "licenses")
RULES = {"uniform": "uniform", "size": "size", "dynamic": "dynamic"}
SMOKE = dict(model="tiny", n_layers=1, seeds=(0,), pretrain_steps=4, steps=4, every=2, batch_size=8, seq_len=32,
             lrs=(3e-3,), eval_batches=1, score_batches=1)


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/data_mixing"
  work: str = "runs/experiments/data_mixing"
  """The pretraining run directory (reused by a rerun)."""
  model: str = "small"
  n_layers: int | None = None
  seeds: tuple[int, ...] = (0, 1, 2)
  pretrain_steps: int = 600
  pretrain_lr: float = 3e-3
  steps: int = 200
  """T: every arm's tuning steps on the mixture."""
  every: int = 25
  """The dynamic rule's period (the code's: 100 of 2,000 steps; here 8 updates in 200)."""
  score_batches: int = 2
  batch_size: int = 16
  seq_len: int = 64
  num_experts: int = 8
  top_k: int = 2
  lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
  eval_batches: int = 4


def corpora() -> dict:
  return {"stdlib": load_corpus(), "docs": load_corpus(docs_corpus.build()),
          "licenses": load_corpus(docs_corpus.build(kind="licenses"))}


def pretrained(cfg: Config, work: str):
  """The dense model pretrained by the train CLI on the stdlib corpus (trained here unless a finished run is there)."""
  tc = TrainConfig(model=cfg.model, n_layers=cfg.n_layers, steps=cfg.pretrain_steps, batch_size=cfg.batch_size,
                   seq_len=cfg.seq_len, devices=1, mesh="data=-1", progress=False, keep=1,
                   ckpt_every=cfg.pretrain_steps, eval_every=max(cfg.pretrain_steps // 4, 1), tracker=("none",))
  return load_run(common.pretrained_run(os.path.join(work, "pretrain"), tc, cfg.pretrain_lr))[0]


def tune(moe, rule: str, lr: float, seed: int, data: dict, val: dict, cfg: Config) -> dict:
  """The upcycled MoE tuned T steps on the mixture under `rule`: per-corpus held-out losses, the weights' history."""
  spec = parse_mix(rule, SOURCES)
  loaders = {n: Loader(c.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed, sampling="random",
                       workers=0) for n, c in data.items()}
  mixture = Mixture(loaders, seed=seed, weights=spec.initial({n: len(c.train) for n, c in data.items()}))
  loads = router_loads(nnx.graphdef(moe))
  tx, model, opt_state, records = common.phase_optimizer(lr, cfg.steps), moe, None, []
  period = cfg.every if spec.rule == "dynamic" else cfg.steps
  for start in range(0, cfg.steps, period):
    f = common.fit(model, tx, None, steps=min(period, cfg.steps - start), start=start, opt_state=opt_state,
                   batch_fn=lambda t: mixture.batch(t)[:2], seed=seed)
    model, opt_state, records = f.model, f.opt_state, records + f.records
    if spec.rule == "dynamic" and start + period < cfg.steps:
      _, params, buffers = common.split(model)
      o = source_loads(loads, params, buffers, [val[n] for n in SOURCES], cfg.score_batches)
      mixture.set_weights(start + period, dynamic_update(mixture.weights(start + period - 1), o, spec.eta, spec.c))
  held = {n: common.evaluate(model, val[n]) for n in SOURCES}
  return {"held_out": held, "final": float(np.mean(list(held.values()))), "train_tail": common.train_tail(records),
          "weights": [[s, w.tolist()] for s, w in mixture.segments]}


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  if cfg.smoke:
    cfg = dataclasses.replace(cfg, **SMOKE)
  if cfg.every < 1 or cfg.steps < 1 or not cfg.seeds or not cfg.lrs:
    raise ValueError("data_mixing needs every, steps >= 1, a seed and an lr")
  import tempfile
  data = corpora()
  val = {n: eval_batches(c.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches) for n, c in data.items()}
  with tempfile.TemporaryDirectory(prefix="optlab-data-mixing-") as tmp:
    dense = pretrained(cfg, tmp if cfg.smoke else cfg.work)
  start = {n: common.evaluate(dense, val[n]) for n in SOURCES}

  def one_seed(seed, tune_grid, chosen):
    moe = upcycle(dense, cfg.num_experts, cfg.top_k, "random", seed=seed)
    run = {"upcycled": {n: common.evaluate(moe, val[n]) for n in SOURCES}, "arms": {}}
    for arm, rule in RULES.items():
      results = {}

      def fit_at(lr):
        results[lr] = tune(moe, rule, lr, seed, data, val, cfg)
        return common.Fit(None, None, [{"step": cfg.steps, "val_loss": results[lr]["final"]}])

      common.tuned_fit(arm, fit_at, cfg.lrs, seed == cfg.seeds[0], tune_grid, chosen)
      run["arms"][arm] = {"lr": chosen[arm], **results[chosen[arm]]}
    return run

  done = common.run_seeds(cfg, one_seed)
  result = {"config": dataclasses.asdict(cfg), "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
            "corpora": {n: {"source": c.source, "train_bytes": int(len(c.train)), "val_bytes": int(len(c.val))}
                        for n, c in data.items()},
            "dense": start, "tune": {a: {str(lr): v for lr, v in t.items()} for a, t in done.tune.items()},
            "lr": done.chosen, "seeds": {s: done.runs[s] for s in cfg.seeds},
            "timing": {"wall_s": done.wall_s, "cpu_s": time.process_time()}}
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


stat = common.seed_stat


def _held_out(n: str):
  return lambda r: r["held_out"][n]


def tables(result: dict) -> list[str]:
  seeds = list(result["seeds"])
  c = result["corpora"]
  vs = common.against(result, "uniform", arms=RULES)
  rows = []
  for arm in RULES:
    w = result["seeds"][seeds[0]]["arms"][arm]["weights"][-1][1]
    rows.append([arm, f"{result['lr'][arm]:g}", *(common.pm(stat(result, arm, _held_out(n))) for n in SOURCES),
                 common.pm(stat(result, arm)), common.delta_cell(vs, arm),
                 ", ".join(f"{n} {x:.3f}" for n, x in zip(SOURCES, w))])
  lines = ["Corpora (train / held-out bytes): " + ", ".join(f"{n} {c[n]['train_bytes']:,} / {c[n]['val_bytes']:,}"
                                                            for n in SOURCES)
           + f". Every arm: {result['config']['steps']} steps = {result['tokens']:,} tokens from the same upcycled "
           f"MoE. The dense model before upcycling: " + ", ".join(f"{n} {v:.4f}" for n, v in result["dense"].items())
           + f". Seeds {', '.join(map(str, seeds))}; mean ± std; Δ = per-seed difference to uniform.", "",
           *common.table(["weights", "lr", *(f"{n} held-out" for n in SOURCES), "mean", "Δ mean vs uniform",
                          f"final weights (seed {seeds[0]})"], rows)]
  lines += common.lr_grid_table(result["tune"], str, f"lr grid (seed {seeds[0]}, mean held-out loss):")
  return lines + common.timing_lines(result)


def findings(result: dict) -> list[str]:
  said = {"level": "within 2 std", "lower": "lower", "higher": "higher"}
  per = {n: common.against(result, "uniform", _held_out(n), ("size", "dynamic")) for n in SOURCES}
  return [f"Reading: {arm} − uniform, mean held-out loss {v.pm()} ({said[v.verdict]}); per corpus: "
          + ", ".join(f"{n} {per[n][arm].pm()}" for n in SOURCES) + "."
          for arm, v in common.against(result, "uniform", arms=("size", "dynamic")).items()]


def plot(result: dict):
  import matplotlib.pyplot as plt
  seeds = list(result["seeds"].values())
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  x = np.arange(len(SOURCES))
  for i, arm in enumerate(RULES):
    m = [stat(result, arm, lambda r, n=n: r["held_out"][n]) for n in SOURCES]
    axes[0].bar(x + 0.25 * (i - 1), [v[0] for v in m], 0.25, yerr=[v[1] for v in m], label=arm)
  axes[0].set_xticks(x, SOURCES)
  axes[0].set(ylabel="held-out loss after T (nats/byte)", title=f"per corpus ({len(seeds)} seeds)")
  axes[0].legend(fontsize=8)
  for s in seeds:
    steps = [p[0] for p in s["arms"]["dynamic"]["weights"]]
    w = np.array([p[1] for p in s["arms"]["dynamic"]["weights"]])
    for j, n in enumerate(SOURCES):
      axes[1].step(steps, w[:, j], where="post", color=f"C{j}", alpha=0.6, label=n if s is seeds[0] else None)
  axes[1].set(xlabel="step", ylabel="weight", title="dynamic weights (each seed)")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict):
  common.write_experiment(cfg, NAME, __doc__.split("\n\n")[0], result, tables, findings, plot)


if __name__ == "__main__":
  common.cli(main, Config, cache="optlab-data-mixing-cache-")
