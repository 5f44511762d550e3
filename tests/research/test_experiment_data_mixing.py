"""research/experiments/data_mixing: the smoke run's invariants (as notebooks/data_mixing.ipynb ran it): every arm
tuned the same upcycled MoE for the same steps, the fixed arms kept their weights, the dynamic arm moved its weights
by the rule at its period, and each corpus's held-out loss is reported."""

import math

import numpy as np
import pytest

from research.data.mixture import parse_mix
from research.experiments import data_mixing


@pytest.fixture(scope="module")
def result(notebooks):
  """`data_mixing.main(data_mixing.Config(smoke=True))`, as notebooks/data_mixing.ipynb ran it."""
  return notebooks.run("data_mixing").result


def test_the_fixed_arms_keep_their_weights_and_the_dynamic_arm_moves_at_its_period(result):
  run = result["seeds"][0]
  assert list(run["arms"]) == ["uniform", "size", "dynamic"]
  sizes = {n: result["corpora"][n]["train_bytes"] for n in data_mixing.SOURCES}
  assert run["arms"]["uniform"]["weights"] == [[0, [1 / 3] * 3]]
  np.testing.assert_allclose(run["arms"]["size"]["weights"][0][1],
                             parse_mix("size", data_mixing.SOURCES).initial(sizes))
  assert len(run["arms"]["size"]["weights"]) == 1
  dyn = run["arms"]["dynamic"]["weights"]
  s = data_mixing.SMOKE
  assert [step for step, _ in dyn] == list(range(0, s["steps"], s["every"]))  # an update every `every` steps
  assert dyn[0][1] == pytest.approx([1 / 3] * 3) and dyn[1][1] != pytest.approx([1 / 3] * 3)
  assert all(sum(w) == pytest.approx(1.0) and min(w) >= 0.05 / 3 for _, w in dyn)  # the c/|D| floor


def test_each_corpus_is_evaluated_and_the_mean_is_their_mean(result):
  for r in result["seeds"][0]["arms"].values():
    assert set(r["held_out"]) == set(data_mixing.SOURCES) and all(math.isfinite(v) for v in r["held_out"].values())
    assert r["final"] == pytest.approx(np.mean(list(r["held_out"].values())))
  assert set(result["seeds"][0]["upcycled"]) == set(data_mixing.SOURCES)


def test_tables_findings_and_plot(result):
  lines = data_mixing.tables(result)
  assert sum(line.startswith(("| uniform", "| size", "| dynamic")) for line in lines) == 6  # arms + grid rows
  assert [line.split(" − ")[0] for line in data_mixing.findings(result)] == ["Reading: size", "Reading: dynamic"]
  assert len(data_mixing.plot(result).axes) == 2
