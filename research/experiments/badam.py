"""BAdam vs AdamW: at equal steps, how much optimizer-state memory does BAdam save, and what does it cost in
held-out loss?

Claim (shared/reference/methods.md §8a, optimizers.md §9; Luo, Yu & Li, "BAdam", arXiv 2404.02827, NeurIPS 2024,
code Ledzy/BAdam `src/badam/block_optim.py`): block coordinate descent that trains one block (a transformer layer)
at a time with Adam, dropping Adam's state at every switch, needs moments for one block only: memory ≈ 2M + 16M/D GB
for M billion parameters in D blocks (bf16 weights everywhere; fp32 master, gradient and Adam moments of the active
block), and it fine-tunes Llama 3-8B on one RTX 3090 to MT-bench 6.67 (LoRA 6.41).

Setup: the `tiny` preset (d_model 64, tied embedding) with `n_layers` = 6 trained from scratch on the byte corpus by
the train CLI's engine (`research.sweep.run_grid` → `research.train.run`: warmup + cosine schedule, clip 1.0, weight
decay 0.1, on the devices the backend has, 1 when run as a script). Contenders:
  adamw      `adamw`.
  badam      `badam` (optim/badam.py, AdamW inside, the reference's descending order, K = `switch_every` updates
             per block) training every parameter: the embedding as one more block (`include_embedding`), the final
             norm's 64 scales at every step (`always_active`). 7 blocks, each gets several turns.
  badam_ref  `badam` with the reference's defaults: the embedding (here also the output head) and the final norm
             are never trained. From random init this caps the logits (see `frozen_head_floor`); it is run on the lr
             grid at one seed to show what the default costs, not tuned further.
Optimizer-state bytes are measured from initialized state trees (`tx.init(params)` of the tx the CLI builds;
abstract `jax.eval_shape` trees for the `small` and `base` presets) and checked against `analytic_state_bytes`.

Honest here means: equal steps, tokens and batches (same batch size, sequence length, steps and data seeds, so
equal tokens counted as steps × batch × sequence length); the same lr grid at the first seed for every contender,
then 3 seeds at adamw's and badam's best lr (final validation loss on the corpus' held-out split, mean ± std, and
the per-seed paired difference with a t statistic); and the setting named as it is: pre-training from random init,
not the paper's fine-tuning, with a BAdam that still differentiates every parameter (so it saves no backward
compute, and gradients stay full size).

  python -m research.experiments.badam           # full size: writes research/results/badam/
  python -m research.experiments.badam --smoke   # seconds; writes nothing (the tests run this)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from models import Transformer, count_params, preset
from models.config import TransformerConfig
from optim import block_index
from research.experiments import common
from research.sweep import SweepConfig, run_grid
from research.train.config import TrainConfig

NAME = "badam"
QUESTION = ("At equal steps, how much optimizer-state memory does BAdam (one block trained at a time, Adam state "
            "dropped at every switch) save versus AdamW, and what does it cost in validation loss?")
BADAM_HP = {"include_embedding": True, "always_active": ("final_norm",)}  # the `badam` contender's extras
TITLES = {"adamw": "AdamW", "badam": "BAdam (all parameters)",
          "badam_ref": "BAdam, reference default (embedding + final norm frozen)"}


class BAdamExperimentError(ValueError):
  """A configuration this experiment cannot run."""


@dataclasses.dataclass
class Config(common.Base):
  """BAdam vs AdamW on a deeper `tiny`: state bytes, val loss at equal steps, tokens/s."""
  smoke: bool = False
  """A few steps of a 3-layer model, in a temporary directory: the same code path, nothing written to `out`."""
  out: str = "research/results/badam"
  work: str = "runs/experiments/badam"
  """The sweep's run directories (metrics.jsonl, config, checkpoint): finished runs are skipped on a rerun."""
  n_layers: int = 6
  steps: int = 200
  batch_size: int = 8
  seq_len: int = 64
  eval_every: int = 25
  eval_batches: int = 8
  switch_every: int = 8
  """K, BAdam's updates per block (the reference's default is 50): 200 / 8 = 25 turns over 7 blocks."""
  lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2)
  """Peak learning rates tried at the first seed, the same grid for every contender."""
  seeds: tuple[int, ...] = (0, 1, 2)
  """Seeds (init and batch order) at adamw's and badam's best lr; the first one also runs the grid."""
  presets: tuple[str, ...] = ("small", "base")
  """Presets whose state bytes are reported (initialized abstractly, not trained)."""


SMOKE = dict(n_layers=3, steps=8, batch_size=8, seq_len=32, eval_every=4, eval_batches=2, switch_every=2,
             lrs=(1e-2,), seeds=(0,), presets=("small",))


def check(cfg: Config):
  if cfg.n_layers < 2:
    raise BAdamExperimentError(f"--n-layers must be >= 2 so BAdam has several layer blocks, got {cfg.n_layers}")
  if not cfg.lrs or not cfg.seeds:
    raise BAdamExperimentError("--lrs and --seeds need at least one value each")
  if not 1 <= cfg.switch_every <= cfg.steps:
    raise BAdamExperimentError(f"--switch-every must lie in [1, --steps={cfg.steps}], got {cfg.switch_every}")


def labels(switch_every: int) -> dict[str, str]:
  """Contender -> sweep label (OPTIMIZER[KEY=VALUE,...], the hyperparameters as the train CLI's --opt)."""
  return {"adamw": "adamw",
          "badam": f'badam[switch_every={switch_every},include_embedding=true,always_active=["final_norm"]]',
          "badam_ref": f"badam[switch_every={switch_every}]"}


# ---- optimizer-state bytes --------------------------------------------------------------------------------------

def layer_params(c: TransformerConfig) -> int:
  """Parameters of one dense block: q, k, v, o projections D·(N + 2K)·H + N·H·D, SwiGLU 3·D·F, two RMSNorm scales
  of D, and two of H with QK-norm."""
  if c.moe is not None or not c.tie_embeddings:
    raise BAdamExperimentError("the bytes formula covers dense blocks and a tied embedding; use such a preset")
  D, H = c.d_model, c.hd
  return D * (c.n_heads + 2 * c.kv_heads) * H + c.n_heads * H * D + 3 * D * c.d_ff + 2 * D + (2 * H if c.qk_norm else 0)


def analytic_state_bytes(c: TransformerConfig, optimizer: str, *, train_embedding: bool = False,
                         train_final_norm: bool = False) -> int:
  """Expected bytes of `common.optimizer(optimizer, ...)`'s state for model `c` (fp32 moments, int32 counters).

    adamw:  8·P + 4·2     P = L·P_layer + V·D (embedding) + D (final norm): m and v for every parameter;
                          counters: Adam's t and the lr schedule's step (clipping keeps no state)
    badam:  8·(P_layer + V·D·[train_embedding] + D·[train_final_norm]) + 4·4
                          m and v of one layer's slice (the view the inner AdamW sees, the same shape for every
                          layer); the embedding block's slot and an always-active leaf sit in the view beside the
                          layer slice, so they add rather than take a maximum; counters: BAdam's step and active
                          block, the inner Adam's t, the schedule's step
  """
  embed, norm = c.vocab_size * c.d_model, c.d_model
  if optimizer == "adamw":
    return 8 * (c.n_layers * layer_params(c) + embed + norm) + 4 * 2
  if optimizer == "badam":
    return 8 * (layer_params(c) + embed * train_embedding + norm * train_final_norm) + 4 * 4
  raise BAdamExperimentError(f"no bytes formula for optimizer {optimizer!r}; use 'adamw' or 'badam'")


def state_bytes(c: TransformerConfig, optimizer: str, *, concrete: bool = False, **hparams) -> int:
  """Bytes of the optimizer state the train CLI builds (clip + schedule + `optimizer`) for model `c`: of
  `tx.init(params)` on initialized parameters if `concrete`, else of its `jax.eval_shape` (nothing allocated)."""
  tx = common.optimizer(optimizer, 1e-3, 100, **hparams)
  if concrete:
    return common.tree_bytes(tx.init(common.split(Transformer(c, rngs=nnx.Rngs(0)))[1]))
  params = jax.eval_shape(lambda: common.split(Transformer(c, rngs=nnx.Rngs(0)))[1])
  return common.tree_bytes(jax.eval_shape(tx.init, params))


def bytes_rows(cfg: Config) -> list[dict]:
  """Per model (the trained one, then `cfg.presets`): parameters, each contender's state measured and expected, and
  the whole fp32 training state ratio (parameters + gradients + state; the step differentiates every parameter)."""
  models = [(f"tiny, {cfg.n_layers} layers (trained)", preset("tiny", n_layers=cfg.n_layers), True)]
  models += [(name, preset(name), False) for name in cfg.presets]
  rows = []
  for name, c, concrete in models:
    p = count_params(c)
    row = {"model": name, "layers": c.n_layers, "params": p, "layer_params": layer_params(c),
           "adamw": state_bytes(c, "adamw", concrete=concrete), "adamw_expected": analytic_state_bytes(c, "adamw"),
           "badam": state_bytes(c, "badam", concrete=concrete, switch_every=cfg.switch_every, **BADAM_HP),
           "badam_expected": analytic_state_bytes(c, "badam", train_embedding=True, train_final_norm=True),
           "badam_ref": state_bytes(c, "badam", concrete=concrete, switch_every=cfg.switch_every),
           "badam_ref_expected": analytic_state_bytes(c, "badam")}
    for k in ("badam", "badam_ref"):
      row[f"{k}_ratio"] = row[k] / row["adamw"]
      row[f"{k}_total_ratio"] = (8 * p + row[k]) / (8 * p + row["adamw"])
    rows.append(row)
  return rows


def frozen_head_floor(params: dict, c: TransformerConfig) -> tuple[float, float]:
  """(B, floor) for a tied embedding E and final RMSNorm scale g that never train (`badam_ref`).

  logit_v = ⟨g ⊙ x/rms(x), e_v⟩ and ‖x/rms(x)‖ ≤ √D, so |logit_v| ≤ B = √D · max_v ‖g ⊙ e_v‖ whatever the layers
  compute; a softmax over V logits in [−B, B] gives the target at most e^B / (e^B + (V−1)·e^−B), so the cross
  entropy is ≥ floor = log(1 + (V−1)·e^(−2B)).
  """
  e_VD, g_D = np.asarray(params["embed_VD"], np.float64), np.asarray(params["final_norm"], np.float64)
  bound = float(np.sqrt(c.d_model) * np.linalg.norm(e_VD * g_D, axis=1).max())
  return bound, float(np.log1p((c.vocab_size - 1) * np.exp(-2 * bound)))


# ---- training ----------------------------------------------------------------------------------------------------

def embedding_turns(num_blocks: int, switch_every: int, steps: int) -> list[tuple[int, int]]:
  """(first, last) step (1-based update numbers) of each turn of block 0 — the embedding block of the `badam`
  contender — in BAdam's descending order (`optim.block_index`)."""
  active = [int(block_index(t, num_blocks, switch_every=switch_every)) == 0 for t in range(steps)]
  turns = []
  for t, on in enumerate(active, 1):
    if on and (t == 1 or not active[t - 2]):
      turns.append([t, t])
    elif on:
      turns[-1][1] = t
  return [tuple(x) for x in turns]


def best_lr(rows: list[dict]) -> dict[str, float]:
  """Per sweep label, the lr with the lowest mean final val loss over its seeds (a diverged run counts as inf)."""
  by: dict[str, dict[float, list[float]]] = {}
  for r in rows:
    by.setdefault(r["label"], {}).setdefault(r["lr"], []).append(
        float("inf") if r.get("diverged") else float(r["final_val_loss"]))
  return {label: min(lrs, key=lambda lr: (np.mean(lrs[lr]), lr)) for label, lrs in by.items()}


def train_config(cfg: Config) -> TrainConfig:
  return TrainConfig(model="tiny", n_layers=cfg.n_layers, steps=cfg.steps, batch_size=cfg.batch_size,
                     seq_len=cfg.seq_len, eval_every=cfg.eval_every, log_every=cfg.eval_every,
                     eval_batches=cfg.eval_batches, devices=1, mesh="data=-1", progress=False, ckpt_every=cfg.steps,
                     keep=1)


def _grid(lrs: dict[str, tuple[float, ...]]) -> tuple[str, ...]:
  return tuple(f"{label}={','.join(f'{lr:g}' for lr in values)}" for label, values in lrs.items())


def summarize(rows: list[dict], names: dict[str, str]) -> dict[str, dict]:
  """Per contender in `names` (contender -> label; rows at its best lr, one per seed): final val loss mean ± std,
  tokens/s, the val curve's mean and min–max over seeds, and versus adamw (same seeds = same init and batches) the
  per-seed differences, their mean ± std and t = mean / (std / √n)."""
  out = {}
  for name, label in names.items():
    rs = sorted((r for r in rows if r["label"] == label and not r.get("diverged")), key=lambda r: r["seed"])
    if not rs:
      out[name] = {"diverged": True}
      continue
    vals = np.array([[v for _, v in r["curve"]] for r in rs])
    mean, std = common.mean_std(r["final_val_loss"] for r in rs)
    out[name] = {"label": label, "lr": rs[0]["lr"], "seeds": [r["seed"] for r in rs], "final_mean": mean,
                 "final_std": std, "finals": [r["final_val_loss"] for r in rs],
                 "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in rs])),
                 "steps": [s for s, _ in rs[0]["curve"]], "curve_mean": vals.mean(0).tolist(),
                 "curve_min": vals.min(0).tolist(), "curve_max": vals.max(0).tolist()}
  base = dict(zip(out["adamw"]["seeds"], out["adamw"]["finals"])) if not out["adamw"].get("diverged") else {}
  for name, s in out.items():
    if name != "adamw" and not s.get("diverged"):
      diffs = [f - base[seed] for seed, f in zip(s["seeds"], s["finals"]) if seed in base]
      s["diffs"] = diffs
      s["diff_mean"], s["diff_std"] = common.mean_std(diffs) if diffs else (float("nan"), float("nan"))
      s["diff_t"] = s["diff_mean"] / (s["diff_std"] / np.sqrt(len(diffs))) if len(diffs) > 1 else float("nan")
  return out


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  if cfg.smoke:
    cfg = dataclasses.replace(cfg, **SMOKE)
  check(cfg)
  t0, cpu0 = time.perf_counter(), time.process_time()
  names, tc = labels(cfg.switch_every), train_config(cfg)
  with tempfile.TemporaryDirectory(prefix="optlab-badam-") as tmp:
    work = os.path.join(tmp, "runs") if cfg.smoke else cfg.work

    def sweep(grid, seeds):  # one directory: the second sweep skips the runs the first one finished
      return run_grid(SweepConfig(grid=grid, seeds=seeds, baseline="adamw", out=work, train=tc))

    runs_dir = os.path.join(work, "runs")  # the sweep's; run directories already there are resumed or skipped
    resumed = sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []
    tuning = sweep(_grid({label: cfg.lrs for label in names.values()}), (cfg.seeds[0],))
    shutil.copy(os.path.join(work, "lr.png"), os.path.join(tmp, "lr.png"))  # the next sweep overwrites it
    best = best_lr(tuning)
    final = {k: names[k] for k in ("adamw", "badam")}
    runs = sweep(_grid({label: (best[label],) for label in final.values()}), tuple(cfg.seeds))
    c = preset("tiny", n_layers=cfg.n_layers)
    bound, floor = frozen_head_floor(common.split(Transformer(c, rngs=nnx.Rngs(cfg.seeds[0])))[1], c)
    ref = [r for r in tuning if r["label"] == names["badam_ref"]]
    result = {"settings": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "work")},
                           "devices": len(jax.devices()), "tokens_per_run": cfg.steps * cfg.batch_size * cfg.seq_len,
                           "labels": names, "badam_hparams": BADAM_HP},
              "bytes": bytes_rows(cfg), "tuning": tuning, "best_lr": {k: best[v] for k, v in names.items()},
              "runs": runs, "summary": summarize(runs, final), "resumed": resumed,
              "embedding_turns": embedding_turns(cfg.n_layers + 1, cfg.switch_every, cfg.steps),
              "badam_ref": {"best": min(ref, key=lambda r: r["final_val_loss"]), "logit_bound": bound,
                            "loss_floor": floor}}
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
    if not cfg.smoke:
      write(cfg, result, os.path.join(tmp, "lr.png"))
  return result


# ---- output ------------------------------------------------------------------------------------------------------

def plot(result: dict):
  """Val loss at each contender's best lr (mean, min–max over seeds; badam_ref: its best lr at one seed, dashed)
  and the state bytes per model."""
  import matplotlib.pyplot as plt
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  for name, s in result["summary"].items():
    if s.get("diverged"):
      continue
    line, = ax.plot(s["steps"], s["curve_mean"], marker=".",
                    label=f"{TITLES[name]} (lr {s['lr']:g}, {len(s['seeds'])} seeds)")
    ax.fill_between(s["steps"], s["curve_min"], s["curve_max"], color=line.get_color(), alpha=0.2)
  ref = result["badam_ref"]
  if ref["best"].get("curve"):
    ax.plot(*zip(*ref["best"]["curve"]), "--", color="gray", label=f"{TITLES['badam_ref']} (lr {ref['best']['lr']:g})")
    ax.axhline(ref["loss_floor"], color="gray", lw=0.8, ls=":", label="its loss floor (frozen head)")
  ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title="val loss at equal steps (min–max over seeds)")
  ax.legend(fontsize=7)
  rows = result["bytes"]
  x, w = np.arange(len(rows)), 0.2
  bars = [("parameters (fp32)", [4 * r["params"] for r in rows]), ("AdamW state", [r["adamw"] for r in rows]),
          ("BAdam state", [r["badam"] for r in rows]),
          ("BAdam state, reference default", [r["badam_ref"] for r in rows])]
  for i, (name, ys) in enumerate(bars):
    bx.bar(x + (i - 1.5) * w, ys, w, label=name)
  for xi, r in zip(x, rows):
    bx.annotate(f"{r['badam_ratio']:.2f}×", (xi + 0.5 * w, r["badam"]), ha="center", va="bottom", fontsize=7)
  bx.set(yscale="log", ylabel="bytes", title="optimizer state (label: BAdam / AdamW)")
  bx.set_xticks(x, [r["model"].replace(" (trained)", "") for r in rows], fontsize=8)
  bx.legend(fontsize=7)
  fig.tight_layout()
  return fig


def tables(result: dict) -> list[str]:
  """The markdown tables of a result."""
  lines = ["Optimizer-state bytes, measured from the state tree (each cell equals `analytic_state_bytes`, or is "
           "marked), and the whole fp32 training state (parameters + full gradients + optimizer state):", "",
           "| model | layers | params | one layer | AdamW | BAdam (all params) | / AdamW | BAdam, ref. default | "
           "/ AdamW | 1/L | whole state, BAdam / AdamW |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in result["bytes"]:
    ok = all(r[k] == r[f"{k}_expected"] for k in ("adamw", "badam", "badam_ref"))
    lines.append(f"| {r['model']} | {r['layers']} | {r['params']:,} | {r['layer_params']:,} | {r['adamw']:,} | "
                 f"{r['badam']:,} | {r['badam_ratio']:.4f} | {r['badam_ref']:,} | {r['badam_ref_ratio']:.4f} | "
                 f"{1 / r['layers']:.4f} | {r['badam_total_ratio']:.3f} |" + ("" if ok else " ≠ formula"))
  names = result["settings"]["labels"]
  lrs = sorted({r["lr"] for r in result["tuning"]})
  lines += ["", f"Learning-rate grid at seed {result['settings']['seeds'][0]} (final val loss, nats/byte):", "",
            "| contender | sweep label | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---|---|" + "---:|" * len(lrs)]
  for name, label in names.items():
    cell = {r["lr"]: ("diverged" if r.get("diverged") else f"{r['final_val_loss']:.4f}")
            for r in result["tuning"] if r["label"] == label}
    lines.append(f"| {TITLES[name]} | `{label}` | " + " | ".join(cell.get(lr, "—") for lr in lrs) + " |")
  lines += ["", "At each one's best lr:", "",
            "| contender | lr | seeds | final val loss (mean ± std) | − AdamW, per seed | mean ± std (t) | tokens/s |",
            "|---|---:|---|---:|---|---:|---:|"]
  for name, x in result["summary"].items():
    if x.get("diverged"):
      lines.append(f"| {TITLES[name]} | {result['best_lr'][name]:g} | — | diverged | — | — | — |")
      continue
    per, diff = ("—", "—") if name == "adamw" else (", ".join(f"{d:+.4f}" for d in x["diffs"]),
                                                     f"{x['diff_mean']:+.4f} ± {x['diff_std']:.4f} "
                                                     f"(t = {x['diff_t']:.1f})")
    lines.append(f"| {TITLES[name]} | {x['lr']:g} | {', '.join(map(str, x['seeds']))} | {x['final_mean']:.4f} ± "
                 f"{x['final_std']:.4f} | {per} | {diff} | {x['tokens_per_s']:.0f} |")
  return lines


def findings(result: dict) -> list[str]:
  """The "Reading:" lines, stated from the numbers."""
  trained, *others = result["bytes"]
  out = [f"Reading: BAdam's optimizer state is {trained['badam_ratio']:.3f}× AdamW's on the trained "
         f"{trained['layers']}-layer model (one layer's moments plus the embedding block's; "
         f"{trained['badam_ref_ratio']:.3f}× with the reference's frozen embedding)"
         + "".join(f", {r['badam_ratio']:.3f}× on {r['model']} ({r['layers']} layers)" for r in others)
         + "; every measured state equals the formula to the byte, and the ratio tends to 1/L as layers dominate."]
  if others:
    big = others[-1]
    out.append(f"Reading: counting fp32 parameters and gradients too (full size here: this BAdam differentiates "
               f"every parameter), the whole training state only falls to {big['badam_total_ratio']:.3f}× on "
               f"{big['model']}; the paper's 2M + 16M/D also needs its bf16 weights and stopped backprop.")
  a, b = result["summary"]["adamw"], result["summary"]["badam"]
  if not (a.get("diverged") or b.get("diverged")):
    n, st = len(b["diffs"]), result["settings"]
    strength = f", t = {b['diff_t']:.1f} over {n} paired seeds" if n > 1 else ""
    if n == 3 and abs(b["diff_t"]) < 4.30:  # two-sided 5% critical t for 2 degrees of freedom
      strength += ": within seed noise at 5% (t_crit 4.30)"
    out.append(f"Reading: at equal steps ({st['steps']} steps, {st['tokens_per_run']:,} tokens) BAdam ends at "
               f"{b['final_mean']:.3f} ± {b['final_std']:.3f} nats/byte vs AdamW {a['final_mean']:.3f} ± "
               f"{a['final_std']:.3f}: {'worse' if b['diff_mean'] > 0 else 'better'} by {abs(b['diff_mean']):.3f}"
               f"{strength}. Tokens/s {b['tokens_per_s']:.0f} vs {a['tokens_per_s']:.0f} (a busy shared machine; "
               "both run the full backward pass, so no speed-up is expected).")
    turns, (s0, b0, a0) = result.get("embedding_turns") or [], (b["steps"][0], b["curve_mean"][0], a["curve_mean"][0])
    after = [(step, y - x) for step, x, y in zip(b["steps"], a["curve_mean"], b["curve_mean"])
             if turns and step > turns[0][1]]
    if after:
      out.append(f"Reading: at step {s0} BAdam's val loss is still {b0:.2f} (AdamW {a0:.2f}): in descending order "
                 f"the embedding block's first turn is steps {turns[0][0]}–{turns[0][1]}. After it the gap to AdamW "
                 f"is {after[0][1]:.2f} at step {after[0][0]} and {after[-1][1]:.2f} at step {after[-1][0]}; each of "
                 f"the {st['n_layers'] + 1} blocks gets 1/{st['n_layers'] + 1} of the updates.")
  ref = result["badam_ref"]
  if not ref["best"].get("diverged"):
    out.append(f"Reading: the reference default (embedding and final norm frozen) reaches only "
               f"{ref['best']['final_val_loss']:.3f} at its best lr {ref['best']['lr']:g}: from random init the frozen "
               f"tied head keeps every logit within ±{ref['logit_bound']:.2f}, so no training of the layers can take "
               f"the loss below {ref['loss_floor']:.2f}. The default presumes a trained embedding (fine-tuning).")
  lrs = result["settings"]["lrs"]
  edge = [TITLES[k] for k in ("adamw", "badam") if len(lrs) > 1 and result["best_lr"][k] in (min(lrs), max(lrs))]
  if edge:
    out.append(f"Reading: the best lr of {', '.join(edge)} lies at the edge of the grid; a wider grid might do better.")
  return out


def write(cfg: Config, result: dict, lr_png: str, cmd: str | None = None):
  import matplotlib.pyplot as plt
  prior = (f" It resumed {len(result['resumed'])} run directories that an earlier, interrupted invocation left "
           "(finished runs are skipped, a partial one continues from its checkpoint); their time is not counted."
           if result.get("resumed") else "")
  table = tables(result) + ["", f"Time of the whole command: {result['wall_s']:.0f} s wall on a 2-core machine "
                            f"(other jobs may share it); {result['cpu_s']:.0f} s of CPU in this process (all "
                            f"threads).{prior} Plots: `badam.png` (val curves, state bytes), `lr.png` (the lr grid "
                            "at the first seed)."]
  common.write_results(cfg.out, NAME, QUESTION, table, findings=findings(result), settings=result["settings"],
                       data=result, cmd=cmd)
  fig = plot(result)
  fig.savefig(os.path.join(cfg.out, "badam.png"), dpi=120)
  plt.close(fig)
  shutil.copy(lr_png, os.path.join(cfg.out, "lr.png"))


if __name__ == "__main__":
  common.cli(main, Config, kept=lambda cfg: f"the runs that finished are kept under {cfg.work}; rerun the same "
                                             f"command to go on")
