"""Search spaces (research/search.py) and the sweep's --search mode: quasi-random trials inside the box, the same on
every rerun, the same budget per contender, the best trial's seeds, edges flagged, and a killed search resumed."""

import math
import os

import numpy as np
import pytest

import research.sweep as sweep
from research.search import Dim, SearchError, edge_flags, grid_edge, parse_dim, quasi_random
from research.sweep import SweepConfig, run_grid
from research.train import TrainConfig

TINY = dict(model="tiny", n_layers=1, batch_size=8, seq_len=32, eval_every=2, log_every=2, eval_batches=1,
            progress=False, devices=8, mesh="data=-1", tracker=("none",))


def test_dimensions_parse_and_map_onto_their_scale():
  d = parse_dim("lr=log:1e-4:1e-2")
  assert (d.at(0), d.at(0.5), d.at(1)) == pytest.approx((1e-4, 1e-3, 1e-2))
  b = parse_dim("b2=beta:0.9:0.999")
  assert (b.at(0), b.at(0.5), b.at(1)) == pytest.approx((0.9, 1 - math.sqrt(0.1 * 0.001), 0.999))
  w = parse_dim("weight_decay=linear:0:0.2")
  assert w.at(0.25) == pytest.approx(0.05)
  for dim in (d, b, w):
    for u in (0.0, 0.3, 1.0):
      assert dim.position(dim.at(u)) == pytest.approx(u)


@pytest.mark.parametrize("text, why", [("lr=log:0:1", "LOW > 0"), ("lr=cube:1:2", "scale"), ("lr:1:2", "NAME="),
                                       ("b2=beta:0.9:1", "HIGH < 1"), ("x=linear:2:1", "LOW < HIGH"),
                                       ("x=linear:a:1", "numbers")])
def test_a_bad_dimension_is_one_clear_error(text, why):
  with pytest.raises(SearchError, match=why):
    parse_dim(text)


def test_quasi_random_trials_fill_the_box_and_repeat():
  dims = [Dim("lr", "log", 1e-4, 1e-2), Dim("weight_decay", "linear", 0.0, 0.2)]
  a, b = quasi_random(dims, 16, seed=3), quasi_random(dims, 16, seed=3)
  assert a == b and quasi_random(dims, 16, seed=4) != a
  lr = np.array([p["lr"] for p in a])
  assert np.all((lr >= 1e-4) & (lr <= 1e-2))
  # low discrepancy: each quarter of the log-lr range holds 4 of the 16 points (a random draw often does not)
  counts = np.histogram(np.log10(lr), bins=4, range=(-4, -2))[0]
  assert counts.tolist() == [4, 4, 4, 4]
  with pytest.raises(SearchError):
    quasi_random([dims[0], dims[0]], 4)


def test_edges_are_flagged():
  dims = [Dim("lr", "log", 1e-4, 1e-2), Dim("weight_decay", "linear", 0.0, 0.2)]
  assert edge_flags(dims, {"lr": 1.1e-4, "weight_decay": 0.1}) == ["lr (low)"]
  assert edge_flags(dims, {"lr": 1e-3, "weight_decay": 0.195}) == ["weight_decay (high)"]
  assert edge_flags(dims, {"lr": 1e-3, "weight_decay": 0.1}) == []
  assert grid_edge([1, 2, 3], 3) == "high" and grid_edge([1, 2, 3], 1) == "low" and grid_edge([1, 2, 3], 2) is None


def _search(tmp_path, **over):
  kw = dict(grid=("adamw=1e-3,1e-2", "sgd[nesterov=false]=0.03,0.3"), seeds=(0, 1), search=True, trials=2,
            space=("weight_decay=linear:0:0.2", "adamw:b2=beta:0.9:0.99"), out=str(tmp_path),
            train=TrainConfig(**TINY), tokens=8 * 32 * 2)
  return SweepConfig(**{**kw, **over})


def test_search_gives_each_contender_the_same_budget_then_seeds_its_best(tmp_path):
  rows = run_grid(_search(tmp_path))
  trials = [r for r in rows if r["seed"] == 0]
  assert sorted(r["label"] for r in trials) == ["adamw"] * 2 + ["sgd[nesterov=false]"] * 2
  assert all(1e-3 <= r["lr"] <= 1e-2 for r in trials if r["label"] == "adamw")
  assert all("b2" in r["values"] for r in trials if r["label"] == "adamw")
  # the entry's own fixed values are not the trial's (a string one once broke the summary)
  assert all(set(r["values"]) == {"weight_decay"} for r in trials if r["label"] != "adamw")
  summary = {s["label"]: s for s in sweep.summarize(trials, "adamw")[0]}
  seeded = [r for r in rows if r["seed"] == 1]  # the best trial of each contender, at seed 1
  assert sorted((r["label"], r["trial"]) for r in seeded) == sorted((k, s["trial"]) for k, s in summary.items())
  text = (tmp_path / "summary.md").read_text()
  assert "quasi-random trials per contender" in text and "near the box's edge" in text
  assert len(os.listdir(tmp_path / "runs")) == 6


def test_a_killed_search_resumes_where_it_stopped(tmp_path, monkeypatch):
  real, calls = sweep._run_one, []

  def dies_on_the_third(kw):
    calls.append(os.path.basename(kw["out"]))
    if len(calls) == 3:
      raise KeyboardInterrupt
    real(kw)
  monkeypatch.setattr(sweep, "_run_one", dies_on_the_third)
  with pytest.raises(KeyboardInterrupt):
    run_grid(_search(tmp_path))
  first = list(calls)
  calls.clear()
  monkeypatch.setattr(sweep, "_run_one", lambda kw: (calls.append(os.path.basename(kw["out"])), real(kw)))
  rows = run_grid(_search(tmp_path))
  assert first[2] == calls[0] and not set(first[:2]) & set(calls)  # the two finished runs are not run again
  assert len(first[:2]) + len(calls) == 6 and len(rows) == 6


def test_search_refusals_are_one_line(tmp_path):
  with pytest.raises(SearchError, match="needs an lr range"):
    run_grid(_search(tmp_path, grid=("adamw=1e-3", "sgd[nesterov=false]=0.03,0.3")))
  with pytest.raises(SearchError, match="not a contender"):
    run_grid(_search(tmp_path, space=("muon:beta=beta:0.8:0.9",)))
  assert not os.path.exists(tmp_path / "runs")
