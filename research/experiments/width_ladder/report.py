"""The width ladder's verdicts (by `research.verdicts`), tables and findings (plots.py draws them), from what
`study.Ladder.run` finished: a rung or contender still running is reported as such, so a partial ladder gives a
partial record."""

from __future__ import annotations

import math

import numpy as np

from research.verdicts import (
  bootstrap_speedup,
  compare,
  extrapolates,
  fit_check,
  fit_power_law,
  lr_band,
  lr_optimum,
  profile_area,
  speedup_slope,
  speedup_trend,
  transfer_slope,
)

BASE = "adamw"
META = ("law", "law_error", "fit")  # a width's keys in verdicts()["widths"] that are not contenders


def _finished(entry: dict) -> bool:
  return bool(entry) and "finals" in entry and None not in entry["finals"]


def verdicts(done: dict, tokens_per_step: int) -> dict:
  """Per width: AdamW's fitted L(D), each contender's speedup (bootstrap interval over seeds) and its Welch test
  against AdamW; per contender: the lr optimum at each width and the transfer slope; the performance profiles' areas.

  Args:
    done: `Ladder.run()`'s result.
    tokens_per_step: batch × sequence length.

  Returns:
    {"widths": {width: {"law": ..., contender: {...}}}, "budgets": {width: {contender: {fraction: {...}}}},
    "trend": {contender: {...}}, "transfer": {...}, "profile": {...}}.
  """
  out: dict = {"widths": {}, "budgets": {}, "trend": {}, "transfer": {}, "profile": {}}
  for width, rung in done.items():
    row = out["widths"][width] = {}
    base = rung.get(BASE, {})
    budgets = rung.get("budgets", {})
    if _finished(base) and budgets:
      tokens = base["steps"] * tokens_per_step
      points = {b["steps"] * tokens_per_step: b["finals"] for b in budgets.values() if None not in b["finals"]}
      points[tokens] = base["finals"]
      points = {d: kept for d, f in points.items() if (kept := [v for v in f if math.isfinite(v)])}  # diverged: out
      try:
        if tokens not in points:
          raise ValueError("every AdamW seed diverged at the full budget")
        law = fit_power_law(list(points), [float(np.mean(f)) for f in points.values()])  # as the bootstrap fits it
      except ValueError as e:  # fewer than 3 budgets left
        row["law_error"] = str(e)
        continue
      chk = fit_check(law, points)
      row["law"] = {"alpha": law.alpha, "exponent": law.exponent, "floor": law.floor}
      row["fit"] = {"tokens_per_param": [d / rung["params"] for d in chk.tokens],
                    "miss": np.subtract(chk.means, chk.fitted).tolist(), "std": list(chk.stds), "z": list(chk.z),
                    "f": chk.f_statistic, "df": list(chk.df), "p": chk.p_value,
                    "floor_bound": chk.floor_bound}
      full = {}
      for name, entry in rung.items():
        if not isinstance(entry, dict) or not _finished(entry):
          continue
        finals = [v for v in entry["finals"] if math.isfinite(v)]
        if len(finals) < 2:
          continue
        iv = bootstrap_speedup(points, finals, tokens, seed=width)
        rel = full[name] = bootstrap_speedup(points, finals, tokens, seed=width, relative=True)
        c = compare(finals, points[tokens]) if name != BASE and len(points[tokens]) > 1 else None
        row[name] = {"speedup": iv.estimate, "low": iv.low, "high": iv.high,
                     "relative": rel.estimate, "relative_low": rel.low, "relative_high": rel.high,
                     "extrapolated": extrapolates(law, float(np.mean(finals))),
                     "mean": float(np.mean(finals)), "std": float(np.std(finals, ddof=1)),
                     **({"p": c.p_value, "t": c.statistic, "df": c.df, "diff": c.diff, "test": c.test} if c else {})}
      out["budgets"][width] = _at_budgets(rung, points, tokens_per_step, width, full)
  names = sorted({n for rung in done.values() for n, e in rung.items() if isinstance(e, dict) and "scan" in e})
  for name in names:
    optima = {}
    for width, rung in done.items():
      scan = rung.get(name, {}).get("scan", {})
      if scan and None not in scan.values():
        o = lr_optimum(list(scan), list(scan.values()))
        finals = [x for x in rung[name].get("finals", []) if x is not None and math.isfinite(x)]
        noise = float(np.std(finals, ddof=1)) if len(finals) > 1 else math.nan
        band = lr_band(list(scan), list(scan.values()), noise) if math.isfinite(noise) else None
        optima[width] = {"lr": o.lr, "at_edge": o.at_edge, "fitted": o.fitted, "noise": noise,
                         "band": [band.low, band.high] if band else [math.nan, math.nan],
                         "band_open": [band.open_low, band.open_high] if band else [False, False]}
    slope = transfer_slope(list(optima), [o["lr"] for o in optima.values()]) if len(optima) >= 2 else float("nan")
    out["transfer"][name] = {"optima": optima, "slope": slope}
  out["trend"] = _trends(out["budgets"])
  cost = costs(out)
  if any(cost.values()):
    out["profile"] = profile_area({n: c for n, c in cost.items() if c})
  return out


def _at_budgets(rung: dict, points: dict, tokens_per_step: int, width: int, full: dict) -> dict:
  """Stage D for every contender at one width: {contender: {fraction: speedup (÷ AdamW's own at that budget) with its
  interval, and the Welch test against AdamW at the same budget}}; the full budget is fraction 1, its interval the
  main table's (`full`: contender -> its relative `Interval`)."""
  base, out = rung[BASE], {}
  runs_of = lambda e: {1.0: (e["finals"], rung["steps"])} | {
      f: (b["finals"], b["steps"]) for f, b in e.get("budgets", {}).items()}
  adamw = runs_of({**base, "budgets": rung["budgets"]})
  for name, entry in rung.items():
    if name == BASE or not isinstance(entry, dict) or not _finished(entry) or not entry.get("budgets"):
      continue
    if any(None in b["finals"] for b in entry["budgets"].values()):
      continue
    row = out[name] = {}
    for fraction, (finals, steps) in sorted(runs_of(entry).items()):
      finals, tokens = [v for v in finals if math.isfinite(v)], steps * tokens_per_step
      if len(finals) < 2 or fraction not in adamw or tokens not in points:  # AdamW unfinished or diverged there
        continue
      iv = full[name] if fraction == 1.0 else bootstrap_speedup(points, finals, tokens, seed=width, relative=True)
      theirs = [v for v in adamw[fraction][0] if math.isfinite(v)]
      c = compare(finals, theirs) if len(theirs) > 1 else None
      row[fraction] = {"tokens_per_param": tokens / rung["params"], "relative": iv.estimate, "low": iv.low,
                       "high": iv.high, "extrapolated": iv.extrapolated, "diff": c.diff if c else math.nan,
                       "p": c.p_value if c else math.nan}
  return out


def _trends(budgets: dict) -> dict:
  """Per contender, `speedup_trend` over every (width, budget) point of stage D: the speedup's exponent in width at
  fixed tokens per parameter and in tokens per parameter at fixed width."""
  out = {}
  for name in sorted({n for row in budgets.values() for n in row}):
    pts = [(w, r["tokens_per_param"], r["relative"]) for w, row in budgets.items()
           for r in row.get(name, {}).values() if math.isfinite(r["relative"]) and r["relative"] > 0]
    try:
      t = speedup_trend(*zip(*pts)) if pts else None
    except ValueError:  # one width only so far, or too few points
      t = None
    if t:
      out[name] = {"width_exponent": t.width_exponent, "width_se": t.width_se, "data_exponent": t.data_exponent,
                   "data_se": t.data_se, "points": t.points}
  return out


def tables(cfg, done: dict, v: dict) -> list[str]:
  """The record's tables: the rungs, the tuned settings, speedups, significance, lr transfer."""
  f = lambda x, spec=".3g": "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
  lines = ["## Rungs", "", "| d_model | parameters | tokens / parameter | steps | tokens |", "|---|---|---|---|---|"]
  for w, rung in done.items():
    lines.append(f"| {w} | {rung['params']:,} | {rung['tokens_per_param']:g} | {rung['steps']} | "
                 f"{rung['steps'] * cfg.batch_size * cfg.seq_len:,} |")
  lines += ["", "## Tuned settings (seed 0) and final held-out loss at the optimum (mean ± std over seeds)", "",
            "The last column is the tuning seed's final loss minus the other seeds' mean: the optimum was picked on "
            "seed 0, so a negative value is the selection's luck (the winner's curse), which the other seeds do not "
            "share.",
            "", "| d_model | contender | best settings | lr scan edge | search-box edges | final val loss | "
            "seed 0 − others |", "|---|---|---|---|---|---|---|"]
  for w, rung in done.items():
    for name in cfg.contenders:
      e = rung.get(name, {})
      if not _finished(e):
        lines.append(f"| {w} | {name} | (not finished) | | | | |")
        continue
      finals = [x for x in e["finals"] if math.isfinite(x)]
      best = ", ".join(f"{k}={x:.4g}" for k, x in sorted(e["best"].items()))
      lines.append(f"| {w} | {name} | {best} | {e.get('scan_edge') or '—'} | {', '.join(e['best_edges']) or '—'} | "
                   f"{np.mean(finals):.4f} ± {np.std(finals, ddof=1) if len(finals) > 1 else 0:.4f} "
                   f"({len(finals)} of {len(e['finals'])} seeds finite) | "
                   f"{f(_luck(e['finals']), '+.4f')} |")
  lines += ["", "## Data-matched speedup over AdamW and significance", "",
            "Speedup = the tokens AdamW's fitted L(D) = α·D^(−B) + β needs to reach the contender's mean final loss / "
            "the tokens used (95% bootstrap interval over seeds, 1000 resamples); p: one-sided Welch t-test that the "
            "contender's final losses are lower than AdamW's. AdamW's own row reads its mean final loss on its own "
            "fit: where it is not 1, the fit is biased at the full budget, and the next column divides that out "
            "(the data AdamW's fit needs for the contender's loss over the data it needs for AdamW's own, resampled "
            "jointly: `bootstrap_speedup(..., relative=True)`).", "",
            "| d_model | AdamW's L(D): α, B, β | contender | speedup [95% CI] | ÷ AdamW's own [95% CI] | "
            "extrapolated | Δ loss vs AdamW | t, df | p |",
            "|---|---|---|---|---|---|---|---|---|"]
  for w, row in v["widths"].items():
    law = row.get("law")
    lawtxt = f"{law['alpha']:.3g}, {law['exponent']:.3g}, {law['floor']:.3g}" if law else "(not finished)"
    for name in cfg.contenders:
      r = row.get(name)
      if not r:
        continue
      lines.append(f"| {w} | {lawtxt} | {name} | {f(r['speedup'], '.2f')}× [{f(r['low'], '.2f')}, "
                   f"{f(r['high'], '.2f')}] | {f(r['relative'], '.2f')}× [{f(r['relative_low'], '.2f')}, "
                   f"{f(r['relative_high'], '.2f')}] | "
                   f"{'yes' if r['extrapolated'] else 'no'} | {f(r.get('diff'), '+.4f')} | "
                   f"{f(r.get('t'), '.2f')}, {f(r.get('df'), '.1f')} | {f(r.get('p'), '.3g')} |")
  lines += _fit_table(v)
  lines += ["", "## Learning-rate transfer (stage A's scans)", "",
            "lr* per width: the vertex of a parabola in log lr through the scan's best point and its neighbours "
            "(`research.verdicts.lr_optimum`); in brackets the lrs whose scan loss lies within the seeds' standard "
            "deviation at the optimum of the scan's best (`research.verdicts.lr_band`, interpolated in log lr; ≤ or ≥: "
            "the band reaches the scan's end): where two widths' brackets overlap, the scans do not tell their optima "
            "apart. slope: log lr* on log width (0: the lr transfers).", "",
            "| contender | " + " | ".join(f"lr* at {w}" for w in done) + " | slope |",
            "|---|" + "---|" * (len(done) + 1)]
  for name, t in v["transfer"].items():
    cells = [_optimum_cell(t["optima"][w]) if w in t["optima"] else "—" for w in done]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {f(t['slope'], '+.2f')} |")
  lines += _budget_table(v)
  if v["profile"]:
    lines += ["", "Performance profile (cost = 1 / speedup per width; AlgoPerf's normalised area, τ ≤ 4): " +
              ", ".join(f"{n} {a:.3f}" for n, a in sorted(v["profile"].items(), key=lambda t: -t[1]))]
  return lines


def _fit_table(v: dict) -> list[str]:
  """AdamW's L(D) against its own runs per width: each budget's miss in standard errors, the lack-of-fit test."""
  rows = [(w, row["fit"]) for w, row in v["widths"].items() if "fit" in row]
  if not rows:
    return []
  lines = ["", "## AdamW's L(D): does the fit follow its own runs?", "",
           "Each budget's miss: AdamW's mean final loss − the fit, beside its seeds' standard deviation; F, p: the "
           "lack-of-fit test (`research.verdicts.fit_check`: F(budgets − 3, runs − budgets), the seeds' variance "
           "pooled over budgets as the unweighted fit weighs them). A small p, or a floor at a bound of the fit, says "
           "the power law's shape does not follow AdamW's runs at that width; a miss many stds wide at a quiet budget "
           "says the same where the pooled test cannot. The speedups read off such a fit carry that error, most "
           "where they extrapolate; the ÷ AdamW's own column removes the miss at the full budget.", "",
           "| d_model | miss (std) at each budget, by tokens / parameter | F (df) | p | floor at a bound |",
           "|---|---|---|---|---|"]
  for w, fit in rows:
    zs = ", ".join(f"{r:.3g}: {m:+.3f} ({s:.3f})" for r, m, s in zip(fit["tokens_per_param"], fit["miss"],
                                                                       fit["std"]))
    lines.append(f"| {w} | {zs} | {fit['f']:.3g} ({fit['df'][0]}, {fit['df'][1]}) | {fit['p']:.3g} | "
                 f"{fit['floor_bound'] or '—'} |")
  return lines


def compute_table(compute: dict) -> list[str]:
  """The record's compute: per width and stage, the finished runs, their steps and the hours they took
  (`Ladder.compute`: wall, and quiet: at the width's 10th-percentile step time)."""
  lines = ["", "## Compute (measured from the runs' records)", "",
           "Wall hours: each group's wall time shared among its members, compile and evaluation included, and any "
           "time the process was paused or shared the machine. Quiet hours: member-steps × the width's "
           "10th-percentile seconds per member-step over all its logging intervals, what a quiet 2-core machine "
           "takes (`Ladder.compute`).", "",
           "| d_model | stage | runs | member-steps | wall hours | quiet hours |", "|---|---|---|---|---|---|"]
  cells = [(w, stage, c) for w in sorted(compute) for stage, c in sorted(compute[w].items())]
  lines += [f"| {w} | {stage} | {c['runs']} | {c['member_steps']:,} | {c['hours']:.2f} | {c.get('quiet', 0):.2f} |"
            for w, stage, c in cells]
  total = lambda key: sum(c.get(key, 0) for _, _, c in cells)
  return lines + [f"| all | | {total('runs')} | {total('member_steps'):,} | {total('hours'):.2f} | "
                  f"{total('quiet'):.2f} |"]


def _luck(finals: list[float]) -> float | None:
  """The tuning seed's final loss minus the other seeds' mean (None without two finite values to compare)."""
  others = [x for x in finals[1:] if math.isfinite(x)]
  return finals[0] - float(np.mean(others)) if others and math.isfinite(finals[0]) else None


def _optimum_cell(o: dict) -> str:
  """lr* (flagged at a scan's edge) and its band; an end marked ≤ or ≥ reaches the scan's end and may extend past."""
  (lo, hi), (open_lo, open_hi) = o.get("band", (math.nan, math.nan)), o.get("band_open", (False, False))
  cell = format(o["lr"], ".3g") + (" (edge)" if o["at_edge"] else "")
  return cell + (f" [{'≤' * open_lo}{lo:.3g}, {'≥' * open_hi}{hi:.3g}]" if math.isfinite(lo) else "")


def _budget_table(v: dict) -> list[str]:
  """Stage D for every contender: the speedup at each (width, tokens per parameter), and each contender's fitted
  exponents in width and in tokens per parameter."""
  if not any(v["budgets"].values()):
    return []
  lines = ["", "## The speedup at each budget: width and tokens per parameter apart (stage D)", "",
           "Every contender at its optimum also ran AdamW's shorter budgets (each its own schedule, every seed). "
           "Speedup: the data AdamW's fit needs for the contender's mean loss over the data it needs for AdamW's own "
           "at the same budget (95% bootstrap interval); Δ loss and p: against AdamW's runs at that budget (one-sided "
           "Welch). Along the ladder width and tokens per parameter move together; these points part them.", "",
           "| contender | d_model | tokens / parameter | speedup ÷ AdamW's own [95% CI] | extrapolated | "
           "Δ loss vs AdamW | p |", "|---|---|---|---|---|---|---|"]
  names = sorted({n for row in v["budgets"].values() for n in row})
  for name in names:
    pts = sorted((r["tokens_per_param"], w, r) for w, row in v["budgets"].items() for r in row.get(name, {}).values())
    for tpp, w, r in pts:
      lines.append(f"| {name} | {w} | {tpp:.3g} | {r['relative']:.2f}× [{r['low']:.2f}, {r['high']:.2f}] | "
                   f"{'yes' if r['extrapolated'] else 'no'} | {r['diff']:+.4f} | {r['p']:.3g} |")
  if v["trend"]:
    lines += ["", "log speedup fitted as a plane in log width and log tokens per parameter over these points "
              "(`research.verdicts.speedup_trend`; ± one standard error, residuals taken as independent):", ""]
    lines += [f"- {n}: width exponent {t['width_exponent']:+.3f} ± {t['width_se']:.3f}, tokens-per-parameter "
              f"exponent {t['data_exponent']:+.3f} ± {t['data_se']:.3f} ({t['points']} points)"
              for n, t in v["trend"].items()]
  return lines


def _word(x: float, se: float) -> str:
  return "holds (within 2 standard errors)" if abs(x) <= 2 * se else "grows" if x > 0 else "shrinks"


def findings(v: dict) -> list[str]:
  """Sentences generated from the verdicts: the speedup's trend with width, which Muon convention transfers."""
  out = []
  for name in sorted({n for row in v["widths"].values() for n in row if n not in (*META, BASE)}):
    pts = [(w, row[name]) for w, row in v["widths"].items() if name in row and all(
        math.isfinite(row[name][k]) and row[name][k] > 0 for k in ("relative", "relative_low", "relative_high"))]
    try:
      s = speedup_slope(*zip(*[(w, r["relative"], r["relative_low"], r["relative_high"]) for w, r in pts]))
    except ValueError:  # fewer than two widths so far, or an interval of zero width
      continue
    sig = [w for w, row in v["widths"].items() if name in row and row[name].get("p", 1) < 0.05]
    path = " → ".join(f"{r['relative']:.2f}×" for _, r in pts)
    chi = f", reduced χ² {s.reduced_chi2:.3g}" if math.isfinite(s.reduced_chi2) else ""
    out.append(f"- {name}: speedup ÷ AdamW's own {path} over widths "
               f"{', '.join(str(w) for w, _ in pts)}: along the ladder it {_word(s.exponent, s.scaled_se)} with width "
               f"(exponent {s.exponent:+.2f} ± {s.scaled_se:.2f}: `speedup_slope`, the seeds' intervals widened by the "
               f"widths' scatter about the line{chi}); significantly "
               f"below AdamW's loss (p < 0.05) at {', '.join(map(str, sig)) or 'no width'}.")
  bad = [w for w, row in v["widths"].items() if "fit" in row and (row["fit"]["p"] < 0.01 or row["fit"]["floor_bound"])]
  if bad:
    out.append(f"- AdamW's L(D) misses its own runs at width {', '.join(map(str, bad))} (lack-of-fit p < 0.01 or its "
               "floor at a bound): the speedups there read the fit's shape as much as the contenders' gain.")
  for name, t in v.get("trend", {}).items():
    out.append(f"- {name}: at fixed tokens per parameter the speedup {_word(t['width_exponent'], t['width_se'])} with "
               f"width (exponent {t['width_exponent']:+.2f} ± {t['width_se']:.2f}); at fixed width it "
               f"{_word(t['data_exponent'], t['data_se'])} with tokens per parameter ({t['data_exponent']:+.2f} ± "
               f"{t['data_se']:.2f}).")
  for name, t in v["transfer"].items():
    ws = sorted(w for w, o in t["optima"].items() if math.isfinite(o.get("band", [math.nan])[0]))
    same = [(a, b) for a, b in zip(ws, ws[1:]) if t["optima"][a]["band"][0] <= t["optima"][b]["band"][1]
            and t["optima"][b]["band"][0] <= t["optima"][a]["band"][1]]
    if same:
      out.append(f"- {name}: lr* is not told apart within the seeds' noise between widths "
                 f"{', '.join(f'{a} and {b}' for a, b in same)} (their bands overlap).")
  t = v["transfer"]
  for a, b in (("muon-moonlight", "muon-keller"),):
    if a in t and b in t and np.isfinite(t[a]["slope"]) and np.isfinite(t[b]["slope"]):
      closer = a if abs(t[a]["slope"]) < abs(t[b]["slope"]) else b
      out.append(f"- lr transfer: {a} slope {t[a]['slope']:+.2f}, {b} {t[b]['slope']:+.2f}: {closer}'s optimum "
                 f"moves less with width.")
  return out


def costs(v: dict) -> dict:
  """{contender: {width: 1 / speedup}}: the data each needs relative to AdamW's fit, per width (lower is better)."""
  names = {n for row in v["widths"].values() for n in row if n not in META}
  return {n: {str(w): 1 / r[n]["speedup"] for w, r in v["widths"].items() if n in r and r[n]["speedup"] > 0}
          for n in names}
