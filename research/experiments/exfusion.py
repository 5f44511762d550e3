"""Does training a dense transformer's FFNs as several experts fused in weight space (ExFusion), then fusing them into
one dense FFN, beat training the dense model directly, at equal training steps and equal inference cost?

  python -m research.experiments.exfusion            # full: writes research/results/exfusion/
  python -m research.experiments.exfusion --smoke    # seconds: what the tests and the notebook run

Claim (Ruan, Dong, Qu et al., "ExFusion: Efficient Transformer Training via Multi-Experts Fusion", arXiv 2603.27965,
IEEE TMM 2026; its abstract, the only part readable here, no code public): upcycling each FFN into several weighted
experts that are fused into one FFN for every forward pass, and into a single FFN after training, improves
transformers on vision and language tasks consistently, at a marginal training cost and no inference cost.

Setup (ours: a 2-layer byte-level `tiny`, d_ff 128, ~10^5 tokens; the fusion rule and the expert initialisation are
our choices, stated in models/exfusion.py, because the paper's method section was not available):
  dense:          `tiny` trained from a random init for N = `steps` steps on the stdlib corpus (AdamW, the CLI's
                  schedule);
  exfusion E:     the same random init expanded at step 0 (`models.exfusion.expand`: E experts per FFN matrix,
                  W_e = W + ε_e centred, α = softmax(a) with a = 0), trained the same N steps on the same batches,
                  then fused (`exfusion.fuse`) into a dense model, which is what is evaluated;
  exfusion E, no noise: the control, experts identical copies (a pure reparameterisation of the dense model).
Honest means: held-out val loss of the fused model (the deployed one), equal steps and tokens, equal inference
FLOPs (the fused model is the dense architecture), training cost reported (parameters trained, the fusion's
per-step FLOPs), 3 seeds with mean ± std and the paired per-seed difference to the dense arm, a peak lr per arm picked
from `lrs` by seed 0's final val loss (grid edges flagged).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
from flax import nnx

from models import Transformer, count_params, exfusion, flops_per_token, preset
from research.experiments import common

NAME = "exfusion"
SMOKE = dict(seeds=(0,), steps=4, batch_size=4, seq_len=32, lrs=(3e-3,), experts=(4,), eval_every=2, val_batch=8,
             val_batches=2)


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/exfusion"
  seeds: tuple[int, ...] = (0, 1, 2)
  steps: int = 400
  """N: every arm's training steps (equal tokens)."""
  batch_size: int = 16
  seq_len: int = 64
  d_ff: int = 128
  experts: tuple[int, ...] = (2, 4)
  """Expert counts of the ExFusion arms (each with noise; the largest also without)."""
  noise: float = 0.01
  """The experts' initial spread, as a share of each matrix's std."""
  lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
  """Peak lrs tried with seeds[0], per arm."""
  eval_every: int = 50
  val_batch: int = 32
  val_batches: int = 4


def arms(cfg: Config) -> dict[str, tuple[int, float]]:
  """{arm: (experts, noise)}; the dense arm has 0 experts."""
  out = {"dense": (0, 0.0)}
  out.update({f"exfusion{e}": (e, cfg.noise) for e in cfg.experts})
  out[f"exfusion{max(cfg.experts)}_copies"] = (max(cfg.experts), 0.0)
  return out


def label(arm: str) -> str:
  if arm == "dense":
    return "dense"
  e = arm[len("exfusion"):].split("_")[0]
  return f"ExFusion, {e} experts" + (", identical copies" if arm.endswith("_copies") else "") + ", fused"


def sized(cfg: Config) -> Config:
  cfg = dataclasses.replace(cfg, **SMOKE) if cfg.smoke else cfg
  if not cfg.seeds or not cfg.lrs or not cfg.experts or cfg.steps < 1 or min(cfg.experts) < 1 or cfg.noise < 0:
    raise ValueError("exfusion needs a seed, an lr, steps >= 1, expert counts >= 1 and noise >= 0")
  return cfg


def model_for(arm_spec: tuple[int, float], c, seed: int) -> Transformer:
  experts, noise = arm_spec
  model = Transformer(c, rngs=nnx.Rngs(seed))
  return model if experts == 0 else exfusion.expand(model, experts, noise=noise, seed=seed)


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  cfg = sized(cfg)
  c = preset("tiny", d_ff=cfg.d_ff)
  train, val = common.corpus_and_val(cfg.val_batch, cfg.seq_len, cfg.val_batches)
  fit = functools.partial(common.fit, tokens=train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, val=val,
                          steps=cfg.steps, eval_every=cfg.eval_every)
  specs = arms(cfg)

  def one_seed(seed, tune, chosen):
    run = {"arms": {}}
    for arm, spec in specs.items():
      f = common.tuned_fit(arm, lambda lr: fit(model_for(spec, c, seed), common.phase_optimizer(lr, cfg.steps),
                                               seed=seed), cfg.lrs, seed == cfg.seeds[0], tune, chosen)
      record = {"lr": chosen[arm], "curve": f.curve(), "trained": f.final_val,
                "train_tail": common.train_tail(f.records)}
      if spec[0]:
        record.update(alphas={k: np.asarray(v).tolist() for k, v in exfusion.fusion_weights(f.model).items()},
                      spread=_spread(f.model))
        record["final"] = common.evaluate(exfusion.fuse(f.model), val)  # the deployed dense model
      else:
        record["final"] = f.final_val
      run["arms"][arm] = record
    return run

  done = common.run_seeds(cfg, one_seed)
  result = {"config": dataclasses.asdict(cfg), "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
            "params": {arm: _trained_params(c, spec) for arm, spec in specs.items()},
            "inference_params": count_params(c), "flops_per_token": flops_per_token(c, cfg.seq_len),
            "fusion_flops_per_step": {arm: 2 * spec[0] * 3 * c.d_model * c.d_ff * c.n_layers
                                      for arm, spec in specs.items()},
            "tune": {a: {str(lr): v for lr, v in t.items()} for a, t in done.tune.items()}, "lr": done.chosen,
            "seeds": {s: done.runs[s] for s in cfg.seeds},
            "timing": {"wall_s": done.wall_s, "cpu_s": time.process_time()}}
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


def _trained_params(c, spec) -> int:
  """Parameters trained: the dense model's, the FFN matrices held E times plus E logits per matrix and layer."""
  experts = spec[0]
  ffn = 3 * c.d_model * c.d_ff * c.n_layers
  return count_params(c) if not experts else count_params(c) + (experts - 1) * ffn + experts * 3 * c.n_layers


def _spread(model) -> float:
  """Mean over the FFN matrices of the experts' RMS distance from their mean, relative to the mean's RMS (after
  training; it starts at `noise`)."""
  out = []
  for path, w in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if str(path[-1]) == "experts_EIO":  # (layers, experts, in, out)
      w = np.asarray(w.get_value(), np.float64)
      mean = w.mean(1, keepdims=True)
      out.append(float(np.sqrt(((w - mean) ** 2).mean()) / np.sqrt((mean ** 2).mean())))
  return float(np.mean(out))


stat = common.seed_stat


def tables(result: dict) -> list[str]:
  seeds = list(result["seeds"])
  vs = common.against(result, "dense")
  rows = []
  for arm in result["seeds"][seeds[0]]["arms"]:
    r0 = result["seeds"][seeds[0]]["arms"][arm]
    rows.append([label(arm), f"{result['params'][arm]:,}", f"{result['fusion_flops_per_step'][arm]:,}",
                 f"{result['lr'][arm]:g}", common.pm(stat(result, arm, "final")), common.delta_cell(vs, arm),
                 common.pm(stat(result, arm, "train_tail")),
                 "–" if arm == "dense" else f"{r0['spread']:.4f} (seed {seeds[0]})"])
  lines = [f"Every arm: {result['config']['steps']} steps = {result['tokens']:,} tokens of the stdlib corpus from the "
           f"same random init and batches; the deployed model is the dense `tiny` (d_ff {result['config']['d_ff']}, "
           f"{result['inference_params']:,} parameters, {result['flops_per_token'] / 1e6:.2f} MFLOPs/token) for every "
           f"arm. Seeds {', '.join(map(str, seeds))}; mean ± std (ddof 1); Δ = per-seed difference to dense.", "",
           *common.table(["arm", "parameters trained", "fusion FLOPs per step", "lr",
                          "val loss of the deployed (fused) model", "Δ vs dense", "train loss (last 10 steps)",
                          "experts' spread after training"], rows)]
  lines += common.lr_grid_table(result["tune"], label, f"lr grid (seed {seeds[0]}, final val loss):")
  return lines + common.timing_lines(result)


def findings(result: dict) -> list[str]:
  said = {"level": "within 2 std of dense", "lower": "below dense", "higher": "above dense"}
  vs = common.against(result, "dense")
  return [f"Reading: {label(arm)}: {v.pm()} val loss vs dense at equal steps and equal inference cost "
          f"({said[v.verdict]}; lower in {v.lower} of {v.n} seeds)." for arm, v in vs.items()]


def plot(result: dict):
  import matplotlib.pyplot as plt
  seeds = list(result["seeds"].values())
  fig, ax = plt.subplots(figsize=(7, 4.2))
  common.curves_plot(ax, seeds, label, result["lr"])
  ax.set(xlabel="training step", ylabel="val loss (nats/byte), before fusion",
         title=f"dense vs ExFusion ({len(seeds)} seeds, mean ± std)")
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict):
  common.write_experiment(cfg, NAME, __doc__.split("\n\n")[0], result, tables, findings, plot)


if __name__ == "__main__":
  common.cli(main, Config, cache="optlab-exfusion-cache-")
