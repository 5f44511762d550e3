"""research/experiments/optimizers.py at smoke size: both stages run, stage 2 reuses stage 1's runs, tables hold."""

import pytest

from research.experiments import optimizers


@pytest.fixture(scope="module")
def result(notebooks):
  """`optimizers.main(optimizers.Config(smoke=True))`, as notebooks/optimizers.ipynb ran it."""
  return notebooks.run("optimizers").result


def test_stage_two_runs_every_contender_at_its_stage_one_best_lr_over_the_seeds(result):
  tune = {(r["label"], r["lr"]): r["final_val_loss"] for r in result["tune"]}
  assert set(tune) == {("adamw", 3e-3), ("adamw", 1e-2), ("muon", 1e-2)} and all(r["seed"] == 0 for r in result["tune"])
  for s in result["summary"]:
    assert s["best_lr"] == min((lr for lab, lr in tune if lab == s["label"]), key=lambda lr: tune[s["label"], lr])
    assert s["seeds"] == 2
  # seed 0 at the best lr is the very run stage 1 made (shared run directory), not a rerun with other numbers
  for r in result["rows"]:
    if r["seed"] == 0:
      assert r["final_val_loss"] == tune[r["label"], r["lr"]]


def test_runs_learn_and_the_summary_is_consistent(result):
  for r in result["rows"]:
    first, last = r["curve"][0][1], r["curve"][-1][1]
    assert last < first < 5.55  # below the uniform-byte loss ln 256 and falling
  base = next(s for s in result["summary"] if s["label"] == "adamw")
  assert base["speedup"] == pytest.approx(1.0)
  assert result["target"] == pytest.approx(base["curve"][-1][1])


def test_tables_flag_the_best_lr_and_an_edge(result):
  lines = optimizers.tune_table(result["tune"], result["grid"])
  adamw = next(line for line in lines if line.startswith("| adamw "))
  assert adamw.count("**") == 2 and "(edge)" in adamw  # a 2-point grid: the best is always at an edge
  rows = optimizers.summary_table(result["summary"], result["target"])
  assert len(rows) == 2 + 2 and "| adamw | " in "\n".join(rows) and "+0.0000" in "\n".join(rows)
