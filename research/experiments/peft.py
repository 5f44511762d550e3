"""The fine-tuning methods study: full fine-tuning (AdamW, Muon), the block optimizers (BAdam, BREAD, BREAD-SGD) and
five adapters (LoRA, DoRA, Pre-Diag, SORA, a SNIP-pruned sparse adapter) fine-tuning one pretrained model on a second
corpus, each run as the trainer runs it (BAdam and BREAD-SGD by the blockwise step, frozen weights in bfloat16), with
each method's step FLOPs and bytes per parameter from `research.bench finetune` beside its learning and forgetting.

Claim (shared/reference/methods.md §7; Chang et al., "Calibrating and Rotating", AAAI 2026, arXiv 2511.00051, code
MaeChd/SORA): DoRA works because it raises the singular-value entropy of the update ΔW toward full fine-tuning's;
Pre-Diag (a diagonal before the low-rank update) and SORA (Pre-Diag + an output rotation) keep that at lower cost
than DoRA. §11 (He et al., SparseAdapter, arXiv 2210.04284): a wide adapter pruned at init by SNIP ("Large-Sparse")
matches or beats a dense one at the same budget. BlockOptimizers (BAdam, Luo et al., NeurIPS 2024; BREAD, Luo et al.,
NeurIPS 2025; optim/badam.py, optim/bread.py): BREAD's cheap updates of the inactive layers the backward pass reaches
("landscape expansion") close BAdam's gap to full Adam.

Setup. Pretraining: the `small` preset (d 256, 4 layers) with AdamW from random init on the default corpus (the
standard library's Python source, bytes) by the train CLI, one run (seed 0). Fine-tuning: `--init-from` that run on
the second corpus (`research.data.docs_corpus`: package descriptions, split by package), by the same CLI (warmup +
cosine, clip 1.0, the optimizer's default weight decay, one device), at equal steps and tokens for every contender:
  adamw, muon        full fine-tuning, every parameter.
  badam              BAdam with the reference defaults (one layer at a time, embedding and final norm frozen), run by
                     the blockwise step (parameters stored in bfloat16, the active layer's float32 master).
  bread              BREAD, low-rank mode (rank 8, alpha 16: optim.bread's defaults) on BAdam's blocks and switching,
                     run by the blockwise step (the layers above the active one move through their factors' AdamW
                     steps in the same backward pass; parameters stored in bfloat16).
  bread_sgd          BREAD-SGD (inactive lr ratio 1, the reference's class default) on BAdam's blocks, run by the
                     blockwise step (the layers above the active one take SGD steps in the same backward pass).
  bread_sgd_f32      the same with --frozen-dtype float32: the stored weights the SGD steps land on in float32 (in
                     bfloat16 a step below half an ulp rounds away; `sgd_rounding` measures how often).
  lora, dora,        adapters on the attention q/k/v/o and MLP projections (`--peft`, AdamW on the adapters), the
  prediag            base frozen and stored in bfloat16 (the trainer's default when fine-tuning): rank 8, alpha 16
                     (the paper's alpha = 2r).
  sora               rank 4, alpha 8, r_p 4 (the reference's r_p): the rotation's C, D (O × r_p each) take the place
                     of four ranks, so its budget is LoRA-8's (within the table's ratio).
  sparse_adapter     "Large-Sparse": a rank-16 adapter (alpha 32) pruned to 50% by SNIP on the first batch: rank 8's
                     budget.
Trainable counts are measured and tabled with their ratio to LoRA's (DoRA and Pre-Diag add one vector per matrix).
The lr is tuned per contender on seed 0 by the fine-tuning corpus's held-out loss (full fine-tuning on 1e-4..3e-2,
adapters on 1e-3..3e-2, higher as their practice is; a best lr at a grid edge is flagged), then 3 seeds at each one's
best. Learning = held-out loss on the new corpus (packages never trained on); forgetting = held-out loss on the old
corpus's val split, of the final checkpoint (adapters merged). Optimizer-state bytes: `tx.init` of the run's
trainable parameters. Cost per step (`costs`), measured side by side in one process after the runs, each contender's
step built as the trainer builds it at this model and batch (`research.bench.finetune`): matmul FLOPs of the
compiled step over full AdamW's (BAdam: the static-split step's mean over its first, middle and last block;
BREAD-SGD: its layer loop at the cycle's mean trip count), the train state's bytes per parameter, the step's peak
estimate (argument + temp + output − aliased bytes), and the wall time per step (`step_seconds`: the mean of
`timing_steps` calls on a real state, one block cycle — layers x switch_every calls — for the block optimizers; the
runs' own throughput is not used: they share the machine with whatever else runs).

Singular-value entropy. For every adapted matrix (each of the 7 projections of each layer) ΔW = W_final − W_pretrained
(adapters merged), σ its singular values, p_i = σ_i / Σ_j σ_j, H = −Σ p_i ln p_i (nats); also H / ln(min(I, O)), 1
for a flat spectrum of full rank. A rank-r LoRA has H ≤ ln r. The paper's normalisation is not verified; this is the
one used here. Reported per layer (mean over the 7 matrices and the seeds) and overall.

  python -m research.experiments.peft           # full size: writes research/results/peft/
  python -m research.experiments.peft --smoke   # a minute; writes nothing (the tests run this)
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Annotated

import jax
import numpy as np
from flax import nnx

from models import count_params
from research import flags
from research.bench import finetune as bench
from research.data import docs_corpus, eval_batches, load_corpus
from research.experiments import common
from research.sweep import Run, SweepConfig, parse_grid, run_grid
from research.train.config import PeftFlags, TrainConfig
from research.train.setup.build import make_optimizer, optimizer_needs
from research.train.store.pretrained import load_run

NAME = "peft"
QUESTION = ("Fine-tuning a pretrained model on a second corpus at equal steps: how do the five adapters (LoRA, DoRA, "
            "Pre-Diag, SORA, a SNIP-sparse adapter) at an equal trainable budget compare with full fine-tuning (AdamW, "
            "Muon) and the block optimizers (BAdam, BREAD) in learning, forgetting, optimizer state and step cost, "
            "and does the paper's "
            "singular-value-entropy ordering of ΔW (LoRA < DoRA, Pre-Diag/SORA ≈ DoRA, toward full fine-tuning) hold?")
TITLES = {"adamw": "full FT, AdamW", "muon": "full FT, Muon", "badam": "BAdam", "bread": "BREAD (low-rank)",
          "bread_sgd": "BREAD-SGD", "bread_sgd_f32": "BREAD-SGD, float32 storage", "lora": "LoRA", "dora": "DoRA",
          "prediag": "Pre-Diag", "sora": "SORA", "sparse_adapter": "SparseAdapter (SNIP)"}
FULL = ("adamw", "muon", "badam", "bread", "bread_sgd", "bread_sgd_f32")
BLOCKS = ("badam", "bread", "bread_sgd", "bread_sgd_f32")  # train the layers only (embedding and final norm frozen)
BENCH = {"bread_sgd": "bread-sgd", "bread_sgd_f32": "bread-sgd-f32"}  # the research.bench finetune row of a contender
STORAGE = {"bread_sgd_f32": "float32"}  # --frozen-dtype of a contender (else the fine-tuning default, bfloat16)
# the projections every adapter adapts (models.peft.DEFAULT_TARGETS on a dense model), and whose ΔW is measured
MATRICES = ("wq_DQ", "wk_DK", "wv_DK", "wo_QD", "w_gate_DF", "w_up_DF", "w_down_FD")


@dataclasses.dataclass
class Config(common.Base):
  """Pretrain `small` on the stdlib corpus; fine-tune it on the package-docs corpus eleven ways."""
  smoke: bool = False
  """A few steps of a 1-layer model in a temporary directory: the same code path, nothing written to `out`."""
  out: str = "research/results/peft"
  work: str = "runs/experiments/peft"
  """Run directories (pretraining and each contender's sweep): finished runs are skipped on a rerun."""
  model: str = "small"
  n_layers: int | None = None
  """Override the preset's layers (the smoke run uses 1)."""
  pretrain_steps: int = 800
  pretrain_lr: float = 3e-3
  pretrain_batch: int = 16
  steps: int = 200
  """Fine-tuning steps, equal for every contender."""
  batch_size: int = 8
  seq_len: int = 64
  eval_every: int = 25
  eval_batches: int = 8
  switch_every: int = 8
  """BAdam's updates per block: 200 / 8 = 25 turns over 4 layers."""
  rank: int = 8
  """The budget: LoRA/DoRA/Pre-Diag rank; SORA rank - r_p, the sparse adapter's surviving rank."""
  r_p: int = 4
  full_lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
  adapter_lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2)
  seeds: tuple[int, ...] = (0, 1, 2)
  contenders: Annotated[tuple[str, ...], flags.one_of(*TITLES)] = tuple(TITLES)
  timing_steps: int = 32
  """Calls of each contender's step timed for its wall time per step (block optimizers: one block cycle)."""
  timed: Annotated[tuple[str, ...] | None, flags.one_of(*TITLES)] = None
  """The contenders whose step is timed (None: every one; the others' step time is not measured)."""


# the smoke run keeps AdamW (the reference) and the five adapters; Muon and BAdam are the same full-fine-tuning path
# with another optimizer (the badam and optimizers notebooks smoke-test those)
SMOKE = dict(n_layers=1, model="tiny", pretrain_steps=4, pretrain_batch=8, steps=4, batch_size=8, seq_len=32,
             eval_every=2, eval_batches=2, switch_every=2, rank=4, r_p=2, full_lrs=(3e-3,), adapter_lrs=(1e-2,),
             timing_steps=2, timed=("adamw", "lora"),  # the timing path once, not a second compile per contender
             seeds=(0,), contenders=("adamw", "lora", "dora", "prediag", "sora", "sparse_adapter"))


def contender(cfg: Config, name: str) -> tuple[str, str | None, PeftFlags | None]:
  """(optimizer grid label, --peft method, --peft.* flags) of a contender."""
  r = cfg.rank
  if name in FULL:
    k = cfg.switch_every
    return {"adamw": "adamw", "muon": "muon", "badam": f"badam[switch_every={k}]", "bread": f"bread[switch_every={k}]",
            "bread_sgd": f'bread[mode="sgd",switch_every={k}]',
            "bread_sgd_f32": f'bread[mode="sgd",switch_every={k}]'}[name], None, None
  flags = {"lora": PeftFlags(rank=r, alpha=2 * r), "dora": PeftFlags(rank=r, alpha=2 * r),
           "prediag": PeftFlags(rank=r, alpha=2 * r),
           "sora": PeftFlags(rank=r - cfg.r_p, alpha=2 * (r - cfg.r_p), r_p=cfg.r_p),
           "sparse_adapter": PeftFlags(rank=r, alpha=4 * r, sparsity=0.5)}[name]  # alpha = 2 x its width 2r
  return "adamw", name, flags


def lrs(cfg: Config, name: str) -> tuple[float, ...]:
  return cfg.full_lrs if name in FULL else cfg.adapter_lrs


def _run_config(cfg: Config, **kw) -> TrainConfig:
  over = {} if cfg.n_layers is None else {"n_layers": cfg.n_layers}
  return TrainConfig(seq_len=cfg.seq_len, eval_every=cfg.eval_every, log_every=cfg.eval_every,
                     eval_batches=cfg.eval_batches, devices=1, mesh="data=-1", progress=False, keep=1, **over, **kw)


def pretrain(cfg: Config, work: str) -> str:
  tc = _run_config(cfg, model=cfg.model, steps=cfg.pretrain_steps, batch_size=cfg.pretrain_batch,
                   ckpt_every=cfg.pretrain_steps)
  return common.pretrained_run(os.path.join(work, "pretrain"), tc, cfg.pretrain_lr)


def entropy(delta: np.ndarray) -> tuple[float, float]:
  """(H, H / ln min(I, O)) of a matrix's singular values: p = σ / Σσ, H = −Σ p ln p (nats)."""
  s = np.linalg.svd(np.asarray(delta, np.float64), compute_uv=False)
  p = s / s.sum()
  p = p[p > 0]
  h = float(-(p * np.log(p)).sum())
  return h, h / float(np.log(min(delta.shape)))


def delta_entropies(model, before: dict) -> dict[str, list[list[float]]]:
  """{"H": [[H of each matrix] per layer], "H_norm": same normalised}: the ΔW of the 7 projections of each layer."""
  blocks = nnx.to_pure_dict(nnx.state(model, nnx.Param))["blocks"]
  out = {"H": [], "H_norm": []}
  for layer in range(before["wq_DQ"].shape[0]):
    hs = [entropy(np.asarray(blocks[m])[layer] - before[m][layer]) for m in MATRICES]
    out["H"].append([h for h, _ in hs])
    out["H_norm"].append([n for _, n in hs])
  return out


def state_bytes(tc: TrainConfig, params) -> int:
  """Optimizer-state bytes the CLI's tx keeps for `params` (full fine-tuning: every parameter)."""
  tx = make_optimizer(tc.optim, tc.training.steps, optimizer_needs(tc.optim), tc.trains.freeze)[0]
  return common.tree_bytes(jax.eval_shape(tx.init, params))


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  if cfg.smoke:
    cfg = dataclasses.replace(cfg, **SMOKE)
  unknown = set(cfg.contenders) - set(TITLES)
  if unknown or "adamw" not in cfg.contenders:
    raise SystemExit(f"error: contenders must include adamw and come from {', '.join(TITLES)}")
  t0, cpu0 = time.perf_counter(), time.process_time()
  with tempfile.TemporaryDirectory(prefix="optlab-peft-") as tmp:
    work = tmp if cfg.smoke else cfg.work
    docs = docs_corpus.build()
    corpora = {"docs": load_corpus(docs), "stdlib": load_corpus()}
    batches = {k: eval_batches(c.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches) for k, c in corpora.items()}
    source = pretrain(cfg, work)
    pretrained, c, _ = load_run(source)
    start = {k: common.evaluate(pretrained, b) for k, b in batches.items()}
    params0 = nnx.to_pure_dict(nnx.state(pretrained, nnx.Param))
    before = {m: np.asarray(params0["blocks"][m]) for m in MATRICES}
    total = common.tree_bytes(params0) // 4
    blocks = common.tree_bytes(params0["blocks"]) // 4
    tc = _run_config(cfg, init_from=source, data=docs, steps=cfg.steps, batch_size=cfg.batch_size,
                     ckpt_every=cfg.steps)

    measured = {}  # run directory -> what was read from its final checkpoint (the seed sweep repeats seed 0's run)

    def sweep(name, grid_lrs, seeds):
      label, method, flags = contender(cfg, name)
      train = dataclasses.replace(tc, peft=method, frozen_dtype=STORAGE.get(name),
                                  **({"peft_options": flags} if flags else {}))
      out = os.path.join(work, name)
      rows = run_grid(SweepConfig(grid=(f"{label}={','.join(f'{x:g}' for x in grid_lrs)}",), seeds=seeds,
                                  baseline=label, out=out, train=train))
      for r in rows:
        run_dir = os.path.join(out, "runs", Run(r["label"], r["optimizer"], (), r["lr"], r["seed"]).name)
        r["contender"], r["run_dir"] = name, run_dir
        if r.get("diverged"):
          continue
        if run_dir not in measured:
          model = load_run(run_dir)[0]  # adapters merged
          m = measured[run_dir] = {"held_out": {k: common.evaluate(model, b) for k, b in batches.items()},
                                   "entropy": delta_entropies(model, before)}
          meta = json.load(open(os.path.join(run_dir, "config.json")))
          if method:
            m["trainable"], m["state_bytes"] = meta["peft"]["trainable"], meta["peft"]["opt_state_bytes"]
          else:  # BAdam trains the blocks only (the embedding and final norm frozen), one at a time
            _, optimizer, opt, _ = parse_grid([f"{r['label']}={r['lr']:g}"])[0]
            m["trainable"] = blocks if name in BLOCKS else total
            m["state_bytes"] = state_bytes(dataclasses.replace(train, optimizer=optimizer, opt=opt, lr=r["lr"]),
                                           params0)
        r.update(measured[run_dir])
      return rows

    tuning = [r for name in cfg.contenders for r in sweep(name, lrs(cfg, name), (cfg.seeds[0],))]
    best = {}
    for name in cfg.contenders:
      ok = [r for r in tuning if r["contender"] == name and not r.get("diverged")]
      best[name] = min(ok, key=lambda r: r["final_val_loss"])["lr"] if ok else None
    runs = [r for name in cfg.contenders if best[name] is not None for r in sweep(name, (best[name],), cfg.seeds)]
    cost = costs(cfg, c)
    rounding = sgd_rounding(tuning) if {"badam", "bread_sgd"} <= set(cfg.contenders) else None
    result = {"settings": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "work")},
                           "tokens_per_run": cfg.steps * cfg.batch_size * cfg.seq_len,
                           "pretrain_tokens": cfg.pretrain_steps * cfg.pretrain_batch * cfg.seq_len,
                           "labels": {n: contender(cfg, n)[0] for n in cfg.contenders},
                           "peft": {n: dataclasses.asdict(f) for n in cfg.contenders
                                    if (f := contender(cfg, n)[2]) is not None},
                           "docs_corpus": {"fingerprint": corpora["docs"].fingerprint,
                                           "documents": len(os.listdir(docs)),
                                           "train_bytes": len(corpora["docs"].train),
                                           "val_bytes": len(corpora["docs"].val)},
                           "stdlib_fingerprint": corpora["stdlib"].fingerprint},
              "params": total, "start": start, "tuning": tuning, "best_lr": best, "runs": runs,
              "summary": summarize(runs, cfg.contenders), "costs": cost, "sgd_rounding": rounding}
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
    if not cfg.smoke:
      write(cfg, result)
  return result


def sgd_rounding(tuning: list[dict]) -> dict:
  """{lr: share of the parameter entries in which BREAD-SGD's final model differs from BAdam's} at each lr both ran
  at the first seed: BREAD-SGD is BAdam plus SGD steps on the layers above the active one, taken by the blockwise step
  on the stored (bfloat16) weights, where a step below half a bfloat16 ulp rounds away."""
  dirs = {(r["contender"], r["lr"]): r["run_dir"] for r in tuning if not r.get("diverged")}
  out = {}
  for (name, lr), path in sorted(dirs.items()):
    if name == "bread_sgd" and ("badam", lr) in dirs:
      a, b = (jax.tree.leaves(nnx.to_pure_dict(nnx.state(load_run(p)[0], nnx.Param)))
              for p in (dirs["badam", lr], path))
      differ = sum(int(np.sum(np.asarray(x) != np.asarray(y))) for x, y in zip(a, b))
      out[lr] = differ / sum(x.size for x in a)
  return out


def costs(cfg: Config, mcfg) -> dict:
  """{contender: matmul FLOPs per step, its ratio to full AdamW's, train-state bytes per parameter, peak estimate}
  from `research.bench.finetune` at the study's model and batch (module docstring)."""
  n, out = count_params(mcfg), {}
  for name in cfg.contenders:
    flags = contender(cfg, name)[2]
    if flags is not None:  # the runs' base dtype: the trainer's default when fine-tuning (setup.build.resolved_peft)
      flags = dataclasses.replace(flags, base_dtype=flags.base_dtype or "bfloat16")
    method = BENCH.get(name, name)
    row = bench.measure(method, mcfg, cfg.batch_size, cfg.seq_len, cfg.rank, peft=flags)
    flops = row["matmul_flops"]
    if name == "badam":  # the masked step's static count runs every layer; the static split's cycle mean
      flops = bench.badam_block_flops(mcfg, cfg.batch_size, cfg.seq_len, cfg.rank, 3)["mean"]
    opt, calls = (), cfg.timing_steps
    if name in BLOCKS:  # one block cycle, as the runs switch
      opt, calls = (f"switch_every={cfg.switch_every}",), mcfg.n_layers * cfg.switch_every
    seconds = (bench.step_seconds(method, mcfg, cfg.batch_size, cfg.seq_len, cfg.rank, calls, peft=flags, opt=opt)
               if cfg.timed is None or name in cfg.timed else None)
    out[name] = {"matmul_flops": flops, "state_bytes_per_param": row["state_bytes"] / n,
                 "peak_bytes": bench.step_bytes(row).peak, "step_s": seconds}
  for x in out.values():
    x["flops_vs_adamw"] = x["matmul_flops"] / out["adamw"]["matmul_flops"]
  return out


def summarize(runs: list[dict], names) -> dict:
  """Per contender at its best lr, over seeds: learning, forgetting, sizes, speed, entropies; and the paired
  difference to full AdamW (same seeds, same batches)."""
  out = {}
  for name in names:
    rs = sorted((r for r in runs if r["contender"] == name and not r.get("diverged")), key=lambda r: r["seed"])
    if not rs:
      out[name] = {"diverged": True}
      continue
    h = np.array([r["entropy"]["H"] for r in rs])  # (seeds, layers, matrices)
    hn = np.array([r["entropy"]["H_norm"] for r in rs])
    out[name] = {"lr": rs[0]["lr"], "seeds": [r["seed"] for r in rs], "docs": [r["final_val_loss"] for r in rs],
                 "stdlib": [r["held_out"]["stdlib"] for r in rs], "trainable": rs[0]["trainable"],
                 "state_bytes": rs[0]["state_bytes"], "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in rs])),
                 "H_layer": h.mean(axis=(0, 2)).tolist(), "H": float(h.mean()), "H_norm": float(hn.mean()),
                 "H_seed_std": float(h.mean(axis=(1, 2)).std(ddof=1)) if len(rs) > 1 else 0.0,
                 "curve": [[s, v] for s, v in rs[0]["curve"]]}
  base = out.get("adamw", {})
  for s in out.values():
    if s.get("diverged") or base.get("diverged"):
      continue
    for key in ("docs", "stdlib"):
      by_seed = dict(zip(base["seeds"], base[key]))
      s[f"{key}_vs_adamw"] = [v - by_seed[seed] for seed, v in zip(s["seeds"], s[key]) if seed in by_seed]
  return out


# ---- output ------------------------------------------------------------------------------------------------------

def _grid_edge(result: dict, name: str) -> bool:
  grid = result["settings"]["full_lrs" if name in FULL else "adapter_lrs"]
  return len(grid) > 1 and result["best_lr"].get(name) in (min(grid), max(grid))


def tables(result: dict) -> list[str]:
  st, start, s = result["settings"], result["start"], result["summary"]
  dc = st["docs_corpus"]
  names = [n for n in st["contenders"]]
  grid_lrs = sorted(set(st["full_lrs"]) | set(st["adapter_lrs"]))
  layers = "" if st["n_layers"] is None else f" with {st['n_layers']} layers"
  lines = [f"Pretrained model: `{st['model']}`{layers} "
           f"({result['params']:,} parameters), AdamW lr {st['pretrain_lr']:g}, {st['pretrain_steps']} steps × "
           f"{st['pretrain_batch']} × {st['seq_len']} = {st['pretrain_tokens']:,} bytes of the stdlib corpus. "
           f"Fine-tuning corpus: {dc['documents']} package descriptions, {dc['train_bytes']:,} train / "
           f"{dc['val_bytes']:,} val bytes (held-out packages). Fine-tuning: {st['steps']} steps × {st['batch_size']} "
           f"× {st['seq_len']} = {st['tokens_per_run']:,} tokens per run, one device. Losses in nats/byte.", "",
           f"Before fine-tuning: docs val {start['docs']:.4f}, stdlib val {start['stdlib']:.4f}.", "",
           f"Learning-rate grid at seed {st['seeds'][0]} (docs val after fine-tuning; **best**; † best at a grid "
           "edge):", "", "| contender | " + " | ".join(f"lr {lr:g}" for lr in grid_lrs) + " |",
           "|---|" + "---:|" * len(grid_lrs)]
  for name in names:
    cell = {}
    for r in result["tuning"]:
      if r["contender"] == name:
        v = "diverged" if r.get("diverged") else f"{r['final_val_loss']:.4f}"
        cell[r["lr"]] = f"**{v}**" + ("†" if _grid_edge(result, name) else "") if r["lr"] == result["best_lr"][
            name] else v
    lines.append(f"| {TITLES[name]} | " + " | ".join(cell.get(lr, "") for lr in grid_lrs) + " |")
  lora = s.get("lora", {}).get("trainable")
  lines += ["", f"At each one's best lr, {len(st['seeds'])} seeds (mean ± std; differences to full AdamW paired by "
            "seed):", "",
            "| contender | lr | docs val (learning) | − AdamW | stdlib val (forgetting) | − AdamW | trainable params "
            "| / LoRA | optimizer state | step ms (timed) | matmul FLOPs / AdamW | state B/param | peak est. MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  cost = result.get("costs", {})
  for name in names:
    x = s[name]
    if x.get("diverged"):
      lines.append(f"| {TITLES[name]} | | diverged | | | | | | | | | " + _cost_cells(cost.get(name)) + " |")
      continue
    diff = lambda key: "—" if name == "adamw" else common.pm(common.mean_std(x[f"{key}_vs_adamw"]), sign=True)
    ratio = f"{x['trainable'] / lora:.2f}" if lora else "—"
    lines.append(f"| {TITLES[name]} | {x['lr']:g} | {common.pm(common.mean_std(x['docs']))} | {diff('docs')} | "
                 f"{common.pm(common.mean_std(x['stdlib']))} | {diff('stdlib')} | {x['trainable']:,} | {ratio} | "
                 f"{_mib(x['state_bytes'])} | " + _cost_cells(cost.get(name)) + " |")
  n_layers = len(next(x for x in s.values() if not x.get("diverged"))["H_layer"])
  lines += ["", "Singular-value entropy of ΔW = W_final − W_pretrained (p = σ/Σσ, H = −Σ p ln p in nats; mean over "
            "the 7 projections and the seeds; H / ln min(I, O) normalises by a flat full-rank spectrum):", "",
            "| contender | " + " | ".join(f"layer {i}" for i in range(n_layers))
            + " | mean H | ± seeds | H / ln min(I,O) |", "|---|" + "---:|" * (n_layers + 3)]
  for name in names:
    x = s[name]
    if not x.get("diverged"):
      lines.append(f"| {TITLES[name]} | " + " | ".join(f"{v:.3f}" for v in x["H_layer"]) +
                   f" | {x['H']:.3f} | {x['H_seed_std']:.3f} | {x['H_norm']:.3f} |")
  return lines


def _cost_cells(c: dict | None) -> str:
  if c is None:
    return " | | | "
  ms = "—" if c["step_s"] is None else f"{1e3 * c['step_s']:.1f}"
  return (f"{ms} | {c['flops_vs_adamw']:.2f} | {c['state_bytes_per_param']:.2f} | "
          f"{c['peak_bytes'] / 2**20:.1f}")


def _mib(b: int) -> str:
  return f"{b / 2**20:.2f} MiB"


def findings(result: dict) -> list[str]:
  s, start = result["summary"], result["start"]
  ok = {n: x for n, x in s.items() if not x.get("diverged")}
  out = []
  if "adamw" in ok:
    a = ok["adamw"]
    gain = start["docs"] - np.mean(a["docs"])
    ranked = sorted(ok, key=lambda n: np.mean(ok[n]["docs"]))
    out.append("Reading (learning): ranked by docs val, " + ", ".join(
        f"{TITLES[n]} {np.mean(ok[n]['docs']):.3f}" for n in ranked) + f" (pretrained: {start['docs']:.3f}). " +
        "; ".join(f"{TITLES[n]} gets {(start['docs'] - np.mean(ok[n]['docs'])) / gain:.0%} of full AdamW's gain"
                  for n in ranked if n not in FULL) + ".")
    ranked = sorted(ok, key=lambda n: np.mean(ok[n]["stdlib"]))
    out.append("Reading (forgetting): stdlib val after fine-tuning, lowest first: " + ", ".join(
        f"{TITLES[n]} {np.mean(ok[n]['stdlib']):.3f}" for n in ranked) + f" (pretrained: {start['stdlib']:.3f}).")
  adapters = [n for n in ("lora", "dora", "prediag", "sora", "sparse_adapter") if n in ok]
  if {"lora", "dora"} <= set(ok):
    order = sorted(ok, key=lambda n: ok[n]["H"])
    h = {n: ok[n]["H"] for n in ok}
    sd = max(ok[n]["H_seed_std"] for n in ok)
    verdict = []
    verdict.append(f"DoRA {'>' if h['dora'] > h['lora'] else '≤'} LoRA ({h['dora']:.3f} vs {h['lora']:.3f})")
    for n in ("prediag", "sora"):
      if n in h:
        verdict.append(f"{TITLES[n]} {h[n]:.3f} ({h[n] - h['dora']:+.3f} vs DoRA)")
    full = [n for n in ("adamw", "muon") if n in h]
    out.append("Reading (entropy): H(ΔW) from lowest to highest: " + ", ".join(f"{TITLES[n]} {h[n]:.3f}" for n in order)
               + f"; the largest seed-to-seed std of a mean is {sd:.3f}. " + "; ".join(verdict) +
               ("; full fine-tuning: " + ", ".join(f"{TITLES[n]} {h[n]:.3f}" for n in full) if full else "") + ".")
  if adapters:
    cheapest = min(adapters, key=lambda n: ok[n]["state_bytes"])
    out.append(f"Reading (cost): the adapters keep {_mib(ok[cheapest]['state_bytes'])}–"
               f"{_mib(max(ok[n]['state_bytes'] for n in adapters))} of optimizer state against full AdamW's "
               f"{_mib(ok['adamw']['state_bytes'])}.")
  out += claim(result)
  out += blocks_claim(result)
  edges = [TITLES[n] for n in result["best_lr"] if result["best_lr"][n] is not None and _grid_edge(result, n)]
  if edges:
    out.append(f"Reading: the best lr of {', '.join(edges)} lies at the edge of its grid; a wider grid might do "
               "better.")
  return out


def paired(s: dict, a: str, b: str, key: str = "docs") -> str:
  """a − b on `key`, paired by seed: mean ± std, and in how many seeds a is lower."""
  pa, pb = dict(zip(s[a]["seeds"], s[a][key])), dict(zip(s[b]["seeds"], s[b][key]))
  d = [pa[k] - pb[k] for k in pa if k in pb]
  return f"{common.pm(common.mean_std(d), sign=True, digits=3)} (lower in {sum(x < 0 for x in d)}/{len(d)} seeds)"


def claim(result: dict) -> list[str]:
  """The paper's claim, read off the tables: entropy ordering, the losses it goes with, and the cost."""
  s, st = result["summary"], result["settings"]
  need = ("adamw", "lora", "dora", "prediag", "sora")
  if any(n not in s or s[n].get("diverged") for n in need):
    return []
  h = {n: s[n]["H"] for n in need}
  keeps = all(h[n] >= h["dora"] - 2 * max(s[n]["H_seed_std"], s["dora"]["H_seed_std"], 1e-3)
              for n in ("prediag", "sora"))
  out = [f"Reading (the paper's claim): DoRA raises H(ΔW) from LoRA's {h['lora']:.2f} to {h['dora']:.2f} (full AdamW "
         f"{h['adamw']:.2f}): {'holds' if h['lora'] < h['dora'] <= h['adamw'] + 0.5 else 'does not hold'} here. "
         f"Pre-Diag ({h['prediag']:.2f}) and SORA ({h['sora']:.2f}) raise it above LoRA's too, but "
         + ("keep DoRA's level." if keeps else f"stay {h['dora'] - h['prediag']:.2f} and {h['dora'] - h['sora']:.2f} "
            "below DoRA's: they do not keep it here.")
         + f" Docs val, paired by seed: DoRA − LoRA {paired(s, 'dora', 'lora')}; Pre-Diag − DoRA "
         f"{paired(s, 'prediag', 'dora')}; SORA − DoRA {paired(s, 'sora', 'dora')}; SORA − LoRA "
         f"{paired(s, 'sora', 'lora')}."]
  cost = result.get("costs", {})
  if all(n in cost and cost[n]["step_s"] is not None for n in need):
    f = {n: cost[n]["flops_vs_adamw"] for n in need}
    ms = {n: cost[n]["step_s"] for n in need}
    out.append(f"Reading (cost, the paper's efficiency claim): matmul FLOPs per step over full AdamW's: LoRA "
               f"{f['lora']:.2f}, DoRA {f['dora']:.2f}, Pre-Diag {f['prediag']:.2f}, SORA {f['sora']:.2f}; so Pre-Diag "
               f"costs {f['prediag'] / f['dora']:.2f}× and SORA {f['sora'] / f['dora']:.2f}× DoRA's FLOPs. Measured "
               f"step time vs DoRA: Pre-Diag {ms['prediag'] / ms['dora']:.2f}×, SORA {ms['sora'] / ms['dora']:.2f}×, "
               f"LoRA {ms['lora'] / ms['dora']:.2f}×, full AdamW {ms['adamw'] / ms['dora']:.2f}× (timed side by side, "
               "one CPU device).")
  if "sparse_adapter" in s and not s["sparse_adapter"].get("diverged"):
    out.append(f"Reading (SparseAdapter, a rank-{2 * st['rank']} adapter pruned to 50% by SNIP vs LoRA rank "
               f"{st['rank']}, the same surviving budget): docs val {paired(s, 'sparse_adapter', 'lora')}, stdlib val "
               f"{paired(s, 'sparse_adapter', 'lora', 'stdlib')}; its optimizer state is "
               f"{s['sparse_adapter']['state_bytes'] / s['lora']['state_bytes']:.1f}× LoRA's (the moments of pruned "
               "entries are stored, zero).")
  return out


def blocks_claim(result: dict) -> list[str]:
  """BREAD's claim (it matches Adam where BAdam falls short), read off the seeds table and the costs."""
  s, cost = result["summary"], result.get("costs", {})
  names = [n for n in ("badam", "bread", "bread_sgd", "bread_sgd_f32") if n in s and not s[n].get("diverged")]
  if "adamw" not in s or s["adamw"].get("diverged") or "badam" not in names or len(names) < 2:
    return []
  a = np.mean(s["adamw"]["docs"])
  gap = np.mean(s["badam"]["docs"]) - a
  parts = []
  for n in names[1:]:
    closed = (np.mean(s["badam"]["docs"]) - np.mean(s[n]["docs"])) / gap if gap > 0 else float("nan")
    parts.append(f"{TITLES[n]} − AdamW {paired(s, n, 'adamw')}, − BAdam {paired(s, n, 'badam')}: "
                 f"{closed:.0%} of BAdam's gap closed")
  line = (f"Reading (BREAD, the paper's claim): docs val, paired by seed: BAdam − AdamW {paired(s, 'badam', 'adamw')}; "
          + "; ".join(parts) + ". Forgetting (stdlib val): " + ", ".join(
              f"{TITLES[n]} {np.mean(s[n]['stdlib']):.3f}" for n in ["adamw"] + names) + ".")
  if all(n in cost and cost[n]["step_s"] is not None for n in ["adamw"] + names):
    line += (" Per step: matmul FLOPs / AdamW " + ", ".join(f"{TITLES[n]} {cost[n]['flops_vs_adamw']:.2f}"
                                                            for n in names)
             + "; wall time / AdamW's " + ", ".join(f"{TITLES[n]} {cost[n]['step_s'] / cost['adamw']['step_s']:.2f}"
                                                   for n in names)
             + "; state bytes per parameter " + ", ".join(f"{TITLES[n]} {cost[n]['state_bytes_per_param']:.2f}"
                                                          for n in ["adamw"] + names) + ".")
  out = [line]
  rounding = result.get("sgd_rounding") or {}
  if rounding:
    out.append("Reading (BREAD-SGD in bfloat16 storage): its final model differs from BAdam's at the same lr, seed and "
               "batches in " + ", ".join(f"{share:.2%} of the entries at lr {float(lr):g}" for lr, share in
                                         sorted(rounding.items(), key=lambda kv: float(kv[0])))
               + ". The SGD steps on the layers above the active one are taken on the stored bfloat16 weights (the "
               "blockwise step keeps no float32 copy of them), and a step below half a bfloat16 ulp of its weight "
               "rounds away: at the small lrs BREAD-SGD is BAdam. "
               + ("With float32 storage (`bread_sgd_f32`) the steps are kept; compare its rows for whether they "
                  "help." if "bread_sgd_f32" in result["summary"] else "A float32 store would keep them (not run)."))
  return out


def plot(result: dict):
  """Left: docs val over fine-tuning (seed 0, each at its best lr). Right: learning vs forgetting (mean over seeds)
  with H(ΔW) as the marker size."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(11, 4))
  ax, bx = fig.subplots(1, 2)
  start = result["start"]
  for name, x in result["summary"].items():
    if x.get("diverged"):
      continue
    steps, vals = zip(*x["curve"])
    line, = ax.plot((0,) + steps, (start["docs"],) + vals, marker=".", label=f"{TITLES[name]} (lr {x['lr']:g})",
                    linestyle="-" if name in FULL else "--")
    bx.scatter([np.mean(x["docs"])], [np.mean(x["stdlib"])], s=40 + 60 * x["H"], color=line.get_color(),
               label=f"{TITLES[name]} (H {x['H']:.2f})")
  bx.plot([start["docs"]], [start["stdlib"]], "k*", label="pretrained")
  ax.set(xlabel="fine-tuning step", ylabel="docs val loss (nats/byte)", title="learning the new corpus (seed 0)")
  bx.set(xlabel="docs val loss (learning → left)", ylabel="stdlib val loss (forgetting ↑)",
         title="at the best lr, mean over seeds (size: H(ΔW))")
  ax.legend(fontsize=7)
  bx.legend(fontsize=6)
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict, cmd: str | None = None):
  table = tables(result) + ["", f"Time of the whole command: {result['wall_s']:.0f} s wall on a 2-core machine; "
                            f"{result['cpu_s']:.0f} s of CPU in this process (finished runs found in `work` are "
                            "skipped, their time not counted). Plot: `peft.png`."]
  common.write_results(cfg.out, NAME, QUESTION, table, findings=findings(result), settings=result["settings"],
                       data=result, cmd=cmd)
  plot(result).savefig(os.path.join(cfg.out, "peft.png"), dpi=120)


if __name__ == "__main__":
  common.cli(main, Config)
