"""research/experiments/optimizers.py at smoke size: both stages run, stage 2 reuses stage 1's runs, tables hold."""

import pytest

from research.experiments import optimizers


@pytest.fixture(scope="module")
def result(notebooks):
  """`optimizers.main(optimizers.Config(smoke=True))`, as notebooks/optimizers.ipynb ran it."""
  return notebooks.run("optimizers").result


def test_stage_two_runs_every_contender_at_its_stage_one_best_lr_over_the_seeds(result):
  tune = {(r["label"], r["lr"]): r["final_val_loss"] for r in result["tune"]}
  # adamw's 2-point grid has its best at an edge, so one lr past it joins (÷3 below 3e-3, ×3 above 1e-2)
  first = {lr: tune["adamw", lr] for lr in (3e-3, 1e-2)}
  extra = 1e-3 if first[3e-3] < first[1e-2] else 3e-2
  assert set(tune) == {("adamw", 3e-3), ("adamw", 1e-2), ("adamw", extra), ("muon", 1e-2)}
  assert all(r["seed"] == 0 for r in result["tune"])
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
  rank = result["ranking"]
  assert sorted(rank["half"]) == sorted(rank["end"]) == ["adamw", "muon"] and rank["half_step"] <= rank["end_step"] / 2


def test_grid_extension_and_ranking_stability_on_hand_made_inputs():
  tune = [{"label": "a", "lr": 1e-3, "final_val_loss": 2.0, "diverged": False},
          {"label": "a", "lr": 3e-3, "final_val_loss": 2.1, "diverged": False},
          {"label": "b", "lr": 1e-3, "final_val_loss": 2.2, "diverged": False},
          {"label": "b", "lr": 3e-3, "final_val_loss": 2.1, "diverged": False},
          {"label": "b", "lr": 1e-2, "final_val_loss": 2.3, "diverged": False},
          {"label": "c", "lr": 1e-3, "final_val_loss": 2.3, "diverged": False},
          {"label": "c", "lr": 3e-3, "final_val_loss": 9.9, "diverged": True}]
  assert optimizers.extended_grid(("a=1e-3,3e-3", "b=1e-3,3e-3,1e-2", "c=1e-3,3e-3"), tune) == (
      "a=1e-3,3e-3,0.000333", "b=1e-3,3e-3,1e-2", "c=1e-3,3e-3,0.000333")
  assert optimizers.kendall_tau(list("abcd"), list("abcd")) == 1.0
  assert optimizers.kendall_tau(list("abcd"), list("dcba")) == -1.0
  assert optimizers.kendall_tau(list("abcd"), list("bacd")) == pytest.approx(4 / 6)
  curve = lambda *v: [(10, v[0]), (20, v[1]), (30, v[2]), (40, v[3])]
  summary = [{"label": "x", "curve": curve(3.0, 2.5, 2.2, 2.0)}, {"label": "y", "curve": curve(3.0, 2.4, 2.3, 2.1)},
             {"label": "z", "curve": curve(3.0, 2.6, 2.4, 2.2)}]
  rank = optimizers.ranking_stability(summary)
  assert rank["half_step"] == 20 and rank["half"] == ["y", "x", "z"] and rank["end"] == ["x", "y", "z"]
  assert rank["swaps"] == [("y", "x")] and rank["tau"] == pytest.approx(1 / 3)
