"""Does inserting a zero-initialised block into the middle of a trained transformer, then training on, beat training
the original model on for the same tokens, and how does the answer depend on how much training data there is?

  python -m research.experiments.depth_expansion            # full: writes research/results/depth_expansion/
  python -m research.experiments.depth_expansion --smoke    # seconds: what the tests and the notebook run

Claim (shared/reference/methods.md §3 and §12 row 5; Cheng et al., "A Qualitative Test-Risk Mechanism for Scaling
Behavior in Normalized Residual Networks", arXiv 2605.08297): in a trained residual network a block inserted at an
intermediate layer near zero initialisation leaves the function unchanged; if the first-order descent condition
holds (a non-zero gradient of the new block's zeroed weights), a small step along it (the "jumpboard" model) has
strictly lower risk, and whether the expansion's statistical cost is controlled depends on the data size n. A theory
paper without experiments to match: this is a small illustration of the mechanism, not a test of its bounds.
Differences: the paper's network is POST-norm, h ← Norm(h + f(h)); ours (models/transformer.py) is PRE-norm,
x ← x + Attn(N(x)), x ← x + FFN(N(x)). Zeroing the new block's W_o and W_down (`models.insert_block`) makes it the
identity exactly here (no normalisation after the sum), and only those two projections get gradient at insertion:
∂L/∂W_o = Σ_t o_tᵀγ_t, ∂L/∂W_down = Σ_t a_tᵀγ_t (o the attention output, a the SwiGLU activation, γ = ∂L/∂x).

Setup. `tiny` (D 64, L = 2 blocks, d_ff 128, 4/2 heads, QK-norm), seeds 0-2 (init, batches, the new block's init).
Training data: n bytes of the train split (`subset`: n/chunk evenly spaced chunks, so n changes the amount of data,
not its kind), n ∈ `sizes` (0 = the whole split, 30M bytes); validation on the held-out split. Phase 1: N steps of
B×S windows of the subset (AdamW wd 0.1, clip 1, 10% warmup, cosine to 0.1x). Insertion: `insert_block(model, L//2)`;
val loss before and after must be equal. At insertion: the mean gradient over the first K phase-2 batches, its
Frobenius norms for the new block's W_o and W_down next to the old blocks' same projections (the descent condition),
and the max |gradient| of the new block's other weights (0 exactly). Jumpboard: the new W_o, W_down set to −η·g/‖g‖
(‖g‖ their joint norm): the loss on those K batches must fall by ≈ η‖g‖ (checked by a central difference), the val
loss may or may not. Phase 2, T more steps on data steps N..N+T-1 of the same subset and seed, for
  continued: the L-block model;   expanded: the (L+1)-block model;
and optionally scratch: an (L+1)-block model from random init for N + T steps on the same subset and data steps.
Both phase-2 arms start from a fresh AdamW state with the same schedule (the new block has no moments to inherit;
keeping the old weights' moments in one arm only would confound the comparison).
Honest means: equal tokens (phase 2: T·B·S input positions per arm, the same batches; scratch = N + T steps), the
held-out split, 3 seeds with the per-seed paired gain = val(expanded) − val(continued) (negative: expansion helps)
as mean ± std per n. The peak lr is one value for every phase and arm, not tuned: both arms start from the same
weights and the question is the architecture change under a fixed recipe; an lr that suits the fresh block better
could favour expansion, which this run does not explore.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Annotated

import jax
import numpy as np
from flax import nnx

from models import Transformer, insert_block, preset
from models.surgery import OUT_PROJECTIONS
from research import flags
from research.data import get_batch
from research.experiments import common

ARMS = ("continued", "expanded", "scratch")
LABELS = {"continued": "continued (L blocks)", "expanded": "expanded (L+1, inserted)",
          "scratch": "L+1 from scratch (N+T steps)"}
SMOKE = dict(seeds=(0,), sizes=(4096,), chunk=256, pretrain_steps=6, continue_steps=4, batch_size=4, seq_len=32,
             grad_batches=2, eval_every=2, val_batches=2)


class DataSizeError(ValueError):
  """A training-set size the subset cannot be built with."""


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/depth_expansion"
  seeds: tuple[int, ...] = (0, 1, 2)
  sizes: Annotated[tuple[int, ...], flags.NONNEGATIVE] = (16384, 131072, 0)
  """Training-set sizes n in bytes (multiples of chunk); 0 = the whole train split."""
  chunk: int = 1024
  pretrain_steps: int = 150
  """N: training before the insertion."""
  continue_steps: int = 100
  """T: each arm's steps after it."""
  batch_size: int = 16
  seq_len: int = 64
  lr: float = 3e-3
  """Peak lr of every phase and arm (not tuned; module docstring)."""
  grad_batches: int = 4
  """K: phase-2 batches the gradient at insertion is averaged over."""
  jump: float = 0.01
  """η: Frobenius norm of the jumpboard step on the new block's projections."""
  scratch: bool = True
  eval_every: int = 20
  val_batches: int = 8
  """Held-out batches of batch_size windows."""


def sized(cfg: Config) -> Config:
  cfg = dataclasses.replace(cfg, **SMOKE) if cfg.smoke else cfg
  if not cfg.seeds or not cfg.sizes or cfg.pretrain_steps < 1 or cfg.continue_steps < 1 or cfg.grad_batches < 1:
    raise ValueError("depth_expansion needs seeds, sizes, and pretrain_steps, continue_steps, grad_batches >= 1")
  return cfg


def subset(tokens: np.ndarray, n: int, chunk: int) -> np.ndarray:
  """n tokens of `tokens`: n/chunk chunks of `chunk` consecutive tokens at evenly spaced starts (first at 0, last
  ending at the end); n = 0 or n ≥ len(tokens) gives all of them."""
  if n == 0 or n >= len(tokens):
    return tokens
  if n < 0 or chunk < 1 or n % chunk:
    raise DataSizeError(f"a subset of n={n} tokens needs n to be a positive multiple of chunk={chunk}; "
                        f"pick sizes that are multiples of chunk (or 0 for all tokens)")
  starts = np.linspace(0, len(tokens) - chunk, n // chunk).astype(np.int64)
  return np.asarray(tokens[starts[:, None] + np.arange(chunk)]).reshape(-1)


def insertion_grads(model: Transformer, index: int, batches) -> dict:
  """The mean training-loss gradient over `batches` at block `index` (just inserted) and at the other blocks.

  Returns {"new": {name: ‖∂L/∂W‖_F} for the block's output projections, "old": the same, mean over the other blocks,
  "other_max_abs": max |∂L/∂w| over the block's other weights, "grads": {name: the new block's gradient (NumPy)}}.
  """
  graphdef, params, buffers = common.split(model)
  grad = jax.jit(jax.grad(lambda p, x, y: common.loss_fn(graphdef, p, buffers, x, y)[0]))
  total = None
  for x, y in batches:
    g = jax.tree.map(lambda a: np.asarray(a, np.float64), grad(params, x, y))
    total = g if total is None else jax.tree.map(np.add, total, g)
  blocks = jax.tree.map(lambda a: a / len(batches), total)["blocks"]
  proj = [k for k in OUT_PROJECTIONS if k in blocks]
  others = [i for i in range(model.c.n_layers) if i != index]
  return {"new": {k: float(np.linalg.norm(blocks[k][index])) for k in proj},
          "old": {k: float(np.mean([np.linalg.norm(blocks[k][i]) for i in others])) for k in proj},
          "other_max_abs": max(float(np.abs(v[index]).max()) for k, v in blocks.items() if k not in proj),
          "grads": {k: blocks[k][index] for k in proj}}


def jumpboard(model: Transformer, index: int, grads: dict, eta: float) -> Transformer:
  """`model` with block `index`'s output projections set to −η·g/‖g‖, ‖g‖ the joint Frobenius norm of `grads`."""
  norm = np.sqrt(sum(np.sum(np.square(g)) for g in grads.values()))
  graphdef, params, buffers = common.split(model)
  blocks = dict(params["blocks"])
  for k, g in grads.items():
    w = np.array(blocks[k])
    w[index] = -eta * g / norm
    blocks[k] = w
  return common.join(graphdef, {**params, "blocks": blocks}, buffers)


def _out_norm(model: Transformer, index: int) -> float:
  """Joint Frobenius norm of block `index`'s W_o and W_down."""
  blocks = common.split(model)[1]["blocks"]
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(blocks[k][index], np.float64)))
                           for k in OUT_PROJECTIONS if k in blocks)))


def run_one(cfg: Config, train, val, n: int, seed: int) -> dict:
  """Phase 1, insertion measurements and phase 2 for one data size and seed."""
  N, T, B, S = cfg.pretrain_steps, cfg.continue_steps, cfg.batch_size, cfg.seq_len
  data = subset(train, n, cfg.chunk)
  fit = functools.partial(common.fit, tokens=data, batch_size=B, seq_len=S, seed=seed, val=val)
  c = preset("tiny")
  index = c.n_layers // 2
  pre = fit(Transformer(c, rngs=nnx.Rngs(seed)), common.phase_optimizer(cfg.lr, N), steps=N, eval_every=max(N // 4, 1))
  big = insert_block(pre.model, index, seed=seed)
  batches = [get_batch(data, seed, N + i, B, S) for i in range(cfg.grad_batches)]
  g = insertion_grads(big, index, batches)
  train_at = common.evaluate(big, batches)
  jump = jumpboard(big, index, g["grads"], cfg.jump)
  at = {"val_before": pre.final_val, "val_after": common.evaluate(big, val), "grad_new": g["new"],
        "grad_old": g["old"], "grad_other_max_abs": g["other_max_abs"],
        "grad_norm": float(np.sqrt(sum(v ** 2 for v in g["new"].values()))), "train": train_at,
        "train_jump": common.evaluate(jump, batches), "val_jump": common.evaluate(jump, val),
        "train_back": common.evaluate(jumpboard(big, index, g["grads"], -cfg.jump), batches)}
  at["slope_measured"] = (at["train_jump"] - at["train_back"]) / (2 * cfg.jump)  # ≈ −‖g‖ (central difference)
  start = {"continued": pre.model, "expanded": big}
  arms = {}
  for arm, model in start.items():
    f = fit(model, common.phase_optimizer(cfg.lr, T), steps=T, start=N, eval_every=cfg.eval_every)
    arms[arm] = {"curve": [(N, pre.final_val)] + f.curve(), "final": f.final_val,
                 "train_tail": common.train_tail(f.records)}
    if arm == "expanded":
      arms[arm]["new_out_norm"] = _out_norm(f.model, index)
      arms[arm]["old_out_norm"] = float(np.mean([_out_norm(f.model, i) for i in range(c.n_layers + 1) if i != index]))
  if cfg.scratch:
    f = fit(Transformer(big.c, rngs=nnx.Rngs(seed)), common.phase_optimizer(cfg.lr, N + T), steps=N + T,
            eval_every=max((N + T) // 6, 1))
    arms["scratch"] = {"curve": f.curve(), "final": f.final_val, "train_tail": common.train_tail(f.records)}
  return {"n": len(data), "pretrain_curve": pre.curve(), "insertion": at, "arms": arms}


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  cfg = sized(cfg)
  train, val = common.corpus_and_val(cfg.batch_size, cfg.seq_len, cfg.val_batches)
  t_start = time.perf_counter()
  done = resume(cfg)
  runs = {}
  for n in cfg.sizes:
    runs[n] = {}
    for seed in cfg.seeds:
      if f"{n}/{seed}" in done:
        runs[n][seed] = done[f"{n}/{seed}"]
        continue
      t_run = time.perf_counter()
      r = runs[n][seed] = run_one(cfg, train, val, n, seed)
      r["wall_s"] = time.perf_counter() - t_run
      if not cfg.smoke:
        done[f"{n}/{seed}"] = r
        common.save_partial(cfg, runs=done)
      delta = abs(r["insertion"]["val_after"] - r["insertion"]["val_before"])
      finals = ", ".join(f"{a} {v['final']:.4f}" for a, v in r["arms"].items())
      print(f"n {r['n']} seed {seed}: abs(Δ val) at insertion {delta:.1e}, {finals} "
            f"({time.perf_counter() - t_start:.0f} s)", flush=True)
  tokens = cfg.batch_size * cfg.seq_len
  result = {"config": dataclasses.asdict(cfg),
            "steps": {"pretrain": cfg.pretrain_steps, "continue": cfg.continue_steps},
            "tokens": {"continue": cfg.continue_steps * tokens,
                       "total": (cfg.pretrain_steps + cfg.continue_steps) * tokens},
            "runs": runs, "timing": {"wall_s": time.perf_counter() - t_start, "cpu_s": time.process_time()}}
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


def resume(cfg: Config) -> dict:
  """{"n/seed": run} that an interrupted full run with the same config finished (OUT/partial.json); nothing for a
  smoke run or another config."""
  p = common.load_partial(cfg)
  return {} if p is None else p["runs"]


def _seeds(result: dict, n) -> list[dict]:
  return list(result["runs"][n].values())


def gain(result: dict, n, arm: str = "expanded", base: str = "continued") -> tuple[float, float]:
  """Mean ± std over seeds of val(arm) − val(base) after phase 2 at data size n (negative: arm is better)."""
  return common.mean_std([r["arms"][arm]["final"] - r["arms"][base]["final"] for r in _seeds(result, n)])


def _ms(result, n, f) -> tuple[float, float]:
  return common.mean_std([f(r) for r in _seeds(result, n)])


def _size(r) -> str:
  return f"{r['n']:,}"


def tables(result: dict) -> list[str]:
  cfg = result["config"]
  N, T = result["steps"]["pretrain"], result["steps"]["continue"]
  names = list(next(iter(next(iter(result["runs"].values())).values()))["insertion"]["grad_new"])
  seeds = list(next(iter(result["runs"].values())))
  has_scratch = "scratch" in next(iter(next(iter(result["runs"].values())).values()))["arms"]
  lines = [f"Seeds {', '.join(map(str, seeds))}; mean ± std (ddof 1). Phase 1: N = {N} steps; phase 2: T = {T} steps = "
           f"{result['tokens']['continue']:,} tokens per arm (the same batches); scratch: N + T steps = "
           f"{result['tokens']['total']:,} tokens. Epochs = (N + T)·B·S / n.", "",
           "At insertion (block inserted at index L//2; gradients: mean over the first "
           f"{cfg['grad_batches']} phase-2 batches; jumpboard step η = {cfg['jump']}):", "",
           "| n (bytes) | val loss before insertion | max abs(Δ val) at insertion | "
           + " | ".join(f"‖∂L/∂{k}‖ new / old blocks" for k in names)
           + " | max abs grad, other new weights | slope along −g: measured / −‖g‖ | Δ train loss, jumpboard | "
           "Δ val loss, jumpboard |", "|---|---|---|" + "---|" * len(names) + "---|---|---|---|"]
  for n, by_seed in result["runs"].items():
    rs = list(by_seed.values())
    ins = [r["insertion"] for r in rs]
    lines.append(
        f"| {_size(rs[0])} | {common.pm(_ms(result, n, lambda r: r['insertion']['val_before']))} | "
        f"{max(abs(i['val_after'] - i['val_before']) for i in ins):.1e} | "
        + " | ".join(f"{np.mean([i['grad_new'][k] for i in ins]):.3g} / {np.mean([i['grad_old'][k] for i in ins]):.3g}"
                     for k in names)
        + f" | {max(i['grad_other_max_abs'] for i in ins):.1e} | "
        f"{np.mean([i['slope_measured'] / -i['grad_norm'] for i in ins]):.4f} | "
        f"{common.pm(_ms(result, n, lambda r: r['insertion']['train_jump'] - r['insertion']['train']), True, 5)} | "
        f"{common.pm(_ms(result, n, lambda r: r['insertion']['val_jump'] - r['insertion']['val_after']), True, 5)} |")
  lines += ["", "After phase 2 (val loss, nats/byte; gain = expanded − continued per seed, negative = expansion "
                "helps; train loss = mean of the last 10 steps):", "",
            "| n (bytes) | epochs | continued | expanded | gain | " + ("L+1 from scratch | " if has_scratch else "")
            + "train loss continued / expanded | new block ‖W_o, W_down‖ / old blocks' after T |",
            "|---|---|---|---|---|" + ("---|" if has_scratch else "") + "---|---|"]
  for n in result["runs"]:
    r0 = _seeds(result, n)[0]
    epochs = result["tokens"]["total"] / r0["n"]
    cells = [_size(r0), f"{epochs:.3g}", common.pm(_ms(result, n, lambda r: r["arms"]["continued"]["final"])),
             common.pm(_ms(result, n, lambda r: r["arms"]["expanded"]["final"])), common.pm(gain(result, n), True)]
    if has_scratch:
      cells.append(common.pm(_ms(result, n, lambda r: r["arms"]["scratch"]["final"])))
    cells += [f"{_ms(result, n, lambda r: r['arms']['continued']['train_tail'])[0]:.4f} / "
              f"{_ms(result, n, lambda r: r['arms']['expanded']['train_tail'])[0]:.4f}",
              f"{_ms(result, n, lambda r: r['arms']['expanded']['new_out_norm'])[0]:.3g} / "
              f"{_ms(result, n, lambda r: r['arms']['expanded']['old_out_norm'])[0]:.3g}"]
    lines.append("| " + " | ".join(cells) + " |")
  return lines + _timing(result)


def _timing(result: dict) -> list[str]:
  t = result.get("timing")
  return [] if not t else [
      "", f"Run time: {t['wall_s']:.0f} s wall, {t['cpu_s']:.0f} s CPU (the whole process) on the shared 2-core VM"
      + (f" {t['note']}" if t.get("note") else "") + "."]


def findings(result: dict) -> list[str]:
  ins = [r["insertion"] for by_seed in result["runs"].values() for r in by_seed.values()]
  worst = max(abs(i["val_after"] - i["val_before"]) for i in ins)
  slope = [i["slope_measured"] / -i["grad_norm"] for i in ins]
  val_down = sum(i["val_jump"] < i["val_after"] for i in ins)
  lines = [
      f"Reading: insertion preserves the function (max abs(Δ val) {worst:.1e} over {len(ins)} runs); the new block's "
      f"W_o and W_down get non-zero gradient in every run (‖g‖ {min(i['grad_norm'] for i in ins):.3g} to "
      f"{max(i['grad_norm'] for i in ins):.3g}), its other weights exactly "
      f"{max(i['grad_other_max_abs'] for i in ins):g}: the first-order descent condition holds.",
      f"Reading: the jumpboard step lowers the loss on the batches the gradient came from in "
      f"{sum(i['train_jump'] < i['train'] for i in ins)} of {len(ins)} runs (finite-difference slope / −‖g‖ = "
      f"{min(slope):.3f} to {max(slope):.3f}); the held-out loss falls in {val_down} of {len(ins)}.",
  ]
  parts = []
  for n, by_seed in result["runs"].items():
    d = [r["arms"]["expanded"]["final"] - r["arms"]["continued"]["final"] for r in by_seed.values()]
    m, s = gain(result, n)
    parts.append(f"n = {_size(next(iter(by_seed.values())))}: {m:+.4f} ± {s:.4f} (expanded lower in "
                 f"{sum(x < 0 for x in d)} of {len(d)} seeds)")
  lines.append("Reading: gain (expanded − continued) after equal phase-2 tokens, " + "; ".join(parts) + ".")
  first = next(iter(result["runs"].values()))
  if "scratch" in next(iter(first.values()))["arms"]:
    parts = []
    for n, by_seed in result["runs"].items():
      m, s = gain(result, n, "expanded", "scratch")
      parts.append(f"n = {_size(next(iter(by_seed.values())))}: {m:+.4f} ± {s:.4f}")
    lines.append("Reading: expanded − (L+1)-block model from scratch on the same N + T steps: " + "; ".join(parts)
                 + ". Recipes differ too: scratch runs one warmup + cosine over N + T steps, the expanded model two "
                 "(phase 1 decays to 0.1x by step N, phase 2 warms up again).")
  means = {n: gain(result, n) for n in result["runs"]}
  spread = max(m for m, _ in means.values()) - min(m for m, _ in means.values())
  noise = 2 * max(s for _, s in means.values())
  gap = {n: _ms(result, n, lambda r: r["arms"]["continued"]["final"] - r["arms"]["continued"]["train_tail"])[0]
         for n in result["runs"]}
  sizes = list(result["runs"])
  lines.append(
      f"Reading: the gain {'does not change' if spread <= noise else 'changes'} with n beyond seed noise (spread of "
      f"the means {spread:.4f}, 2 std {noise:.4f}), although the smallest set is overfit: val − train loss of the "
      f"continued model {gap[sizes[0]]:+.3f} at n = {_size(_seeds(result, sizes[0])[0])} vs {gap[sizes[-1]]:+.3f} at "
      f"n = {_size(_seeds(result, sizes[-1])[0])}.")
  return lines


def plot(result: dict):
  """Top: val loss against step per data size (mean ± std over seeds); bottom: the per-seed gain curve."""
  import matplotlib.pyplot as plt
  sizes = list(result["runs"])
  N = result["steps"]["pretrain"]
  colors = {"continued": "k", "expanded": "C0", "scratch": "C3"}
  fig, axes = plt.subplots(2, len(sizes), figsize=(4.6 * len(sizes), 6.4), squeeze=False, sharex=True,
                           gridspec_kw={"height_ratios": [2, 1]})
  for col, n in enumerate(sizes):
    ax, bx = axes[0][col], axes[1][col]
    rs = _seeds(result, n)
    x, y = common.band([r["pretrain_curve"] for r in rs])
    ax.plot(x, y.mean(0), ":", color="gray", label="phase 1 (L blocks)")
    for arm in ARMS:
      if arm not in rs[0]["arms"]:
        continue
      x, y = common.band([r["arms"][arm]["curve"] for r in rs])
      m, sd = y.mean(0), y.std(0)
      ax.plot(x, m, "-o", ms=3, color=colors[arm], alpha=0.5 if arm == "scratch" else 1, label=LABELS[arm])
      ax.fill_between(x, m - sd, m + sd, color=colors[arm], alpha=0.15)
    x, cont = common.band([r["arms"]["continued"]["curve"] for r in rs])
    d = common.band([r["arms"]["expanded"]["curve"] for r in rs])[1] - cont
    bx.plot(x, d.T, color="C0", alpha=0.3, lw=1)
    bx.plot(x, d.mean(0), "-o", ms=3, color="C0")
    bx.axhline(0, color="k", lw=0.8)
    for a in (ax, bx):
      a.axvline(N, color="gray", ls=":", lw=1)
    g = gain(result, n)
    ax.set(title=f"n = {rs[0]['n']:,} bytes: gain {g[0]:+.3f} ± {g[1]:.3f}", ylabel="val loss (nats/byte)")
    bx.set(xlabel="step (insertion at the line)", ylabel="expanded − continued")
    tail = [v for r in rs for a in r["arms"].values() for _, v in a["curve"][1:]]
    ax.set_ylim(min(tail) - 0.1, max(tail) + 0.3)
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"depth expansion vs continued training ({len(_seeds(result, sizes[0]))} seeds: mean ± std; "
               "bottom: per seed and mean)")
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict):
  common.write_experiment(cfg, "depth_expansion", __doc__.split("\n\n")[0], result, tables, findings, plot)


if __name__ == "__main__":
  common.cli(main, Config, cache="optlab-depth-cache-")
