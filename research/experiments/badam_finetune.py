"""BAdam in the regime it is made for: fine-tuning a pretrained model on a new corpus. At equal steps, how much of
full AdamW's learning does it reach, how much less does it forget, and with how much optimizer state?

Claim (shared/reference/methods.md §8a, optimizers.md §9; Luo, Yu & Li, "BAdam", arXiv 2404.02827, NeurIPS 2024,
code Ledzy/BAdam): block coordinate descent over the transformer layers (Adam on one layer at a time, its state
dropped at every switch; embedding and head frozen by default) fine-tunes a pretrained Llama with one layer's Adam
state, to downstream scores close to full Adam's and above LoRA's. Experiment 6 (`badam.py`) ran BAdam from random
init, where its reference default cannot work (a frozen random head caps the logits); this one starts where the
paper starts.

Setup. Pretraining: the `tiny` preset with `n_layers` = 6, AdamW from random init on the default corpus (the standard
library's Python source, bytes) by the train CLI, one run (seed 0). Fine-tuning: `--init-from` that run, on the second
corpus (`research.data.docs_corpus`: the package descriptions of optlab's runtime dependencies, English prose and
markup, split by package), by the same CLI (warmup + cosine schedule, clip 1.0, weight decay 0.1, one
device). Contenders:
  adamw  full AdamW on every parameter.
  badam  `badam` with the reference's defaults: the 6 layers as blocks in descending order, K = `switch_every`
         updates per block, the embedding (tied: also the head) and the final norm frozen.
Both see the same batches (same seeds), for the same steps and tokens. Learning = held-out loss on the fine-tuning
corpus (val split: packages never trained on); forgetting = held-out loss on the pretraining corpus' val split, of
the final checkpoint, against the pretrained model's. The lr is tuned per contender on seed 0 by the fine-tuning
val loss (the same grid for both; an edge is flagged), then 3 seeds at each one's best; the whole grid's forgetting
is tabled too, since a smaller lr forgets less. Optimizer-state bytes are measured from `tx.init(params)` of the tx
the CLI builds (and checked against `badam.analytic_state_bytes`).

  python -m research.experiments.badam_finetune           # full size: writes research/results/badam_finetune/
  python -m research.experiments.badam_finetune --smoke   # seconds; writes nothing (the tests run this)
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import jax
import numpy as np

from optim.trees import path_name
from research.data import docs_corpus, eval_batches, load_corpus
from research.experiments import badam, common
from research.sweep import Run, SweepConfig, run_grid
from research.train.config import TrainConfig
from research.train.store.pretrained import load_run

NAME = "badam_finetune"
QUESTION = ("Fine-tuning a pretrained model on a second corpus at equal steps: how close does BAdam (one layer "
            "trained at a time, the reference's defaults) come to full AdamW on the new corpus, how much less does it "
            "forget of the old one, and with how much optimizer state?")
TITLES = {"adamw": "AdamW (all parameters)", "badam": "BAdam (reference defaults: layers only)"}


@dataclasses.dataclass
class Config(common.Base):
  """Pretrain a 6-layer `tiny` on the stdlib corpus, fine-tune it on the package-docs corpus with AdamW and BAdam."""
  smoke: bool = False
  """A few steps of a 2-layer model in a temporary directory: the same code path, nothing written to `out`."""
  out: str = "research/results/badam_finetune"
  work: str = "runs/experiments/badam_finetune"
  """Run directories (pretraining and the fine-tuning sweep): finished runs are skipped on a rerun."""
  n_layers: int = 6
  pretrain_steps: int = 800
  pretrain_lr: float = 3e-3
  """AdamW's best lr for this model at 200 steps in experiment 6."""
  pretrain_batch: int = 16
  steps: int = 200
  """Fine-tuning steps, equal for both contenders."""
  batch_size: int = 8
  seq_len: int = 64
  eval_every: int = 25
  eval_batches: int = 8
  switch_every: int = 8
  """K, BAdam's updates per block: 200 / 8 = 25 turns over 6 layers."""
  lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
  seeds: tuple[int, ...] = (0, 1, 2)


SMOKE = dict(n_layers=2, pretrain_steps=6, pretrain_batch=8, steps=6, batch_size=8, seq_len=32, eval_every=3,
             eval_batches=2, switch_every=2, lrs=(3e-3,), seeds=(0,))


def labels(switch_every: int) -> dict[str, str]:
  return {"adamw": "adamw", "badam": f"badam[switch_every={switch_every}]"}


def _run_config(cfg: Config, **kw) -> TrainConfig:
  # frozen_dtype float32: BAdam's parameters stored as the pretrained ones (the blockwise step would store them in
  # bfloat16 when fine-tuning), so the study measures the algorithm, and "changed" means trained, not rounded
  return TrainConfig(seq_len=cfg.seq_len, eval_every=cfg.eval_every, log_every=cfg.eval_every,
                     eval_batches=cfg.eval_batches, devices=1, mesh="data=-1", progress=False, keep=1,
                     frozen_dtype="float32", **kw)


def pretrain(cfg: Config, work: str) -> str:
  """The pretrained run's directory (trained here unless a finished one is there)."""
  tc = _run_config(cfg, model="tiny", n_layers=cfg.n_layers, steps=cfg.pretrain_steps,
                   batch_size=cfg.pretrain_batch, ckpt_every=cfg.pretrain_steps)
  return common.pretrained_run(os.path.join(work, "pretrain"), tc, cfg.pretrain_lr)


def held_out(model, batches: dict) -> dict[str, float]:
  """Mean held-out cross entropy (nats/byte) of `model` on each named batch list."""
  return {k: common.evaluate(model, b) for k, b in batches.items()}


def changed(model, before: dict) -> list[str]:
  """Names of the parameters (`blocks/wq_DQ`, `embed_VD`, ...) in which `model` differs from `before` anywhere."""
  after = dict(jax.tree_util.tree_flatten_with_path(common.split(model)[1])[0])
  return sorted(path_name(p) for p, x in after.items() if not np.array_equal(np.asarray(x), before[p]))


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  if cfg.smoke:
    cfg = dataclasses.replace(cfg, **SMOKE)
  badam.check(dataclasses.replace(badam.Config(), n_layers=cfg.n_layers, steps=cfg.steps, lrs=cfg.lrs, seeds=cfg.seeds,
                                  switch_every=cfg.switch_every))
  t0, cpu0 = time.perf_counter(), time.process_time()
  names = labels(cfg.switch_every)
  with tempfile.TemporaryDirectory(prefix="optlab-badam-ft-") as tmp:
    work = tmp if cfg.smoke else cfg.work
    docs = docs_corpus.build()
    corpora = {"docs": load_corpus(docs), "stdlib": load_corpus()}
    batches = {k: eval_batches(c.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches) for k, c in corpora.items()}
    source = pretrain(cfg, work)
    pretrained, c, _ = load_run(source)
    start = held_out(pretrained, batches)
    before = {p: np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(common.split(pretrained)[1])[0]}
    tc = _run_config(cfg, init_from=source, data=docs, steps=cfg.steps, batch_size=cfg.batch_size, ckpt_every=cfg.steps)
    sweep_out = os.path.join(work, "finetune")

    def sweep(grid, seeds):  # one directory: the second sweep skips the runs the first one finished
      rows = run_grid(SweepConfig(grid=badam._grid(grid), seeds=seeds, baseline="adamw", out=sweep_out, train=tc))
      for r in rows:  # forgetting: the final checkpoint on both held-out sets
        run_dir = os.path.join(sweep_out, "runs", Run(r["label"], r["optimizer"], (), r["lr"], r["seed"]).name)
        if not r.get("diverged"):
          model = load_run(run_dir)[0]
          r["held_out"], r["changed"] = held_out(model, batches), changed(model, before)
      return rows

    tuning = sweep({label: cfg.lrs for label in names.values()}, (cfg.seeds[0],))
    best = badam.best_lr(tuning)
    runs = sweep({label: (best[label],) for label in names.values()}, tuple(cfg.seeds))
    summary = badam.summarize(runs, names)
    for name, s in summary.items():
      if not s.get("diverged"):
        rs = sorted((r for r in runs if r["label"] == names[name]), key=lambda r: r["seed"])
        s["stdlib"] = [r["held_out"]["stdlib"] for r in rs]
        s["docs_check"] = [r["held_out"]["docs"] for r in rs]
    state = {k: badam.state_bytes(c, "adamw" if k == "adamw" else "badam", concrete=True,
                                  **({} if k == "adamw" else {"switch_every": cfg.switch_every})) for k in names}
    expected = {"adamw": badam.analytic_state_bytes(c, "adamw"), "badam": badam.analytic_state_bytes(c, "badam")}
    result = {"settings": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "work")},
                           "tokens_per_run": cfg.steps * cfg.batch_size * cfg.seq_len,
                           "pretrain_tokens": cfg.pretrain_steps * cfg.pretrain_batch * cfg.seq_len, "labels": names,
                           "docs_corpus": {"path_name": os.path.basename(docs),
                                           "fingerprint": corpora["docs"].fingerprint,
                                           "documents": len(os.listdir(docs)),
                                           "train_bytes": len(corpora["docs"].train),
                                           "val_bytes": len(corpora["docs"].val)},
                           "stdlib_fingerprint": corpora["stdlib"].fingerprint},
              "params": int(sum(np.size(x) for x in before.values())),
              "start": start, "tuning": tuning, "best_lr": {k: best[v] for k, v in names.items()}, "runs": runs,
              "summary": summary, "state_bytes": state, "state_bytes_expected": expected}
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
    if not cfg.smoke:
      write(cfg, result)
  return result


# ---- output ------------------------------------------------------------------------------------------------------

def tables(result: dict) -> list[str]:
  st, names, start = result["settings"], result["settings"]["labels"], result["start"]
  dc = st["docs_corpus"]
  lines = [f"Pretrained model: `tiny` with {st['n_layers']} layers ({result['params']:,} parameters), AdamW lr "
           f"{st['pretrain_lr']:g}, {st['pretrain_steps']} steps × {st['pretrain_batch']} × {st['seq_len']} = "
           f"{st['pretrain_tokens']:,} bytes of the stdlib corpus. Fine-tuning corpus: {dc['documents']} package "
           f"descriptions, {dc['train_bytes']:,} train / {dc['val_bytes']:,} val bytes (held-out packages). "
           f"Fine-tuning: {st['steps']} steps × {st['batch_size']} × {st['seq_len']} = {st['tokens_per_run']:,} "
           "tokens per run. Losses in nats/byte on the val splits.", "",
           f"Before fine-tuning: docs val {start['docs']:.4f}, stdlib val {start['stdlib']:.4f}.", "",
           f"Learning-rate grid at seed {st['seeds'][0]} (docs val / stdlib val after fine-tuning):", "",
           "| contender | sweep label | " + " | ".join(f"lr {lr:g}" for lr in st["lrs"]) + " |",
           "|---|---|" + "---:|" * len(st["lrs"])]
  for name, label in names.items():
    cell = {r["lr"]: ("diverged" if r.get("diverged") else
                      f"{r['final_val_loss']:.4f} / {r['held_out']['stdlib']:.4f}")
            for r in result["tuning"] if r["label"] == label}
    lines.append(f"| {TITLES[name]} | `{label}` | " + " | ".join(cell.get(lr, "—") for lr in st["lrs"]) + " |")
  lines += ["", "At each one's best lr (by docs val at the first seed), all seeds:", "",
            "| contender | lr | docs val (learning) | − AdamW, paired | stdlib val (forgetting) | − AdamW, paired | "
            "optimizer state (bytes) | / AdamW | tokens/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  s, bytes_ = result["summary"], result["state_bytes"]
  for name in names:
    x = s[name]
    if x.get("diverged"):
      lines.append(f"| {TITLES[name]} | {result['best_lr'][name]:g} | diverged | | | | | | |")
      continue
    forget = common.mean_std(x["stdlib"])
    if name == "adamw":
      d_learn = d_forget = "—"
    else:
      d_learn = f"{x['diff_mean']:+.4f} ± {x['diff_std']:.4f} (t = {x['diff_t']:.1f})"
      df = [b - a for a, b in zip(s["adamw"]["stdlib"], x["stdlib"])]
      d_forget = common.pm(common.mean_std(df), sign=True)
    mark = "" if bytes_[name] == result["state_bytes_expected"][name] else " ≠ formula"
    lines.append(f"| {TITLES[name]} | {x['lr']:g} | {x['final_mean']:.4f} ± {x['final_std']:.4f} | {d_learn} | "
                 f"{common.pm(forget)} | {d_forget} | {bytes_[name]:,}{mark} | "
                 f"{bytes_[name] / bytes_['adamw']:.3f} | {x['tokens_per_s']:.0f} |")
  return lines


def findings(result: dict) -> list[str]:
  s, start, st = result["summary"], result["start"], result["settings"]
  a, b = s["adamw"], s["badam"]
  if a.get("diverged") or b.get("diverged"):
    return ["Reading: a contender diverged at its best lr; see the grid."]
  fa, fb = common.mean_std(a["stdlib"]), common.mean_std(b["stdlib"])
  gain_a, gain_b = start["docs"] - a["final_mean"], start["docs"] - b["final_mean"]
  n = len(b["diffs"])
  sig = f"t = {b['diff_t']:.1f} over {n} paired seeds" if n > 1 else "one seed"
  out = [f"Reading (learning): fine-tuning takes the docs val loss from {start['docs']:.3f} to {a['final_mean']:.3f} "
         f"with AdamW and {b['final_mean']:.3f} with BAdam: BAdam gets {gain_b / gain_a:.0%} of AdamW's improvement "
         f"({b['diff_mean']:+.3f} nats/byte, {sig}).",
         f"Reading (forgetting): the stdlib val loss goes from {start['stdlib']:.3f} to {fa[0]:.3f} ± {fa[1]:.3f} "
         f"(AdamW, {fa[0] - start['stdlib']:+.3f}) and {fb[0]:.3f} ± {fb[1]:.3f} "
         f"(BAdam, {fb[0] - start['stdlib']:+.3f}): "
         f"BAdam ends {abs(fb[0] - fa[0]):.3f} nats/byte {'lower' if fb[0] < fa[0] else 'higher'} than AdamW on the "
         "pretraining corpus.",
         "Reading (memory): BAdam's optimizer state is "
         f"{result['state_bytes']['badam'] / result['state_bytes']['adamw']:.3f}× "
         f"AdamW's ({result['state_bytes']['badam']:,} vs {result['state_bytes']['adamw']:,} bytes: one layer's "
         "moments, the embedding frozen), as the formula gives."]
  out += tradeoff(result)
  lrs = st["lrs"]
  edge = [TITLES[k] for k in ("adamw", "badam") if len(lrs) > 1 and result["best_lr"][k] in (min(lrs), max(lrs))]
  if edge:
    out.append(f"Reading: the best lr of {', '.join(edge)} lies at the edge of the grid; a wider grid might do better.")
  return out


def tradeoff(result: dict) -> list[str]:
  """Learning vs forgetting over the lr grid: which contender's grid points are dominated (the other has a point
  lower on both corpora)? At equal lr the one that learns less also moves less; the grid shows whether that is a
  better trade or only a smaller step."""
  names = result["settings"]["labels"]
  pts = {k: [(r["final_val_loss"], r["held_out"]["stdlib"], r["lr"]) for r in result["tuning"]
             if r["label"] == label and not r.get("diverged")] for k, label in names.items()}

  def dominated(k, other):
    return [(p, min((q for q in pts[other] if q[0] < p[0] and q[1] < p[1]), key=lambda q: q[0] + q[1]))
            for p in pts[k] if any(q[0] < p[0] and q[1] < p[1] for q in pts[other])]

  db, da = dominated("badam", "adamw"), dominated("adamw", "badam")
  line = (f"Reading (trade-off, lr grid at seed {result['settings']['seeds'][0]}): {len(db)} of {len(pts['badam'])} "
          f"BAdam points are dominated by an AdamW point (lower loss on both corpora), {len(da)} of "
          f"{len(pts['adamw'])} AdamW points by a BAdam point")
  if db:
    best = result["best_lr"]["badam"]
    p, q = next(((p, q) for p, q in db if p[2] == best), max(db, key=lambda pq: pq[0][2]))
    line += (f"; e.g. BAdam at lr {p[2]:g} (docs {p[0]:.3f}, stdlib {p[1]:.3f}) vs AdamW at lr {q[2]:g} "
             f"(docs {q[0]:.3f}, stdlib {q[1]:.3f})")
  free = [p for p in pts["badam"] if p not in [x for x, _ in db]]
  if not free:
    line += ". BAdam's lower forgetting at equal lr is a smaller step, not a better trade."
  else:
    below = [p for p in free if p[1] < min(q[1] for q in pts["adamw"])]
    line += (f". Not dominated: BAdam at lr {', '.join(f'{p[2]:g}' for p in free)}"
             + (f"; at lr {', '.join(f'{p[2]:g}' for p in below)} it forgets less than every AdamW point on the grid, "
                f"at a higher docs loss (AdamW's smallest lr, {min(q[2] for q in pts['adamw']):g}, is the grid's edge: "
                "a smaller one was not tried)" if below else ""))
  line += "."
  return [line]


def plot(result: dict):
  """Docs val loss over fine-tuning (mean, min–max over seeds) and forgetting vs learning over the lr grid."""
  import matplotlib.pyplot as plt
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  start = result["start"]
  for name, s in result["summary"].items():
    if s.get("diverged"):
      continue
    line, = ax.plot([0] + s["steps"], [start["docs"]] + s["curve_mean"], marker=".",
                    label=f"{TITLES[name]} (lr {s['lr']:g}, {len(s['seeds'])} seeds)")
    ax.fill_between(s["steps"], s["curve_min"], s["curve_max"], color=line.get_color(), alpha=0.2)
    grid = sorted((r for r in result["tuning"] if r["label"] == s["label"] and not r.get("diverged")),
                  key=lambda r: r["lr"])
    bx.plot([r["final_val_loss"] for r in grid], [r["held_out"]["stdlib"] for r in grid], marker="o",
            color=line.get_color(), label=TITLES[name])
    for r in grid:
      bx.annotate(f"{r['lr']:g}", (r["final_val_loss"], r["held_out"]["stdlib"]), fontsize=7)
  bx.plot([start["docs"]], [start["stdlib"]], "k*", label="pretrained (before fine-tuning)")
  ax.set(xlabel="fine-tuning step", ylabel="docs val loss (nats/byte)", title="learning the new corpus")
  bx.set(xlabel="docs val loss (learning → left)", ylabel="stdlib val loss (forgetting ↑)",
         title=f"lr grid at seed {result['settings']['seeds'][0]}")
  ax.legend(fontsize=7)
  bx.legend(fontsize=7)
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict, cmd: str | None = None):
  import matplotlib.pyplot as plt
  table = tables(result) + ([""] + [result["note"]] if result.get("note") else []) + [
      "", f"Time of the whole command: {result['wall_s']:.0f} s wall on a 2-core machine; "
      f"{result['cpu_s']:.0f} s of CPU in this process (finished runs found in `work` are "
      "skipped, their time not counted). Plot: `badam_finetune.png`."]
  common.write_results(cfg.out, NAME, QUESTION, table, findings=findings(result), settings=result["settings"],
                       data=result, cmd=cmd)
  fig = plot(result)
  fig.savefig(os.path.join(cfg.out, "badam_finetune.png"), dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  common.cli(main, Config)
