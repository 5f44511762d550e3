import math

import jax.numpy as jnp
import numpy as np
import pytest

import optim
from optim import OPTIMIZERS, UnknownOptimizerError, decay_mask, get_optimizer, hyperparameters, make_schedule

PARAMS = {"blocks": {"wq": jnp.ones((2, 4, 4)), "attn_norm": jnp.ones((2, 4))}, "embed": jnp.ones((8, 4)),
          "final_norm": jnp.ones((4,))}


def test_registry_has_the_starting_optimizers_and_their_defaults():
  assert {"adamw", "sgd", "lion"} <= set(OPTIMIZERS)
  assert hyperparameters("adamw") == {"b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "mu_dtype": None}


def test_unknown_names_and_hyperparameters_are_refused():
  names = ", ".join(sorted(OPTIMIZERS))
  assert names.startswith("adamuon, adamw, badam, bread, cautious_adamw")  # every registered name is listed, sorted
  with pytest.raises(UnknownOptimizerError, match=f"unknown optimizer .adam.; registered: {names}$"):
    get_optimizer("adam", 1e-3)
  with pytest.raises(UnknownOptimizerError, match="'lion' has no hyperparameter momentum"):
    get_optimizer("lion", 1e-3, momentum=0.9)


@pytest.mark.parametrize("name, hparams, message", [
    ("muon", {"ns_steps": "abc"}, "ns_steps='abc' must be an integer"),
    ("muon", {"ns_steps": 2.5}, "must be an integer"),
    ("adamw", {"b1": 1.5}, r"b1=1.5 must lie in \[0, 1\]"),
    ("adamw", {"eps": -1e-8}, "must lie in"),
    ("adamw", {"weight_decay": float("nan")}, "must be finite"),
    ("adamw", {"b2": True}, "must be a number"),
    ("muon", {"nesterov": "yes"}, "must be true or false"),
    ("muon", {"method": 3}, "must be a string"),
])
def test_values_of_the_wrong_type_or_range_are_refused(name, hparams, message):
  with pytest.raises(UnknownOptimizerError, match=message):
    get_optimizer(name, 1e-3, **hparams)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1.0])
def test_a_learning_rate_that_is_not_finite_and_nonnegative_is_refused(lr):
  with pytest.raises(UnknownOptimizerError, match="learning rate"):
    get_optimizer("adamw", lr)


def test_weight_decay_skips_norms_by_name():
  assert decay_mask(PARAMS) == {"blocks": {"wq": True, "attn_norm": False}, "embed": True, "final_norm": False}


def test_adamw_decays_matrices_but_not_norms():
  """Zero gradients: Adam's step is 0, so only decoupled decay moves parameters (by lr * wd * p)."""
  tx = get_optimizer("adamw", 0.1, weight_decay=0.5)
  zeros = {k: np.zeros_like(v) if not isinstance(v, dict) else {a: np.zeros_like(b) for a, b in v.items()}
           for k, v in PARAMS.items()}
  updates, _ = tx.update(zeros, tx.init(PARAMS), PARAMS)
  np.testing.assert_allclose(updates["embed"], -0.05 * np.ones((8, 4)))
  np.testing.assert_array_equal(updates["final_norm"], 0.0)
  np.testing.assert_array_equal(updates["blocks"]["attn_norm"], 0.0)


def test_cosine_schedule_against_its_formula():
  s = make_schedule("cosine", 1.0, 100, warmup=10, min_ratio=0.1)
  for t in (0, 5, 10, 40, 99, 100):
    want = t / 10 if t < 10 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 10) / 90))
    assert float(s(t)) == pytest.approx(want, abs=1e-6), t


def test_wsd_schedule_is_flat_then_decays_linearly():
  s = make_schedule("wsd", 2.0, 100, warmup=10, min_ratio=0.0, decay_fraction=0.2)
  assert float(s(5)) == pytest.approx(1.0)
  assert [float(s(t)) for t in (10, 50, 80)] == pytest.approx([2.0, 2.0, 2.0])
  assert float(s(90)) == pytest.approx(1.0) and float(s(100)) == pytest.approx(0.0)
  with pytest.raises(ValueError, match="unknown schedule"):
    make_schedule("step", 1.0, 10)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_registered_optimizers_jit_and_stay_finite_on_zero_gradients(name):
  import jax
  tx = get_optimizer(name, 1e-2)
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  updates, new_state = jax.jit(tx.update)(grads, state, PARAMS)
  assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
  assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, state)


def test_a_declaration_computed_from_hyperparameters_checks_them_first():
  """BREAD's declared needs divide by `rank`: rank=0 is refused by its range in one line, not a ZeroDivisionError."""
  with pytest.raises(optim.UnknownOptimizerError, match="rank=0"):
    optim.needs("bread", {"rank": 0})
  with pytest.raises(optim.UnknownOptimizerError, match="no hyperparameter"):
    optim.needs("bread", {"rnak": 4})
  assert optim.needs("bread", {"rank": 4}).blockwise is not None


def test_bread_takes_what_its_docstring_offers():
  """inactive_lr_ratio=0 is BAdam (optim/bread.py): the registry's range accepts it, a negative ratio it refuses."""
  optim.get_optimizer("bread", 1e-3, inactive_lr_ratio=0.0)
  with pytest.raises(optim.UnknownOptimizerError, match="inactive_lr_ratio"):
    optim.get_optimizer("bread", 1e-3, inactive_lr_ratio=-0.5)
