"""The sweep harness: grid parsing, budgets, resumability, results.csv, the speedup arithmetic."""

import csv
import os

import pytest

from research.sweep import SweepConfig, SweepError, budget_steps, main, parse_grid, run_grid, steps_to, summarize
from research.train import TrainConfig

TINY = dict(model="tiny", batch_size=8, seq_len=32, eval_every=2, log_every=2, eval_batches=2, progress=False,
            devices=8, mesh="data=-1")  # whatever the backend already has: 8 under conftest


def test_parse_grid_and_errors():
  g = parse_grid(["adamw=1e-3,3e-3", "muon[nesterov=false,ns_steps=3]=0.01"])
  assert g == [("adamw", "adamw", (), [1e-3, 3e-3]),
               ("muon[nesterov=false,ns_steps=3]", "muon", ("nesterov=false", "ns_steps=3"), [0.01])]
  for bad, msg in [("adamw", "is not OPTIMIZER"), ("nosuch=1e-3", "unknown optimizer"), ("adamw=fast", "numbers"),
                   ("adamw=-1", "positive"), ("adamw[x=1=1e-3", "is not OPTIMIZER")]:
    with pytest.raises(SweepError, match=msg):
      parse_grid([bad])
  with pytest.raises(SweepError, match="twice"):
    parse_grid(["adamw=1e-3", "adamw=3e-3"])


def test_budgets():
  cfg = SweepConfig(train=TrainConfig(batch_size=8, seq_len=32, steps=7))
  assert budget_steps(cfg) == 7
  assert budget_steps(SweepConfig(tokens=8 * 32 * 5, train=cfg.train)) == 5
  from models import flops_per_token, preset
  per_step = flops_per_token(preset("small"), 32) * 8 * 32
  assert budget_steps(SweepConfig(flops=per_step * 3.5, train=cfg.train)) == 3
  with pytest.raises(SweepError, match="less than one step"):
    budget_steps(SweepConfig(tokens=10, train=cfg.train))


def test_steps_to_interpolates_between_evaluations():
  curve = [(10, 3.0), (20, 2.0), (30, 1.0)]
  assert steps_to(curve, 2.5) == 15.0
  assert steps_to(curve, 3.0) == 10.0
  assert steps_to(curve, 1.0) == 30.0
  assert steps_to(curve, 0.5) is None


def test_summary_picks_best_lr_by_seed_mean_and_computes_speedup():
  def row(label, lr, seed, curve):
    return {"label": label, "lr": lr, "seed": seed, "final_val_loss": curve[-1][1],
            "best_val_loss": min(v for _, v in curve), "tokens_per_s": 1.0, "curve": curve}
  rows = [row("base", 1, 0, [(10, 3.0), (20, 2.0)]), row("base", 1, 1, [(10, 3.0), (20, 2.2)]),
          row("base", 2, 0, [(10, 3.0), (20, 2.5)]), row("base", 2, 1, [(10, 3.0), (20, 2.5)]),
          row("fast", 1, 0, [(10, 2.1), (20, 1.5)]), row("fast", 1, 1, [(10, 2.1), (20, 1.7)])]
  summary, target = summarize(rows, "base")
  s = {x["label"]: x for x in summary}
  assert s["base"]["best_lr"] == 1 and target == pytest.approx(2.1)
  assert s["base"]["final_mean"] == pytest.approx(2.1) and s["base"]["final_std"] == pytest.approx(0.1414, abs=1e-4)
  assert s["base"]["speedup"] == pytest.approx(1.0)
  assert s["fast"]["speedup"] == pytest.approx(2.0)  # reaches 2.1 at step 10, the baseline at step 20
  assert [x["label"] for x in summary] == ["fast", "base"]


def test_a_tiny_grid_runs_writes_results_and_resumes(tmp_path, capsys):
  cfg = SweepConfig(grid=("adamw=3e-3", "sgd=0.1"), seeds=(0, 1), out=str(tmp_path), train=TrainConfig(**TINY),
                    tokens=8 * 32 * 4)
  rows = run_grid(cfg)
  assert [(r["label"], r["seed"]) for r in rows] == [("adamw", 0), ("sgd", 0), ("adamw", 1), ("sgd", 1)]
  assert all(r["steps"] == 4 and [s for s, _ in r["curve"]] == [2, 4] for r in rows)
  assert rows[0]["final_val_loss"] != rows[2]["final_val_loss"]  # seeds differ
  with open(tmp_path / "results.csv") as f:
    table = list(csv.DictReader(f))
  assert len(table) == 4 and float(table[0]["final_val_loss"]) == pytest.approx(rows[0]["final_val_loss"])
  for name in ("summary.md", "curves.png", "lr.png"):
    assert os.path.getsize(tmp_path / name) > 0
  stamp = {p: os.path.getmtime(tmp_path / "runs" / p / "metrics.jsonl") for p in os.listdir(tmp_path / "runs")}
  capsys.readouterr()
  again = run_grid(cfg)  # everything finished: nothing reruns, same numbers
  assert "4 already finished" in capsys.readouterr().err
  assert [r["final_val_loss"] for r in again] == [r["final_val_loss"] for r in rows]
  assert stamp == {p: os.path.getmtime(tmp_path / "runs" / p / "metrics.jsonl") for p in stamp}


def test_cli_bad_input_is_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    main(["--grid", "adamw=1e-3", "--baseline", "muon", "--out", str(tmp_path)])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: --baseline 'muon' is not in the grid") and "\n" not in err
  assert not os.listdir(tmp_path)


def test_a_diverging_run_is_recorded_not_fatal(tmp_path):
  cfg = SweepConfig(grid=("adamw=3e-3", "sgd=1e12"), out=str(tmp_path), tokens=8 * 32 * 4,
                    train=TrainConfig(**TINY, max_bad_steps=1, grad_clip=0.0))
  rows = run_grid(cfg)
  by = {r["label"]: r for r in rows}
  assert by["sgd"]["diverged"] and not by["adamw"]["diverged"]
  assert os.path.exists(tmp_path / "runs" / "sgd_lr1e+12_s0" / "diverged")
  summary, _ = summarize(rows, "adamw")
  assert [s["label"] for s in summary] == ["adamw"]
  with open(tmp_path / "results.csv") as f:
    assert [r["diverged"] for r in csv.DictReader(f)] == ["False", "True"]
