"""Alignment masks (optim.alignment) against NumPy selections written from their definitions, exact top-K on
sharded leaves (Auto and Explicit meshes), and the optax contract for the six MGUP / Cautious optimizers: jit,
inject_hyperparams (τ, α, γ, floor injected), finite on zero gradients, state dtypes and shardings stable,
sharded 8-device updates equal to unsharded, weight decay never masked."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optim
import sharding
from optim import AlignmentError, cautious_mask, cautious_mgup_mask, mgup_mask, topk_mask

RNG = np.random.default_rng(0)
SIX = ("mgup_adamw", "mgup_lion", "mgup_muon", "cautious_adamw", "cautious_lion", "cautious_muon")


def tensors(x: np.ndarray):
  """Index tuples of the tensors of a leaf: each matrix of a stack (last two axes), or the whole of a vector."""
  return list(np.ndindex(x.shape[:-2])) if x.ndim >= 2 else [()]


def np_topk(s: np.ndarray, tau: float) -> np.ndarray:
  """The K = int(τ·N) first of each tensor's ranking by score descending, ties by lower flat index."""
  out = np.zeros(s.shape, bool)
  for i in tensors(s):
    flat = s[i].ravel()
    chosen = np.zeros(flat.size, bool)
    chosen[np.argsort(-flat, kind="stable")[:int(tau * flat.size)]] = True  # stable: ties keep index order
    out[i] = chosen.reshape(s[i].shape)
  return out


def tied_scores(shape, seed=1):
  """Scores with many ties (a few levels) and signed zeros: the hard case for an exact top-K."""
  s = np.random.default_rng(seed).integers(-2, 3, size=shape).astype(np.float32) * 0.5
  s.reshape(-1)[::7] = -0.0
  return s


def test_topk_selects_exactly_k_with_ties_python_and_traced_tau():
  """A stack of matrices, a vector and a scalar, with many ties and signed zeros; τ traced (one program for all
  τ, K = ⌊τ·N⌋ including 0 and N) and τ a Python float (K = int(τ·N))."""
  shapes = [(2, 16, 24), (40,), ()]
  scores = [jnp.asarray(tied_scores(shape)) for shape in shapes]
  traced = jax.jit(lambda ss, tau: [topk_mask(x, tau) for x in ss])
  for tau in (0.0, 0.3, 0.5, 0.77, 1.0):
    for s, got in zip(scores, traced(scores, jnp.float32(tau))):
      np.testing.assert_array_equal(np.asarray(got), np_topk(np.asarray(s), tau), err_msg=f"tau={tau} {s.shape}")
  assert traced._cache_size() == 1
  static = jax.jit(topk_mask, static_argnums=1)(scores[0], 0.3)
  np.testing.assert_array_equal(np.asarray(static), np_topk(np.asarray(scores[0]), 0.3))
  with pytest.raises(AlignmentError, match="tau must lie in \\[0, 1\\]"):
    topk_mask(scores[1], 1.5)


def test_topk_orders_signed_scores_not_magnitudes_and_handles_extremes():
  s = np.array([[-5.0, 3.0, -np.inf, 0.0], [np.inf, -1e-30, 1e-30, 2.0]])  # one 2×4 tensor
  np.testing.assert_array_equal(np.asarray(jax.jit(topk_mask)(jnp.asarray(s, jnp.float32), 0.5)),
                                [[False, True, False, False], [True, False, True, True]])
  with jax.enable_x64(True):  # float64 scores take the 64-bit key
    x = np.random.default_rng(2).standard_normal((3, 5, 7))
    x[0, 0, :3] = x[0, 1, :3] = 1.0 + 1e-15  # differ from 1.0 only beyond float32
    x[0, 2, :3] = 1.0
    np.testing.assert_array_equal(np.asarray(jax.jit(topk_mask)(jnp.asarray(x), 0.4)), np_topk(x, 0.4))


@pytest.mark.parametrize("explicit", [False, True])
def test_topk_on_a_sharded_leaf_selects_the_unsharded_coordinates(explicit):
  """P(None, "fsdp", "tensor") over fsdp=4, tensor=2, many ties, traced τ: the coordinates NumPy selects, exactly K
  per matrix. The sort runs on whole matrices (gathered once, no loop); on an Explicit mesh the mask comes back
  in the leaf's sharding."""
  s = tied_scores((2, 16, 24), seed=3)
  mesh = sharding.make_mesh("fsdp=4,tensor=2", explicit=explicit)
  x = jax.device_put(jnp.asarray(s), NamedSharding(mesh, P(None, "fsdp", "tensor")))
  with jax.set_mesh(mesh):
    compiled = jax.jit(topk_mask).lower(x, jnp.float32(0.3)).compile()
    got = compiled(x, jnp.float32(0.3))
  text = compiled.as_text()
  assert "all-gather" in text and " while(" not in text
  if explicit:
    assert got.sharding.is_equivalent_to(x.sharding, 3)
  np.testing.assert_array_equal(np.asarray(got), np_topk(s, 0.3))
  np.testing.assert_array_equal(np.asarray(got).sum(axis=(1, 2)), [int(0.3 * 16 * 24)] * 2)


def test_masks_against_their_definitions():
  u, g = RNG.standard_normal((2, 6, 10)), RNG.standard_normal((2, 6, 10))
  g[0, 0, :4] = 0.0  # u·g = 0: Cautious-MGUP's ≥ 0 takes α there, Cautious's > 0 drops it
  v = RNG.standard_normal(12)

  @jax.jit
  def masks(u, g, v):
    return (mgup_mask(u, g, 0.3, 2.0, 0.1), cautious_mgup_mask(u, g, 1.5, 0.25), cautious_mask(u, g),
            cautious_mask(u, g, normalize="count"), cautious_mask(v, -v),
            optim.mgup_policy("topk", tau=0.25, alpha="1/tau", gamma="tau")(u, g))

  mgup, cmgup, caut, caut_count, none_aligned, paper = masks(u, g, v)
  s = u * g
  np.testing.assert_array_equal(mgup, np.where(np_topk(s, 0.3), 2.0, 0.1).astype(np.float32))
  np.testing.assert_array_equal(cmgup, np.where(s >= 0, 1.5, 0.25).astype(np.float32))
  c = (s > 0).astype(np.float64)
  np.testing.assert_allclose(caut, c / np.maximum(c.mean(axis=(1, 2), keepdims=True), 1e-3), rtol=1e-6)
  np.testing.assert_allclose(caut_count, c * 60 / (c.sum(axis=(1, 2), keepdims=True) + 1), rtol=1e-6)
  np.testing.assert_array_equal(none_aligned, np.zeros(12))  # nothing aligned: the floor, φ = 0, finite
  np.testing.assert_allclose(paper, np.where(np_topk(s, 0.25), 4.0, 0.25), rtol=1e-6)  # α = 1/τ, γ = τ


def test_bad_policies_and_arguments_say_how_to_fix_them():
  v = jnp.ones(12)
  with pytest.raises(AlignmentError, match="normalize must be one of mean, count"):
    cautious_mask(v, v, normalize="sum")
  with pytest.raises(AlignmentError, match="must have one shape"):
    mgup_mask(v, v[:6])
  with pytest.raises(AlignmentError, match="unknown MGUP policy 'sign'; use 'topk'"):
    optim.mgup_adamw(1e-3, policy="sign")
  with pytest.raises(AlignmentError, match="must be 'tau'"):
    optim.mgup_lion(1e-3, gamma="0.5")
  with pytest.raises(AlignmentError, match="tau .the boosted fraction. must lie in \\(0, 1\\], got 0.0"):
    optim.mgup_muon(1e-3, tau=0.0, alpha="1/tau")
  with pytest.raises(AlignmentError, match="must lie in \\[0, 1\\], got 2"):
    optim.get_optimizer("mgup_adamw", 1e-3, tau=2)
  with pytest.raises(AlignmentError, match="normalize must be"):
    optim.cautious_muon(1e-3, normalize="median")


# --- the optax contract for the six optimizers


def small_params():
  """A stacked hidden matrix (Muon-routed), an embedding and a norm (AdamW-routed for the Muon variants)."""
  rng = np.random.default_rng(4)
  return {"blocks": {"w_up_DF": jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)},
          "embed_VD": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32),
          "final_norm": jnp.ones((16,), jnp.float32)}


SPECS = {"blocks": {"w_up_DF": P(None, "fsdp", "tensor")}, "embed_VD": P("tensor", "fsdp"), "final_norm": P()}


def injected(name, **hp):
  factory = optim.OPTIMIZERS[name]
  static = ("ns_steps",) if name.endswith("muon") else ()
  return optax.inject_hyperparams(factory, static_args=static)(**hp)


@pytest.mark.parametrize("name", SIX)
def test_contract_and_unmasked_weight_decay(name):
  """One jitted inject_hyperparams step (lr, weight_decay, and τ, α, γ or floor injected as floats):
  - zero gradients: finite, exactly zero updates; state shapes and dtypes unchanged;
  - injected values act without recompiling (MGUP-Lion: |update|/lr = φ has exactly ⌊τ·N⌋ α's per matrix);
  - weight decay is never masked: a coordinate the mask kills (g = 0 there, so u·g = 0: not > 0 for Cautious,
    last in MGUP's ranking, with γ = 0) still moves by exactly −lr·wd·w. First step without Nesterov, so Muon's
    pre-NS direction is G. Cautious-Muon masks before NS, which spreads the killed entry again: there the whole
    decay term is checked against the same step with weight_decay 0."""
  params = small_params()
  mgup = name.startswith("mgup")
  hp = {"tau": 0.3, "alpha": 1.5, "gamma": 0.2} if mgup else {"floor": 1e-3}
  tx = injected(name, learning_rate=0.01, weight_decay=0.0, **hp, **({"nesterov": False} if "muon" in name else {}))
  state = tx.init(params)
  step = jax.jit(tx.update)
  u, new = step(jax.tree.map(jnp.zeros_like, params), state, params)
  assert all(bool(jnp.isfinite(x).all()) and float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(u))
  structure = lambda s: jax.tree.map(lambda a: (a.shape, a.dtype), s)
  assert structure(new) == structure(state)

  def run(grads, **values):  # a first step from `state` with some hyperparameters changed
    for k, v in values.items():
      state.hyperparams[k] = jnp.asarray(v, jnp.float32)
    return step(grads, state, params)[0]["blocks"]["w_up_DF"]

  if name == "mgup_lion":
    for tau in (0.3, 0.7):
      phi = np.abs(np.asarray(run(jax.tree.map(lambda p: jnp.sin(3 * p) + 0.1, params), tau=tau))) / 0.01
      np.testing.assert_allclose(np.unique(phi), [0.2, 1.5], rtol=1e-5)
      np.testing.assert_array_equal((phi > 1).sum(axis=(1, 2)), [int(tau * 512)] * 2)
  dead, lr, wd = (0, 0, 0), 0.01, 0.5
  grads = jax.tree.map(lambda p: jnp.cos(5 * p) + 0.5, params)
  grads["blocks"]["w_up_DF"] = grads["blocks"]["w_up_DF"].at[dead].set(0.0)
  w = params["blocks"]["w_up_DF"]
  decayed = run(grads, weight_decay=wd, **({"tau": 0.5, "alpha": 1.0, "gamma": 0.0} if mgup else {}))
  if name == "cautious_muon":
    bare = run(grads, weight_decay=0.0)
    assert float(jnp.abs(bare[dead])) > 1e-4  # the killed entry is back after NS
    np.testing.assert_allclose(decayed - bare, -lr * wd * w, atol=1e-7)
  else:
    np.testing.assert_allclose(decayed[dead], -lr * wd * w[dead], rtol=1e-6)
  assert step._cache_size() == 1


def _updates_on(spec: str):
  """All six optimizers in one program, 3 steps on `spec` (a one-device mesh: everything replicated): the last
  updates, the parameters, and the optimizer states' (sharding, dtype, ndim) before and after."""
  params0 = small_params()
  txs = {name: optim.get_optimizer(name, 0.01, **({"tau": 0.3} if name.startswith("mgup") else {})) for name in SIX}
  grads = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)), params0) for k in range(3)]
  one = spec == "data=1"
  mesh = sharding.make_mesh(spec, devices=jax.devices()[:1] if one else None)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, P() if one else s), SPECS)
  params = jax.device_put(params0, shardings)
  with jax.set_mesh(mesh):
    states = {}
    for name, tx in txs.items():
      out_shardings = sharding.shardings_like_params(jax.eval_shape(tx.init, params), params, shardings, mesh)
      states[name] = jax.jit(tx.init, out_shardings=out_shardings)(params)
    before = jax.tree.map(lambda a: (a.sharding, a.dtype, a.ndim), states)
    step = jax.jit(lambda g, s, p: {n: txs[n].update(g, s[n], p) for n in txs})
    for g in grads:
      out = step(jax.device_put(g, shardings), states, params)
      states = {n: out[n][1] for n in txs}
  after = jax.tree.map(lambda a: (a.sharding, a.dtype, a.ndim), states)
  return {n: out[n][0] for n in txs}, params, before, after


def test_sharded_updates_equal_unsharded_and_keep_shardings():
  """fsdp=4,tensor=2 (Auto axes; the top-K's Explicit path is tested above): the same updates as on one device
  (to fp32 rounding), each update sharded like its parameter, the states' shardings and dtypes unchanged."""
  ref, _, _, _ = _updates_on("data=1")
  got, params, before, after = _updates_on("fsdp=4,tensor=2")
  pairs = lambda t: jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3
                                    and isinstance(x[0], jax.sharding.Sharding))
  for (b_sh, b_dt, ndim), (a_sh, a_dt, _) in zip(pairs(before), pairs(after), strict=True):
    assert b_dt == a_dt and a_sh.is_equivalent_to(b_sh, ndim)
  for name in SIX:
    for u, p in zip(jax.tree.leaves(got[name]), jax.tree.leaves(params)):
      assert u.sharding.is_equivalent_to(p.sharding, p.ndim), name
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, err_msg=name),
                 got[name], ref[name])
  mu = pairs(after)  # a moment of the stacked matrix keeps the parameter's sharding
  assert any(sh.spec == P(None, "fsdp", "tensor") for sh, _, _ in mu)


@pytest.mark.parametrize("name", ["mgup_muon", "cautious_muon"])
def test_muon_variants_pass_distributed_through(name, monkeypatch):
  """`distributed` reaches scale_by_muon's orthogonalization (recorded while tracing; nothing compiles)."""
  module = importlib.import_module("optim.muon")  # `optim.muon` is the factory function
  seen, original = [], module.orthogonalize_tree

  def record(tree, **kwargs):
    seen.append(kwargs["distributed"])
    return original(tree, **{**kwargs, "distributed": False})

  monkeypatch.setattr(module, "orthogonalize_tree", record)
  params = small_params()
  for flag in (False, True):
    tx = optim.get_optimizer(name, 0.01, distributed=flag)
    jax.eval_shape(tx.update, params, tx.init(params), params)
  assert seen == [False, True]
