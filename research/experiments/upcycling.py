"""Does a trained dense model turned into a top-2-of-8 MoE (its FFN neurons split into experts: random or clustered
split) win back the loss the conversion costs, and does it beat the dense model trained on for the same tokens?

  python -m research.experiments.upcycling            # full: writes research/results/upcycling/
  python -m research.experiments.upcycling --smoke    # seconds: what the tests and the notebook run

Claim (shared/reference/methods.md §2 and §12 row 2; Zhu et al., "LLaMA-MoE", arXiv 2406.16554, code
pjlab-sys4nlp/llama-moe): the intermediate neurons of a dense SwiGLU FFN split into E disjoint sets give E experts
that sum to the dense FFN exactly; with a fresh top-k router and continual pre-training the MoE recovers, and the
random split (their released models) is competitive with balanced k-means clustering. Their scale is 7B parameters
and 200B tokens; ours is a 0.24M-parameter byte-level model and ~10^5 tokens: the mechanism at toy scale only.

Setup. A dense `tiny` transformer with d_ff = 512 (D 64, 2 pre-norm blocks, 4/2 heads, QK-norm), seeds 0-2 (init and
batches), trained N = `pretrain_steps` steps on the built-in byte corpus (AdamW, CLI schedule: 10% warmup, cosine to
0.1x, clip 1). Conversion with `models.upcycle`: E = 8 experts of 64 neurons, top-2, softmax gates renormalised over
the two selected, dropless, output scale s = E (models/surgery.py: unbiased under uniform routing), a fresh router;
split `random` (LLaMA-MoE's RandomSplit) or `clustered` (balanced k-means on normalised W_up columns). Check: the
experts' SwiGLUs must sum to s·(dense FFN) on any input (`split_error`, float64; the split is exact).
Arms after conversion, each trained T = `continue_steps` more steps on the same batches (data steps N..N+T-1 of the
seed) with a fresh AdamW state (the MoE's parameter tree differs, so every arm gets the same fresh start):
  dense:      the dense model continued;
  random, clustered: the upcycled MoEs;
  scratch:    (optional) the same MoE architecture trained from a random init for N + T steps on data steps
              0..N+T-1, i.e. the same batches the dense model saw before and after conversion.
Tokens are input positions of training batches: every continued arm sees T·B·S, scratch and dense pretraining +
continuation (N+T)·B·S. Parameters: the split keeps every dense FFN weight, so the MoE has the dense model's total
parameters plus a router (8·64 per layer); a token uses 2 of 8 experts, i.e. 1/4 of the FFN: the MoE has FEWER
active parameters and FLOPs per token than the dense arm (table), not equal ones.
Honest means: held-out validation (the corpus' val split, fixed windows), 3 seeds with mean ± std and the paired
per-seed difference to the dense arm, equal tokens as above, and the same lr tuning for the continued arms: peak lr
from `lrs` picked by seed 0's final val loss for the dense arm and for the random-split MoE (the clustered MoE, the
same architecture, takes the MoE's); the pretraining lr (and the scratch MoE's) is the CLI default 3e-3, untuned
for both. Seed 0's tuned runs are its reported runs, so its numbers are selected on the val set they report.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
from flax import nnx

from models import MoEConfig, SurgeryError, Transformer, count_params, flops_per_token, preset, upcycle
from research.experiments import common

SPLITS = ("random", "clustered")
ARMS = ("dense", "random", "clustered", "scratch")
LABELS = {"dense": "dense, continued", "random": "MoE, random split", "clustered": "MoE, clustered split",
          "scratch": "MoE from scratch (N+T steps)"}
TUNED_BY = {"dense": "dense", "random": "random", "clustered": "random"}  # whose lr grid an arm's lr comes from
SMOKE = dict(seeds=(0,), pretrain_steps=6, continue_steps=4, batch_size=4, seq_len=32, lrs=(3e-3,), eval_every=2,
             val_batch=8, val_batches=2)


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/upcycling"
  seeds: tuple[int, ...] = (0, 1, 2)
  pretrain_steps: int = 200
  """N: dense training before the conversion."""
  continue_steps: int = 100
  """T: every arm's steps after the conversion."""
  batch_size: int = 16
  seq_len: int = 64
  d_ff: int = 512
  num_experts: int = 8
  top_k: int = 2
  pretrain_lr: float = 3e-3
  """Dense pretraining and the scratch MoE (the CLI default, not tuned)."""
  lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
  """Continued-training peak lrs tried with seeds[0] for the dense arm and the random-split MoE."""
  scratch: bool = True
  eval_every: int = 20
  val_batch: int = 32
  val_batches: int = 4
  """Held-out windows: val_batches batches of val_batch windows of seq_len bytes."""


def sized(cfg: Config) -> Config:
  """The run's sizes: `cfg` itself, or at smoke size the SMOKE values over it; checks them."""
  cfg = dataclasses.replace(cfg, **SMOKE) if cfg.smoke else cfg
  if cfg.d_ff % cfg.num_experts:
    raise SurgeryError(f"d_ff={cfg.d_ff} does not split into num_experts={cfg.num_experts} equal experts; "
                       f"pick a num_experts that divides it")
  if not cfg.seeds or not cfg.lrs or cfg.pretrain_steps < 1 or cfg.continue_steps < 1:
    raise ValueError("upcycling needs at least one seed, one lr and pretrain_steps, continue_steps >= 1")
  return cfg


def param_counts(c) -> dict:
  """{"total", "active"} parameters of a config: active counts the top_k of the E routed experts a token uses."""
  total = count_params(c)
  if c.moe is None:
    return {"total": total, "active": total}
  per_expert = 3 * c.d_model * (c.moe.d_expert or c.d_ff)
  return {"total": total, "active": total - c.n_layers * (c.moe.num_experts - c.moe.top_k) * per_expert}


def split_error(dense: Transformer, moe: Transformer, scale: float, *, samples: int = 256, seed: int = 0) -> float:
  """How far the experts are from an exact split of the dense FFN: max over layers of
  max|Σ_e Expert_e(h)/s − FFN(h)| / max|FFN(h)| for Gaussian h (float64 NumPy; 0 up to rounding when exact).
  Expert_e and FFN are SwiGLUs, silu(h·W_gate)·(h·W_up)·W_down, with the MoE's per-expert weight stacks."""
  silu = lambda z: z / (1 + np.exp(-z))
  f64 = lambda w: np.asarray(w[...], np.float64)
  g, u, d = (f64(getattr(dense.blocks, k)) for k in ("w_gate_DF", "w_up_DF", "w_down_FD"))
  ge, ue, de = (f64(getattr(moe.blocks.moe, k)) for k in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
  h_ND = np.random.default_rng(seed).standard_normal((samples, g.shape[1]))
  err = 0.0
  for l in range(g.shape[0]):
    ffn_ND = (silu(h_ND @ g[l]) * (h_ND @ u[l])) @ d[l]
    experts_ND = sum((silu(h_ND @ ge[l, e]) * (h_ND @ ue[l, e])) @ de[l, e] for e in range(ge.shape[1])) / scale
    err = max(err, float(np.abs(experts_ND - ffn_ND).max() / np.abs(ffn_ND).max()))
  return err


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  cfg = sized(cfg)
  N, T, E, K = cfg.pretrain_steps, cfg.continue_steps, cfg.num_experts, cfg.top_k
  train, val = common.corpus_and_val(cfg.val_batch, cfg.seq_len, cfg.val_batches)
  fit = functools.partial(common.fit, tokens=train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, val=val)
  dense_c = preset("tiny", d_ff=cfg.d_ff)
  done = resume(cfg)
  runs, tune, chosen = done["runs"], done["tune"], done["chosen"]
  t_start = time.perf_counter()
  for seed in cfg.seeds:
    if seed in runs:
      continue
    t_seed = time.perf_counter()
    pre = fit(Transformer(dense_c, rngs=nnx.Rngs(seed)), common.phase_optimizer(cfg.pretrain_lr, N), steps=N,
              seed=seed, eval_every=max(N // 4, 1))
    dense = pre.model
    candidates = {"dense": dense, **{s: upcycle(dense, E, K, s, seed=seed) for s in SPLITS}}
    run = {"pretrain_curve": pre.curve(), "dense_val": pre.final_val, "arms": {},
           "split_error": {s: split_error(dense, candidates[s], E) for s in SPLITS}}
    for arm, model in candidates.items():
      at = pre.final_val if arm == "dense" else common.evaluate(model, val)
      tuning = seed == cfg.seeds[0] and TUNED_BY[arm] == arm
      fits = {lr: fit(model, common.phase_optimizer(lr, T), steps=T, seed=seed, start=N, eval_every=cfg.eval_every)
              for lr in (cfg.lrs if tuning else (chosen[TUNED_BY[arm]],))}
      if tuning:
        tune[arm] = {lr: f.final_val for lr, f in fits.items()}
        chosen[arm] = min(tune[arm], key=tune[arm].get)
      lr = chosen[TUNED_BY[arm]]
      run["arms"][arm] = {"lr": lr, "at_conversion": at, "curve": [(N, at)] + fits[lr].curve(),
                          "final": fits[lr].final_val, "train_tail": common.train_tail(fits[lr].records)}
    if cfg.scratch:
      moe_c = candidates["random"].c
      f = fit(Transformer(moe_c, rngs=nnx.Rngs(seed)), common.phase_optimizer(cfg.pretrain_lr, N + T),
              steps=N + T, seed=seed, eval_every=max((N + T) // 6, 1))
      run["arms"]["scratch"] = {"lr": cfg.pretrain_lr, "at_conversion": None, "curve": f.curve(), "final": f.final_val,
                                "train_tail": common.train_tail(f.records)}
    run["wall_s"] = time.perf_counter() - t_seed
    runs[seed] = run
    if not cfg.smoke:
      common.save_partial(cfg, runs=runs, tune=tune, chosen=chosen)
    print(f"seed {seed}: " + ", ".join(f"{a} {r['final']:.4f}" for a, r in run["arms"].items())
          + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
  shapes = {"dense": dense_c, "moe": dataclasses.replace(dense_c, moe=MoEConfig(num_experts=E, top_k=K,
                                                                               d_expert=cfg.d_ff // E))}
  result = {"config": dataclasses.asdict(cfg), "steps": {"pretrain": N, "continue": T},
            "tokens": {"continue": T * cfg.batch_size * cfg.seq_len,
                       "total": (N + T) * cfg.batch_size * cfg.seq_len},
            "params": {k: param_counts(c) for k, c in shapes.items()},
            "flops_per_token": {k: flops_per_token(c, cfg.seq_len) for k, c in shapes.items()},
            "tune": {arm: {str(lr): v for lr, v in t.items()} for arm, t in tune.items()},
            "lr": {arm: chosen[TUNED_BY[arm]] for arm in TUNED_BY} | ({"scratch": cfg.pretrain_lr} if cfg.scratch
                                                                        else {}),
            "seeds": {s: runs[s] for s in cfg.seeds},
            "timing": {"wall_s": time.perf_counter() - t_start, "cpu_s": time.process_time()}}
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


def resume(cfg: Config) -> dict:
  """What an interrupted full run with the same config finished (OUT/partial.json): its seeds' runs and the lr
  tuning; nothing for a smoke run or another config."""
  p = common.load_partial(cfg)
  if p is None:
    return {"runs": {}, "tune": {}, "chosen": {}}
  return {"runs": {int(s): r for s, r in p["runs"].items()}, "chosen": p["chosen"],
          "tune": {a: {float(lr): v for lr, v in t.items()} for a, t in p["tune"].items()}}


def paired(result: dict, arm: str, key: str = "final", base: str = "dense") -> tuple[float, float]:
  """Mean ± std over seeds of the per-seed difference arm − base of `key`."""
  return common.versus(result, arm, base, key).d


stat = common.seed_stat


def tables(result: dict) -> list[str]:
  arms = [a for a in ARMS if a in next(iter(result["seeds"].values()))["arms"]]
  seeds = list(result["seeds"])
  N, T = result["steps"]["pretrain"], result["steps"]["continue"]
  dense_val = common.mean_std([r["dense_val"] for r in result["seeds"].values()])
  split_err = max(e for r in result["seeds"].values() for e in r["split_error"].values())
  p, fl = result["params"], result["flops_per_token"]
  vs = common.against(result, "dense", arms=arms)
  rows = []
  for arm in arms:
    kind = "dense" if arm == "dense" else "moe"
    rows.append([LABELS[arm], f"{p[kind]['total']:,} / {p[kind]['active']:,}", f"{fl[kind] / 1e6:.2f} M",
                 f"{result['lr'][arm]:g}", "–" if arm == "scratch" else common.pm(stat(result, arm, "at_conversion")),
                 common.pm(stat(result, arm, "final")), common.delta_cell(vs, arm),
                 common.pm(stat(result, arm, "train_tail"))])
  lines = [f"Dense model after N = {N} steps: val loss {common.pm(dense_val)} (nats/byte). Split exactness "
           f"(Σ_e Expert_e = s·FFN, float64 on Gaussian inputs): max relative error {split_err:.1e} over layers, "
           f"splits and seeds. Continued arms: T = {T} steps = "
           f"{result['tokens']['continue']:,} tokens each; scratch: {N + T} steps = {result['tokens']['total']:,} "
           f"tokens (= dense pretraining + continuation). Seeds {', '.join(map(str, seeds))}; mean ± std (ddof 1); "
           "Δ = per-seed difference to the dense arm.", "",
           *common.table(["arm", "params total / active", "train FLOPs/token", "lr", "val loss right after conversion",
                          f"val loss after T = {T} steps", "Δ vs dense after T", "train loss (last 10 steps)"], rows)]
  lines += common.lr_grid_table(result["tune"], LABELS.get, f"Continued-training lr grid (seed {seeds[0]}, final val "
                                f"loss after T steps):", " (the arms share the grid)")
  t = result.get("timing")
  return lines + ([] if not t else [
      "", f"Run time: {t['wall_s']:.0f} s wall, {t['cpu_s']:.0f} s CPU (the whole process) on the shared 2-core VM"
      + (f" {t['note']}" if t.get("note") else "") + "."])


def _agree(result: dict, arm: str, base: str = "dense") -> str:
  v = common.versus(result, arm, base)
  return f"lower in {v.lower} of {v.n} seeds"


def findings(result: dict) -> list[str]:
  gap = {s: paired(result, s, "at_conversion") for s in SPLITS}
  after = {s: paired(result, s) for s in SPLITS}
  rec = {s: 1 - after[s][0] / gap[s][0] for s in SPLITS}
  rc = common.versus(result, "clustered", "random")
  ratio = result["params"]["moe"]["active"] / result["params"]["dense"]["active"]
  lines = [
      f"Reading: the conversion costs {common.pm(gap['random'], True)} nats/byte (random split) and "
      f"{common.pm(gap['clustered'], True)} (clustered) of val loss over the dense model; the experts sum to the dense "
      "FFN exactly (table), so the cost is the top-2 routing by a router that has not learned anything yet.",
      f"Reading: after T more steps the random-split MoE is {common.pm(after['random'], True)} from the dense model "
      f"continued on the same tokens ({_agree(result, 'random')}; clustered {common.pm(after['clustered'], True)}, "
      f"{_agree(result, 'clustered')})"
      + (f": it wins back {100 * rec['random']:.0f}% (random) / {100 * rec['clustered']:.0f}% (clustered) of its "
         "conversion gap" if min(gap[s][0] for s in SPLITS) > 0 else "")
      + f", with {100 * ratio:.0f}% of the dense model's active parameters per token.",
      f"Reading: clustered − random after continued training: {rc.pm()} "
      + ("(within 2 std: the splits end level, as LLaMA-MoE reports)." if rc.verdict == "level" else
         "(beyond 2 std of the seeds)."),
  ]
  if "scratch" in next(iter(result["seeds"].values()))["arms"]:
    v = common.versus(result, "random", "scratch")
    lines.append(f"Reading: the upcycled MoE (random) − the same MoE trained from scratch on the same N+T steps' "
                 f"tokens: {v.pm()} (upcycled lower in {v.lower} of {len(result['seeds'])} seeds); the "
                 f"scratch MoE runs at the untuned pretraining lr {result['lr']['scratch']:g}"
                 + (", below the continued arms' tuned one, so this comparison may favour upcycling."
                    if result["lr"]["scratch"] < result["lr"]["random"] else "."))
  return lines


def plot(result: dict):
  import matplotlib.pyplot as plt
  seeds = list(result["seeds"].values())
  N = result["steps"]["pretrain"]
  arms = [a for a in ARMS if a in seeds[0]["arms"]]
  colors = {"dense": "k", "random": "C0", "clustered": "C2", "scratch": "C3"}
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  for i, ax in enumerate(axes):
    if i == 0:
      x, y = common.band([s["pretrain_curve"] for s in seeds])
      ax.plot(x, y.mean(0), ":", color="k", label="dense pretraining")
    for arm in arms:
      x, y = common.band([s["arms"][arm]["curve"] for s in seeds])
      keep = x >= N if i == 1 else x >= 0
      m, sd = y.mean(0)[keep], y.std(0)[keep]
      ax.plot(x[keep], m, "-o", ms=3, color=colors[arm], label=f"{LABELS[arm]} (lr {result['lr'][arm]:g})")
      ax.fill_between(x[keep], m - sd, m + sd, color=colors[arm], alpha=0.15)
    ax.axvline(N, color="gray", ls=":", lw=1)
    ax.set(xlabel="training step (conversion at the dotted line)", ylabel="val loss (nats/byte)")
  axes[0].set_title(f"dense → top-{result['config']['top_k']}-of-{result['config']['num_experts']} MoE "
                    f"({len(seeds)} seeds, mean ± std)")
  axes[1].set_title("after the conversion: equal extra tokens")
  lo = min(s["arms"][a]["final"] for s in seeds for a in arms)
  hi = max(s["arms"][a]["at_conversion"] or s["arms"][a]["final"] for s in seeds for a in arms)
  axes[1].set_ylim(lo - 0.05, hi + 0.05)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict):
  common.write_experiment(cfg, "upcycling", __doc__.split("\n\n")[0], result, tables, findings, plot)


if __name__ == "__main__":
  common.cli(main, Config, cache="optlab-upcycling-cache-")
