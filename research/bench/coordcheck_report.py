"""The coordinate check's report on what research/bench/coordcheck.py measured: log-log slope fits against width, the
markdown record with its reading, and µP's plot per contender."""

from __future__ import annotations

import json

import numpy as np

import optim
from optim.muon import shape_scale
from research.bench.report import table

HIDDEN = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the Muon group's matrices


def loglog_slope(widths, values) -> float:
  """The slope of log(value) on log(width) (least squares, `numpy.polyfit`): ~0 for a width-stable quantity.

  Args:
    widths: the widths (two or more, positive).
    values: the quantity at each width (positive).

  Returns:
    The fitted exponent p of value ∝ width^p; NaN with fewer than two widths or a value that is not positive.
  """
  w, v = np.asarray(widths, np.float64), np.asarray(values, np.float64)
  if len(w) < 2 or not np.all(v > 0):
    return float("nan")
  return float(np.polyfit(np.log(w), np.log(v), 1)[0])



def report(record: dict, base: str) -> list[str]:
  """The markdown record: settings, a headline table, the reading, then every quantity per contender.

  Args:
    record: the coordinate check's record (coordcheck.json's contents).
    base: the preset the width ladder scales (its depth, head size and d_ff / d_model).

  Returns:
    The markdown's lines.
  """
  s, res = record["settings"], record["results"]
  widths, T = s["widths"], s["steps"]
  f = lambda v: "—" if v is None else f"{v:.3g}"
  at = lambda vals: " · ".join(f(v) for v in vals)
  lines = ["# Coordinate check (µP, Yang et al. 2022): activations and update sizes across width", "",
           f"Command: `{record['command']}`  ", f"Commit {record['commit']}; {record['machine']} (one used); device "
           f"{record['device']}; {record['date']}; runtime {record['runtime_s']:.0f} s", "",
           f"Settings: `{json.dumps(s)}`", "",
           f"Model: the `{base}` preset at d_model = {', '.join(map(str, widths))} ({s['n_layers']} layers, head size "
           f"{s['head_dim']}, d_ff = {s['d_ff_over_d_model']:g}·d_model), the model's own init: std {s['init_std']} "
           "at every width (output projections / √(2L)), i.e. the standard parametrization, not µP's. Each "
           f"contender at one lr for every width, {T} steps on fixed batches of {s['batch_size']}×{s['seq_len']} "
           f"bytes, measured on one fixed held-out probe batch, mean over {s['seeds']} seeds. Slope: `numpy.polyfit` "
           "of log(value) on log(width): 0 = width-stable, 1 = grows as the width. Hidden: the Muon group's "
           f"matrices ({', '.join(HIDDEN)}); the embedding (tied head) and the norms are AdamW's in every contender.",
           "", f"## Headline (step T = {T})", ""]
  rows = []
  for name, r in res.items():
    m = r["mean"]
    sl = lambda kind, keys: f(mean_slope(r, kind, keys))
    rows.append([name, f"{r['lr']:g}", sl("act", blocks(m)), sl("dact", blocks(m)), sl("act", ["logits"]),
                 sl("dact", ["logits"]), sl("rms", HIDDEN), sl("rel", HIDDEN), at(hidden_rms(r, -1) / r["lr"]),
                 at(m["probe_loss"][-1])])
  lines += table(["contender", "lr", "slope \\|x\\| (blocks)", "slope \\|x−x₀\\| (blocks)", "slope \\|logits\\|",
                  "slope \\|logits−logits₀\\|", "slope RMS(ΔW) hidden", "slope ‖ΔW‖/‖W‖ hidden",
                  f"RMS(ΔW)/lr hidden at {', '.join(map(str, widths))}", "probe loss at T per width"], rows)
  lines += ["", "Probe loss at init (every contender): " + at(next(iter(res.values()))["mean"]["probe_loss"][0]),
            "", *reading(record)]
  for name, r in res.items():
    m = r["mean"]
    lines += ["", f"## {name}: `{r['optimizer']}` lr {r['lr']:g}, {json.dumps(r['hyper'])}", "",
              f"![{name}](coordcheck_{name}.png)", ""]
    cols = ["output", *(f"\\|x\\| w={w}" for w in widths), "slope", "slope at init",
            *(f"\\|x−x₀\\| w={w}" for w in widths), "slope"]
    lines += table(cols, [[k, *map(f, m["act"][k][-1]), f(m["slope"]["act"][k][-1]), f(m["slope"]["act"][k][0]),
                           *map(f, m["dact"][k][-1]), f(m["slope"]["dact"][k][-1])] for k in m["act"]])
    lines.append("")
    cols = ["matrix (mean over layers)", *(f"RMS(ΔW) w={w}" for w in widths), "slope",
            *(f"‖ΔW‖/‖W‖ w={w}" for w in widths), "slope"]
    lines += table(cols, [[k, *map(f, m["rms"][k][-1]), f(m["slope"]["rms"][k][-1]), *map(f, m["rel"][k][-1]),
                           f(m["slope"]["rel"][k][-1])] for k in m["rms"]])
  return lines


def mean_slope(r: dict, kind: str, keys, t: int = -1) -> float:
  """A contender's slope of `kind` at step t, averaged over the curves `keys` (NaN where there is none)."""
  return float(np.mean([np.nan if (v := r["mean"]["slope"][kind][k][t]) is None else v for k in keys]))


def blocks(m: dict) -> list[str]:
  """The blocks' outputs among the tracked layers (attention, MLP, residual stream of every block)."""
  return [k for k in m["act"] if k.startswith("L")]


def hidden_rms(r: dict, t: int) -> np.ndarray:
  """RMS(ΔW) at step t (an index into 1..T) per width, averaged over the hidden matrices."""
  return np.mean([r["mean"]["rms"][k][t] for k in HIDDEN], axis=0)


def orthogonal_share(r: dict, widths: list[int], t: int) -> np.ndarray | None:
  """A Muon-family contender's hidden RMS(ΔW) at step t as a share of a full-rank orthogonal update's (lr · its shape
  scale / √max(m, n), Liu et al. Lemma 1) per width: the RMS of the update's singular values. None for AdamW."""
  if r["optimizer"] == "adamw":
    return None
  scale = r["hyper"].get("scale", optim.hyperparameters(r["optimizer"])["scale"])
  m = r["mean"]

  def full(w, k):
    fan_in, fan_out = m["shapes"][str(w)][k]
    return r["lr"] * shape_scale(scale, fan_in, fan_out) / np.sqrt(max(fan_in, fan_out))
  return np.array([np.mean([m["rms"][k][t][i] / full(w, k) for k in HIDDEN]) for i, w in enumerate(widths)])


def reading(record: dict) -> list[str]:
  """The result read against the papers, its numbers taken from the record."""
  s, res = record["settings"], record["results"]
  widths, T = s["widths"], s["steps"]
  f = lambda v: f"{v:.3g}"
  at = lambda vals: " → ".join(f(v) for v in vals)
  slope = mean_slope
  if len(widths) < 2:
    return ["## Reading", "", "One width: no slope to read."]
  order = sorted(res, key=lambda n: abs(slope(res[n], "dact", blocks(res[n]["mean"]))))
  lines = ["## Reading", "",
           "What the papers predict. Under µP every layer's activations, and their change in training, stay Θ(1) as "
           "the width grows (flat lines); in the standard parametrization with Adam they grow with width (Yang et al. "
           "2022, Fig. 1 and 5), which is why its best lr moves with width. This model is in the standard "
           "parametrization (a fixed init std, and the embedding, tied head and norms under AdamW at one lr in every "
           "contender), so no contender is expected to be flat here; the check measures what each convention for the "
           "hidden matrices adds to the width growth. A full-rank orthogonalized m×n update has RMS 1/√max(m, n) "
           "(Liu et al. 2025, Lemma 1): keller's √max(1, fan_out/fan_in) keeps its spectral norm fixed, the spectral "
           "condition for feature learning (Yang, Simon and Bernstein 2023), so its RMS falls as width^-1/2; "
           "moonlight's 0.2·√max(m, n) fixes the RMS at 0.2·lr, said to match AdamW's typical update RMS (0.2–0.4) "
           "so that AdamW's lr and weight decay carry over, and lets the spectral norm grow as width^1/2; an AdamW "
           "update has RMS ≈ lr at any width (±lr at step 1) and a spectral norm that can grow up to width^1. "
           "Predicted: the blocks' change since init grows least with keller, then moonlight (and NorMuon at the "
           "moonlight scale), then AdamW.", "",
           f"Measured, step {T}:", "",
           "- Change of the blocks' outputs since init (mean slope over the blocks' attention, MLP and residual "
           "outputs), flattest first: " + ", ".join(f"{n} {f(slope(res[n], 'dact', blocks(res[n]['mean'])))}"
                                                   for n in order)
           + f". At init these outputs already grow with width (mean slope of \\|x₀\\| "
           f"{f(slope(res[order[0]], 'act', blocks(res[order[0]]['mean']), 0))}): the fixed init std.",
           "- Hidden-matrix update RMS per unit lr, widths " + ", ".join(map(str, widths)) + ": "
           + "; ".join(f"{n} {at(hidden_rms(r, -1) / r['lr'])} (slope {f(slope(r, 'rms', HIDDEN))})"
                       for n, r in res.items()) + "."]
  if "adamw" in res:
    a = res["adamw"]
    lines.append(f"- AdamW's hidden update RMS per unit lr by step, mean over widths: "
                 f"{at([np.mean(hidden_rms(a, t)) / a['lr'] for t in range(T)])} (a bias-corrected first Adam step is "
                 "±lr; Liu et al. give 0.2–0.4 as AdamW's typical RMS over a run).")
  explained = False
  for n, r in res.items():
    share = orthogonal_share(r, widths, -1)
    if share is None:
      continue
    falls = share[-1] < 0.9 * share[0]
    why = ("NorMuon rescales its update to that RMS" if r["optimizer"] == "normuon" else
           "the RMS of its singular values" + ("" if not falls else ", as above" if explained else
           ", below 1 and falling with width: Newton–Schulz starts from G/‖G‖_F and five quintic steps lift a small "
           "singular value by at most 3.4445⁵ ≈ 485×, so those of an early gradient below ~1/500 of its Frobenius "
           "norm stay below 1, and a wider matrix has more of them"))
    explained |= falls and r["optimizer"] != "normuon"
    lines.append(f"- {n}: hidden update RMS = {at(share)} × a full-rank orthogonal update's, across the widths "
                 f"({why}).")
  muons = [n for n, r in res.items() if r["optimizer"] != "adamw"]
  if len(muons) > 1:
    same = sorted(muons, key=lambda n: slope(res[n], "rms", HIDDEN)) == sorted(
        muons, key=lambda n: slope(res[n], "dact", blocks(res[n]["mean"])))
    lines.append(f"- Across the Muon family the slopes of the blocks' change {'rank' if same else 'do not rank'} as "
                 "those of the update RMS (slope of RMS(ΔW), slope of \\|x−x₀\\|): " + ", ".join(
                     f"{n} ({f(slope(res[n], 'rms', HIDDEN))}, {f(slope(res[n], 'dact', blocks(res[n]['mean'])))})"
                     for n in muons) + ".")
  logit = {n: slope(r, "dact", ["logits"]) for n, r in res.items()}
  lines.append("- Logits' change since init, slope: " + ", ".join(f"{n} {f(v)}" for n, v in logit.items())
               + (": it grows with width in every contender; the tied embedding head is AdamW's at one lr in all of "
                  "them, where µP would shrink the output layer's update as 1/width." if min(logit.values()) > 0.25
                  else "."))
  last = {n: r["mean"]["probe_loss"][-1] for n, r in res.items()}
  worse = [n for n, v in last.items() if v[-1] > v[-2]]
  lines.append(f"- Probe loss at step {T}, widest vs next width: "
               + ", ".join(f"{n} {v[-1]:.3f} vs {v[-2]:.3f}" for n, v in last.items())
               + (f"; worse at the widest: {', '.join(worse)}." if worse else "."))
  rises = [f"{n} at width {w}, step {t}: {pl[t - 1][i]:.3f} → {pl[t][i]:.3f}" for n, r in res.items()
           if (pl := r["mean"]["probe_loss"]) for i, w in enumerate(widths) for t in range(1, T + 1)
           if pl[t][i] > pl[t - 1][i]]
  lines.append("- Steps that raised the probe loss (seed mean): " + ("; ".join(rises) if rises else "none") + ".")
  flat = [n for n in order if abs(slope(res[n], "dact", blocks(res[n]["mean"]))) < 0.2]
  by_rms = sorted(res, key=lambda n: abs(slope(res[n], "rms", HIDDEN)))
  lines += ["", f"So, as measured: the activations' change is flattest across width with {order[0]} "
            + (f"(width-stable, |slope| < 0.2: {', '.join(flat)})" if flat else "(none is width-stable here)")
            + f"; the hidden update RMS is flattest with {by_rms[0]} (slope {f(slope(res[by_rms[0]], 'rms', HIDDEN))})"
            + f" and steepest with {by_rms[-1]} ({f(slope(res[by_rms[-1]], 'rms', HIDDEN))})."]
  if "adamw" in res and "muon-moonlight" in res:
    ratio = hidden_rms(res["adamw"], -1) / hidden_rms(res["muon-moonlight"], -1) * (
        res["muon-moonlight"]["lr"] / res["adamw"]["lr"])
    match = "holds to within 1.5×" if np.all(abs(np.log(ratio)) < np.log(1.5)) else "is off by more than 1.5×"
    lines[-1] += (f" At equal lr, AdamW's hidden updates are {at(ratio)} × moonlight-Muon's in RMS across the widths "
                  f"at this step: the RMS matching {match} in these first steps (the project's tuned lrs at "
                  "`small`, research/results/optimizers, are 1e-3 for AdamW and 1e-2 for Muon at the moonlight "
                  "scale).")
  return lines


def plot(path: str, name: str, r: dict, widths: list[int]) -> None:
  """µP's figure for one contender: a column per step, rows mean |x| and mean |x − x₀| per output (a colour per block,
  a line style per kind), RMS(ΔW) and ‖ΔW‖/‖W‖ per matrix (mean over layers), each against width, log-log."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  m, T = r["mean"], len(r["mean"]["rms"]["embed"])
  n_blocks = len(blocks(m)) // 3
  layer = plt.get_cmap("viridis")

  def style(kind: str, j: int, k: str) -> dict:
    if kind in ("rms", "rel"):
      return {"color": plt.get_cmap("tab10")(j), "ls": "-"}
    if k in ("embed", "logits"):
      return {"color": "black" if k == "embed" else "tab:red", "ls": "-", "lw": 2}
    l, _, part = k.partition(".")
    return {"color": layer(int(l[1:]) / max(1, n_blocks - 1)), "ls": {"attn": "--", "mlp": ":"}.get(part, "-")}

  rows = [("act", "mean |x|", 0), ("dact", "mean |x − x₀|", 1), ("rms", "RMS(ΔW)", 1), ("rel", "‖ΔW‖ / ‖W‖", 1)]
  fig, axes = plt.subplots(len(rows), T + 1, figsize=(3.2 * (T + 1), 2.8 * len(rows)), squeeze=False)
  for i, (kind, label, first) in enumerate(rows):
    for t in range(T + 1):
      ax = axes[i][t]
      if t < first:
        ax.axis("off")
        continue
      for j, (k, v) in enumerate(m[kind].items()):
        ax.plot(widths, v[t - (kind in ("rms", "rel"))], marker="o", ms=3, label=k, **style(kind, j, k))
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      lo, hi = ax.get_ylim()
      if hi < 10 * lo:  # at least a decade, so a flat line looks flat
        ax.set_ylim(np.sqrt(lo * hi) / np.sqrt(10), np.sqrt(lo * hi) * np.sqrt(10))
      ax.set_title(f"{label}, t={t}" + (" (init)" if t == 0 else ""), fontsize=9)
      ax.set_xlabel("width (d_model)", fontsize=8)
      ax.tick_params(labelsize=7, which="both")
    axes[i][T].legend(fontsize=6, ncol=2 if len(m[kind]) > 8 else 1, loc="center left", bbox_to_anchor=(1.02, 0.5))
  fig.suptitle(f"coordinate check: {name} (lr {r['lr']:g} at every width)")
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
