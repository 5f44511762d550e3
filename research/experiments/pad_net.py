"""Does a Mixture-of-Experts fine-tuned with most of its expert weights made static (shared by all experts) keep, or
improve, the quality of the fully dynamic MoE, as PAD-Net reports?

  python -m research.experiments.pad_net            # full: writes research/results/pad_net/
  python -m research.experiments.pad_net --smoke    # seconds: what the tests and the notebook run

Claim (He, Ding, Dong et al., "PAD-Net: An Efficient Framework for Dynamic Networks", ACL 2023, arXiv 2211.05528;
code Shwai-He/PAD-Net; shared/reference/methods.md §11): a fully dynamic layer holds a subset of dynamic parameters
that, with the rest made static, matches or beats it: +1.9 GLUE average over the fully dynamic MoE-BERT with 50%
dynamic parameters, +0.7% top-1 for DY-Conv ResNet-50 with 30%. Their MoE regime is fine-tuning: the mode partition
runs once at the start of fine-tuning (`trainer_pad.py`), on a sample of the fine-tuning data.

Setup (ours, at toy scale: a 2-layer byte-level `tiny` MoE, 8 SwiGLU experts of width 64, top-2, ~10^5 tokens):
  pretraining: the MoE trained from a random init for N = `pretrain_steps` steps on the stdlib corpus (AdamW, the
               CLI's schedule, lr 3e-3 untuned), per seed;
  arms, each fine-tuned T = `steps` steps on the package-description corpus (`research.data.docs_corpus`, a domain
  shift) with a fresh AdamW state, on the same batches:
    moe:       the pretrained MoE as it is;
    pad r:     the pretrained MoE in PAD-Net form (models/surgery.py `to_padnet`: static weights = the experts' mean,
               φ = 0) partitioned by IMP (models/padnet.py: |∂L/∂M| on `score_batches` fine-tuning batches,
               `rounds` rounds, exponential schedule, global ranking: the code's defaults but for its 1 round) to a
               dynamic share r ∈ `ratios`; r = 1 is the MoE plus the two learnable scale factors.
Honest means: held-out loss on the docs corpus' val split (held-out packages) and on the stdlib val split (what
fine-tuning forgets), 3 seeds with mean ± std and the paired per-seed difference to the MoE arm, equal steps and
tokens for every arm, and a peak lr per arm picked from `lrs` by seed 0's final docs val loss (grid edges flagged).
Parameters: a PAD-Net arm holds the MoE's parameters plus one static matrix per expert stack; its dynamic count is
the expert entries left dynamic; training FLOPs per token are the MoE's (the mixing is per step, not per token).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Annotated

import numpy as np
from flax import nnx

from models import MoEConfig, Transformer, count_params, padnet, preset, surgery
from research import flags
from research.data import docs_corpus, eval_batches, get_batch, load_corpus
from research.experiments import common

NAME = "pad_net"
SMOKE = dict(seeds=(0,), pretrain_steps=6, steps=4, batch_size=4, seq_len=32, lrs=(3e-3,), ratios=(0.3,),
             eval_every=2, val_batch=8, val_batches=2, score_batches=1, rounds=2)


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/pad_net"
  seeds: tuple[int, ...] = (0, 1, 2)
  pretrain_steps: int = 400
  """N: the MoE's pretraining on the stdlib corpus."""
  pretrain_lr: float = 3e-3
  steps: int = 150
  """T: every arm's fine-tuning steps on the docs corpus."""
  batch_size: int = 16
  seq_len: int = 64
  num_experts: int = 8
  top_k: int = 2
  d_expert: int = 64
  ratios: Annotated[tuple[float, ...], flags.FRACTION] = (1.0, 0.5, 0.3, 0.1)
  """PAD-Net's final dynamic shares, each in (0, 1]."""
  rounds: int = 5
  """IMP rounds (the code's prune_epochs defaults to 1)."""
  score_batches: int = 4
  """Fine-tuning batches IMP scores |∂L/∂M| on (not the held-out ones)."""
  lrs: tuple[float, ...] = (3e-3, 1e-2, 3e-2)
  """Fine-tuning peak lrs tried with seeds[0], per arm (a first run on 1e-3..1e-2 put every arm's best at 1e-2)."""
  eval_every: int = 25
  val_batch: int = 32
  val_batches: int = 4


def arms(cfg: Config) -> list[str]:
  return ["moe"] + [f"pad{round(100 * r)}" for r in cfg.ratios]


def sized(cfg: Config) -> Config:
  cfg = dataclasses.replace(cfg, **SMOKE) if cfg.smoke else cfg
  if not cfg.seeds or not cfg.lrs or cfg.pretrain_steps < 1 or cfg.steps < 1 or cfg.score_batches < 1:
    raise ValueError("pad_net needs a seed, an lr, pretrain_steps, steps and score_batches >= 1")
  for r in cfg.ratios:
    padnet.check(r, cfg.rounds)
  return cfg


def moe_config(cfg: Config):
  return preset("tiny", moe=MoEConfig(num_experts=cfg.num_experts, top_k=cfg.top_k, d_expert=cfg.d_expert))


def partitioned(pretrained: Transformer, ratio: float, tokens, cfg: Config, seed: int) -> tuple[Transformer, list]:
  """The pretrained MoE in PAD-Net form, partitioned by IMP on `score_batches` fine-tuning batches (a data stream
  of their own: seed + 10_000) to the dynamic share `ratio`; and the share after each round."""
  model = surgery.to_padnet(pretrained)
  batches = [get_batch(tokens, seed + 10_000, i, cfg.batch_size, cfg.seq_len) for i in range(cfg.score_batches)]
  graphdef = nnx.graphdef(model)

  def loss(m, batch):
    _, params, buffers = common.split(m)
    return common.loss_fn(graphdef, params, buffers, *batch)[0]

  shares = padnet.partition(model, loss, batches, ratio, rounds=cfg.rounds) if ratio < 1 else []
  return model, shares


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  cfg = sized(cfg)
  N, T = cfg.pretrain_steps, cfg.steps
  stdlib = load_corpus()
  docs = load_corpus(docs_corpus.build())
  val = {"docs": eval_batches(docs.val, cfg.val_batch, cfg.seq_len, cfg.val_batches),
         "stdlib": eval_batches(stdlib.val, cfg.val_batch, cfg.seq_len, cfg.val_batches)}
  fit = functools.partial(common.fit, batch_size=cfg.batch_size, seq_len=cfg.seq_len)

  def one_seed(seed, tune, chosen):
    pre = fit(Transformer(moe_config(cfg), rngs=nnx.Rngs(seed)), common.phase_optimizer(cfg.pretrain_lr, N),
              tokens=stdlib.train, steps=N, seed=seed, val=val["stdlib"], eval_every=max(N // 4, 1))
    run = {"pretrain_curve": pre.curve(), "pretrained": {k: common.evaluate(pre.model, b) for k, b in val.items()},
           "arms": {}}
    for arm in arms(cfg):
      if arm == "moe":
        model, shares = pre.model, []
      else:
        model, shares = partitioned(pre.model, float(arm[3:]) / 100, docs.train, cfg, seed)
      start = {k: common.evaluate(model, b) for k, b in val.items()}
      f = common.tuned_fit(arm, lambda lr: fit(model, common.phase_optimizer(lr, T), tokens=docs.train, steps=T,
                                               seed=seed, val=val["docs"], eval_every=cfg.eval_every),
                           cfg.lrs, seed == cfg.seeds[0], tune, chosen)
      counts = padnet.counts(f.model) if arm != "moe" else {"dynamic": _expert_entries(model), "masked": 0,
                                                             "static": 0}
      run["arms"][arm] = {"lr": chosen[arm], "shares": shares, "counts": counts, "start": start,
                          "curve": [(0, start["docs"])] + f.curve(), "final": f.final_val,
                          "stdlib_final": common.evaluate(f.model, val["stdlib"]),
                          "phi": _phis(f.model) if arm != "moe" else None}
    return run

  done = common.run_seeds(cfg, one_seed)
  c = moe_config(cfg)
  result = {"config": dataclasses.asdict(cfg), "steps": {"pretrain": N, "finetune": T},
            "tokens": {"finetune": T * cfg.batch_size * cfg.seq_len},
            "params": {"moe": count_params(c),
                       "padnet": count_params(dataclasses.replace(c, moe=dataclasses.replace(c.moe, pad=True)))},
            "docs_corpus": {"train_bytes": int(len(docs.train)), "val_bytes": int(len(docs.val))},
            "tune": {a: {str(lr): v for lr, v in t.items()} for a, t in done.tune.items()}, "lr": done.chosen,
            "seeds": {s: done.runs[s] for s in cfg.seeds},
            "timing": {"wall_s": done.wall_s, "cpu_s": time.process_time()}}
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


def _expert_entries(model: Transformer) -> int:
  moe = model.blocks.moe
  return int(sum(getattr(moe, k)[...].size for k in padnet.MATRICES.values()))


def _phis(model: Transformer) -> list[float]:
  """λ_d = 2σ(φ) per layer after fine-tuning."""
  phi = np.asarray(model.blocks.moe.pad_phi[...], np.float64)
  return (2 / (1 + np.exp(-phi))).tolist()


stat = common.seed_stat


def label(arm: str) -> str:
  return "MoE (all dynamic, no static part)" if arm == "moe" else f"PAD-Net, {arm[3:]}% dynamic"


def tables(result: dict) -> list[str]:
  seeds = list(result["seeds"])
  first = result["seeds"][seeds[0]]
  T, N = result["steps"]["finetune"], result["steps"]["pretrain"]
  pre = {k: common.mean_std([r["pretrained"][k] for r in result["seeds"].values()]) for k in ("docs", "stdlib")}
  vs = common.against(result, "moe")
  rows = []
  for arm in first["arms"]:
    phi = first["arms"][arm]["phi"]
    rows.append([label(arm), f"{first['arms'][arm]['counts']['dynamic']:,}", f"{result['lr'][arm]:g}",
                 common.pm(stat(result, arm, lambda r: r["start"]["docs"])), common.pm(stat(result, arm, "final")),
                 common.delta_cell(vs, arm), common.pm(stat(result, arm, "stdlib_final")),
                 f"{'–' if phi is None else ', '.join(f'{p:.3f}' for p in phi)} (seed {seeds[0]})"])
  lines = [f"MoE pretrained N = {N} steps on the stdlib corpus: val {common.pm(pre['stdlib'])} (stdlib), "
           f"{common.pm(pre['docs'])} (docs) nats/byte. Fine-tuning: T = {T} steps = {result['tokens']['finetune']:,} "
           f"tokens per arm on the docs corpus. Parameters: MoE {result['params']['moe']:,}, PAD-Net form "
           f"{result['params']['padnet']:,}. Seeds {', '.join(map(str, seeds))}; mean ± std (ddof 1); Δ = per-seed "
           "difference to the MoE arm.", "",
           *common.table(["arm", "dynamic expert entries", "lr", "docs val at the start (after IMP)",
                          "docs val after T", "Δ vs MoE", "stdlib val after T (forgetting)", "λ_d after T"], rows)]
  lines += common.lr_grid_table(result["tune"], label, f"Fine-tuning lr grid (seed {seeds[0]}, final docs val loss):")
  return lines + common.timing_lines(result)


def findings(result: dict) -> list[str]:
  vs, forgetting = common.against(result, "moe"), common.against(result, "moe", "stdlib_final")
  said = {"level": "within 2 std of the MoE", "lower": "below the MoE", "higher": "above the MoE"}
  lines = [f"Reading: {label(arm)}: docs val {v.pm()} vs the MoE after equal steps ({said[v.verdict]}; lower in "
           f"{v.lower} of {v.n} seeds); forgetting (stdlib val) {forgetting[arm].pm()}." for arm, v in vs.items()]
  kinds = {"level": [], "lower": [], "higher": []}
  for arm, v in vs.items():
    kinds[v.verdict].append(label(arm))
  lines.append("Reading: against the paper's claim (a partly static MoE matches or beats the fully dynamic one): "
               f"beats it: {', '.join(kinds['lower']) or 'none'}; matches it within 2 std of the seeds: "
               f"{', '.join(kinds['level']) or 'none'}; worse: {', '.join(kinds['higher']) or 'none'}. At this scale "
               "each expert sees ~10^4 fine-tuning tokens, far from MoE-BERT on GLUE.")
  return lines


def plot(result: dict):
  import matplotlib.pyplot as plt
  seeds = list(result["seeds"].values())
  names = list(seeds[0]["arms"])
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  common.curves_plot(axes[0], seeds, label, result["lr"])
  axes[0].set(xlabel="fine-tuning step", ylabel="docs val loss (nats/byte)",
              title=f"fine-tuning a pretrained MoE ({len(seeds)} seeds, mean ± std)")
  dyn = [seeds[0]["arms"][a]["counts"]["dynamic"] for a in names]
  m = [stat(result, a, "final") for a in names]
  axes[1].errorbar(dyn, [v[0] for v in m], yerr=[v[1] for v in m], fmt="o-")
  for a, x, v in zip(names, dyn, m):
    axes[1].annotate(a, (x, v[0]), fontsize=8)
  axes[1].set(xlabel="dynamic expert entries", ylabel="docs val loss after T", title="quality vs dynamic parameters")
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict):
  common.write_experiment(cfg, NAME, __doc__.split("\n\n")[0], result, tables, findings, plot)


if __name__ == "__main__":
  common.cli(main, Config, cache="optlab-pad-net-cache-")
