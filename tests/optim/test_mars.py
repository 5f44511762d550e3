"""MARS against pytorch_optimizer's MARS (every variant, approximate and exact, float64), a float64 NumPy
reference of the AGI-Arena/MARS equations (exact mode, the reference's eps placement), optax.adamw / optax.lion
where MARS reduces to them (γ = 0, no clip active), and the optax contract (jit, inject_hyperparams, extra
args through chain / partition, sharded == unsharded, stable state, zero gradients).

Layouts: torch weights are (out, in), ours (in, out) = (fan_in, fan_out): torch gets our transposes. Our stacks
(layers, fan_in, fan_out) and stacked norm scales (layers, D) are separate tensors for torch, one per layer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from pytorch_optimizer.base.optimizer import BaseOptimizer
from pytorch_optimizer.optimizer import mars as po_mars

import models
import optim
import sharding
from optim import MarsError, mars, mars_correction, mars_labels

RNG = np.random.default_rng(0)
SHAPES = {"w": (2, 6, 10), "wo": (10, 6), "attn_norm": (2, 10), "bias": (10,)}
STEPS = 6
# Per-step gradient scales: the per-tensor clip ‖c‖_F > 1 is inactive at 0.05 and active at 2.0.
SCALES = (0.05, 0.5, 2.0, 0.1, 1.0, 0.3)
HP = dict(lr=1e-2, b1=0.95, b2=0.99, gamma=0.025, lr_1d=3e-3, wd=0.1, wd_1d=0.05)


def tree(scale=1.0):
  return {k: scale * RNG.standard_normal(s) for k, s in SHAPES.items()}


P0 = tree()
GRADS = [tree(s) for s in SCALES]
PREV = [tree(s) for s in SCALES]  # g̃_t for the exact mode (g̃_1 must be ignored: the reference's is zero)


def to_torch(t):
  """Torch's parameter list: each matrix of the stack transposed to (out, in), each stacked vector on its own."""
  arrays = [t["w"][0].T, t["w"][1].T, t["wo"].T, t["attn_norm"][0], t["attn_norm"][1], t["bias"]]
  return [torch.tensor(np.ascontiguousarray(a)) for a in arrays]


def from_torch(ts):
  a = [x.detach().numpy().copy() for x in ts]
  return {"w": np.stack([a[0].T, a[1].T]), "wo": a[2].T, "attn_norm": np.stack([a[3], a[4]]), "bias": a[5]}


def run_oracle(monkeypatch, variant, optimize_1d, exact):
  """pytorch_optimizer.MARS in float64: its Newton–Schulz in float64 (bf16 by default) and its extra 1e-15 under
  the square root set to 0 (both are its own parameters), so that only the algorithm is compared. Exact mode as
  AGI-Arena's `update_last_grad()` does it: after each step, `last_grad` ← ∇f(x_t, ξ_{t+1})."""
  monkeypatch.setattr(po_mars, "zero_power_via_newton_schulz_5",
                      functools.partial(po_mars.zero_power_via_newton_schulz_5, dtype=torch.float64))
  monkeypatch.setattr(po_mars.MARS, "apply_ams_bound", staticmethod(
      lambda ams, v, vmax, eps: BaseOptimizer.apply_ams_bound(ams, v, vmax, eps, exp_avg_sq_eps=0.0)))
  params = to_torch(P0)
  opt = po_mars.MARS(params, lr=HP["lr"], betas=(HP["b1"], HP["b2"]), gamma=HP["gamma"], mars_type=variant,
                     optimize_1d=optimize_1d, lr_1d=HP["lr_1d"], weight_decay=HP["wd"],
                     weight_decay_1d=HP["wd_1d"], eps=0.0, foreach=False)
  out = []
  for k, g in enumerate(GRADS):
    for p, gi in zip(params, to_torch(g)):
      p.grad = gi
    opt.step()
    if exact and k + 1 < STEPS:
      for p, gt in zip(params, to_torch(PREV[k + 1])):
        opt.state[p]["last_grad"].copy_(gt)
    out.append(from_torch(params))
  return out


# Every MARS run below goes through optax.inject_hyperparams (the numeric hyperparameters, γ included, are state),
# so one compiled program per structure serves every test and hyperparameter setting.
STRUCTURES = [("adamw", True, "approx"), ("adamw", True, "exact"), ("adamw", False, "exact"), ("lion", True, "approx"),
              ("lion", False, "exact"), ("shampoo", False, "approx"), ("shampoo", True, "exact")]
DEFAULTS = dict(gamma=0.025, b1=0.95, b2=0.99, eps=1e-8, weight_decay=0.0, lr_1d=3e-3, b1_1d=0.9, b2_1d=0.95,
                weight_decay_1d=0.1)


@functools.cache
def injected(variant, optimize_1d, mode):
  tx = optax.inject_hyperparams(mars, static_args=("ns_steps",))(
      learning_rate=0.0, variant=variant, mode=mode, optimize_1d=optimize_1d, **DEFAULTS)
  return tx, jax.jit(tx.update)


def run_mars(variant, optimize_1d, mode, grads=GRADS, prevs=None, **hp):
  tx, step = injected(variant, optimize_1d, mode)
  return run_ours(tx, grads, prevs, step=step, hparams={**DEFAULTS, **hp})


def run_ours(tx, grads=GRADS, prevs=None, *, step=None, hparams=None):
  with jax.enable_x64(True):
    params = jax.tree.map(jnp.asarray, P0)
    state = tx.init(params)
    for k, v in (hparams or {}).items():
      state.hyperparams[k] = jnp.asarray(v, jnp.float64)
    step = step or jax.jit(tx.update)
    kinds = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    out = []
    for k, g in enumerate(grads):
      extra = {} if prevs is None else {"prev_grads": jax.tree.map(jnp.asarray, prevs[k])}
      updates, state = step(jax.tree.map(jnp.asarray, g), state, params, **extra)
      params = optax.apply_updates(params, updates)
      assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == kinds
      assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(params))
      out.append(jax.tree.map(np.asarray, params))
  return out


@pytest.mark.parametrize("variant, optimize_1d, mode", STRUCTURES)
def test_matches_pytorch_optimizer_mars(monkeypatch, variant, optimize_1d, mode):
  want = run_oracle(monkeypatch, variant, optimize_1d, mode == "exact")
  got = run_mars(variant, optimize_1d, mode, prevs=PREV if mode == "exact" else None, learning_rate=HP["lr"],
                 gamma=HP["gamma"], b1=HP["b1"], b2=HP["b2"], eps=0.0, weight_decay=HP["wd"], lr_1d=HP["lr_1d"],
                 weight_decay_1d=HP["wd_1d"])
  moved = 0.0
  for k in range(STEPS):
    for name in SHAPES:
      np.testing.assert_allclose(got[k][name], want[k][name], rtol=0, atol=1e-12, err_msg=f"step {k + 1} {name}")
      moved = max(moved, float(np.abs(want[k][name] - P0[name]).max()))
  assert moved > 1e-3  # the weights did move


def test_exact_mode_fed_the_previous_gradients_is_the_approximate_mode():
  approx = run_mars("adamw", True, "approx", learning_rate=1e-2)
  exact = run_mars("adamw", True, "exact", prevs=[tree()] + GRADS[:-1], learning_rate=1e-2)  # g̃_1 is ignored
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-13), exact, approx)
  other = run_mars("adamw", True, "exact", prevs=PREV, learning_rate=1e-2)
  assert float(np.abs(other[-1]["w"] - approx[-1]["w"]).max()) > 1e-4  # the extra argument is used


def np_mars_reference(grads, prevs, lr, b1, b2, eps, wd, gamma, lr_1d, b1_1d, b2_1d, wd_1d):
  """AGI-Arena/MARS `update_fn` (mars-adamw, optimize_1d=False) from its equations, float64, per tensor:
  c = g + γ·β1/(1−β1)·(g − g̃) (g̃ = 0 at t = 1), c ← c/‖c‖ if ‖c‖ > 1, m, v on c,
  W ← W − lr·(wd·W + m / ((√v/√(1−β2^t) + eps)·(1−β1^t))); vectors: the same AdamW on g with the 1-D settings."""
  w = {k: v.copy() for k, v in P0.items()}
  mats = [("w", 0), ("w", 1), ("wo", None)]
  vecs = ["attn_norm", "bias"]
  m = {k: np.zeros_like(v) for k, v in w.items()}
  v = {k: np.zeros_like(x) for k, x in w.items()}
  out = []
  for t, (g, gt) in enumerate(zip(grads, prevs), start=1):
    for name, i in mats:
      sl = (i,) if i is not None else ()
      gi = g[name][sl]
      prev = np.zeros_like(gi) if t == 1 else gt[name][sl]
      c = gi + gamma * b1 / (1 - b1) * (gi - prev)
      n = np.sqrt(np.sum(c * c))
      c = c / n if n > 1 else c
      m[name][sl] = b1 * m[name][sl] + (1 - b1) * c
      v[name][sl] = b2 * v[name][sl] + (1 - b2) * c * c
      denom = (np.sqrt(v[name][sl]) / np.sqrt(1 - b2 ** t) + eps) * (1 - b1 ** t)
      w[name][sl] = w[name][sl] - lr * (wd * w[name][sl] + m[name][sl] / denom)
    for name in vecs:
      gi = g[name]
      m[name] = b1_1d * m[name] + (1 - b1_1d) * gi
      v[name] = b2_1d * v[name] + (1 - b2_1d) * gi * gi
      denom = (np.sqrt(v[name]) / np.sqrt(1 - b2_1d ** t) + eps) * (1 - b1_1d ** t)
      w[name] = w[name] - lr_1d * (wd_1d * w[name] + m[name] / denom)
    out.append({k: x.copy() for k, x in w.items()})
  return out


def test_exact_mode_equals_float64_reference_with_default_eps():
  want = np_mars_reference(GRADS, PREV, lr=6e-3, b1=0.95, b2=0.99, eps=1e-8, wd=1e-2, gamma=0.025, lr_1d=3e-3,
                           b1_1d=0.9, b2_1d=0.95, wd_1d=0.1)
  got = run_mars("adamw", False, "exact", prevs=PREV, learning_rate=6e-3, weight_decay=1e-2)  # the rest: defaults
  for k in range(STEPS):
    for name in SHAPES:
      np.testing.assert_allclose(got[k][name], want[k][name], rtol=0, atol=1e-12, err_msg=f"step {k + 1} {name}")


def small_tree():
  return [jax.tree.map(lambda x: 0.01 * x / np.sqrt(x.size), tree()) for _ in range(STEPS)]


@pytest.mark.parametrize("variant", ["adamw", "lion"])
def test_without_correction_and_clip_mars_is_optax(variant):
  """γ = 0 and ‖g‖_F < 1 per tensor: c̃ = g, so MARS-AdamW is optax.adamw(β1, β2) and MARS-Lion (sign of the EMA
  m_t) is optax.lion with b1 = b2 = β1 (its sign(β1·m_{t−1} + (1−β1)·g) is sign(m_t)). Every leaf on MARS."""
  grads = small_tree()
  assert max(float(np.linalg.norm(g["w"][0])) for g in grads) < 1  # the clip is inactive
  ours = run_mars(variant, True, "approx", grads, learning_rate=1e-2, gamma=0.0, weight_decay=0.1)
  if variant == "adamw":
    ref = optax.adamw(1e-2, b1=0.95, b2=0.99, eps=1e-8, weight_decay=0.1)
  else:
    ref = optax.lion(1e-2, b1=0.95, b2=0.95, weight_decay=0.1)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-13), ours, run_ours(ref, grads))


def test_clip_is_per_matrix_of_a_stack_and_per_vector_of_stacked_vectors():
  g = {"w": jnp.stack([jnp.full((3, 4), 2.0), jnp.full((3, 4), 0.01)])}  # ‖·‖_F = 6.93 and 0.035
  tx = mars_correction(0.0, 0.9)
  c, _ = jax.jit(tx.update)(g, tx.init(g))
  np.testing.assert_allclose(c["w"][0], g["w"][0] / np.sqrt(48.0), rtol=1e-6)
  np.testing.assert_allclose(c["w"][1], g["w"][1], rtol=1e-6)  # not divided by the stack's norm
  v = {"attn_norm": jnp.asarray([[3.0, 4.0], [0.3, 0.4]])}
  tx = mars_correction(0.0, 0.9, tensor_ndim=1)
  c, _ = jax.jit(tx.update)(v, tx.init(v))
  np.testing.assert_allclose(c["attn_norm"], [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)


def test_first_step_correction_is_from_a_zero_previous_gradient():
  """c₁ = (1 + γ·β/(1−β))·g₁: the reference codes' `last_grad` starts at zero, in both modes."""
  g = {"w": jnp.full((2, 3), 0.01)}
  for mode, extra in (("approx", {}), ("exact", {"prev_grads": {"w": jnp.full((2, 3), 5.0)}})):
    tx = mars_correction(0.5, 0.9, mode=mode)
    c, state = jax.jit(tx.update)(g, tx.init(g), **extra)
    np.testing.assert_allclose(c["w"], 0.01 * (1 + 0.5 * 9), rtol=1e-6)
    assert int(state.count) == 1


def test_labels_route_norms_and_biases_to_the_vector_group():
  model = nnx.eval_shape(lambda: models.Transformer(models.preset("tiny", tie_embeddings=False), rngs=nnx.Rngs(0)))
  labels = mars_labels(nnx.to_pure_dict(nnx.state(model)))
  assert labels["embed_VD"] == labels["head_DV"] == labels["blocks"]["w_up_DF"] == "matrix"  # 2-D: MARS
  assert labels["final_norm"] == labels["blocks"]["attn_norm"] == labels["blocks"]["q_norm"] == "vector"


def test_bad_settings_and_calls_raise_one_clear_error():
  g = {"w": jnp.ones((2, 3))}
  with pytest.raises(MarsError, match="variant must be one of adamw, lion, shampoo"):
    mars(1e-3, variant="sgd")
  with pytest.raises(MarsError, match="mode must be one of approx, exact"):
    mars(1e-3, mode="stale")
  exact = mars_correction(mode="exact")
  with pytest.raises(MarsError, match="needs update\\(..., prev_grads=...\\)"):
    exact.update(g, exact.init(g))
  approx = mars_correction()
  with pytest.raises(MarsError, match="pass prev_grads only with the exact mode"):
    approx.update(g, approx.init(g), prev_grads=g)
  assert isinstance(MarsError("x"), ValueError)
  assert optim.needs_prev_grads("mars", {"mode": "exact"}) and not optim.needs_prev_grads("mars")
  assert not optim.needs_prev_grads("adamw", {"weight_decay": 0.1})


# --- the optax contract


@pytest.mark.parametrize("variant, optimize_1d, mode", [s for s in STRUCTURES if s[2] == "exact"])
def test_finite_on_zero_gradients(variant, optimize_1d, mode):
  zeros = [jax.tree.map(np.zeros_like, P0)] * 2
  out = run_mars(variant, optimize_1d, mode, zeros, zeros, learning_rate=1e-2, weight_decay=0.0, weight_decay_1d=0.0)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), out[-1], P0)  # no step, no decay: unchanged


def test_clip_wrapper_clips_prev_grads_by_their_own_norm_and_keeps_the_chain_state():
  seen = {}

  def spy_update(updates, state, params=None, *, prev_grads=None):
    seen["g"], seen["prev"] = updates, prev_grads
    return updates, state

  spy = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), spy_update)
  g, prev = {"a": jnp.full((4,), 3.0)}, {"a": jnp.full((4,), 0.5)}  # norms 6 and 1
  tx = optim.with_global_norm_clip(spy, 2.0)
  tx.update(g, tx.init(g), prev_grads=prev)
  np.testing.assert_allclose(seen["g"]["a"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(seen["prev"]["a"], 0.5, rtol=1e-6)  # under the threshold: untouched
  chained = optax.chain(optax.clip_by_global_norm(2.0), spy)
  assert jax.tree.structure(tx.init(g)) == jax.tree.structure(chained.init(g))


SPECS = {"w": P(None, "fsdp", "tensor"), "wo": P(None, "tensor", "fsdp"), "embed": P("tensor", "fsdp"),
         "attn_norm": P(None, "tensor")}
SHARDED_SHAPES = {"w": (2, 16, 32), "wo": (2, 32, 16), "embed": (32, 16), "attn_norm": (2, 16)}


def test_sharded_updates_equal_unsharded_and_keep_shardings():
  """Exact MARS-Shampoo with MARS on vectors too (per-matrix and per-vector norms over sharded axes, Newton–Schulz):
  3 steps on 8 devices (fsdp=4, tensor=2, Explicit axes; Auto axes in test_muon_mvr) equal 1 device; updates and
  state keep the parameters' shardings and dtypes, with no weight decay to restore them (the default)."""
  tx = mars(1e-2, variant="shampoo", mode="exact", optimize_1d=True)
  params = {k: jnp.asarray(RNG.standard_normal(sh), jnp.float32) for k, sh in SHARDED_SHAPES.items()}
  grads = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)), params) for k in range(4)]
  mesh = sharding.make_mesh("fsdp=4,tensor=2", explicit=True)
  put = lambda t: {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, SPECS[k])) for k, v in t.items()}

  def run(params, grads):
    state = tx.init(params)
    kinds = jax.tree.map(lambda a: (a.dtype, a.sharding), state)
    step = jax.jit(lambda g, s, p, pg: tx.update(g, s, p, prev_grads=pg))
    for g, pg in zip(grads[1:], grads[:-1]):
      u, state = step(g, state, params, pg)
      params = optax.apply_updates(params, u)
    assert jax.tree.map(lambda a: (a.dtype, a.sharding), state) == kinds
    return u, params

  _, p_ref = run(params, grads)
  with jax.set_mesh(mesh):
    u, p_sharded = run(put(params), [put(g) for g in grads])
  for k, spec in SPECS.items():
    assert u[k].sharding.spec == spec and p_sharded[k].sharding.spec == spec, k
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), p_sharded, p_ref)
