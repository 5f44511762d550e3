"""`python -m research.bench coordcheck`: µP's coordinate check of the optimizers' width scaling.

Does one learning rate move the network by the same amount at every width? For a ladder of widths (d_model 64..512;
heads of the `small` preset's size 64, d_ff = 3·d_model and 4 layers as `small`; the byte corpus's vocabulary) each
contender trains `--steps` steps from the model's own init on the same batches, at one learning rate for every width.
Before training and after every step the bench records, on one fixed held-out probe batch, the mean |x| of every
layer's output (the embedding, each block's attention output, MLP output and residual stream, the logits) and the
mean |x − x₀| (its change since init); and for every step each weight matrix's update RMS(ΔW) and ‖ΔW‖_F/‖W‖_F per
layer. Everything is averaged over `--seeds` inits; the log-log slope of a quantity against width is ~0 when it is
width-stable. This module measures; coordcheck_report.py fits the slopes, writes the markdown and draws the plots.

Shapes: B batch, T sequence, D d_model, L layers (the letters of models/transformer.py).

References:
  Yang et al., "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer", 2022,
    arXiv 2203.03466, Fig. 1 and 5 (microsoft/mup `coord_check`).
  Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982, Lemma 1 (the 0.2·√max(m, n) scale).
  Yang, Simon and Bernstein, "A Spectral Condition for Feature Learning", 2023, arXiv 2310.17813.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optim
from models import Transformer, TransformerConfig, cross_entropy, preset
from models.attention import attend
from models.blockwise import layer_weights
from models.transformer import rms_norm
from research import flags
from research.bench.coordcheck_report import loglog_slope, plot, report
from research.bench.report import call_command, git_commit, machine
from research.data import eval_batches, get_batch, load_corpus
from research.train.steps.step import make_update

# contender -> (registry name, hyperparameters, default lr). The lrs are the `small` preset's tuned ones
# (research/results/optimizers: adamw 1e-3, muon at its default moonlight scale 1e-2, normuon 3e-3); keller's 3e-2 is
# moonlight's 1e-2 in keller's convention at small's width (0.2·√256 = 3.2 on a square 256×256 matrix, keller's 1).
CONTENDERS: dict[str, tuple[str, dict, float]] = {
    "adamw": ("adamw", {}, 1e-3),
    "muon-keller": ("muon", {"scale": "keller"}, 3e-2),
    "muon-moonlight": ("muon", {"scale": "moonlight"}, 1e-2),
    "normuon": ("normuon", {}, 3e-3),
}
BASE = "small"  # depth, head size and d_ff / d_model come from this preset


def _lr_override(text: str) -> tuple[str, float]:
  """("muon-keller", 0.02) of "muon-keller=0.02"; ValueError (one line) for anything else."""
  name, eq, value = text.partition("=")
  if not eq or name not in CONTENDERS:
    raise ValueError(f"give CONTENDER=LR, CONTENDER one of {', '.join(CONTENDERS)}")
  lr = float(value)  # ValueError for text that is no number
  if not (np.isfinite(lr) and lr >= 0):
    raise ValueError(f"the learning rate must be finite and >= 0, got {value}")
  return name, lr


CONTENDER = flags.one_of(*CONTENDERS)
LR_OVERRIDES = flags.Rule(parse=_lr_override, empty=True)


def width_config(width: int, vocab_size: int) -> TransformerConfig:
  """`small` at d_model `width`: its depth, its head size (one head below it), its d_ff / d_model ratio."""
  base = preset(BASE)
  return preset(BASE, d_model=width, n_heads=max(1, width // base.hd), d_ff=base.d_ff * width // base.d_model,
                vocab_size=vocab_size)


def layer_outputs(model: Transformer, tokens_BT: jax.Array) -> dict[str, jax.Array]:
  """Every tracked layer's output, the blocks run one at a time with the model's own Block methods.

  Args:
    model: a dense transformer (no pipeline, no context parallelism).
    tokens_BT: the input tokens.

  Returns:
    {"embed": x_BTD, "L{l}.attn" / "L{l}.mlp": block l's attention and MLP outputs (before the residual add),
    "L{l}.resid": its residual stream out, "logits": logits_BTV}, in the model's order.
  """
  c = model.c
  graphdef = nnx.split(model.blocks)[0]
  x_BTD = model.embed(tokens_BT)
  out = {"embed": x_BTD}
  for l in range(c.n_layers):
    block = nnx.merge(graphdef, layer_weights(model, l))
    a_BTD = block.out_proj(attend(*block.qkv(rms_norm(x_BTD, block.attn_norm[...], c.norm_eps)), impl=c.attention))
    x_BTD = x_BTD + a_BTD
    m_BTD = block.mlp(rms_norm(x_BTD, block.mlp_norm[...], c.norm_eps))
    x_BTD = x_BTD + m_BTD
    out |= {f"L{l}.attn": a_BTD, f"L{l}.mlp": m_BTD, f"L{l}.resid": x_BTD}
  out["logits"] = model.unembed(x_BTD)
  return out


def matrix_name(key: str) -> str:
  """"w_gate" of "w_gate_DF": a weight's name without its shape suffix."""
  head, _, suffix = key.rpartition("_")
  return head if head and suffix.isupper() else key


def matrices(tree: dict) -> dict:
  """A pure-dict parameter tree's weight matrices by name, each behind a layer axis ((1, V, D) for the embedding)."""
  out = {"embed": tree["embed_VD"][None]}
  out |= {matrix_name(k): v for k, v in tree["blocks"].items() if v.ndim == 3}  # norm scales (L, D) are vectors
  return out | ({"head": tree["head_DV"][None]} if "head_DV" in tree else {})


def update_sizes(updates: dict, params: dict) -> dict[str, tuple[jax.Array, jax.Array]]:
  """(RMS(ΔW), ‖ΔW‖_F / ‖W‖_F) of each weight matrix, per layer: (L,) for a block weight, (1,) for the embedding.

  Args:
    updates: the applied update ΔW (a pure dict like the params).
    params: the weights it was applied to.

  Returns:
    {matrix name: (rms, relative)}; norm scales and other vectors are left out.
  """
  norm = lambda a: jnp.sqrt(jnp.sum(jnp.square(a), axis=(-2, -1)))
  w = matrices(params)
  return {k: (jnp.sqrt(jnp.mean(jnp.square(u), axis=(-2, -1))), norm(u) / norm(w[k]))
          for k, u in matrices(updates).items()}


def _graphdef(c: TransformerConfig) -> nnx.GraphDef:
  return nnx.split(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]


@functools.cache
def _outputs(c: TransformerConfig):
  """`layer_outputs` of config `c`, jitted (params, buffers, tokens_BT) -> outputs: one compile per width."""
  graphdef = _graphdef(c)
  return jax.jit(lambda params, buffers, tokens_BT: layer_outputs(nnx.merge(graphdef, params, buffers), tokens_BT))


def make_tracer(c: TransformerConfig, tx: optax.GradientTransformation,
                probe: tuple[np.ndarray, np.ndarray]) -> Callable[[int, list], tuple[dict, dict]]:
  """A coordinate-check run of config `c` with optimizer `tx`, compiled once for every seed.

  Args:
    c: the model configuration (dense).
    tx: the optimizer.
    probe: the fixed probe batch (x_BT, y_BT).

  Returns:
    run(seed, batches) -> (record, params after the last step), from the model's init with `nnx.Rngs(seed)`;
    `batches` holds one (x, y) per step. The record: "act" and "dact" ({layer: [mean |x_t|] and [mean |x_t − x_0|]
    for t = 0..T} on the probe), "probe_loss" ([t = 0..T]), "rms" and "rel" ({matrix: [[per layer] for t = 1..T]}),
    "loss" (each step's batch loss, before its update) and "shapes" ({matrix: [fan_in, fan_out]}).
  """
  graphdef, outputs, init = _graphdef(c), _outputs(c), jax.jit(tx.init)
  update = make_update(graphdef, tx)  # the trainer's update path

  @jax.jit
  def step(params, buffers, opt_state, x, y):  # a dense model: the loss is the cross entropy, the buffers constant
    u = update(params, buffers, opt_state, x, y)
    return u.params, u.result.opt_state, u.result.loss, update_sizes(u.result.updates, params)

  def run(seed: int, batches) -> tuple[dict, dict]:
    _, params, buffers = nnx.split(Transformer(c, rngs=nnx.Rngs(seed)), nnx.Param, ...)
    params, buffers = nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)
    opt_state = init(params)
    rec: dict = {"act": {}, "dact": {}, "probe_loss": [], "rms": {}, "rel": {}, "loss": [],
                 "shapes": {k: list(v.shape[-2:]) for k, v in matrices(params).items()}}
    x0: dict = {}

    def read(params):
      xs = outputs(params, buffers, probe[0])
      rec["probe_loss"].append(float(cross_entropy(xs["logits"], probe[1])))
      for k, v in xs.items():
        v = np.asarray(v, np.float64)
        x0.setdefault(k, v)  # the first read is the init's
        rec["act"].setdefault(k, []).append(float(np.mean(np.abs(v))))
        rec["dact"].setdefault(k, []).append(float(np.mean(np.abs(v - x0[k]))))

    read(params)
    for x, y in batches:
      params, opt_state, loss, sizes = step(params, buffers, opt_state, x, y)
      read(params)
      for k, (rms, rel) in sizes.items():
        rec["rms"].setdefault(k, []).append(np.asarray(rms, np.float64).tolist())
        rec["rel"].setdefault(k, []).append(np.asarray(rel, np.float64).tolist())
      rec["loss"].append(float(loss))
    return rec, params

  return run


def summarize(runs: dict[int, list[dict]], widths: list[int]) -> dict:
  """One contender's seed means: {kind: {name: [[value per width] per step]}} (update sizes also averaged over the
  layers), "probe_loss" [[per width] per step], and every curve's slope against width at every step (None: none)."""
  mean = lambda f: [float(np.mean([f(r) for r in runs[w]])) for w in widths]
  rec0 = runs[widths[0]][0]
  steps = len(rec0["loss"])
  out: dict = {"probe_loss": [mean(lambda r, t=t: r["probe_loss"][t]) for t in range(steps + 1)]}
  for kind in ("act", "dact"):
    out[kind] = {k: [mean(lambda r, k=k, t=t: r[kind][k][t]) for t in range(steps + 1)] for k in rec0[kind]}
  for kind in ("rms", "rel"):
    out[kind] = {k: [mean(lambda r, k=k, t=t: np.mean(r[kind][k][t])) for t in range(steps)] for k in rec0[kind]}
  out["shapes"] = {str(w): runs[w][0]["shapes"] for w in widths}
  fit = lambda v: None if np.isnan(p := loglog_slope(widths, v)) else p  # None (JSON's null): no slope (|x₀ − x₀|)
  out["slope"] = {kind: {k: [fit(v) for v in curves] for k, curves in out[kind].items()}
                  for kind in ("act", "dact", "rms", "rel")}
  return out


def coordcheck(widths: tuple[int, ...] = (64, 128, 256, 512),
               optimizers: Annotated[tuple[str, ...], CONTENDER] = tuple(CONTENDERS),
               lrs: Annotated[tuple[str, ...], LR_OVERRIDES] = (), adam_lr: float = 1e-3, steps: int = 3,
               seeds: Annotated[int, flags.COUNT] = 2, batch_size: int = 8, seq_len: int = 128,
               out: Annotated[str, flags.OUT_DIR] = "research/results/diagnostics") -> dict:
  """µP coordinate check: per-layer activations and update sizes at steps 0..T across widths, per contender.

  Writes OUT/coordcheck.md (settings, a table per contender with every quantity at each width at the last step and
  its log-log slope against width), OUT/coordcheck.json (every run's numbers) and OUT/coordcheck_CONTENDER.png (one
  panel per step: mean |x| per layer, mean |x − x₀|, RMS(ΔW) and ‖ΔW‖/‖W‖ per matrix against width).

  Args:
    widths: the d_model ladder (heads of `small`'s size, d_ff and depth as `small`).
    optimizers: the contenders (`CONTENDERS`: adamw, muon-keller, muon-moonlight, normuon).
    lrs: learning rates replacing the defaults, as CONTENDER=LR (the same lr at every width).
    adam_lr: the AdamW group's lr (embedding, norms) of the Muon-family contenders: AdamW's own by default, so every
      contender treats the embedding and norms alike and they differ in the hidden matrices only.
    steps: training steps T (one fixed batch per step, the same for every width and contender).
    seeds: inits (and batch draws) averaged over: seeds 0..seeds-1.
    batch_size: sequences per batch (the training batches and the probe batch).
    seq_len: tokens per sequence.
    out: the directory written.
  """
  t0 = time.perf_counter()
  cmd = call_command("coordcheck", coordcheck, dict(
      widths=widths, optimizers=optimizers, lrs=lrs, adam_lr=adam_lr, steps=steps, seeds=seeds,
      batch_size=batch_size, seq_len=seq_len, out=out))
  widths_ = sorted(set(widths))
  corpus = load_corpus()
  configs = {w: width_config(w, corpus.vocab_size) for w in widths_}  # a bad width fails before any work
  lr = {name: CONTENDERS[name][2] for name in optimizers} | dict(map(_lr_override, lrs))
  probe = eval_batches(corpus.val, batch_size, seq_len, 1)[0]  # held out, the same for every run
  batches = {s: [get_batch(corpus.train, s, t, batch_size, seq_len) for t in range(steps)] for s in range(seeds)}
  results = {}
  for name in dict.fromkeys(optimizers):
    opt, hyper, _ = CONTENDERS[name]
    hyper = hyper | ({} if opt == "adamw" else {"adam_learning_rate": adam_lr})
    runs = {}
    for w in widths_:
      run = make_tracer(configs[w], optim.get_optimizer(opt, lr[name], **hyper), probe)
      runs[w] = [run(s, batches[s])[0] for s in range(seeds)]
      print(f"  {name} width {w}: probe loss {' '.join(f'{v:.3f}' for v in runs[w][0]['probe_loss'])} "
            f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    results[name] = {"optimizer": opt, "hyper": hyper, "lr": lr[name], "runs": {str(w): r for w, r in runs.items()},
                     "mean": summarize(runs, widths_)}
  settings = {"widths": widths_, "optimizers": list(dict.fromkeys(optimizers)), "lrs": {k: lr[k] for k in results},
              "adam_lr": adam_lr, "steps": steps, "seeds": seeds, "batch_size": batch_size, "seq_len": seq_len,
              "n_layers": configs[widths_[0]].n_layers, "head_dim": preset(BASE).hd,
              "d_ff_over_d_model": preset(BASE).d_ff / preset(BASE).d_model, "vocab_size": corpus.vocab_size,
              "init_std": configs[widths_[0]].init_std, "corpus": corpus.fingerprint[:8]}
  record = {"command": cmd, "commit": git_commit(), "machine": machine(),
            "device": str(jax.devices()[0].device_kind), "date": datetime.date.today().isoformat(),
            "runtime_s": round(time.perf_counter() - t0, 1), "settings": settings, "results": results}
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "coordcheck.json"), "w") as f:
    json.dump(record, f)
  for name, res in results.items():
    plot(os.path.join(out, f"coordcheck_{name}.png"), name, res, widths_)
  with open(os.path.join(out, "coordcheck.md"), "w") as f:
    f.write("\n".join(report(record, BASE)) + "\n")
  print(f"coordcheck: wrote {out}/coordcheck.md, .json, {len(results)} plots in {record['runtime_s']:.0f} s",
        file=sys.stderr)
  return record
