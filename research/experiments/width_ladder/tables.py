"""The width ladder's tables, from `report.verdicts`: the rungs, the tuned settings, the speedups and their tests,
AdamW's fit against its own runs, lr transfer, stage D's speedup at each budget, the compute."""

from __future__ import annotations

import math

import numpy as np

from research.experiments.width_ladder.report import WAYS, finished


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
            "share. Muon (Moonlight) and NorMuon search the same box (lr around the same scan optimum, weight decay, "
            "momentum) at the same quasi-random points (seeded by width): where the same point wins for both, their "
            "settings coincide; their runs and losses are their own.",
            "", "| d_model | contender | best settings | lr scan edge | search-box edges | final val loss | "
            "seed 0 − others |", "|---|---|---|---|---|---|---|"]
  for w, rung in done.items():
    for name in cfg.contenders:
      e = rung.get(name, {})
      if not finished(e):
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
            "the tokens used (95% interval over seeds, 1000 draws: AdamW's mean at each budget and the contender's "
            "drawn from its Student-t posterior on its own seeds' spread, `bootstrap_speedup`'s default: in the "
            "calibration checks of tests/research/test_verdicts.py it covers 95.5–98% at 3 seeds between AdamW's runs "
            "(at least 90% on the fit ÷ its own), resampling the seeds 72–76%; the trend along the ladder weighs "
            "each width by the delta method's standard error of its log "
            "speedup, `Interval.se_log`, not by the interval); p: one-sided Welch t-test that the "
            "contender's final losses are lower than AdamW's. AdamW's own row reads its mean final loss on its own "
            "fit (its runs drawn once, in both roles): where it is not 1, the fit is biased at the full budget, and "
            "the next column divides that out "
            "(the data AdamW's fit needs for the contender's loss over the data it needs for AdamW's own, drawn "
            "jointly: `bootstrap_speedup(..., relative=True)`). Between AdamW's runs: the same data ratio read off "
            "AdamW's mean losses at its measured budgets, linear in log tokens between two of them, no law assumed "
            "(`method=\"interpolate\"`; > or <: the contender's loss lies past AdamW's runs, a bound).", "",
            "| d_model | AdamW's L(D): α, B, β | contender | speedup [95% CI] | ÷ AdamW's own [95% CI] | "
            "extrapolated | between AdamW's runs [95% CI] | Δ loss vs AdamW | t, df | p |",
            "|---|---|---|---|---|---|---|---|---|---|"]
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
                   f"{'yes' if r['extrapolated'] else 'no'} | {_interp_cell(r)} | {f(r.get('diff'), '+.4f')} | "
                   f"{f(r.get('t'), '.2f')}, {f(r.get('df'), '.1f')} | {f(r.get('p'), '.3g')} |")
  lines += _pairs_table(v)
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
    lines += ["", "Performance profile (cost = 1 / speedup per width, read between AdamW's runs, a bound at its "
              "range's end; AlgoPerf's normalised area, τ ≤ 4): " +
              ", ".join(f"{n} {a:.3f}" for n, a in sorted(v["profile"].items(), key=lambda t: -t[1]))]
  return lines


def _pairs_table(v: dict) -> list[str]:
  """Who beats whom at each width: every pair of contenders, Welch's two-sided test, Holm over the width's pairs."""
  if not v.get("pairs"):
    return []
  lines = ["", "## Which contender beats which", "",
           "Every pair of the width's optimizers, AdamW included, the one with the lower mean final loss first: "
           "Welch's two-sided t-test over seeds, its p-value Holm-adjusted over the width's pairs "
           "(`research.verdicts.pairwise`), so that p (Holm) < 0.05 holds the chance of any false rejection at a width "
           "to 5%.", "",
           "| d_model | better | worse | Δ loss | t, df | p | p (Holm) |", "|---|---|---|---|---|---|---|"]
  for w, pairs in v["pairs"].items():
    for q in pairs:
      lines.append(f"| {w} | {q['better']} | {q['worse']} | {q['diff']:+.4f} | {q['t']:.2f}, {q['df']:.1f} | "
                   f"{q['p']:.3g} | {q['p_holm']:.3g} |")
  return lines


def _fit_table(v: dict) -> list[str]:
  """AdamW's L(D) against its own runs per width: each budget's miss in standard errors, the lack-of-fit test."""
  rows = [(w, row["fit"]) for w, row in v["widths"].items() if "fit" in row]
  if not rows:
    return []
  lines = ["", "## AdamW's L(D): does the fit follow its own runs?", "",
           "Each budget's miss: AdamW's mean final loss − the fit, beside its seeds' standard deviation; F, p: the "
           "lack-of-fit test (`research.verdicts.fit_check`: F(budgets − 3, or − 2 with the floor at a bound; runs − "
           "budgets), the seeds' variance pooled over budgets as the unweighted fit weighs them); p, budget by budget: "
           "the smallest two-sided t-test of a budget's miss against its own seeds, Bonferroni-adjusted over the "
           "budgets (a miss many stds wide at a quiet budget, which the pooled test hides). A small p, or a floor at a "
           "bound, says the power law's shape does not follow AdamW's runs at that width: the speedups read off it "
           "carry that error, most where they extrapolate (the ÷ AdamW's own column removes the miss at the full "
           "budget only). Both tests lean on what 3 seeds hold: the pooled F on alike spreads, the per-budget tests "
           "on a fit without error; the last column is how often each rejects at 0.05 if the law held, over ladders "
           "drawn from the fit with each budget's own spread and refitted (`fit_check(..., n_resamples)`).", "",
           "| d_model | miss (std) at each budget, by tokens / parameter | F (df) | p | p, budget by budget | "
           "floor at a bound | false alarms at 0.05 (F, budget by budget) |", "|---|---|---|---|---|---|---|"]
  for w, fit in rows:
    zs = ", ".join(f"{r:.3g}: {m:+.3f} ({s:.3f})" for r, m, s in zip(fit["tokens_per_param"], fit["miss"],
                                                                       fit["std"]))
    lines.append(f"| {w} | {zs} | {fit['f']:.3g} ({fit['df'][0]}, {fit['df'][1]}) | {fit['p']:.3g} | "
                 f"{fit['p_own']:.3g} | {fit['floor_bound'] or '—'} | "
                 f"{', '.join(f'{100 * x:.0f}%' for x in fit.get('null_rates', [math.nan] * 2))} |")
  return lines


def compute_table(compute: dict, restored: int = 0) -> list[str]:
  """The record's compute: per width and stage, the finished runs, their steps and the hours they took
  (`Ladder.compute`: wall, and quiet: at the width's 10th-percentile step time); `restored`: how many runs the ledger
  took from an earlier record (`ledger.from_record`)."""
  lines = ["", "## Compute (measured from the runs' records)", "",
           "Wall hours: each group's wall time shared among its members, compile and evaluation included, and any "
           "time the process was paused or shared the machine. Quiet hours: member-steps × the width's "
           "10th-percentile seconds per member-step over all its logging intervals, what a quiet 2-core machine "
           "takes (`Ladder.compute`).", "",
           *([f"{restored} runs finished before the ledger (ledger.jsonl) existed and their run directories were lost "
              "with a checkout: their losses, steps and commits are the record's that first listed them, and each "
              "keeps its stage's recorded wall hours shared in proportion to its steps, with its width's recorded "
              "quiet rate for each of its logging intervals (`ledger.from_record`).", ""] if restored else []),
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
           "at the same budget (95% interval, drawn as above); Δ loss and p: against AdamW's runs at that budget (one-"
           "sided Welch). Along the ladder width and tokens per parameter move together; these points part them.", "",
           "| contender | d_model | tokens / parameter | speedup ÷ AdamW's own [95% CI] | extrapolated | "
           "between AdamW's runs [95% CI] | Δ loss vs AdamW | p |", "|---|---|---|---|---|---|---|---|"]
  names = sorted({n for row in v["budgets"].values() for n in row})
  for name in names:
    pts = sorted((r["tokens_per_param"], w, r) for w, row in v["budgets"].items() for r in row.get(name, {}).values())
    for tpp, w, r in pts:
      lines.append(f"| {name} | {w} | {tpp:.3g} | {r['relative']:.2f}× [{r['low']:.2f}, {r['high']:.2f}] | "
                   f"{'yes' if r['extrapolated'] else 'no'} | {_interp_cell(r)} | {r['diff']:+.4f} | {r['p']:.3g} |")
  if any(v["trend"].values()):
    lines += ["", "log speedup fitted as a plane in log width and log tokens per parameter over these points "
              "(`research.verdicts.speedup_trend`; ± one standard error, residuals taken as independent, though a "
              "width's points share one AdamW fit or set of runs, so the errors are optimistic):", ""]
    lines += [f"- {n} ({WAYS[way]}): width exponent {t['width_exponent']:+.3f} ± {t['width_se']:.3f}, "
              f"tokens-per-parameter exponent {t['data_exponent']:+.3f} ± {t['data_se']:.3f} ({t['points']} points)"
              for way, trend in v["trend"].items() for n, t in trend.items()]
  return lines


def _interp_cell(r: dict) -> str:
  """A model-free speedup cell: the estimate and interval, or the bound where it lies past AdamW's runs."""
  if r["interp"] == math.inf:
    return f"> {r['interp_range'][1]:.2f}×"
  if r["interp"] == 0:
    return f"< {r['interp_range'][0]:.2f}×"
  ends = [("∞" if x == math.inf else "0" if x == 0 else f"{x:.2f}") for x in (r["interp_low"], r["interp_high"])]
  return f"{r['interp']:.2f}× [{ends[0]}, {ends[1]}]"
