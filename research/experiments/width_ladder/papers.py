"""The width ladder read against the papers it answers: each paper's finding, as its text states it, beside what this
ladder measured, every number computed from the verdicts (report.py) so that the reading follows the record.

References:
  Wen, Hall, Ma, Liang, "Fantastic Pretraining Optimizers and Where to Find Them", arXiv 2509.02046 (2025).
  Semenov, Pagliardini, Jaggi, "Benchmarking Optimizers for LLM Pretraining", arXiv 2509.01440 (2025).
  Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982 (2025).
  Yang et al., "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer" (µP),
  arXiv 2203.03466 (2022).
"""

from __future__ import annotations

import math

from research.experiments.width_ladder.report import BASE, FULL, META, WAYS, overlap, usable, verdict
from research.verdicts import spread_ratio

MOONLIGHT, KELLER = "muon-moonlight", "muon-keller"
WEN = ("**Wen et al. 2025** (\"Fantastic Pretraining Optimizers\"; 130M–1.2B parameters at 1–8× Chinchilla's tokens, "
       "every optimizer tuned on its own): no optimizer reaches 2× over a well-tuned AdamW; the best matrix "
       "optimizers' data-matched speedup is about 1.4× at 0.1B and falls to about 1.1× at 1.2B.")
WEN_BEST = 1.4  # their largest speedup, at their smallest scale
WEN_SMALLEST, WEN_LARGEST = 130e6, 1.2e9  # their models' parameters
SEMENOV = ("**Semenov et al. 2025** (\"Benchmarking Optimizers for LLM Pretraining\"; 124M–720M): Muon with "
           "Moonlight's weight decay and update-RMS scaling is more stable than plain Muon.")
TRANSFER = ("**µP against Moonlight** (the issue's question): Keller's fan-ratio scale √max(1, fan_out/fan_in) is "
            "µP's, under which the lr should hold across width; Moonlight's 0.2·√max(m, n) matches AdamW's update "
            "RMS so that AdamW's lr can be reused, under which its lr* should follow AdamW's.")


def _rows(v: dict) -> dict:
  """{width: {contender: its main-table verdict}}, AdamW left out, as the verdicts order the widths."""
  return {w: {n: r for n, r in row.items() if n not in (*META, BASE)} for w, row in v["widths"].items()}


def _wen(v: dict, done: dict) -> list[str]:
  """The best speedup per width against Wen et al.'s 1.4× and 2×, and its trend along the ladder."""
  rows, best = _rows(v), []
  ok = {w: {n: r for n, r in row.items() if usable(r, FULL["fit"])} for w, row in rows.items()}
  for w, row in ok.items():
    if row:
      n, r = max(row.items(), key=lambda kv: kv[1]["relative"])
      best.append(f"{w} {n} {r['relative']:.2f}× [{r['relative_low']:.2f}, {r['relative_high']:.2f}]"
                  + (" (extrapolated)" if r.get("extrapolated") else ""))
  cells = [(w, n, r) for w, row in ok.items() for n, r in row.items()]
  above = lambda k: sorted({w for w, _, r in cells if r["relative_low"] > k}, key=list(rows).index)
  out = [f"- {WEN}", f"  - Here ({', '.join(map(str, rows))}: the best contender's speedup ÷ AdamW's own on its fit, "
         f"95% interval): {'; '.join(best) or 'none yet'}. Intervals wholly above their best ({WEN_BEST}×) at widths "
         f"{', '.join(map(str, above(WEN_BEST))) or 'none'} ({sum(r['relative_low'] > WEN_BEST for *_, r in cells)} "
         f"of {len(cells)} contender-widths); above 2× at {', '.join(map(str, above(2.0))) or 'none'}."]
  for way, ladder in v.get("ladder", {}).items():
    if ladder:
      words = {n: verdict(s["exponent"], s["se"], s["dof"]) for n, s in ladder.items()}
      shrinks = [n for n, x in words.items() if x == "shrinks"]
      out.append(f"  - Along the ladder, speedup {WAYS[way]}: "
                 + ", ".join(f"{n} {x}" for n, x in words.items())
                 + f" — the speedup shrinks with width for {', '.join(shrinks) or 'none'}.")
  if trend := v.get("trend", {}).get("fit", {}):
    say = lambda e, se: ", ".join(f"{n} {verdict(t[e], t[se], t['points'] - 3)}" for n, t in trend.items())
    out.append(f"  - Width and data apart (stage D, on the fit): at fixed tokens per parameter, with width: "
               f"{say('width_exponent', 'width_se')}; at fixed width, with tokens per parameter: "
               f"{say('data_exponent', 'data_se')}.")
  params = [rung["params"] for rung in done.values()]
  ratio = " → ".join(f"{rung['tokens_per_param']:g}" for rung in done.values())
  out.append(f"  - Not their regime: these models ({min(params) / 1e6:.2g}M–{max(params) / 1e6:.2g}M parameters) are "
             f"{WEN_SMALLEST / max(params):,.0f}–{WEN_LARGEST / min(params):,.0f}× smaller than theirs, trained at "
             f"{ratio} tokens per parameter along the widths where theirs train at 20–160 (1–8× Chinchilla); a win "
             "that holds or grows here does not contradict one that shrinks from 0.1B to 1.2B.")
  out.append("  - Tuning: each contender here, AdamW included, had the same budget (an lr scan, then a few "
             "quasi-random trials over lr, weight decay and one knob of its own); theirs tuned about nine "
             "hyperparameters each by coordinate descent, and found that a baseline tuned less inflates the speedups "
             "over it. AdamW's warmup, β1 and ε are untuned here (as are the contenders' other knobs), so these "
             "speedups may read high next to theirs.")
  return out


def _diverged(entry: dict) -> tuple[int, int]:
  """(non-finite, all) final losses over a contender's scan, trials, seeds and budgets at one width."""
  xs = [*entry.get("scan", {}).values(), *(t[1] for t in entry.get("trials", [])), *entry.get("finals", []),
        *(x for b in entry.get("budgets", {}).values() for x in b.get("finals", []))]
  xs = [x for x in xs if x is not None]
  return sum(not math.isfinite(x) for x in xs), len(xs)


def _semenov(v: dict, done: dict) -> list[str]:
  """Moonlight's Muon against Keller's: mean loss (Holm), seed spread (F-test) and diverged runs."""
  both = [w for w, rung in done.items() if all(rung.get(n, {}).get("finals") and None not in rung[n]["finals"]
                                               for n in (MOONLIGHT, KELLER))]
  if not both:
    return []
  out = [f"- {SEMENOV}"]
  pairs = {w: next((q for q in v.get("pairs", {}).get(w, []) if {q["better"], q["worse"]} == {MOONLIGHT, KELLER}),
                   None) for w in both}
  lower = [f"{w}: {q['better']} by {-q['diff']:.4f} (Holm p {q['p_holm']:.2g})" for w, q in pairs.items() if q]
  out.append(f"  - Final loss: {'; '.join(lower)}.")
  finals = {n: [[x for x in done[w][n]["finals"] if math.isfinite(x)] for w in both] for n in (MOONLIGHT, KELLER)}
  try:
    s = spread_ratio(finals[MOONLIGHT], finals[KELLER])
    out.append(f"  - Seed-to-seed spread at the optimum, pooled over widths {', '.join(map(str, both))}: {MOONLIGHT} "
               f"std {math.sqrt(s.var_a):.4f}, {KELLER} {math.sqrt(s.var_b):.4f}, variance ratio {s.ratio:.2f} "
               f"(F({s.df_a}, {s.df_b}), two-sided p {s.p_value:.2g}; `research.verdicts.spread_ratio`).")
  except ValueError:
    pass
  div = {n: [_diverged(done[w][n]) for w in both] for n in (MOONLIGHT, KELLER)}
  out.append("  - Diverged runs (non-finite final loss) over every scan, trial, seed and budget: " + ", ".join(
      f"{n} {sum(d for d, _ in c)} of {sum(a for _, a in c)}" for n, c in div.items()) + ". Both Muons here take "
      "tuned weight decay (from the same search box), so here they differ in their update's scale (and Keller's in "
      "the AdamW lr of its other parameters); where the paper's plain Muon also lacks weight decay, that part of its "
      "contrast is not tested here.")
  return out


def _transfer(v: dict) -> list[str]:
  """Each convention's lr* from the narrowest width to the widest, and whether the seeds' noise tells them apart."""
  t = v.get("transfer", {})
  out = [f"- {TRANSFER}"]
  for n in (KELLER, MOONLIGHT, BASE):
    o = t.get(n, {}).get("optima", {})
    if len(o) < 2:
      continue
    lo, hi = min(o, key=int), max(o, key=int)
    same = overlap(o[lo], o[hi])
    ends = ("no band at an end (fewer than 2 seeds)" if same is None else "the two ends' bands overlap (one lr is "
            "within the noise at both ends)" if same else "the two ends' bands do not overlap (the lr moves beyond "
            "the noise)")
    out.append(f"  - {n}: lr* {o[lo]['lr']:.3g} at {lo} → {o[hi]['lr']:.3g} at {hi}, slope {t[n]['slope']:+.2f} on "
               f"log width; {ends}.")
  m, w = t.get(MOONLIGHT, {}).get("optima", {}), t.get(BASE, {}).get("optima", {})
  if common := [x for x in m if x in w]:
    out.append(f"  - {MOONLIGHT}'s lr* over AdamW's, width by width (1 where AdamW's lr carries over): "
               + ", ".join(f"{x} {m[x]['lr'] / w[x]['lr']:.2f}" for x in common) + ".")
  return out if len(out) > 1 else []


def reading(done: dict, v: dict) -> list[str]:
  """The record's section that reads the ladder against Wen et al., Semenov et al., and µP against Moonlight.

  Args:
    done: `Ladder.run()`'s result.
    v: `report.verdicts(done, ...)`.

  Returns:
    The section's markdown lines, empty before any width has a verdict.
  """
  body = [*_wen(v, done), *_semenov(v, done), *_transfer(v)] if any(_rows(v).values()) else []
  head = ("Each paper's finding beside what this ladder measured (computed from the verdicts above), every contender "
          "compared at the end of its schedule as Wen et al. advise.")
  return ["## Read against the papers", "", head, "", *body] if body else []
