"""research/experiments/exfusion: the smoke run's invariants (as notebooks/exfusion.ipynb ran it): the deployed
(fused) model computes what the trained expanded one did, identical copies stay identical, noisy experts stay apart."""

import math

import pytest

from research.experiments import exfusion


@pytest.fixture(scope="module")
def result(notebooks):
  """`exfusion.main(exfusion.Config(smoke=True))`, as notebooks/exfusion.ipynb ran it."""
  return notebooks.run("exfusion").result


def test_arms_train_equal_steps_and_deploy_the_dense_architecture(result):
  run = result["seeds"][0]
  assert list(run["arms"]) == ["dense", "exfusion4", "exfusion4_copies"]
  s = exfusion.SMOKE
  assert result["tokens"] == s["steps"] * s["batch_size"] * s["seq_len"]
  for arm, r in run["arms"].items():
    assert r["curve"][-1][0] == s["steps"] and math.isfinite(r["final"]), arm
  ffn = 3 * 64 * 128 * 2  # the FFN matrices of the two blocks, held 4 times while training
  assert result["params"]["exfusion4"] == result["inference_params"] + 3 * ffn + 4 * 3 * 2
  assert result["params"]["dense"] == result["inference_params"]


def test_the_fused_model_is_the_trained_one(result):
  for arm in ("exfusion4", "exfusion4_copies"):
    r = result["seeds"][0]["arms"][arm]
    assert r["final"] == pytest.approx(r["trained"], rel=1e-5), arm  # the same held-out batches, fused vs expanded
    assert all(len(a) == 2 and all(len(x) == 4 for x in a) for a in r["alphas"].values())  # (layers, experts)


def test_identical_copies_stay_identical_and_noisy_experts_stay_apart(result):
  arms = result["seeds"][0]["arms"]
  assert arms["exfusion4_copies"]["spread"] == 0.0  # equal gradients α_e·∂L/∂W̄ and equal α: equal updates
  assert arms["exfusion4_copies"]["alphas"]["blocks/w_up_DF"] == [[0.25] * 4] * 2  # a = 0 gets no gradient
  assert arms["exfusion4"]["spread"] == pytest.approx(exfusion.Config().noise, rel=0.5)


def test_tables_findings_and_plot(result):
  lines = exfusion.tables(result)
  assert sum(line.startswith("| ExFusion, 4 experts") for line in lines) == 4  # two arms, two grid rows
  assert len(exfusion.findings(result)) == 2
  assert exfusion.plot(result).axes[0].lines


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="expert counts >= 1"):
    exfusion.sized(exfusion.Config(experts=(0,)))
