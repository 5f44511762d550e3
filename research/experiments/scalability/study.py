"""Does the data bound how far parallel training scales? Cheng et al. ("The Scalability for Parallel Machine Learning
Training Algorithm: Dataset Matters", arXiv 1910.11510; shared/reference/methods.md §9) argue that a dataset's
characters (feature variance, sparsity, diversity, similarity along the sampling order) set each parallel
algorithm's scalability ceiling. Here four algorithms of the train CLI's --sync run with W ∈ {1, 2, 4, 8} workers on
datasets built to differ in those characters, and the speedup each reaches is set beside what the characters (and
the gradient noise scale they feed) predict.

Algorithms (research/train/steps/sync.py; every worker takes `batch` samples a step, so W workers see W times the data):
  allreduce   synchronous mini-batch SGD: the mean gradient of W·batch samples every step
  local       local SGD / model averaging (the paper's model-averaging mini-batch SGD): H = `local_period` steps
              apart, the replicas' parameters are replaced by their mean (LM: --outer-lr 1 --outer-momentum 0)
  gossip      decentralized SGD on a ring
  stale       W asynchronous workers, simulated: each gradient taken at parameters up to W − 1 steps old (a random
              delay per worker and step), the staleness W workers updating one copy in turn would see (Hogwild!'s
              setting), the delayed gradients averaged synchronously (delayed SGD)
  diloco      (LM, `diloco_datasets` only) local SGD with DiLoCo's outer Nesterov step on the averaged delta (lr 0.7,
              momentum 0.9, the paper's values, untuned). A first pass ran it as the LM's `local`: over 256 steps
              (32 outer steps) it never reached the 1-worker target at any W, while plain averaging did (W = 4, lr
              3e-3: 2.206 vs 2.441 for DiLoCo's tuned lr); DiLoCo's regime is hundreds of inner steps per round and
              many rounds, so it is kept as its own row (and swept over H beside averaging)

Speedup(W) = (steps W = 1 needs to reach the target held-out loss) / (steps W workers need), the target being the
worst final held-out loss of W = 1 over the seeds (so every W = 1 seed reaches it); steps between evaluations are
interpolated linearly; a run that never reaches it has no speedup ("—"). The bytes each run's replicas sent each other
until then come from the compiled programs (comm_bytes_replicas). The learning rate is tuned per (dataset, algorithm,
W) on `tune_seed` (not one of the reported seeds) over `*_lrs` by the final held-out loss (the LM's per (algorithm,
W) on `stdlib` only, and reused: its grid costs most; where the best sits on the grid's end, one more lr past it
(`extend_edge`)), a best still at an edge flagged; then `seeds` seeds. Held-out data: a fixed
20% of the images (convex), the stdlib corpus's val split (LM, every dataset: the same questions for all).

Predicted speedup of synchronous SGD (McCandlish et al. 2018): steps(B) ≈ S_min (1 + B_noise / B), so
speedup(W) ≈ (1 + B_noise/b) / (1 + B_noise/(W b)), with B_noise = tr Σ / ‖G‖² of per-sample gradients at the
W = 1 run's final parameters (research/data/datastats.py `gradient_stats`) and b the per-worker batch.

Parts:
  convex  multinomial logistic regression on scikit-learn's digits, plain SGD (research/experiments/
          scalability/convex.py): variants shuffled, sorted (by class, read in order), repeated (a tenth of the images
          ×10), binary (thresholded pixels)
  lm      the `tiny` transformer on bytes: stdlib (random windows), sequential (the same corpus read in order:
          --sampling sequential), repeated (a tenth of the training text, in chunks of 4 KiB, ×10), mixed (half the
          training text replaced by the package-description corpus); AdamW; each run a CLI process with W
          devices on mesh data=W, so every collective is between workers
  sweep   H ∈ `h_sweep` on the LM with W = `h_workers`, for DiLoCo's outer step and for plain averaging, each at its
          tuned lr: bytes between replicas against held-out loss

  python -m research.experiments.scalability            # full size: writes research/results/scalability/
  python -m research.experiments.scalability --smoke    # a minute; writes nothing (the tests run this)
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Annotated

import numpy as np

from research import flags
from research.data import datastats, get_batch, load_corpus
from research.experiments import common
from research.experiments.scalability import convex as cv
from research.experiments.scalability import report

NAME = "scalability"
QUESTION = ("Do a dataset's characters (feature variance, sparsity, diversity, similarity along the sampling order) "
            "predict how far synchronous SGD, local SGD / DiLoCo, gossip and stale-gradient SGD scale with the number "
            "of workers, and what does DiLoCo's sync period H trade between communication and loss?")
ALGORITHMS = ("allreduce", "local", "gossip", "stale")
LM_ALGORITHMS = ALGORITHMS + ("diloco",)
AVERAGING = {"outer_lr": 1.0, "outer_momentum": 0.0}
"""The `local` algorithm's outer step on the LM: the averaged parameters replace every replica's."""
LM_DATASETS = ("stdlib", "sequential", "repeated", "mixed")
CHUNK = 4096  # bytes per repeated chunk of the `repeated` LM dataset


@dataclasses.dataclass
class Config(common.Base):
  """Every algorithm × worker count × dataset, tuned and seeded; DiLoCo's H sweep."""
  smoke: bool = False
  """Two workers at most, a few steps, one seed, in a temporary directory: nothing written to `out`."""
  out: str = "research/results/scalability"
  work: str = "runs/experiments/scalability"
  """LM run directories and datasets (a finished run is reused)."""
  workers: Annotated[tuple[int, ...], flags.Rule(choices=(1, 2, 4, 8))] = (1, 2, 4, 8)  # data-parallel: divide 8
  algorithms: Annotated[tuple[str, ...], flags.one_of(*ALGORITHMS)] = ALGORITHMS
  seeds: tuple[int, ...] = (0, 1, 2)
  tune_seed: int = 100
  """The seed the learning rates are tuned on (not one of `seeds`: the reported runs are not the grid's best draw)."""
  local_period: int = 8
  """H of the `local` algorithm."""
  convex_variants: Annotated[tuple[str, ...], flags.one_of(*cv.VARIANTS)] = cv.VARIANTS
  convex_steps: int = 400
  convex_batch: int = 8
  convex_lrs: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0)
  convex_eval: int = 8
  lm_datasets: Annotated[tuple[str, ...], flags.one_of(*LM_DATASETS)] = LM_DATASETS
  lm_algorithms: Annotated[tuple[str, ...], flags.one_of(*LM_ALGORITHMS)] = LM_ALGORITHMS
  diloco_datasets: Annotated[tuple[str, ...], flags.one_of(*LM_DATASETS)] = ("stdlib",)
  """The LM datasets `diloco` runs on (its 1-worker target and characters are those of the same dataset)."""
  lm_steps: int = 256
  lm_batch: int = 8
  seq_len: int = 64
  lm_lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2)
  extend_edge: bool = True
  """LM: one more lr past the grid's end (×3 or ÷3, tune seed) for an (algorithm, W) whose best sits on it."""
  lm_eval: int = 16
  eval_batches: int = 4
  h_sweep: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
  h_workers: int = 8
  sweep_algorithms: Annotated[tuple[str, ...], flags.one_of("diloco", "local")] = ("diloco", "local")
  """The H sweep's outer steps: DiLoCo's Nesterov step, and plain averaging (each at its tuned W = h_workers lr)."""


SMOKE = dict(workers=(1, 2), seeds=(0,), tune_seed=0, local_period=2, convex_variants=("shuffled", "sorted"),
             convex_steps=16, convex_lrs=(1.0,), lm_datasets=("stdlib",), lm_algorithms=("allreduce", "local"),
             lm_steps=4, lm_batch=8, seq_len=32, lm_lrs=(3e-3,), lm_eval=2, eval_batches=1, h_sweep=(2,), h_workers=2,
             sweep_algorithms=("local",))


def sync_flag(algorithm: str, workers: int, cfg: Config) -> str:
  """The --sync value of an algorithm at W workers (W = 1: every algorithm is synchronous SGD)."""
  if workers == 1:
    return "allreduce"
  return {"allreduce": "allreduce", "local": f"local:{cfg.local_period}", "diloco": f"local:{cfg.local_period}",
          "gossip": "gossip", "stale": f"stale:{workers - 1}:random"}[algorithm]


def steps_to(curve, target: float) -> float | None:
  """The first step at which a held-out curve [(step, loss)] reaches `target`, interpolated linearly between
  evaluations; None if it never does."""
  for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
    if l1 <= target:
      return float(s1) if l0 == l1 else float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1)) if l0 > target else float(s0)
  return None


def at_step(points, step: float) -> float:
  """A cumulative quantity [(step, value)] at a (fractional) step, linearly interpolated."""
  xs, ys = zip(*points)
  return float(np.interp(step, xs, ys))


def predicted_speedup(noise_scale: float, batch: int, workers: int) -> float:
  """(1 + B/b) / (1 + B/(W b)): synchronous SGD's speedup from W b over b samples a step (McCandlish et al.)."""
  return (1 + noise_scale / batch) / (1 + noise_scale / (workers * batch))


def outer_flags(algorithm: str) -> dict | None:
  """--outer-lr/--outer-momentum of an algorithm's local:H runs: plain averaging for `local`, DiLoCo's defaults
  (None) for `diloco`; None for the others, which take no outer step."""
  return AVERAGING if algorithm == "local" else None


def grid(workers, algorithms) -> list[tuple[str, int]]:
  """(algorithm, W) pairs run: the W = 1 baseline once (as allreduce), every algorithm at each W > 1."""
  return [("allreduce", 1)] * (1 in workers) + [(a, w) for w in workers if w > 1 for a in algorithms]


# ---------------------------------------------------------------------------------------------------------------------
# convex part


def convex_part(cfg: Config, done: dict, save) -> dict:
  out = done.setdefault("convex", {})
  runners = {}
  for variant in cfg.convex_variants:
    if variant in out:
      continue
    data = cv.digits(variant)
    runs = {}
    for alg, w in grid(cfg.workers, cfg.algorithms):
      key = (sync_flag(alg, w, cfg), w)
      if key not in runners:  # one set of compiled programs per (algorithm, W), reused across variants
        runners[key] = cv.Runner(key[0], w, cfg.convex_batch)
      runner = runners[key]
      tune = {lr: runner.run(data, lr, cfg.tune_seed, cfg.convex_steps, cfg.convex_eval) for lr in cfg.convex_lrs}
      lr = min(tune, key=lambda v: tune[v]["curve"][-1][1])
      seeds = {str(s): tune[lr] if s == cfg.tune_seed else runner.run(data, lr, s, cfg.convex_steps, cfg.convex_eval)
               for s in cfg.seeds}
      runs[f"{alg}/W{w}"] = {"lr": lr, "tune": {str(v): r["curve"][-1][1] for v, r in tune.items()},
                             "seeds": {s: {"curve": r["curve"], "bytes": r["bytes"]} for s, r in seeds.items()}}
      if w == 1:  # the noise scale at synchronous SGD's final parameters, on 1024 training samples
        idx = np.concatenate([cv.rows(data, 0, s, 64) for s in range(16)])
        runs[f"{alg}/W{w}"]["gradients"] = datastats.gradient_stats(
            lambda p, x, y: cv.loss_fn(p, x[None], y[None], {})[0], seeds[str(cfg.seeds[0])]["params"],
            data.x[idx], data.y[idx])
    out[variant] = {"characters": cv.characters(data), "runs": runs}
    save()
    print(f"[{time.strftime('%H:%M:%S')}] convex {variant} done", flush=True)
  return out


# ---------------------------------------------------------------------------------------------------------------------
# language-model part


def lm_data(name: str, work: str) -> tuple[str | None, str]:
  """(--data, --sampling) of an LM dataset; `repeated` and `mixed` are token files written once under `work`, whose
  last 5% (the CLI's held-out split of a single array) is exactly the stdlib corpus's val split."""
  if name in ("stdlib", "sequential"):
    return None, "random" if name == "stdlib" else "sequential"
  path = os.path.join(work, f"data_{name}.npy")
  if not os.path.exists(path):
    corpus = load_corpus()
    n_train = 19 * len(corpus.val)  # ceil(20 n_val · 0.05) = n_val
    train = np.asarray(corpus.train)
    if name == "repeated":
      chunks = train[:len(train) // CHUNK * CHUNK].reshape(-1, CHUNK)
      keep = np.random.default_rng(0).choice(len(chunks), max(1, len(chunks) // 10), replace=False)
      body = np.resize(np.repeat(chunks[keep], 10, axis=0).ravel(), n_train)
    else:  # mixed: every other 4 KiB chunk from the package descriptions
      from research.data import docs_corpus
      docs = np.asarray(load_corpus(docs_corpus.build()).train)
      body = np.resize(train, n_train).copy()
      prose = np.resize(docs, n_train)
      for start in range(CHUNK, n_train, 2 * CHUNK):
        body[start:start + CHUNK] = prose[start:start + CHUNK]
    arr = np.concatenate([body, np.asarray(corpus.val)]).astype(np.uint8)
    os.makedirs(work, exist_ok=True)
    np.save(path + ".tmp.npy", arr)
    os.replace(path + ".tmp.npy", path)
  return path, "random"


def lm_run(cfg: Config, work: str, dataset: str, sync: str, workers: int, lr: float, seed: int,
           outer: dict | None = None) -> dict:
  """One train CLI run in a process of its own with W devices on mesh data=W (so every collective between devices
  is between workers), reused when finished: its held-out curve and cumulative bytes between replicas. `outer`:
  --outer-lr/--outer-momentum of a local:H run other than DiLoCo's defaults (plain averaging: a "-avg" run)."""
  data, sampling = lm_data(dataset, work)
  tag = sync.replace(':', '-') + ("-avg" if outer == AVERAGING else "")
  out = os.path.join(work, "runs", f"{dataset}_{tag}_W{workers}_lr{lr:g}_s{seed}")
  flags = dict(model="tiny", steps=cfg.lm_steps, batch_size=cfg.lm_batch * workers, seq_len=cfg.seq_len, lr=lr,
               seed=seed, devices=workers, mesh=f"data={workers}", sync=sync, sampling=sampling,
               eval_every=cfg.lm_eval, log_every=cfg.lm_eval, eval_batches=cfg.eval_batches, ckpt_every=cfg.lm_steps,
               keep=1, out=out, **(dict(data=data) if data else {}), **(outer or {}))
  cmd = [sys.executable, "-m", "research.train", "--no-progress",
         *[a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
  records = _records(out) if cfg.smoke else []
  # smoke: a run this session already finished (its tune-seed run reread as seed 0, the sweep's H = local_period
  # run as the grid's local run) is read back instead of starting a CLI process that only finds it done
  if not (cfg.smoke and records and records[-1]["step"] == cfg.lm_steps):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
      raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    records = _records(out)
  curve = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
  sent = [(r["step"], r.get("comm_bytes_replicas", 0.0)) for r in records if "val_loss" in r]
  return {"curve": curve, "bytes": sent, "dir": out}


def _records(out: str) -> list[dict]:
  """The metrics records of a run directory (none if it has no metrics yet)."""
  path = os.path.join(out, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f]


def lm_characters(cfg: Config, dataset: str, work: str, samples: int = 512) -> dict:
  """The characters of a dataset's training windows as the sampler draws them (bags of bytes)."""
  data, sampling = lm_data(dataset, work)
  corpus = load_corpus(data)
  windows = np.concatenate([get_batch(corpus.train, 0, s, cfg.lm_batch, cfg.seq_len, sampling)[0]
                            for s in range(max(2, samples // cfg.lm_batch))])
  return datastats.characters(datastats.token_features(windows, 256))


def lm_gradients(cfg: Config, run_dir: str, dataset: str, work: str, samples: int = 64) -> dict:
  """Per-sequence gradient diversity and noise scale at a run's final parameters, on its dataset's windows."""
  from flax import nnx

  from models import cross_entropy
  from research.train.store.pretrained import load_run
  model, _, _ = load_run(run_dir)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  data, sampling = lm_data(dataset, work)
  x, y = get_batch(load_corpus(data).train, 1, 0, samples, cfg.seq_len, sampling)

  def loss(p, xs, ys):
    return cross_entropy(nnx.merge(graphdef, p, rest).forward(xs[None])[0], ys[None])
  return datastats.gradient_stats(loss, params, x, y)


def lm_part(cfg: Config, done: dict, save, work: str) -> dict:
  out = done.setdefault("lm", {})
  lrs = out.setdefault("lr", {})
  for dataset in cfg.lm_datasets:
    rec = out.setdefault(dataset, {"runs": {}})
    if "characters" not in rec:
      rec["characters"] = lm_characters(cfg, dataset, work)
    for alg, w in grid(cfg.workers, cfg.lm_algorithms):
      if alg == "diloco" and dataset not in cfg.diloco_datasets:
        continue
      key = f"{alg}/W{w}"
      flag, outer = sync_flag(alg, w, cfg), outer_flags(alg)
      if key not in lrs:  # tuned on the first dataset, reused on the others
        tune = {lr: lm_run(cfg, work, cfg.lm_datasets[0], flag, w, lr, cfg.tune_seed, outer) for lr in cfg.lm_lrs}
        lrs[key] = {"lr": min(tune, key=lambda v: tune[v]["curve"][-1][1]),
                    "tune": {str(v): r["curve"][-1][1] for v, r in tune.items()}}
        save()
      tried = {float(v): loss for v, loss in lrs[key]["tune"].items()}
      past = common.past_edge(tried) if cfg.extend_edge and len(tried) == len(cfg.lm_lrs) else None
      if past is not None:  # one lr past the grid's end where the best sits on it (a best still there is flagged)
        tried[past] = lm_run(cfg, work, cfg.lm_datasets[0], flag, w, past, cfg.tune_seed, outer)["curve"][-1][1]
        lrs[key] = {"lr": min(tried, key=tried.get), "tune": {str(v): loss for v, loss in tried.items()}}
        save()
      lr = lrs[key]["lr"]
      if rec["runs"].get(key, {}).get("lr", lr) != lr:  # seeds run at the lr the extension displaced
        del rec["runs"][key]
      if key in rec["runs"] and len(rec["runs"][key]["seeds"]) == len(cfg.seeds):
        continue
      run = rec["runs"].setdefault(key, {"lr": lr, "seeds": {}})
      for s in cfg.seeds:
        if str(s) not in run["seeds"]:
          r = lm_run(cfg, work, dataset, flag, w, lr, s, outer)
          run["seeds"][str(s)] = {"curve": r["curve"], "bytes": r["bytes"]}
          if key == "allreduce/W1" and s == cfg.seeds[0]:
            rec["gradients"] = lm_gradients(cfg, r["dir"], dataset, work)
          save()
      print(f"[{time.strftime('%H:%M:%S')}] lm {dataset} {key} done", flush=True)
  return out


def sweep_part(cfg: Config, done: dict, save, work: str) -> dict:
  """Per algorithm of `sweep_algorithms` (diloco, local: its outer step), per H: the runs at its W = h_workers lr."""
  w = cfg.h_workers
  for alg in cfg.sweep_algorithms:
    out = done.setdefault("sweep", {}).setdefault(alg, {})
    lr = done["lm"]["lr"].get(f"{alg}/W{w}", {}).get("lr", cfg.lm_lrs[len(cfg.lm_lrs) // 2])
    for h in cfg.h_sweep:
      rec = out.setdefault(str(h), {"lr": lr, "seeds": {}})
      for s in cfg.seeds:
        if str(s) not in rec["seeds"]:
          r = lm_run(cfg, work, cfg.lm_datasets[0], f"local:{h}", w, lr, s, outer_flags(alg))
          rec["seeds"][str(s)] = {"curve": r["curve"], "bytes": r["bytes"]}
          save()
  return done.get("sweep", {})


# ---------------------------------------------------------------------------------------------------------------------
# summary


def speedups(part: dict, workers, algorithms, batch: int, tried) -> dict:
  """Per dataset: the target, and per (algorithm, W) the speedup and bytes to target (mean, std over seeds, None
  where a seed never reached it), and the predicted synchronous speedup. `tried(key, run)`: the lrs tuned over."""
  out = {}
  for dataset, rec in part.items():
    if not isinstance(rec, dict) or "runs" not in rec or "allreduce/W1" not in rec["runs"]:
      continue
    base = rec["runs"]["allreduce/W1"]["seeds"]
    target = max(r["curve"][-1][1] for r in base.values())
    base_steps = np.mean([steps_to(r["curve"], target) for r in base.values()])
    # (a target the first evaluation already meets, as when W = 1 never improved on the start, has no speedups)
    row = {"target": target, "base_steps": float(base_steps), "cells": {}}
    noise = rec.get("gradients", rec["runs"]["allreduce/W1"].get("gradients", {})).get("noise_scale")
    row["noise_scale"] = noise
    for alg, w in grid(workers, algorithms):
      run = rec["runs"].get(f"{alg}/W{w}")
      if run is None:
        continue
      reach = [steps_to(r["curve"], target) for r in run["seeds"].values()]
      grid_lrs = tried(f"{alg}/W{w}", run)
      cell = {"reached": sum(x is not None for x in reach), "seeds": len(reach), "lr": run["lr"],
              "lr_edge": run["lr"] in (min(grid_lrs), max(grid_lrs)) and len(grid_lrs) > 1,
              "final": common.mean_std([r["curve"][-1][1] for r in run["seeds"].values()])}
      if all(x is not None for x in reach) and base_steps > 0 and min(reach) > 0:
        cell["speedup"] = common.mean_std([base_steps / x for x in reach])
        cell["bytes"] = common.mean_std([at_step(r["bytes"], x) for r, x in zip(run["seeds"].values(), reach)])
      if noise is not None:
        cell["predicted_sync"] = predicted_speedup(noise, batch, w)
      row["cells"][f"{alg}/W{w}"] = cell
    out[dataset] = row
  return out


def summarize(done: dict, cfg: Config) -> dict:
  lm_lrs = done.get("lm", {}).get("lr", {})
  s = {"convex": speedups(done.get("convex", {}), cfg.workers, cfg.algorithms, cfg.convex_batch,
                          lambda key, run: [float(v) for v in run["tune"]]),
       "lm": speedups({k: v for k, v in done.get("lm", {}).items() if k != "lr"}, cfg.workers, cfg.lm_algorithms,
                      cfg.lm_batch, lambda key, run: [float(v) for v in lm_lrs[key]["tune"]])}
  s["sweep"] = {alg: {h: {"final": common.mean_std([r["curve"][-1][1] for r in rec["seeds"].values()]),
                          "bytes": common.mean_std([r["bytes"][-1][1] for r in rec["seeds"].values()]), "lr": rec["lr"]}
                      for h, rec in hs.items()}
                for alg, hs in done.get("sweep", {}).items()}
  return s


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  if cfg.smoke:
    cfg = dataclasses.replace(cfg, **SMOKE)
  from research.train.runtime.devices import setup_jax
  setup_jax(8, compile_cache=True)
  unknown = set(cfg.algorithms) - set(ALGORITHMS) or set(cfg.lm_algorithms) - set(LM_ALGORITHMS) or \
      set(cfg.lm_datasets) - set(LM_DATASETS) or \
      set(cfg.convex_variants) - set(cv.VARIANTS)
  if unknown or any(8 % w for w in cfg.workers) or not cfg.seeds:
    raise SystemExit(f"error: algorithms are {ALGORITHMS}, LM datasets {LM_DATASETS}, convex variants "
                     f"{cv.VARIANTS}, workers divide 8, and --seeds needs a value")
  t0 = time.perf_counter()
  done = common.load_partial(cfg) or {}
  with tempfile.TemporaryDirectory(prefix="optlab-scalability-") as tmp:
    work = tmp if cfg.smoke else cfg.work
    save = (lambda: None) if cfg.smoke else (lambda: common.save_partial(cfg, **done))
    convex_part(cfg, done, save)
    lm_part(cfg, done, save, work)
    sweep_part(cfg, done, save, work)
  result = {"settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "work")},
            "convex": done["convex"], "lm": done["lm"], "sweep": done["sweep"], "summary": summarize(done, cfg),
            "wall_s": time.perf_counter() - t0}
  if not cfg.smoke:
    report.write(cfg, result, NAME, QUESTION)
    common.drop_partial(cfg)
  return result

