"""research/experiments/width_ladder: the smoke ladder (as notebooks/width_ladder.ipynb ran it) tunes every contender
at every width with the same budget, seeds its optimum, runs every contender at AdamW's shorter budgets and AdamW
past its full one, fits AdamW's L(D) and reads verdicts from it; the plan lists groups without running them; a rerun
skips everything that finished."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from runs import free_port

from research.entry import UsageError
from research.experiments import width_ladder
from research.experiments.width_ladder import ledger, papers, report, study
from research.verdicts import pairwise, speedup_slope, spread_ratio


@pytest.fixture(scope="module")
def result(notebooks):
  """`width_ladder.main(width_ladder.Config(smoke=True))`, as notebooks/width_ladder.ipynb ran it."""
  return notebooks.run("width_ladder").result


def test_every_contender_is_tuned_with_the_same_budget_and_seeded(result):
  smoke = width_ladder.SMOKE
  assert result["missing"] == []  # every group ran: none is left (a trained group is not listed as next)
  for width in smoke["widths"]:
    rung = result["done"][width]
    for name in smoke["contenders"]:
      e = rung[name]
      assert len(e["trials"]) == smoke["trials"]
      assert smoke["scan"] <= len(e["scan"]) <= smoke["scan"] + smoke["extend"]  # past an edge, at most `extend`
      assert len(e["finals"]) == smoke["seeds"] and all(math.isfinite(x) for x in e["finals"])
      assert e["finals"][0] == min([*e["scan"].values(), *(v for _, v in e["trials"])])  # the best of A and B
      budgets = rung["budgets"] if name == "adamw" else e["budgets"]  # stage D: every contender, AdamW's budgets
      assert sorted(budgets) == sorted([*smoke["budgets"], *(smoke["longer"] if name == "adamw" else ())])  # E: AdamW's
      assert all(len(b["finals"]) == smoke["seeds"] and all(math.isfinite(x) for x in b["finals"])
                 for b in budgets.values())


def test_the_verdicts_come_from_the_runs(result):
  v = result["verdicts"]
  reading = papers.reading(result["done"], v)  # the record's last section, from the same verdicts
  assert reading[0] == "## Read against the papers" and any("muon-moonlight" in x for x in reading)
  for width in width_ladder.SMOKE["widths"]:
    row = v["widths"][width]
    assert {"alpha", "exponent", "floor"} <= set(row["law"])
    k = len(width_ladder.SMOKE["budgets"]) + 1 + len(width_ladder.SMOKE["longer"])  # D, the full budget, E
    assert row["fit"]["df"] == [k - 3, k * (width_ladder.SMOKE["seeds"] - 1)] and len(row["fit"]["miss"]) == k
    assert row["adamw"]["low"] <= row["adamw"]["speedup"] <= row["adamw"]["high"]
    assert 0 <= row["muon-moonlight"]["p"] <= 1
  assert set(v["transfer"]) == set(width_ladder.SMOKE["contenders"])
  for width in width_ladder.SMOKE["widths"]:  # the contender at each budget against AdamW at the same budget
    row = v["budgets"][width]["muon-moonlight"]
    assert sorted(row) == sorted([*width_ladder.SMOKE["budgets"], 1.0])
    full = v["widths"][width]["muon-moonlight"]
    assert row[1.0]["relative"] == full["relative"] and row[1.0]["p"] == pytest.approx(full["p"])
    assert all(r["low"] <= r["relative"] <= r["high"] and 0 <= r["p"] <= 1 for r in row.values())
  trend = v["trend"]["fit"]["muon-moonlight"]  # 2 widths × 3 budgets: a plane with 3 residual degrees of freedom
  assert trend["points"] == 2 * (len(width_ladder.SMOKE["budgets"]) + 1) and trend["width_se"] > 0
  for way in report.KEYS:  # the trend along the ladder needs two widths with a finite standard error
    keys = (report.FULL[way][0], report.SE[way])
    ok = [w for w in width_ladder.SMOKE["widths"] if report.usable(v["widths"][w]["muon-moonlight"], keys)]
    assert ("muon-moonlight" in v["ladder"][way]) == (len(ok) >= 2)


@pytest.mark.parametrize("speedups, ses", [
    ([1.5, 2.1, 2.2], [0.05, 0.05, 0.03]),  # reduced χ² 6.3: the error widened by √6.3
    ([1.5, 1.8, 2.2], [0.15, 0.15, 0.15])])  # 0.0025: narrowed by √0.0025
def test_the_ladders_trend_is_speedup_slope_on_the_tables_finite_cells(speedups, ses):
  """`_ladder` runs speedup_slope on each width's speedup and standard error of log speedup, leaving out (and naming)
  a width without a finite one; the finding quotes the exponent and its Knapp–Hartung error (scaled by the scatter,
  up or down) and its t interval on widths − 2 df."""
  cell = lambda s, se: {"relative": s, "relative_se": se}
  widths = {w: {"muon": cell(*c)} for w, c in zip([32, 64, 128], zip(speedups, ses))}
  widths[256] = {"muon": cell(2.0, math.inf)}
  got = report._ladder(widths, "fit")["muon"]
  s = speedup_slope([32, 64, 128], speedups, ses)
  assert got["widths"] == [32, 64, 128] and got["exponent"] == pytest.approx(s.exponent) and got["left_out"] == [256]
  assert got["se"] == pytest.approx(s.se * math.sqrt(s.reduced_chi2)) and got["dof"] == 1
  v = {"widths": widths, "ladder": {"fit": {"muon": got}}, "transfer": {}}
  line = next(x for x in report.findings(v) if x.startswith("- muon, speedup ÷ AdamW's own on its fit"))
  assert report.word(s.exponent, s.kh_se, 1) in line and "Knapp–Hartung, t on 1 df" in line
  assert "left out (a bound, or no finite positive standard error) at 256" in line
  assert " → ".join(f"{x:.2f}×" for x in speedups) in line
  two = report._ladder({32: widths[32], 128: widths[128]}, "fit")["muon"]  # no scatter df: the seeds' errors, normal
  assert two["se"] == pytest.approx(speedup_slope([32, 128], speedups[::2], ses[::2]).se) and two["dof"] == math.inf


def test_the_compute_is_read_from_the_runs_records(result):
  compute, runs = result["compute"], result["runs"]
  assert sum(c["runs"] for row in compute.values() for c in row.values()) == len(runs)
  assert sum(c["member_steps"] for row in compute.values() for c in row.values()) == sum(r["steps"] for r in runs)
  assert all(set(row) == {"A", "B", "C", "D", "E"} for row in compute.values())
  assert all(c["quiet"] > 0 for row in compute.values() for c in row.values())
  for row in compute.values():  # the wall time holds every group's compile; the quiet estimate, none
    assert sum(c["quiet"] for c in row.values()) < sum(c["hours"] for c in row.values())


def _finished(root, path: str, seconds_per_step, steps: int = 20, loss: float = 1.0):
  """A finished run directory under root/runs, logged at half its steps and at the end (tokens_per_s: its group's
  time per step)."""
  tokens = width_ladder.SMOKE["batch_size"] * width_ladder.SMOKE["seq_len"]
  d = root / "runs" / path
  d.mkdir(parents=True)
  (d / "config.json").write_text(json.dumps({"train": {"steps": steps}}))
  recs = [{"step": at, "loss": 1.0, "tokens_per_s": tokens / t} for at, t in zip((steps // 2, steps), seconds_per_step)]
  (d / "metrics.jsonl").write_text("".join(json.dumps({**r, "val_loss": loss}) + "\n" for r in recs))


def test_compute_shares_a_groups_wall_time_among_its_members(tmp_path):
  """Hand-worked: two runs of one group (their identical tokens_per_s) share its 30 s; a run alone keeps its 80 s; the
  quiet estimate is the member-steps at the 10th-percentile time per member-step (0.5 s here)."""
  cfg = study.Config(**{**width_ladder.SMOKE, "out": str(tmp_path)})
  _finished(tmp_path, "w16/adamw/A/lr0.01_s0", (2.0, 1.0))
  _finished(tmp_path, "w16/adamw/A/lr0.02_s0", (2.0, 1.0))
  _finished(tmp_path, "w16/adamw/B/lr0.01_s0", (4.0, 4.0))
  ladder = study.Ladder(cfg)
  compute = ladder.compute(ladder.runs())[16]
  assert compute["A"] == {"runs": 2, "member_steps": 40, "hours": pytest.approx(30 / 3600),
                          "quiet": pytest.approx(40 * 0.5 / 3600)}
  assert compute["B"] == {"runs": 1, "member_steps": 20, "hours": pytest.approx(80 / 3600),
                          "quiet": pytest.approx(20 * 0.5 / 3600)}


def test_a_checkout_without_runs_resumes_from_the_ledger(tmp_path):
  """runs/ is untracked, the ledger is not: with runs/ gone, AdamW's finished scan is not planned again (its stage B
  is next), and the runs and their compute read as before."""
  cfg = study.Config(**{**width_ladder.SMOKE, "out": str(tmp_path), "contenders": ("adamw",)})
  steps = study.steps_at(cfg, 16)
  for lr, loss in [(0.001, 2.5), (0.002, 2.0), (0.004, 2.2)]:  # the scan's lrs, its best inside
    _finished(tmp_path, f"w16/adamw/A/{study.member_name({'lr': lr}, 0)}", (3.0, 1.0), steps=steps, loss=loss)
  before = study.Ladder(cfg)
  assert not (tmp_path / ledger.FILE).exists()  # found at the start, written after the first run (or at the end)
  before.save()
  assert len((tmp_path / ledger.FILE).read_text().splitlines()) == 3
  shutil.rmtree(tmp_path / "runs")
  after = study.Ladder(dataclasses.replace(cfg, plan=True))
  after.run()
  assert [(g["width"], g["stage"]) for g in after.planned] == [(16, "B"), (32, "A")]
  assert after.runs() == before.runs() and after.compute(after.runs()) == before.compute(before.runs())


def test_a_torn_last_ledger_line_is_left_out_and_cut_before_the_next_append(tmp_path):
  """An append cut off by a kill leaves a partial last line: the runs before it load, and the next append starts on
  a line of its own (cutting the torn one away) instead of continuing it."""
  entry = lambda lr: {"run": f"w16/adamw/A/lr{lr}_s0", "steps": 10, "final_val_loss": 2.0, "commit": "abc",
                      "seconds": 1.0, "rates": [0.1]}
  ledger.append(str(tmp_path), [entry(0.001)])
  with open(tmp_path / ledger.FILE, "a") as f:
    f.write('{"run": "w16/adamw/A/lr0.002_s0", "ste')
  assert ledger.load(str(tmp_path)) == {entry(0.001)["run"]: entry(0.001)}
  ledger.append(str(tmp_path), [entry(0.004)])
  assert ledger.load(str(tmp_path)) == {e["run"]: e for e in (entry(0.001), entry(0.004))}


def test_a_corrupt_ledger_line_before_the_last_is_refused_with_its_place(tmp_path):
  """A line that is not JSON before the last is damage, not a torn append: refused in one line naming file and
  line."""
  (tmp_path / ledger.FILE).write_text('{"run": "x", "steps": 1, "final_val_loss": 1.0}\ngarbage\n{"run": "y"}\n')
  with pytest.raises(UsageError, match=r"ledger.jsonl:2: not a ledger entry"):
    ledger.load(str(tmp_path))


def test_an_interrupted_ladder_says_what_the_ledger_kept(tmp_path):
  cfg = study.Config(out=str(tmp_path))
  assert ledger.kept(cfg).startswith("no run had finished")
  ledger.append(str(tmp_path), [{"run": "w16/adamw/A/lr0.001_s0", "steps": 10, "final_val_loss": 2.0}])
  assert ledger.kept(cfg).startswith(f"1 finished run(s) are kept in {tmp_path / ledger.FILE}")


def test_a_record_from_before_the_ledger_seeds_it(tmp_path):
  """A checkout with results.json but no ledger: the record's runs that runs/ lacks become the ledger, each flagged
  restored with one rate per logging interval, and the compute re-read from it is the record's; a run still on disk
  is read from its directory."""
  runs = [{"run": f"w16/adamw/{stage}/lr{lr}_s0", "steps": steps, "final_val_loss": 2.0, "commit": "abc"}
          for stage, lr, steps in [("A", 0.001, 30), ("A", 0.002, 10), ("D0.5", 0.002, 40)]]
  compute = {"16": {"A": {"runs": 2, "member_steps": 40, "hours": 0.4, "quiet": 0.02},
                    "D": {"runs": 1, "member_steps": 40, "hours": 0.1, "quiet": 0.02}}}
  (tmp_path / "results.json").write_text(json.dumps({"runs": runs, "compute": compute}))
  ladder = study.Ladder(study.Config(**{**width_ladder.SMOKE, "out": str(tmp_path)}))
  ladder.save()
  saved = ledger.load(str(tmp_path))
  assert ladder.runs() == sorted(runs, key=lambda r: r["run"]) and all(e["restored"] for e in saved.values())
  assert [len(saved[r["run"]]["rates"]) for r in runs] == [30, 10, 20]  # logged every 1, 1 and 2 steps
  got = ladder.compute(ladder.runs())[16]
  for stage, cell in compute["16"].items():
    assert got[stage] == {k: pytest.approx(v) for k, v in cell.items()}
  (tmp_path / ledger.FILE).unlink()
  _finished(tmp_path, runs[0]["run"], (1.0, 1.0), steps=30, loss=1.5)
  again = study.Ladder(study.Config(**{**width_ladder.SMOKE, "out": str(tmp_path)}))
  assert again.ledger[runs[0]["run"]]["final_val_loss"] == 1.5 and "restored" not in again.ledger[runs[0]["run"]]
  assert all(again.ledger[r["run"]]["restored"] for r in runs[1:])


def test_plan_lists_groups_and_runs_nothing(tmp_path):
  cfg = study.Config(**{**width_ladder.SMOKE, "out": str(tmp_path)}, plan=True)
  planned = study.main(cfg)["planned"]
  assert [(g["width"], g["contender"], g["stage"]) for g in planned] == [
      (16, "adamw", "A"), (16, "muon-moonlight", "A"), (32, "adamw", "A"), (32, "muon-moonlight", "A")]
  assert not (tmp_path / "runs").exists()


def test_a_width_without_its_budget_is_refused():
  with pytest.raises(ValueError, match="3 widths"):
    study.sized(study.Config(widths=(32, 64, 128), tokens_per_param=(20.0, 20.0)))


def test_every_finished_run_is_listed_with_its_commit(result):
  runs = result["runs"]
  seeds0 = sum(len(e["scan"]) + len(e["trials"]) for rung in result["done"].values()
               for name, e in rung.items() if name in width_ladder.SMOKE["contenders"])
  assert len(runs) >= seeds0 and all(r["commit"] and math.isfinite(r["final_val_loss"]) for r in runs)


def test_a_run_records_the_code_the_process_imported_not_a_later_head(tmp_path, monkeypatch):
  """A ladder runs for hours while the repository moves on: each run's `commit` is the code this process imported
  (`study.CODE`), not HEAD when its group ends."""
  from research.train import TrainConfig
  monkeypatch.setattr(study.common, "commit", lambda: "moved-on")
  cfg = TrainConfig(model="tiny", n_layers=1, steps=1, batch_size=8, seq_len=16, mesh="data=-1", progress=False,
                    log_every=1, eval_every=1, eval_batches=1, ckpt_every=1, out=str(tmp_path / "run"))
  study.Ladder(study.Config(**{**width_ladder.SMOKE, "out": str(tmp_path)}, runner="trainer"))._train(
      [cfg], str(tmp_path))
  assert (tmp_path / "run" / "commit").read_text().strip() == study.CODE != "moved-on"


def _rung(adamw_budgets: dict, adamw_finals: list[float]) -> dict:
  """A hand-built finished rung: AdamW with `adamw_budgets` ({fraction: finals}) and Muon at one shorter budget."""
  curve = lambda f: 1.5 + 0.5 * f ** -0.5  # AdamW's loss at a fraction of the 100 steps, before noise
  return {"params": 1000, "steps": 100, "tokens_per_param": 1.0,
          "adamw": {"scan": {1e-3: 2.1, 2e-3: 2.0, 4e-3: 2.2}, "finals": adamw_finals, "steps": 100},
          "muon-moonlight": {"scan": {1e-2: 1.9, 2e-2: 1.8, 4e-2: 2.0}, "finals": [1.8, 1.82, 1.79], "steps": 100,
                             "budgets": {0.5: {"steps": 50, "finals": [2.1, 2.12, 2.09]}}},
          "budgets": {f: {"steps": round(100 * f), "finals": [curve(f) + e for e in finals]}
                      for f, finals in adamw_budgets.items()}}


def test_diverged_adamw_runs_are_dropped_and_a_failed_fit_is_reported_not_raised():
  """A budget whose AdamW seeds all diverged leaves the fit (3 budgets left: no lack-of-fit degree of freedom); one
  diverged seed at the full budget leaves Welch's test; with 2 budgets left the fit fails into law_error, and the
  findings still read."""
  ok = [-0.01, 0.0, 0.01]
  v = report.verdicts({32: _rung({0.25: [math.inf] * 3, 0.5: ok, 2.0: ok}, [2.0, 2.01, math.inf])}, 10)
  row = v["widths"][32]
  assert row["fit"]["df"] == [0, 3 + 2 + 3 - 3] and math.isnan(row["fit"]["p"]) and len(row["fit"]["miss"]) == 3
  assert row["muon-moonlight"]["p"] < 0.05 and row["muon-moonlight"]["speedup"] > 1
  assert v["budgets"][32]["muon-moonlight"][0.5]["relative"] > 1 and report.findings(v) is not None
  # read between AdamW's runs (means 2.2071 at 50 steps, 2.005 at 100, 1.8536 at 200): Muon's 1.8033 at 100 steps
  # lies past them (a bound, > 2×); its 2.1033 at 50 steps lies 0.5136 of the way from 50 to 100 in log steps
  full = row["muon-moonlight"]
  assert full["interp"] == math.inf and full["interp_range"] == [0.5, 2.0]
  m50, m100 = 1.5 + 0.5 * 0.5**-0.5, 2.005
  frac = (m50 - (2.1 + 2.12 + 2.09) / 3) / (m50 - m100)
  assert v["budgets"][32]["muon-moonlight"][0.5]["interp"] == pytest.approx(2**frac, rel=1e-9)
  v = report.verdicts({32: _rung({0.25: [math.inf] * 3, 0.5: [math.inf] * 3, 2.0: ok}, [2.0, 2.01, 1.99])}, 10)
  assert "3 distinct token budgets" in v["widths"][32]["law_error"] and "muon-moonlight" not in v["widths"][32]
  assert isinstance(report.findings(v), list)


def test_the_profiles_costs_are_read_between_adamws_runs_and_a_bound_at_its_range_end():
  """cost = 1 / the speedup read between AdamW's runs: AdamW's own is 1 (its full-budget mean is its own point); a
  contender inside AdamW's runs costs 2^−(its fraction of the log-step gap), one past them the range's end (÷ 2 past
  its longest, × 4 short of its shortest)."""
  ok = [-0.01, 0.0, 0.01]
  inside = _rung({0.25: ok, 0.5: ok, 2.0: ok}, [2.0, 2.01, 2.005])
  inside["muon-moonlight"]["finals"] = [1.95, 1.96, 1.94]
  v = report.verdicts({32: _rung({0.25: ok, 0.5: ok, 2.0: ok}, [2.0, 2.01, 2.005]), 64: inside}, 10)
  c = report.costs(v)
  assert c["adamw"] == {"32": pytest.approx(1.0, abs=1e-12), "64": pytest.approx(1.0, abs=1e-12)}
  m200 = 1.5 + 0.5 * 2**-0.5
  frac = (2.005 - 1.95) / (2.005 - m200)
  assert v["widths"][32]["muon-moonlight"]["interp"] == math.inf
  assert c["muon-moonlight"] == {"32": 0.5, "64": pytest.approx(2**-frac, rel=1e-9)}
  assert set(v["profile"]) == {"adamw", "muon-moonlight"} and v["profile"]["muon-moonlight"] == 1.0
  short = _rung({0.25: ok, 0.5: ok, 2.0: ok}, [2.0, 2.01, 2.005])
  short["muon-moonlight"]["finals"] = [2.6, 2.62, 2.61]  # worse than AdamW's shortest budget: past its runs, below
  v = report.verdicts({32: short}, 10)
  assert v["widths"][32]["muon-moonlight"]["interp"] == 0.0 and report.costs(v)["muon-moonlight"] == {"32": 4.0}


def test_every_pair_at_a_width_is_tested_and_read_into_a_finding():
  """The width's pairs are `pairwise` on each finished contender's finite finals (a diverged seed left out); the
  finding counts, for each pair without AdamW, the widths where each is lower and where that holds at Holm p < 0.05."""
  ok = [-0.01, 0.0, 0.01]
  rung = _rung({0.25: ok, 0.5: ok, 2.0: ok}, [2.0, 2.01, math.inf])
  rung["normuon"] = {**rung["muon-moonlight"], "finals": [1.70, 1.71, 1.69]}
  v = report.verdicts({32: rung}, 10)
  want = pairwise({"adamw": [2.0, 2.01], "muon-moonlight": [1.8, 1.82, 1.79], "normuon": [1.70, 1.71, 1.69]})
  assert [(q["better"], q["worse"], q["p"], q["p_holm"]) for q in v["pairs"][32]] == [
      (q.better, q.worse, q.comparison.p_value, q.p_holm) for q in want]
  pairs = {32: [{"better": "normuon", "worse": "muon", "p_holm": 0.01}],
           64: [{"better": "muon", "worse": "normuon", "p_holm": 0.2}], 128: [{"better": "muon", "worse": "adamw"}]}
  assert report._pair_findings(pairs) == [
      "- muon against normuon, at widths 32, 64: muon lower at 64 (Holm p < 0.05 at none), normuon lower at 32 (Holm "
      "p < 0.05 at 32)."]


def test_the_two_conventions_lr_slopes_are_compared_over_the_widths_both_have():
  """Moonlight's lr* halves per doubling at 32–128 and Keller's holds; Moonlight also has 256 (off the line): the
  finding's slopes and their difference are read over 32–128 only, −1 and 0, not over unequal sets of widths."""
  opt = lambda lrs: {"optima": {w: {"lr": x} for w, x in lrs.items()}}
  t = {"muon-moonlight": opt({32: 0.04, 64: 0.02, 128: 0.01, 256: 0.03}), "muon-keller": opt({32: 0.02, 64: 0.02,
                                                                                                128: 0.02})}
  line = next(x for x in report.findings({"widths": {}, "transfer": t}) if x.startswith("- lr transfer"))
  assert "(32, 64, 128): muon-moonlight slope -1.00, muon-keller " in line and "difference -1.00" in line
  assert "muon-keller +0.00" in line or "muon-keller -0.00" in line  # 0 up to rounding


def test_the_reading_against_the_papers_is_computed_from_the_verdicts():
  """The best speedup per width and the count above Wen et al.'s 1.4×; Moonlight's Muon against Keller's: the pair's
  Holm p, `spread_ratio` over the widths' seeds and every diverged run counted; each convention's lr* at the ladder's
  ends with its bands' overlap."""
  ok = [-0.01, 0.0, 0.01]
  done = {}
  for w, keller in ((32, [1.70, 1.80, 1.75]), (64, [1.70, 1.74, 1.78])):
    rung = _rung({0.25: ok, 0.5: ok, 2.0: ok}, [2.0, 2.01, 2.005])
    rung["muon-keller"] = {**rung["muon-moonlight"], "finals": keller, "scan": {1e-2: 1.9, 2e-2: math.inf, 4e-2: 2.0}}
    done[w] = rung
  v = report.verdicts(done, 10)
  text = "\n".join(papers.reading(done, v))
  cells = {w: {n: r for n, r in v["widths"][w].items() if n not in (*report.META, "adamw")} for w in done}
  assert all(report.usable(r, report.FULL["fit"]) for row in cells.values() for r in row.values())
  for w, row in cells.items():
    n, r = max(row.items(), key=lambda kv: kv[1]["relative"])
    assert f"{w} {n} {r['relative']:.2f}× [{r['relative_low']:.2f}, {r['relative_high']:.2f}]" in text
  above = sum(r["relative_low"] > 1.4 for row in cells.values() for r in row.values())
  assert f"({above} of 4 contender-widths)" in text
  s = spread_ratio(*([done[w][n]["finals"] for w in done] for n in ("muon-moonlight", "muon-keller")))
  assert f"variance ratio {s.ratio:.2f} (F(4, 4), two-sided p {s.p_value:.2g}" in text
  assert "muon-moonlight 0 of 18, muon-keller 2 of 18" in text  # 3 scan + 3 seeds + 3 at one budget, per width
  q = next(q for q in v["pairs"][64] if "muon-keller" in (q["better"], q["worse"]) and "adamw" not in q.values())
  assert f"64: {q['better']} by {-q['diff']:.4f} (Holm p {q['p_holm']:.2g})" in text
  t = v["transfer"]["muon-keller"]
  assert f"muon-keller: lr* {t['optima'][32]['lr']:.3g} at 32 → {t['optima'][64]['lr']:.3g} at 64" in text
  assert papers.reading({}, {"widths": {}}) == []


def test_two_widths_lr_bands_overlap_where_neither_excludes_the_other():
  band = lambda lo, hi: {"band": [lo, hi]}
  assert report.overlap(band(1e-3, 4e-3), band(3e-3, 9e-3)) and report.overlap(band(3e-3, 9e-3), band(1e-3, 4e-3))
  assert report.overlap(band(1e-3, 2e-3), band(3e-3, 9e-3)) is False
  assert report.overlap(band(1e-3, math.inf), band(3e-3, 9e-3))  # a band open at its top still overlaps
  assert report.overlap({"band": [math.nan, math.nan]}, band(3e-3, 9e-3)) is None and report.overlap({}, {}) is None


def test_an_exponents_verdict_reads_its_95_percent_interval():
  """grows or shrinks where the interval excludes 0, holds where it lies within ±0.1, else not resolved; a standard
  error estimated on 1 degree of freedom widens it by t's 12.71, not the normal's 1.96."""
  assert report.word(0.3, 0.1, math.inf).startswith("grows (exponent +0.30 ± 0.10, 95% interval [+0.10, +0.50])")
  assert report.word(-0.3, 0.1, math.inf).startswith("shrinks")
  assert report.word(0.01, 0.02, math.inf).startswith("holds")  # [−0.03, +0.05]
  assert report.word(0.05, 0.05, math.inf).startswith("not resolved")  # [−0.05, +0.15]: neither
  assert report.word(0.3, 0.1, 1).startswith("not resolved (exponent +0.30 ± 0.10, 95% interval [-0.97, +1.57])")
  assert report.verdict(0.3, 0.1, 1) == "not resolved" and report.verdict(-0.3, 0.1, math.inf) == "shrinks"


def test_the_documented_two_host_command_runs_the_ladder_with_one_writer(tmp_path):
  """docs/experiments.md's multi-host command, as two local processes of 8 CPU devices (a 16-device mesh) on a tiny
  ladder: both end with status 0 (process 0's --process-id 0 is a valid index), each finished run is in the ledger
  once (process 0 writes it) with its commit, and the record is written."""
  args = ["--widths", "16", "--tokens-per-param", "0.4", "--contenders", "adamw", "--scan", "2", "--extend", "1",
          "--trials", "1", "--seeds", "1", "--budgets", "0.5", "--longer", "2", "--layers", "1", "--batch-size", "16",
          "--seq-len", "32", "--runner", "trainer", "--mesh", "data=-1", "--coordinator", f"localhost:{free_port()}",
          "--num-processes", "2", "--out", str(tmp_path)]
  procs = [subprocess.Popen([sys.executable, "-m", "research.experiments.width_ladder", *args, "--process-id", str(i)],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    logs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], "\n\n".join(logs)
  lines = (tmp_path / ledger.FILE).read_text().splitlines()
  runs = [json.loads(line)["run"] for line in lines]
  assert len(runs) == len(set(runs)) == 6  # A: 2 lrs + 1 past the edge; B: 1 trial; D0.5 and E2: 1 seed each
  assert all(json.loads(line)["commit"] == study.CODE for line in lines)
  assert (tmp_path / "results.md").exists()
