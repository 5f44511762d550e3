"""research/experiments/depth_expansion: the smoke run's invariants (function preservation, the descent condition
checked by finite differences, equal tokens) and the experiment's own helpers."""

import math

import numpy as np
import pytest
from flax import nnx

import models
from research.experiments import common
from research.experiments import depth_expansion as de


@pytest.fixture(scope="module")
def result(notebooks):
  """`depth_expansion.main(Config(smoke=True))`, as notebooks/depth_expansion.ipynb ran it."""
  return notebooks.run("depth_expansion").result


def _runs(result):
  return [r for by_seed in result["runs"].values() for r in by_seed.values()]


def test_smoke_insertion_preserves_the_function(result):
  for r in _runs(result):
    ins = r["insertion"]
    assert abs(ins["val_after"] - ins["val_before"]) < 1e-5


def test_smoke_descent_condition_and_its_finite_difference(result):
  for r in _runs(result):
    ins = r["insertion"]
    assert set(ins["grad_new"]) == {"wo_QD", "w_down_FD"}
    assert min(ins["grad_new"].values()) > 1e-6 and ins["grad_other_max_abs"] == 0.0
    # central difference of the loss along −g/‖g‖ on the gradient's own batches = −‖g‖ (autodiff vs measurement)
    assert ins["slope_measured"] / -ins["grad_norm"] == pytest.approx(1.0, abs=0.05)
    assert ins["train_jump"] < ins["train"] < ins["train_back"]


def test_smoke_arms_see_equal_tokens_and_learn(result):
  N, T = result["steps"]["pretrain"], result["steps"]["continue"]
  s = de.SMOKE
  assert list(result["runs"]) == list(s["sizes"])
  for r in _runs(result):
    assert r["n"] == s["sizes"][0]
    assert tuple(r["arms"]) == de.ARMS
    for arm in ("continued", "expanded"):
      steps = [step for step, _ in r["arms"][arm]["curve"]]
      assert steps[0] == N and steps[-1] == N + T
    assert r["arms"]["scratch"]["curve"][-1][0] == N + T
    pre = [v for _, v in r["pretrain_curve"]]
    assert pre[-1] < pre[0] < math.log(256)
    for arm, a in r["arms"].items():
      assert math.isfinite(a["final"]) and a["final"] < a["curve"][0][1], arm
  assert result["tokens"]["continue"] == T * s["batch_size"] * s["seq_len"]


def test_smoke_tables_findings_and_plot(result):
  lines = de.tables(result)
  assert sum(line.startswith("| 4,096 |") for line in lines) == 2
  assert len(de.findings(result)) == 5
  fig = de.plot(result)
  assert len(fig.axes) == 2 and all(ax.lines for ax in fig.axes)


def test_subset_takes_evenly_spaced_chunks():
  tokens = np.arange(100_003)
  out = de.subset(tokens, 40 * 512, 512)
  assert out.shape == (40 * 512,)
  chunks = out.reshape(40, 512)
  assert (np.diff(chunks, axis=1) == 1).all()  # each chunk is a contiguous run of the corpus
  starts = chunks[:, 0]
  assert starts[0] == 0 and chunks[-1, -1] == len(tokens) - 1
  gaps = np.diff(starts)
  assert gaps.min() >= 512 and gaps.max() - gaps.min() <= 1  # disjoint, evenly spaced
  assert de.subset(tokens, 0, 512) is tokens and de.subset(tokens, 10 ** 6, 512) is tokens
  with pytest.raises(de.DataSizeError, match="multiple of chunk"):
    de.subset(tokens, 1000, 512)


def test_jumpboard_moves_only_the_new_projections():
  model = models.insert_block(models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0)), 1, seed=0)
  rng = np.random.default_rng(0)
  before = common.split(model)[1]["blocks"]
  grads = {k: rng.standard_normal(before[k].shape[1:]) for k in ("wo_QD", "w_down_FD")}
  after = common.split(de.jumpboard(model, 1, grads, 0.3))[1]["blocks"]
  norm = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
  for k, w in after.items():
    w, w0 = np.asarray(w), np.asarray(before[k])
    if k in grads:
      np.testing.assert_allclose(w[1], -0.3 * grads[k] / norm, rtol=1e-6, atol=1e-8)
      np.testing.assert_array_equal(np.delete(w, 1, axis=0), np.delete(w0, 1, axis=0))
    else:
      np.testing.assert_array_equal(w, w0)
