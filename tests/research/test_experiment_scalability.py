"""research/experiments/scalability: the smoke run's invariants (as notebooks/scalability.ipynb ran it), the
speedup arithmetic, and the LM datasets' construction."""

import numpy as np
import pytest

from research.data import load_corpus
from research.experiments import scalability
from research.experiments.scalability import convex, study


@pytest.fixture(scope="module")
def result(notebooks):
  return notebooks.run("scalability").result


def test_steps_to_interpolates_between_evaluations():
  curve = [(0, 2.0), (10, 1.0), (20, 0.5)]
  assert scalability.steps_to(curve, 1.5) == 5.0
  assert scalability.steps_to(curve, 1.0) == 10.0
  assert scalability.steps_to(curve, 0.75) == 15.0
  assert scalability.steps_to(curve, 0.4) is None
  assert scalability.steps_to([(0, 2.0), (10, 3.0), (20, 1.0)], 2.0) == 15.0  # the first crossing after a rise


def test_predicted_speedup_limits():
  assert scalability.predicted_speedup(5.0, 8, 1) == 1
  assert scalability.predicted_speedup(1e-9, 8, 8) == pytest.approx(1)  # no noise: a bigger batch buys nothing
  assert scalability.predicted_speedup(1e9, 8, 8) == pytest.approx(8, rel=1e-6)  # all noise: linear
  assert scalability.predicted_speedup(8.0, 8, 4) == pytest.approx(2 / 1.25)


def test_sync_flags():
  cfg = scalability.Config()
  assert [scalability.sync_flag(a, 4, cfg) for a in scalability.ALGORITHMS] == \
      ["allreduce", "local:8", "gossip", "stale:3:random"]
  assert {scalability.sync_flag(a, 1, cfg) for a in scalability.LM_ALGORITHMS} == {"allreduce"}
  assert scalability.sync_flag("diloco", 4, cfg) == "local:8"  # the same sync, DiLoCo's outer step instead of a mean


def test_smoke_runs_every_cell_and_counts_bytes(result):
  s = scalability.SMOKE
  for variant in s["convex_variants"]:
    runs = result["convex"][variant]["runs"]
    assert set(runs) == {"allreduce/W1"} | {f"{a}/W2" for a in scalability.ALGORITHMS}
    for key, run in runs.items():
      curve, sent = run["seeds"]["0"]["curve"], run["seeds"]["0"]["bytes"]
      assert [t for t, _ in curve] == list(range(0, s["convex_steps"] + 1, 8)) == [t for t, _ in sent]
      assert all(b1 >= b0 for (_, b0), (_, b1) in zip(sent, sent[1:]))
      assert (sent[-1][1] == 0) == (key == "allreduce/W1")  # one worker sends nothing; two always do
    last = {k: r["seeds"]["0"]["bytes"][-1][1] for k, r in runs.items()}
    assert last["local/W2"] < last["allreduce/W2"]  # averaging every H = 2 steps, not every step
    assert "noise_scale" in runs["allreduce/W1"]["gradients"]
  lm = result["lm"]["stdlib"]["runs"]
  assert set(lm) == {"allreduce/W1", "allreduce/W2", "local/W2"}
  lm_sent = {k: r["seeds"]["0"]["bytes"][-1][1] for k, r in lm.items()}
  assert lm_sent["allreduce/W1"] == 0 < lm_sent["local/W2"] < lm_sent["allreduce/W2"]
  assert result["lm"]["stdlib"]["gradients"]["noise_scale"] > 0
  assert set(result["sweep"]) == {"local"} and set(result["sweep"]["local"]) == {"2"}
  # the sweep's H = 2 run of plain averaging at W = 2 is the grid's local/W2 run: the same curve
  assert result["sweep"]["local"]["2"]["seeds"]["0"]["curve"] == lm["local/W2"]["seeds"]["0"]["curve"]


def test_the_convex_variants_change_the_characters_they_are_built_for():
  c = {v: convex.characters(convex.digits(v)) for v in convex.VARIANTS}
  assert c["sorted"]["similarity"] > c["shuffled"]["similarity"] + 0.05  # consecutive samples of one class
  assert c["binary"]["sparsity"] > c["shuffled"]["sparsity"] + 0.1
  data = convex.digits("repeated")
  assert len(np.unique(data.x, axis=0)) <= len(data.x) // 10 + 1
  assert np.array_equal(convex.digits("sorted").val_x, convex.digits("shuffled").val_x)  # one held-out set


@pytest.mark.parametrize("name", ["repeated", "mixed"])
def test_lm_datasets_hold_out_exactly_the_stdlib_val_split(tmp_path, name):
  path, sampling = study.lm_data(name, str(tmp_path))
  built, stdlib = load_corpus(path), load_corpus()
  assert sampling == "random" and np.array_equal(built.val, stdlib.val)
  assert len(built.train) == 19 * len(stdlib.val)
  chunks = np.asarray(built.train[:len(built.train) // study.CHUNK * study.CHUNK]).reshape(-1, study.CHUNK)
  distinct = len({c.tobytes() for c in chunks})
  if name == "repeated":
    assert distinct <= len(chunks) // 10 + 2
  else:  # every other chunk is package-description prose: far more letters and spaces than Python source
    assert distinct > len(chunks) // 2


def test_an_lm_best_lr_on_the_grid_edge_gets_one_more_lr_and_displaced_seeds_rerun(monkeypatch):
  """lm_part with the CLI runs replaced by a loss that falls with lr up to 0.05: the best of (1e-3, 1e-2) is the
  edge 1e-2, so 3e-2 is tried once (not again on a rerun) and wins; seeds finished at the displaced 1e-2 are
  dropped and rerun at 3e-2; `summarize` flags an lr on the edge of the lrs actually tried."""
  calls = []

  def fake_run(cfg, work, dataset, sync, workers, lr, seed, outer=None):
    calls.append((dataset, workers, lr, seed))
    loss = 2.0 + abs(np.log(lr / 0.05))
    return {"curve": [(0, 5.0), (4, loss)], "bytes": [(0, 0.0), (4, 0.0)], "dir": ""}

  monkeypatch.setattr(study, "lm_run", fake_run)
  monkeypatch.setattr(study, "lm_characters", lambda cfg, dataset, work: {})
  monkeypatch.setattr(study, "lm_gradients", lambda cfg, run_dir, dataset, work: {"noise_scale": 1.0})
  cfg = study.Config(workers=(1,), seeds=(0, 1), lm_datasets=("stdlib",), lm_algorithms=("allreduce",),
                     lm_lrs=(1e-3, 1e-2))
  stale = {"curve": [(0, 5.0), (4, 9.0)], "bytes": [(0, 0.0)]}
  done = {"lm": {"lr": {"allreduce/W1": {"lr": 1e-2, "tune": {"0.001": 6.6, "0.01": 3.6}}},
                 "stdlib": {"characters": {}, "runs": {"allreduce/W1": {"lr": 1e-2, "seeds": {"0": stale}}}}}}
  study.lm_part(cfg, done, lambda: None, "unused")
  assert calls == [("stdlib", 1, 0.03, cfg.tune_seed), ("stdlib", 1, 0.03, 0), ("stdlib", 1, 0.03, 1)]
  assert done["lm"]["lr"]["allreduce/W1"]["lr"] == 0.03
  assert set(done["lm"]["stdlib"]["runs"]["allreduce/W1"]["seeds"]) == {"0", "1"}
  assert done["lm"]["stdlib"]["runs"]["allreduce/W1"]["lr"] == 0.03
  calls.clear()
  study.lm_part(cfg, done, lambda: None, "unused")  # finished: nothing runs again
  assert calls == []
  cell = study.summarize(done, cfg)["lm"]["stdlib"]["cells"]["allreduce/W1"]
  assert cell["lr"] == 0.03 and cell["lr_edge"]  # 3e-2 is the end of what was tried (0.001, 0.01, 0.03)
