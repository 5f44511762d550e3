"""Tables, findings and plots of the scalability study (research/experiments/scalability/study.py): its results.md."""

from __future__ import annotations

import os

import numpy as np
from scipy.stats import spearmanr

from research.experiments import common

CHARACTERS = ("variance", "sparsity", "diversity", "similarity")


def _speedup(cell: dict | None) -> str:
  if cell is None:
    return "n/a"
  if "speedup" not in cell:
    return f"— ({cell['reached']}/{cell['seeds']})"
  edge = "†" if cell.get("lr_edge") else ""
  return f"{cell['speedup'][0]:.2f} ± {cell['speedup'][1]:.2f}{edge}"


def speedup_table(part: dict, summary: dict, workers, algorithms) -> list[str]:
  ws = [w for w in workers if w > 1]
  lines = ["| dataset | " + " | ".join(CHARACTERS) + " | B_noise | target | algorithm | " +
           " | ".join(f"W={w}" for w in ws) + f" | MiB to target, W={ws[-1]} |",
           "|" + "---|" * (len(CHARACTERS) + 4 + len(ws) + 1)]
  for dataset, row in summary.items():
    chars = part[dataset]["characters"]
    noise = row.get("noise_scale")
    head = [dataset, *[f"{chars[c]:.4g}" for c in CHARACTERS], "—" if noise is None else f"{noise:.1f}",
            f"{row['target']:.4f}"]
    for i, alg in enumerate(a for a in algorithms if any(f"{a}/W{w}" in row["cells"] for w in ws)):
      cells = [row["cells"].get(f"{alg}/W{w}") for w in ws]
      last = cells[-1]
      mib = "—" if not last or "bytes" not in last else f"{last['bytes'][0] / 2**20:.2f}"
      lines.append("| " + " | ".join((head if i == 0 else [""] * len(head)) + [alg, *map(_speedup, cells), mib]) + " |")
    pred = [row["cells"].get(f"allreduce/W{w}", {}).get("predicted_sync") for w in ws]
    if all(p is not None for p in pred):
      lines.append("| " + " | ".join([""] * len(head) + ["(predicted, sync)", *[f"{p:.2f}" for p in pred], ""]) + " |")
  return lines


def sweep_table(sweep: dict) -> list[str]:
  lines = ["| outer step | lr | H | held-out loss | MiB between replicas per device |", "|---|---|---|---|---|"]
  for alg, hs in sweep.items():
    for h, row in sorted(hs.items(), key=lambda kv: int(kv[0])):
      lines.append(f"| {alg} | {row['lr']:g} | {h} | {common.pm(row['final'])} | {row['bytes'][0] / 2**20:.2f} |")
  return lines


def tables(result: dict) -> list[str]:
  s, cfg = result["summary"], result["settings"]
  lines = ["## Convex: logistic regression on digits (plain SGD)", "",
           f"Speedup in steps to the target held-out loss over 1 worker, mean ± std over {len(cfg['seeds'])} seeds "
           "(† the tuned learning rate is at its grid's edge; — (k/n): only k of n seeds reached the target). "
           "Characters of the samples in sampling order (research/data/datastats.py), B_noise at the 1-worker run's "
           f"final parameters; per-worker batch {cfg['convex_batch']}.", ""]
  lines += speedup_table(result["convex"], s["convex"], cfg["workers"], cfg["algorithms"])
  lines += ["", "## Language model: `tiny` on bytes (AdamW)", "",
            f"The same, per-worker batch {cfg['lm_batch']} × {cfg['seq_len']} bytes, {cfg['lm_steps']} steps; the "
            "characters are of bags of bytes of the training windows.", ""]
  lines += speedup_table({k: v for k, v in result["lm"].items() if k != "lr"}, s["lm"], cfg["workers"],
                         cfg["lm_algorithms"])
  if s["sweep"]:
    lines += ["", f"## The sync period H of local SGD (W = {cfg['h_workers']}, `{cfg['lm_datasets'][0]}`; diloco: "
              "DiLoCo's outer Nesterov step, local: plain averaging)", ""]
    lines += sweep_table(s["sweep"])
  return lines


def findings(result: dict) -> list[str]:
  """Statements computed from the numbers: does B_noise order the datasets as the measured synchronous speedup
  does, and which algorithm loses most where consecutive samples are alike."""
  out = []
  for part, algorithms in (("convex", result["settings"]["algorithms"]), ("lm", result["settings"]["lm_algorithms"])):
    rows = result["summary"][part]
    w = max(result["settings"]["workers"])
    pairs = [(r["noise_scale"], r["cells"][f"allreduce/W{w}"]["speedup"][0]) for r in rows.values()
             if r.get("noise_scale") is not None and "speedup" in r["cells"].get(f"allreduce/W{w}", {})]
    if len(pairs) >= 3:
      rho = spearmanr(*zip(*pairs))[0]
      out.append(f"{part}: across {len(pairs)} datasets, Spearman ρ between B_noise and the measured synchronous "
                 f"speedup at W={w} is {rho:+.2f} (the noise-scale model says it should be positive).")
    for dataset, row in rows.items():
      got = {a: row["cells"].get(f"{a}/W{w}", {}).get("speedup", (None,))[0] for a in algorithms}
      got = {a: v for a, v in got.items() if v is not None}
      if len(set(got.values())) > 1:
        best, worst = max(got, key=got.get), min(got, key=got.get)
        out.append(f"{part} `{dataset}` at W={w}: fastest {best} ({got[best]:.2f}×), slowest {worst} "
                   f"({got[worst]:.2f}×).")
  return out


def plot(result: dict):
  import matplotlib.pyplot as plt
  s, cfg = result["summary"], result["settings"]
  parts = [p for p in ("convex", "lm") if s[p]]
  fig, axes = plt.subplots(1, len(parts) + bool(s["sweep"]), figsize=(5 * (len(parts) + 1), 4), squeeze=False)
  for ax, part in zip(axes[0], parts):
    algorithms = cfg["algorithms"] if part == "convex" else cfg["lm_algorithms"]
    for dataset, row in s[part].items():
      for alg, marker in zip(algorithms, "osd^"):
        ws = [w for w in cfg["workers"] if "speedup" in row["cells"].get(f"{alg}/W{w}", {})]
        ax.plot(ws, [row["cells"][f"{alg}/W{w}"]["speedup"][0] for w in ws], marker=marker,
                label=f"{dataset} {alg}", alpha=0.7)
    ws = np.array(cfg["workers"])
    ax.plot(ws, ws, "k:", label="linear")
    ax.set(xscale="log", yscale="log", xlabel="workers W", ylabel="speedup (steps to target)", title=part)
    ax.legend(fontsize=6, ncol=2)
  if s["sweep"]:
    ax = axes[0][-1]
    for alg, sweep in s["sweep"].items():
      hs = sorted(sweep, key=int)
      ax.errorbar([sweep[h]["bytes"][0] / 2**20 for h in hs], [sweep[h]["final"][0] for h in hs],
                  yerr=[sweep[h]["final"][1] for h in hs], marker="o", label=alg)
      for h in hs:
        ax.annotate(f"H={h}", (sweep[h]["bytes"][0] / 2**20, sweep[h]["final"][0]), fontsize=7)
    ax.set(xscale="log", xlabel="MiB between replicas per device", ylabel="held-out loss", title="local SGD: H sweep")
    ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def write(cfg, result: dict, name: str, question: str, cmd: str | None = None):
  """results.md (the study's `name` and `question`, tables, findings), results.json and speedup.png in cfg.out."""
  common.write_results(cfg.out, name, question, tables(result), findings=findings(result),
                       settings=result["settings"], data=result, cmd=cmd)
  fig = plot(result)
  fig.savefig(os.path.join(cfg.out, "speedup.png"), dpi=120)
