"""research/experiments/moe_design: the arms hold equal active parameters (checked on the built models), the smoke
run's invariants (as notebooks/moe_design.ipynb ran it), and the guidance readings on a hand-made result."""

import math

import jax
import pytest
from flax import nnx

from models import Transformer
from research.experiments import moe_design


def test_every_full_size_arm_has_the_same_active_ffn_and_the_chains_hold_what_they_compare():
  cfg = moe_design.Config()
  specs = moe_design.arms(cfg)
  assert {"dense", "E4k1", "E4k2", "E8k4", "E32k4", "E16k1s1", "E16k3s1"} <= set(specs) and "E4k4" not in specs
  sizes = {}
  for arm, spec in specs.items():
    c = moe_design.model_config(cfg, spec)
    model = nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0)))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    sizes[arm] = moe_design.sizes(c)
    assert sizes[arm]["total"] == total, arm
    if spec[0]:
      m = c.moe
      assert (m.top_k + m.num_shared) * m.d_expert == cfg.active, arm  # the active FFN width per token
  router = lambda e: 2 * 64 * e  # noqa: E731  (D x E per layer, 2 layers)
  for arm, (e, _k, _s) in specs.items():  # active = dense + the router (+ the shared expert's gate, none here)
    assert sizes[arm]["active"] == sizes["dense"]["active"] + (router(e) if e else 0), arm
  for fine in ("E16k2", "E32k4"):  # G2's chain: equal total parameters but the router
    assert sizes[fine]["total"] - router(specs[fine][0]) == sizes["E8k1"]["total"] - router(8)


@pytest.fixture(scope="module")
def result(notebooks):
  """`moe_design.main(moe_design.Config(smoke=True))`, as notebooks/moe_design.ipynb ran it."""
  return notebooks.run("moe_design").result


def test_smoke_run(result):
  assert list(result["seeds"][0]["arms"]) == ["dense", "E4k1", "E4k2"]
  for arm, r in result["seeds"][0]["arms"].items():
    assert math.isfinite(r["final"]) and r["curve"][-1][0] == moe_design.SMOKE["steps"], arm
  assert sum(line.startswith("| E=4") for line in moe_design.tables(result)) == 4  # two arms, two grid rows
  assert moe_design.plot(result).axes[0].lines


def test_the_readings_compare_the_arms_that_isolate_each_guidance():
  seeds = {s: {"arms": {a: {"final": v + 0.01 * s} for a, v in
                        {"dense": 2.0, "E4k2": 1.9, "E8k2": 1.8, "E16k2": 1.7, "E32k2": 1.75, "E8k1": 1.85,
                         "E32k4": 1.6, "E16k4": 1.65, "E16k1s1": 1.72, "E16k3s1": 1.64}.items()}}
           for s in range(3)}
  result = {"seeds": seeds, "arms": {a: {} for a in seeds[0]["arms"]}}
  g1, g2, g3, best = moe_design.findings(result)
  assert g1.startswith("Reading (G1") and "E=8, k=2 − E=4, k=2 -0.1000 ± 0.0000 (lower)" in g1
  assert "E=32, k=2 − E=16, k=2 +0.0500 ± 0.0000 (higher)" in g1
  assert "E=16, k=2 − E=8, k=1 -0.1500" in g2 and "E=32, k=4 − E=16, k=2 -0.1000" in g2
  assert "E=16, k=1, 1 shared − E=16, k=2 +0.0200" in g3
  assert "E=32, k=4" in best
