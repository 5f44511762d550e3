"""research/experiments/upcycling: the smoke run's invariants, and the experiment's own helpers against the CLI's
optimizer, leaf counts and NumPy."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from research.experiments import upcycling


@pytest.fixture(scope="module")
def result(notebooks):
  """`upcycling.main(upcycling.Config(smoke=True))`, as notebooks/upcycling.ipynb ran it."""
  return notebooks.run("upcycling").result


def test_smoke_arms_see_equal_tokens(result):
  N, T = result["steps"]["pretrain"], result["steps"]["continue"]
  s = upcycling.SMOKE
  assert (N, T) == (s["pretrain_steps"], s["continue_steps"]) and list(result["seeds"]) == [0]
  run = result["seeds"][0]
  assert tuple(run["arms"]) == upcycling.ARMS
  for arm in ("dense", "random", "clustered"):  # the conversion point, then T steps on data steps N..N+T-1
    steps = [step for step, _ in run["arms"][arm]["curve"]]
    assert steps[0] == N and steps[-1] == N + T and steps == sorted(steps)
  assert run["arms"]["scratch"]["curve"][-1][0] == N + T
  assert result["tokens"] == {"continue": T * s["batch_size"] * s["seq_len"],
                              "total": (N + T) * s["batch_size"] * s["seq_len"]}
  assert result["lr"]["clustered"] == result["lr"]["random"] and set(result["tune"]) == {"dense", "random"}


def test_smoke_split_is_exact_and_routing_changes_the_function(result):
  run = result["seeds"][0]
  assert max(run["split_error"].values()) < 1e-12  # experts are copied columns, s = 8 a power of two
  assert run["arms"]["dense"]["at_conversion"] == run["dense_val"]
  for split in upcycling.SPLITS:  # top-2 of 8 drops 3/4 of the neurons of every token
    assert abs(run["arms"][split]["at_conversion"] - run["dense_val"]) > 1e-4


def test_smoke_every_phase_learns(result):
  run = result["seeds"][0]
  pre = [v for _, v in run["pretrain_curve"]]
  assert pre[-1] < pre[0] < math.log(256)
  for arm, r in run["arms"].items():
    start = r["curve"][0][1]
    assert math.isfinite(r["final"]) and math.isfinite(r["train_tail"])
    assert r["final"] < start, f"{arm} did not improve on its start: {start} -> {r['final']}"


def test_smoke_tables_findings_and_plot(result):
  lines = upcycling.tables(result)
  assert sum(line.startswith("| MoE") for line in lines) == 3 + 1  # three MoE arms + the grid's MoE row
  assert len(upcycling.findings(result)) == 4  # a one-point grid has no edge
  fig = upcycling.plot(result)
  assert len(fig.axes) == 2 and all(ax.lines for ax in fig.axes)


def test_param_counts_against_the_leaves():
  dense_c = models.preset("tiny", d_ff=512)
  moe_c = models.preset("tiny", d_ff=512, moe=models.MoEConfig(num_experts=8, top_k=2, d_expert=64))
  for c in (dense_c, moe_c):
    leaves = nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: models.Transformer(c, rngs=nnx.Rngs(0))), nnx.Param))
    total = sum(int(np.prod(v.get_value().shape)) for _, v in leaves)
    routed = sum(int(np.prod(v.get_value().shape)) for p, v in leaves if str(p[-1]).endswith(("_EDF", "_EFD")))
    active = total - routed + (routed * c.moe.top_k // c.moe.num_experts if c.moe else 0)
    assert upcycling.param_counts(c) == {"total": total, "active": active}
  assert upcycling.param_counts(moe_c)["total"] == upcycling.param_counts(dense_c)["total"] + 2 * 64 * 8  # router


def test_split_error_is_zero_for_the_split_and_catches_a_wrong_one():
  dense = models.Transformer(models.preset("tiny", d_ff=512), rngs=nnx.Rngs(3))
  moe = models.upcycle(dense, 8, 2, "random", seed=1)
  assert upcycling.split_error(dense, moe, 8) < 1e-12
  assert upcycling.split_error(dense, moe, 4) > 0.5  # the wrong scale
  w = np.array(moe.blocks.moe.w_down_EFD[...])
  w[1, 0, 3, :], w[1, 1, 5, :] = w[1, 1, 5, :].copy(), w[1, 0, 3, :].copy()  # layer 1: a down row to the wrong expert
  moe.blocks.moe.w_down_EFD[...] = jnp.asarray(w)
  assert upcycling.split_error(dense, moe, 8) > 1e-4


def test_paired_differences_on_a_hand_made_result():
  finals = {"dense": [2.0, 2.1, 1.9], "random": [2.3, 2.1, 2.2]}
  res = {"seeds": {s: {"arms": {a: {"final": v[i]} for a, v in finals.items()}} for i, s in enumerate((0, 1, 2))}}
  d = np.array(finals["random"]) - np.array(finals["dense"])
  np.testing.assert_allclose(upcycling.paired(res, "random"), (d.mean(), d.std(ddof=1)), rtol=1e-12)
  assert upcycling._agree(res, "random") == "lower in 0 of 3 seeds"
