"""At a fixed active-parameter budget, which MoE structure trains best: how many experts, how fine-grained (expert
width and top-k together), and whether a shared expert helps, compared with the published guidance?

  python -m research.experiments.moe_design            # full: writes research/results/moe_design/
  python -m research.experiments.moe_design --smoke    # seconds: what the tests and the notebook run

Published guidance (each at 10^8–10^10 parameters and 10^10–10^12 tokens; ours is ~0.3M parameters and ~10^5 tokens,
so agreement or disagreement here is about the mechanism at toy scale only):
  G1 more experts at equal active parameters lower the loss (Switch Transformer, arXiv 2101.03961, §3 and Fig. 4;
     Clark et al., arXiv 2202.01169: a power law in the expert count, flattening with model size);
  G2 finer experts (width / m, top-k × m) at equal total and active parameters lower the loss (DeepSeekMoE, arXiv
     2401.06066, fine-grained expert segmentation; Krajewski et al., arXiv 2402.07871: expert width = the FFN's is
     "not optimal at almost any computational budget"; OLMoE, arXiv 2409.02060 §4: 8/top-1 → 32/top-4 → 64/top-8);
  G3 a shared expert (one always-on expert, one routed expert fewer) is mixed: DeepSeekMoE finds it helps, OLMoE finds
     "shared experts are less effective than having separate experts", Qwen3 (arXiv 2505.09388) dropped them.

Setup. Byte-level `tiny` (D 64, 2 pre-norm blocks, 4/2 heads, QK-norm) on the stdlib corpus; every arm has the same
active FFN width A = `active` per token: (top-k + shared)·d_expert = A. Arms E{e}k{k}: E = e routed experts of width
A/k, top-k (k ∈ `top_ks`, e ∈ `experts`, k ≤ e/2); E{e}k{k}s1: one shared expert of width A/(k+1) and k routed ones of
the same width; `dense`: the dense FFN of width A (the same active FFN). Softmax router renormalised over the top-k,
dropless, load-balancing loss 0.01 and z-loss 1e-3 (the defaults). Equal steps and tokens for every arm.
Honest means: held-out val loss, 3 seeds with mean ± std, a peak lr per arm from `lrs` picked on seed 0 (grid
edges flagged), total and active parameters and training FLOPs per token in the table, and each guidance compared
on the arms that isolate it (paired per seed): G1 along E at k = 2, G2 along (E, k) = (8,1) → (16,2) → (32,4) (equal
total and active), G3 E16k1s1 vs E16k2 and E16k3s1 vs E16k4.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from flax import nnx

from models import MoEConfig, Transformer, count_params, flops_per_token, preset
from research.experiments import common

NAME = "moe_design"
SMOKE = dict(seeds=(0,), steps=4, batch_size=4, seq_len=32, lrs=(3e-3,), experts=(4,), top_ks=(1, 2),
             eval_every=2, val_batch=8, val_batches=2, shared=False)


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/moe_design"
  seeds: tuple[int, ...] = (0, 1, 2)
  steps: int = 300
  batch_size: int = 16
  seq_len: int = 64
  active: int = 128
  """A: the active FFN width per token, (top-k + shared)·d_expert, = the dense arm's d_ff."""
  experts: tuple[int, ...] = (4, 8, 16, 32)
  top_ks: tuple[int, ...] = (1, 2, 4)
  shared: bool = True
  """Add the shared-expert arms E16k1s1 and E16k3s1."""
  lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
  eval_every: int = 50
  val_batch: int = 32
  val_batches: int = 4


def arms(cfg: Config) -> dict[str, tuple[int, int, int]]:
  """{arm: (routed experts E, top-k, shared experts)}; the dense arm is (0, 0, 0)."""
  out = {"dense": (0, 0, 0)}
  out.update({f"E{e}k{k}": (e, k, 0) for e in cfg.experts for k in cfg.top_ks if 2 * k <= e})
  if cfg.shared:
    out.update({"E16k1s1": (16, 1, 1), "E16k3s1": (16, 3, 1)})
  return out


def model_config(cfg: Config, spec: tuple[int, int, int]):
  e, k, s = spec
  if e == 0:
    return preset("tiny", d_ff=cfg.active)
  width = cfg.active // (k + s)
  return preset("tiny", moe=MoEConfig(num_experts=e, top_k=k, d_expert=width, num_shared=s, normalize_top_k=True))


def sized(cfg: Config) -> Config:
  cfg = dataclasses.replace(cfg, **SMOKE) if cfg.smoke else cfg
  if not cfg.seeds or not cfg.lrs or cfg.steps < 1:
    raise ValueError("moe_design needs a seed, an lr and steps >= 1")
  for arm, (e, k, s) in arms(cfg).items():
    if e and cfg.active % (k + s):
      raise ValueError(f"arm {arm}: the active width {cfg.active} does not split into {k + s} experts")
  return cfg


def sizes(c) -> dict:
  """Total and active parameters and training FLOPs per token of a config."""
  total = count_params(c)
  active = total if c.moe is None else total - c.n_layers * (c.moe.num_experts - c.moe.top_k) * 3 * c.d_model * (
      c.moe.d_expert or c.d_ff)
  return {"total": total, "active": active}


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  cfg = sized(cfg)
  train, val = common.corpus_and_val(cfg.val_batch, cfg.seq_len, cfg.val_batches)
  fit = functools.partial(common.fit, tokens=train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, val=val,
                          steps=cfg.steps, eval_every=cfg.eval_every)
  specs = arms(cfg)

  def one_seed(seed, tune, chosen):
    run = {"arms": {}}
    for arm, spec in specs.items():
      c = model_config(cfg, spec)
      f = common.tuned_fit(arm, lambda lr: fit(Transformer(c, rngs=nnx.Rngs(seed)),
                                               common.phase_optimizer(lr, cfg.steps), seed=seed),
                           cfg.lrs, seed == cfg.seeds[0], tune, chosen)
      run["arms"][arm] = {"lr": chosen[arm], "curve": f.curve(), "final": f.final_val,
                          "train_tail": common.train_tail(f.records)}
    return run

  done = common.run_seeds(cfg, one_seed)
  result = {"config": dataclasses.asdict(cfg), "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
            "arms": {a: {"experts": e, "top_k": k, "shared": s, **sizes(model_config(cfg, (e, k, s))),
                         "flops_per_token": flops_per_token(model_config(cfg, (e, k, s)), cfg.seq_len)}
                     for a, (e, k, s) in specs.items()},
            "tune": {a: {str(lr): v for lr, v in t.items()} for a, t in done.tune.items()}, "lr": done.chosen,
            "seeds": {s: done.runs[s] for s in cfg.seeds},
            "timing": {"wall_s": done.wall_s, "cpu_s": time.process_time()}}
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


stat = common.seed_stat


def label(arm: str) -> str:
  return arm if arm == "dense" else arm.replace("E", "E=").replace("k", ", k=").replace("s1", ", 1 shared")


def tables(result: dict) -> list[str]:
  seeds = list(result["seeds"])
  a = result["arms"]
  vs = common.against(result, "dense", arms=a)
  rows = []
  for arm in sorted(a, key=lambda n: stat(result, n)[0]):
    x = a[arm]
    width = "–" if not x["experts"] else result["config"]["active"] // (x["top_k"] + x["shared"])
    rows.append([label(arm), f"{x['experts']}, {x['top_k']}, {x['shared']}", f"{width}",
                 f"{x['total']:,} / {x['active']:,}", f"{x['flops_per_token'] / 1e6:.2f}", f"{result['lr'][arm]:g}",
                 common.pm(stat(result, arm)), common.delta_cell(vs, arm)])
  lines = [f"Every arm: {result['config']['steps']} steps = {result['tokens']:,} tokens, active FFN width "
           f"{result['config']['active']} per token. Seeds {', '.join(map(str, seeds))}; mean ± std (ddof 1); Δ = "
           "per-seed difference to the dense arm.", "",
           *common.table(["arm", "experts (routed, top-k, shared)", "d_expert", "params total / active",
                          "train MFLOPs/token", "lr", "val loss", "Δ vs dense"], rows)]
  lines += common.lr_grid_table(result["tune"], label, f"lr grid (seed {seeds[0]}, final val loss):")
  return lines + common.timing_lines(result)


def _steps(result: dict, pairs) -> str:
  """Each (x, y) of `pairs` whose arms both ran, as "y − x  +mean ± std (verdict)", joined by "; "."""
  said = {"level": "within 2 std (no difference resolved)", "lower": "lower", "higher": "higher"}
  vs = [(x, y, common.versus(result, y, x)) for x, y in pairs if x in result["arms"] and y in result["arms"]]
  return "; ".join(f"{label(y)} − {label(x)} {v.pm()} ({said[v.verdict]})" for x, y, v in vs)


def findings(result: dict) -> list[str]:
  lines = []
  chain = lambda arms: list(zip(arms, arms[1:]))  # noqa: E731
  for title, pairs in (("G1, more experts at equal active parameters", chain([f"E{e}k2" for e in (4, 8, 16, 32)])),
                       ("G2, finer experts at equal total and active parameters", chain(["E8k1", "E16k2", "E32k4"])),
                       ("G3, a shared expert in place of a routed one", [("E16k2", "E16k1s1"), ("E16k4", "E16k3s1")])):
    said = _steps(result, pairs)
    if said:
      lines.append(f"Reading ({title}): {said}.")
  best = min(result["arms"], key=lambda n: stat(result, n)[0])
  lines.append(f"Reading: the best arm is {label(best)} ({common.pm(stat(result, best))}); where a reading above is "
               "'higher' the toy scale disagrees with the published guidance, as reported.")
  return lines


def plot(result: dict):
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for k in sorted({x["top_k"] for x in result["arms"].values() if x["experts"] and not x["shared"]}):
    names = sorted([n for n, x in result["arms"].items() if x["top_k"] == k and not x["shared"] and x["experts"]],
                   key=lambda n: result["arms"][n]["experts"])
    m = [stat(result, n) for n in names]
    ax.errorbar([result["arms"][n]["experts"] for n in names], [v[0] for v in m], yerr=[v[1] for v in m], fmt="o-",
                capsize=3, label=f"top-{k}, d_expert {result['config']['active'] // k}")
  dense = stat(result, "dense")
  ax.axhline(dense[0], color="k", ls=":", label="dense (same active FFN)")
  ax.set_xscale("log", base=2)
  ax.set(xlabel="routed experts E", ylabel="val loss (nats/byte)",
         title=f"equal active parameters ({len(result['seeds'])} seeds, mean ± std)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def write(cfg: Config, result: dict):
  common.write_experiment(cfg, NAME, __doc__.split("\n\n")[0], result, tables, findings, plot)


if __name__ == "__main__":
  common.cli(main, Config, cache="optlab-moe-design-cache-")
