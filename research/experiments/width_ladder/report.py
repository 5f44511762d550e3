"""The width ladder's verdicts (by `research.verdicts`) and findings (tables.py and plots.py show them), from what
`study.Ladder.run` finished: a rung or contender still running is reported as such, so a partial ladder gives a
partial record."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from research.verdicts import (
  bootstrap_speedup,
  compare,
  fit_check,
  fit_power_law,
  lr_band,
  lr_optimum,
  pairwise,
  profile_area,
  speedup_slope,
  speedup_trend,
  transfer_slope,
)

BASE = "adamw"
META = ("law", "law_error", "fit")  # a width's keys in verdicts()["widths"] that are not contenders
NULL_DRAWS = 400  # ladders simulated under AdamW's fit per width for `fit_check`'s false-alarm rates


def finished(entry: dict) -> bool:
  """Whether a contender's (or a budget's) runs all finished."""
  return bool(entry) and "finals" in entry and None not in entry["finals"]


def verdicts(done: dict, tokens_per_step: int) -> dict:
  """Per width: AdamW's fitted L(D) and its lack-of-fit checks, each contender's speedup (95% interval over seeds,
  standard error of its log) and its Welch test against AdamW, every pair's Welch test (Holm); per contender: the lr
  optimum at each width and the transfer slope; the performance profiles' areas.

  Args:
    done: `Ladder.run()`'s result.
    tokens_per_step: batch × sequence length.

  Returns:
    {"widths": {width: {"law": ..., contender: {...}}}, "budgets": {width: {contender: {fraction: {...}}}},
    "trend" and "ladder": {"fit" | "between": {contender: {...}}} (the speedup's exponents over stage D's points and
    along the widths, on AdamW's fit or between its runs), "transfer": {...}, "profile": {...}, "pairs": {width:
    [{"better", "worse", "diff", "t", "df", "p", "p_holm"}, ...]}}.
  """
  out: dict = {"widths": {}, "budgets": {}, "trend": {}, "ladder": {}, "transfer": {}, "profile": {}, "pairs": {}}
  for width, rung in done.items():
    row = out["widths"][width] = {}
    if len(seen := _finals(rung)) >= 2:
      out["pairs"][width] = [{"better": q.better, "worse": q.worse, "diff": q.comparison.diff,
                              "t": q.comparison.statistic, "df": q.comparison.df, "p": q.comparison.p_value,
                              "p_holm": q.p_holm} for q in pairwise(seen)]
    base = rung.get(BASE, {})
    budgets = rung.get("budgets", {})
    if finished(base) and budgets:
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
      chk = fit_check(law, points, n_resamples=NULL_DRAWS, seed=width)
      row["law"] = {"alpha": law.alpha, "exponent": law.exponent, "floor": law.floor}
      row["fit"] = {"tokens_per_param": [d / rung["params"] for d in chk.tokens],
                    "miss": np.subtract(chk.means, chk.fitted).tolist(), "std": list(chk.stds), "z": list(chk.z),
                    "z_own": list(chk.z_own), "f": chk.f_statistic, "df": list(chk.df), "p": chk.p_value,
                    "p_own": chk.p_own, "floor_bound": chk.floor_bound, "null_rates": list(chk.null_rates)}
      full = {}
      for name, finals in seen.items():
        mine = None if name == BASE else finals  # AdamW's own row: its runs drawn once, in both roles
        iv = bootstrap_speedup(points, mine, tokens, seed=width)
        rel = bootstrap_speedup(points, mine, tokens, seed=width, relative=True)
        ip = _between(points, mine, tokens, width)
        full[name] = (rel, ip)
        c = compare(finals, points[tokens]) if name != BASE and len(points[tokens]) > 1 else None
        row[name] = {"speedup": iv.estimate, "low": iv.low, "high": iv.high,
                     "relative": rel.estimate, "relative_low": rel.low, "relative_high": rel.high,
                     "relative_se": rel.se_log, **ip,
                     "extrapolated": iv.extrapolated,
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
  out["trend"] = {way: _trends(out["budgets"], way) for way in KEYS}
  out["ladder"] = {way: _ladder(out["widths"], way) for way in KEYS}
  cost = costs(out)
  if any(cost.values()):
    out["profile"] = profile_area({n: c for n, c in cost.items() if c})
  return out


def _finals(rung: dict) -> dict:
  """{contender: its finite final losses at the full budget}, for every finished contender with two or more."""
  out = {}
  for name, entry in rung.items():
    if isinstance(entry, dict) and finished(entry):
      if len(kept := [v for v in entry["finals"] if math.isfinite(v)]) >= 2:
        out[name] = kept
  return out


def _at_budgets(rung: dict, points: dict, tokens_per_step: int, width: int, full: dict) -> dict:
  """Stage D for every contender at one width: {contender: {fraction: speedup (÷ AdamW's own at that budget) with its
  interval, and the Welch test against AdamW at the same budget}}; the full budget is fraction 1, its intervals the
  main table's (`full`: contender -> its relative `Interval` and `_between`'s reading)."""
  base, out = rung[BASE], {}
  runs_of = lambda e: {1.0: (e["finals"], rung["steps"])} | {
      f: (b["finals"], b["steps"]) for f, b in e.get("budgets", {}).items()}
  adamw = runs_of({**base, "budgets": rung["budgets"]})
  for name, entry in rung.items():
    if name == BASE or not isinstance(entry, dict) or not finished(entry) or not entry.get("budgets"):
      continue
    if any(None in b["finals"] for b in entry["budgets"].values()):
      continue
    row = out[name] = {}
    for fraction, (finals, steps) in sorted(runs_of(entry).items()):
      finals, tokens = [v for v in finals if math.isfinite(v)], steps * tokens_per_step
      if len(finals) < 2 or fraction not in adamw or tokens not in points:  # AdamW unfinished or diverged there
        continue
      iv, ip = full[name] if fraction == 1.0 else (
          bootstrap_speedup(points, finals, tokens, seed=width, relative=True),
          _between(points, finals, tokens, width))
      theirs = [v for v in adamw[fraction][0] if math.isfinite(v)]
      c = compare(finals, theirs) if len(theirs) > 1 else None
      row[fraction] = {**ip, "tokens_per_param": tokens / rung["params"], "relative": iv.estimate, "low": iv.low,
                       "high": iv.high, "extrapolated": iv.extrapolated, "diff": c.diff if c else math.nan,
                       "p": c.p_value if c else math.nan}
  return out


def _between(points: dict, finals: list[float] | None, tokens: int, width: int) -> dict:
  """The speedup read between AdamW's runs, no law (`bootstrap_speedup(method="interpolate")`): its interval, and the
  measured range as speedups (past it, the estimate is 0 or inf: a bound)."""
  iv = bootstrap_speedup(points, finals, tokens, seed=width, method="interpolate")
  return {"interp": iv.estimate, "interp_low": iv.low, "interp_high": iv.high, "interp_se": iv.se_log,
          "interp_range": [min(points) / tokens, max(points) / tokens]}


KEYS = {"fit": ("relative", "low", "high"), "between": ("interp", "interp_low", "interp_high")}  # stage D's columns
FULL = {"fit": ("relative", "relative_low", "relative_high"), "between": KEYS["between"]}  # the main table's
SE = {"fit": "relative_se", "between": "interp_se"}  # the main table's standard error of log speedup, for the ladder
WAYS = {"fit": "÷ AdamW's own on its fit", "between": "read between AdamW's runs"}


def usable(r: dict, keys: tuple[str, ...]) -> bool:
  """Whether a verdict row's `keys` (a speedup and its interval's ends, or its standard error) are all finite and
  positive: not a bound."""
  return all(math.isfinite(r[k]) and r[k] > 0 for k in keys)


def _trends(budgets: dict, way: str) -> dict:
  """Per contender, `speedup_trend` over every (width, budget) point of stage D with a usable speedup `way` ("fit" or
  "between": a bound past AdamW's runs is left out): the exponent in width at fixed tokens per parameter and in tokens
  per parameter at fixed width."""
  out, key = {}, KEYS[way][0]
  for name in sorted({n for row in budgets.values() for n in row}):
    pts = [(w, r["tokens_per_param"], r[key]) for w, row in budgets.items()
           for r in row.get(name, {}).values() if usable(r, (key,))]
    try:
      t = speedup_trend(*zip(*pts)) if pts else None
    except ValueError:  # one width only so far, or too few points
      t = None
    if t:
      out[name] = {"width_exponent": t.width_exponent, "width_se": t.width_se, "data_exponent": t.data_exponent,
                   "data_se": t.data_se, "points": t.points}
  return out


def _ladder(widths: dict, way: str) -> dict:
  """Per contender, `speedup_slope` of its full-budget speedup `way` along the widths where it and its standard error
  of log speedup are finite and positive: {name: {"widths", "speedups", "exponent", "se", "dof", "reduced_chi2",
  "left_out", "extrapolated"}} ("left_out": the widths it ran at with no finite standard error, e.g. a speedup one
  standard error from the edge of AdamW's runs, or none at all). The interval is Knapp and Hartung's (Stat. Med. 22,
  2003), on fixed weights 1/se² (no between-width variance term): t on widths − 2 df, the error scaled by √(reduced
  χ²) up or down (its floored variant, √max(1, χ²), overcovers: the chain's calibration test in
  tests/research/test_verdicts.py). Two widths: the normal on the seeds' errors, short of 95%."""
  keys, out = (FULL[way][0], SE[way]), {}
  for name in sorted({n for row in widths.values() for n in row if n not in (*META, BASE)}):
    pts = [(w, row[name]) for w, row in widths.items() if name in row and usable(row[name], keys)]
    try:
      s = speedup_slope(*zip(*[(w, *(r[k] for k in keys)) for w, r in pts]))
    except (ValueError, TypeError):  # fewer than two widths so far
      continue
    # Knapp–Hartung: the scatter about the line scales the error (t on points − 2 df); two widths leave no df: the
    # normal on the seeds' errors, short of its coverage
    dof = s.points - 2 if s.points > 2 else math.inf
    out[name] = {"widths": [w for w, _ in pts], "speedups": [r[keys[0]] for _, r in pts], "exponent": s.exponent,
                 "se": s.kh_se if s.points > 2 else s.se, "dof": dof, "reduced_chi2": s.reduced_chi2,
                 "left_out": [w for w, row in widths.items() if name in row and not usable(row[name], keys)],
                 "extrapolated": [w for w, r in pts if r.get("extrapolated")] if way == "fit" else []}
  return out


SETTLED = 0.1  # an exponent whose 95% interval lies within ±SETTLED: the speedup holds (7% per doubling at most)


def _half(se: float, dof: float) -> float:
  """Half the 95% interval of an estimate with standard error `se`: t on `dof`, the normal where infinite."""
  return se * (stats.t.ppf(0.975, dof) if math.isfinite(dof) else stats.norm.ppf(0.975))


def verdict(x: float, se: float, dof: float) -> str:
  """The verdict on an exponent: grows or shrinks where its 95% interval excludes 0, holds where it lies within
  ±SETTLED, else not resolved."""
  half = _half(se, dof)
  return ("grows" if x - half > 0 else "shrinks" if x + half < 0 else "holds" if abs(x) + half <= SETTLED else
          "not resolved")


def word(x: float, se: float, dof: float) -> str:
  """`verdict` with the estimate and its 95% interval."""
  half = _half(se, dof)
  return f"{verdict(x, se, dof)} (exponent {x:+.2f} ± {se:.2f}, 95% interval [{x - half:+.2f}, {x + half:+.2f}])"


def overlap(a: dict, b: dict) -> bool | None:
  """Whether two widths' lr optima (`verdicts()["transfer"][name]["optima"][width]`) have overlapping bands, i.e. the
  seeds' noise does not tell them apart; None where either has no band."""
  (a0, a1), (b0, b1) = a.get("band", [math.nan] * 2), b.get("band", [math.nan] * 2)
  if any(map(math.isnan, (a0, a1, b0, b1))):
    return None
  return a0 <= b1 and b0 <= a1


def findings(v: dict) -> list[str]:
  """Sentences generated from the verdicts: the speedup's trend with width, which Muon convention transfers."""
  out = []
  for way, ladder in v.get("ladder", {}).items():
    for name, s in ladder.items():
      chi = f", reduced χ² {s['reduced_chi2']:.3g}" if math.isfinite(s["reduced_chi2"]) else ""
      path = " → ".join(f"{x:.2f}×" for x in s["speedups"])
      ex = f"; extrapolated at {', '.join(map(str, s['extrapolated']))}" if s["extrapolated"] else ""
      if s.get("left_out"):
        ex += f"; left out (a bound, or no finite positive standard error) at {', '.join(map(str, s['left_out']))}"
      how = ("the seeds' standard errors alone: two widths leave no scatter to check, and the normal interval on them "
             "falls short of 95%" if not chi else f"the seeds' standard errors scaled by the widths' scatter about the "
             f"line{chi} (Knapp–Hartung, t on {s['dof']} df)")
      out.append(f"- {name}, speedup {WAYS[way]}: {path} over widths {', '.join(map(str, s['widths']))}{ex}. Along "
                 f"the ladder, with width: {word(s['exponent'], s['se'], s['dof'])} (`speedup_slope` on {how}).")
  for name in sorted({n for row in v["widths"].values() for n in row if n not in (*META, BASE)}):
    sig = [w for w, row in v["widths"].items() if name in row and row[name].get("p", 1) < 0.05]
    out.append(f"- {name}: final loss significantly below AdamW's (one-sided Welch p < 0.05, unadjusted) at "
               f"{', '.join(map(str, sig)) or 'no width'}.")
  out += _pair_findings(v.get("pairs", {}))
  bad = {w: row["fit"] for w, row in v["widths"].items() if "fit" in row and (
      row["fit"]["p"] < 0.05 or row["fit"]["p_own"] < 0.05 or row["fit"]["floor_bound"])}
  if bad:
    pct = lambda x: f"{100 * x:.0f}%" if math.isfinite(x) else "not simulated"
    rates = {w: c.get("null_rates", [math.nan] * 2) for w, c in bad.items()}
    why = "; ".join(f"{w}: pooled p {c['p']:.2g}, per budget {c['p_own']:.2g}, floor {c['floor_bound'] or 'free'}, "
                    f"false alarms at 0.05 if the law held with these spreads {pct(rates[w][0])} and "
                    f"{pct(rates[w][1])}" for w, c in bad.items())
    out.append(f"- AdamW's L(D) misses its own runs at width {', '.join(map(str, bad))} (lack-of-fit p < 0.05, pooled "
               f"or budget by budget, or its floor at a bound; {why}): the speedups on the fit there carry the law's "
               "shape error as far as these tests hold their level; read them beside the ones between AdamW's runs.")
  for way, trend in v.get("trend", {}).items():
    for name, t in trend.items():
      out.append(f"- {name}, speedup {WAYS[way]}: at fixed tokens per parameter, with width: "
                 f"{word(t['width_exponent'], t['width_se'], t['points'] - 3)}; at fixed width, with tokens per "
                 f"parameter: {word(t['data_exponent'], t['data_se'], t['points'] - 3)} (`speedup_trend`, "
                 f"{t['points']} points).")
  for name, t in v["transfer"].items():
    ws = sorted(w for w, o in t["optima"].items() if math.isfinite(o.get("band", [math.nan])[0]))
    same = [(a, b) for a, b in zip(ws, ws[1:]) if overlap(t["optima"][a], t["optima"][b])]
    if same:
      out.append(f"- {name}: lr* is not told apart within the seeds' noise between widths "
                 f"{', '.join(f'{a} and {b}' for a, b in same)} (their bands overlap).")
  t = v["transfer"]
  for a, b in (("muon-moonlight", "muon-keller"),):
    both = sorted(set(t.get(a, {}).get("optima", {})) & set(t.get(b, {}).get("optima", {})))
    if len(both) < 2:
      continue
    sa, sb = (transfer_slope(both, [t[n]["optima"][w]["lr"] for w in both]) for n in (a, b))
    closer = a if abs(sa) < abs(sb) else b
    out.append(f"- lr transfer over the widths both have ({', '.join(map(str, both))}): {a} slope {sa:+.2f}, {b} "
               f"{sb:+.2f} ({closer}'s moves less); their difference {sa - sb:+.2f} against the −0.5 that Moonlight's "
               "0.2·√max(m, n) predicts over Keller's fan ratio at a fixed aspect ratio (both optima at the same "
               "update size); whether either lr* moves beyond the scans' noise: the bands above.")
  return out


def _pair_findings(pairs: dict) -> list[str]:
  """Per pair of contenders other than AdamW (against AdamW: the line above), the widths where each has the lower mean
  and where that holds at Holm p < 0.05."""
  out, seen = [], {}
  for w, qs in pairs.items():
    for q in qs:
      if BASE not in (q["better"], q["worse"]):
        seen.setdefault(tuple(sorted((q["better"], q["worse"]))), []).append((w, q))
  for (a, b), rows in sorted(seen.items()):
    part = lambda x: [w for w, q in rows if q["better"] == x]
    sig = lambda x: [w for w, q in rows if q["better"] == x and q["p_holm"] < 0.05]
    say = lambda ws: ", ".join(map(str, ws)) or "none"
    out.append(f"- {a} against {b}, at widths {say([w for w, _ in rows])}: {a} lower at {say(part(a))} (Holm p < "
               f"0.05 at {say(sig(a))}), {b} lower at {say(part(b))} (Holm p < 0.05 at {say(sig(b))}).")
  return out


def costs(v: dict) -> dict:
  """{contender: {width: 1 / speedup}}: the data each needs relative to AdamW, per width (lower is better), on the
  speedup read between AdamW's runs; past them (a bound, "> k×" or "< k×") the measured range's end k is used, which
  understates the distance to AdamW."""
  names = {n for row in v["widths"].values() for n in row if n not in META}
  out: dict = {n: {} for n in names}
  for w, row in v["widths"].items():
    for n in names:
      r = row.get(n, {})
      if "interp" in r:  # 0 or inf past AdamW's runs, never NaN
        lo, hi = r["interp_range"]
        out[n][str(w)] = 1 / min(max(r["interp"], lo), hi)
  return out
