"""Every registered optimizer on any parameter tree: a bare array, nested dicts/lists/tuples, NamedTuples, None
leaves, mixed dtypes, flax `nnx.State`, and inside `flax.nnx.Optimizer` (NNX's own training loop)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from optim import OPTIMIZERS, BAdamError, get_optimizer

NAMES = sorted(OPTIMIZERS)


class Pair(NamedTuple):
  a: jax.Array
  b: jax.Array


def _normal(i, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(i), shape, dtype)


TREES = {
    "bare_matrix": lambda: _normal(0, (5, 4)),
    "bare_vector": lambda: _normal(1, (6,)),
    "nested": lambda: {"dense": {"kernel": _normal(2, (4, 3)), "bias": _normal(3, (3,))},
                       "layers": [_normal(4, (3, 3)), _normal(5, (2, 3, 3))],
                       "pair": (_normal(6, (4,)), _normal(7, (4, 2))),
                       "named": Pair(a=_normal(8, (3, 3)), b=_normal(9, (3,))),
                       "nothing": None,
                       "half": _normal(10, (3, 4), jnp.bfloat16)},
}


class Tiny(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.down = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.norm(self.up(x))))


def _batch(step=0):
  x = _normal(11 + step, (16, 4))
  return x, jnp.stack([jnp.sin(x[:, 0]), jnp.cos(x[:, 1])], -1)


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _run(name, params, steps=3):
  """`steps` jitted updates with fixed pseudo-random gradients; returns (updates per step, states)."""
  tx = get_optimizer(name, 1e-2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  leaves, treedef = jax.tree.flatten(params)
  out = []
  for t in range(steps):
    grads = jax.tree.unflatten(treedef, [_normal(100 + 7 * t + i, x.shape, x.dtype) for i, x in enumerate(leaves)])
    updates, new_state = update(grads, state, params)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == jax.tree.map(lambda a: (a.shape, a.dtype), state)
    params, state = optax.apply_updates(params, updates), new_state
    out.append(updates)
  return out, params


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("name", NAMES)
def test_any_parameter_tree(name, tree):
  """Updates have the tree's structure, each leaf's shape and dtype, are finite, and move the parameters."""
  params = TREES[tree]()
  updates, final = _run(name, params)
  for u in updates:
    assert jax.tree.structure(u) == jax.tree.structure(params)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), u) == jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in jax.tree.leaves(u))
  moved = [not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
           for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(params))]
  if name in ("badam", "bread"):  # one block (here: one leaf) at a time
    assert any(moved)
  else:
    assert all(moved), moved


@pytest.mark.parametrize("name", NAMES)
def test_nnx_state_and_nnx_optimizer(name):
  """`flax.nnx.Optimizer(model, tx, wrt=nnx.Param)` trains with it, and its step equals the optimizer applied by
  hand to the plain parameter dict: NNX's State, its Variables and its paths reach the optimizer intact."""
  model, ref = Tiny(nnx.Rngs(0)), Tiny(nnx.Rngs(0))  # trained by nnx.Optimizer / by hand
  tx = get_optimizer(name, 1e-2)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    opt.update(model, grads)
    return loss

  by_hand = jax.jit(lambda p, s, g: tx.update(g, s, p))
  params = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
  state = tx.init(params)
  losses = []
  for t in range(3):
    x, y = _batch(t)  # a new batch per step: SOAP's step 2 would otherwise see step 1's gradient again
    grads = nnx.to_pure_dict(nnx.grad(_loss)(ref, x, y))
    updates, state = by_hand(params, state, grads)
    params = optax.apply_updates(params, updates)
    new = nnx.state(ref, nnx.Param)
    nnx.replace_by_pure_dict(new, params)
    nnx.update(ref, new)
    losses.append(float(train_step(model, opt, x, y)))
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, params)
  assert np.isfinite(losses).all()


def test_badam_says_why_map_params_cannot_work():
  tx = get_optimizer("badam", 1e-2)
  with pytest.raises(BAdamError, match="needs the parameters themselves at init.*map_params"):
    optax.tree.map_params(tx, lambda v: v, tx.init(jnp.ones(3)))
  with pytest.raises(BAdamError, match="empty tree"):
    tx.init({})


def test_names_see_through_nnx_variables():
  """nnx.Optimizer inits on a State of Variables (paths end in `.value`) and updates on plain arrays: the
  name-based rules (decay mask, Muon and MARS routing) must give both the same answer."""
  from optim import decay_mask, mars_labels, muon_labels
  variables = nnx.state(Tiny(nnx.Rngs(0)), nnx.Param)
  pure = nnx.to_pure_dict(variables)
  for rule in (decay_mask, muon_labels, mars_labels):
    assert jax.tree.leaves(rule(variables)) == jax.tree.leaves(rule(pure)), rule.__name__
  assert jax.tree.leaves(decay_mask(variables)).count(False) == 3  # the biases and the norm's scale


def test_badam_on_a_tree_without_stacked_layers_keeps_its_options():
  """blocks="auto" falls back to one block per leaf, and still freezes embeddings unless asked and trains
  `always_active` leaves at every step."""
  params = {"layers": {"w": jnp.ones((3, 2, 2))}, "embed": jnp.ones((5, 2)), "head": jnp.ones((2, 5))}

  def moved(**kw):
    tx = get_optimizer("badam", 1e-2, switch_every=1, **kw)
    state, out = tx.init(params), []
    for _ in range(4):
      updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
      out.append({k: bool(jnp.any(v != 0)) for k, v in
                  zip(("embed", "head", "w"), jax.tree.leaves(updates))})
    return {k: [o[k] for o in out] for k in out[0]}

  default = moved()
  assert not any(default["embed"]) and any(default["head"]) and any(default["w"])
  assert [h or w for h, w in zip(default["head"], default["w"])] == [True] * 4  # one block at a time
  assert not any(h and w for h, w in zip(default["head"], default["w"]))
  assert any(moved(include_embedding=True)["embed"])
  assert all(moved(always_active=("head",))["head"])
