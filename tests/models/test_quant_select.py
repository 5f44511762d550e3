"""models/quant_select.py: linear CKA against a float64 NumPy reference in its kernel form, its invariances and what
they cost (a pure scale error goes unseen), and CALM's per-layer choice on a tiny model."""

import importlib.util
import pathlib

import numpy as np
import pytest
from flax import nnx
from scipy.stats import ortho_group

from models import Transformer, cross_entropy, preset, quant
from models.quant_select import choose, linear_cka, one_layer_losses, pick

_spec = importlib.util.spec_from_file_location("quant_reference",
                                               pathlib.Path(__file__).with_name("quant_reference.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)  # float64 NumPy, from the papers

RNG = np.random.default_rng(0)
X = RNG.normal(size=(200, 24)) @ RNG.normal(size=(24, 24))
Y = np.tanh(X @ RNG.normal(size=(24, 16))) + 0.3 * RNG.normal(size=(200, 16))


def test_linear_cka_equals_the_kernel_form_reference():
  np.testing.assert_allclose(linear_cka(X, Y), ref.linear_cka(X, Y), rtol=1e-4)
  np.testing.assert_allclose(linear_cka(X, X), 1.0, rtol=1e-5)
  assert 0.0 < float(linear_cka(X, Y)) < 1.0


def test_linear_cka_is_invariant_to_isotropic_scaling_and_orthogonal_transforms_only():
  q = ortho_group.rvs(16, random_state=1)
  base = float(linear_cka(X, Y))
  np.testing.assert_allclose(linear_cka(X, 0.37 * Y), base, rtol=1e-5)
  np.testing.assert_allclose(linear_cka(X, Y @ q), base, rtol=1e-4)
  np.testing.assert_allclose(linear_cka(5.0 * X @ ortho_group.rvs(24, random_state=2), Y), base, rtol=1e-4)
  stretched = Y * np.linspace(0.2, 3.0, 16)  # an anisotropic scale is seen
  assert abs(float(linear_cka(X, stretched)) - base) > 1e-3


def test_a_pure_scale_error_goes_unseen_by_cka_and_not_by_mse():
  """The consequence: between a layer output that is the full-precision one at 70% of its size and one with a small
  noise, CKA prefers the scaled one (a perfect 1), MSE the noisy one."""
  outputs = {"scaled": 0.7 * Y, "noisy": Y + 0.05 * RNG.normal(size=Y.shape)}
  name, scores = pick(Y, outputs, "cka")
  assert name == "scaled" and scores["scaled"] == pytest.approx(1.0, abs=1e-6) and scores["noisy"] < 1.0
  assert pick(Y, outputs, "mse")[0] == "noisy"


TOKENS = np.random.default_rng(1).integers(0, 256, (4, 32))
CANDIDATES = {"rtn": quant.Spec("rtn", 3), "gptq": quant.Spec("gptq", 3), "awq": quant.Spec("awq", 3, group=32)}


@pytest.mark.parametrize("by", ["cka", "mse"])
def test_calm_picks_per_layer_the_best_scoring_candidate_and_the_plan_applies(by):
  model = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  plan, table = choose(model, CANDIDATES, TOKENS, by=by)
  assert len(table) == 2 and all(set(t) == set(CANDIDATES) for t in table)
  best = max if by == "cka" else min
  for layer, scores in enumerate(table):
    chosen = best(scores, key=scores.get)
    assert all(specs[layer] == CANDIDATES[chosen] for specs in plan.values())
    if by == "cka":
      assert all(0.0 < s <= 1.0 + 1e-6 for s in scores.values())
  assert isinstance(model.blocks.wq_DQ, nnx.Param)  # choosing changes nothing
  quant.quantize(model, plan, TOKENS)
  assert model.blocks.wq_DQ.specs == tuple(plan["blocks/wq_DQ"])


def test_one_layer_losses_equal_quantizing_that_layer_alone_and_evaluating_the_whole_model():
  """The oracle's cached-prefix measurement against the plain way: a plan that quantizes layer l only (the others
  kept at 32 bits), `quant.quantize`, and the whole model's forward on every batch."""
  model = Transformer(preset("tiny", vocab_size=256, n_layers=3), rngs=nnx.Rngs(1))
  batches = [(TOKENS[i:i + 2], np.roll(TOKENS[i:i + 2], -1, axis=1)) for i in (0, 2)]
  loss = lambda m: np.mean([float(cross_entropy(m(x), y)) for x, y in batches])
  full, table = one_layer_losses(model, CANDIDATES, TOKENS, batches)
  np.testing.assert_allclose(full, loss(model), rtol=1e-6)
  keep = quant.Spec(bits=32)
  assert len(table) == 3 and all(set(t) == set(CANDIDATES) for t in table)
  for layer, row in enumerate(table):
    for name, spec in CANDIDATES.items():
      plan = {p: [spec if i == layer else keep for i in range(3)] for p in quant.targets(model)}
      np.testing.assert_allclose(row[name], loss(quant.quantize(nnx.clone(model), plan, TOKENS)), rtol=1e-6)
      assert row[name] != full  # 3-bit weights move the loss
  assert isinstance(model.blocks.wq_DQ, nnx.Param)  # measuring changes nothing


def test_bad_selection_settings_are_refused():
  model = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  with pytest.raises(quant.QuantError, match="unknown selection score"):
    choose(model, CANDIDATES, TOKENS, by="ppl")
  with pytest.raises(quant.QuantError, match="no candidate"):
    choose(model, {}, TOKENS)
  with pytest.raises(quant.QuantError, match="does not divide"):
    choose(model, {"g": quant.Spec("rtn", 4, group=48)}, TOKENS)
  with pytest.raises(quant.QuantError, match="no candidate"):
    one_layer_losses(model, {}, TOKENS, [])
  with pytest.raises(quant.QuantError, match="does not divide"):
    one_layer_losses(model, {"g": quant.Spec("rtn", 4, group=48)}, TOKENS, [])
