"""Muon-MVR (= MARS-M) against a float64 NumPy reference written from the equations of Chang et al. (arXiv
2509.15816) and MARS-M (arXiv 2510.21800), MVR1 and MVR2, over 6 steps; and the optax contract (jit,
inject_hyperparams with γ injected, sharded 8-device mesh == 1 device with the parameters' shardings kept, the
distributed Newton–Schulz hand-off, stable state, zero gradients).

Shapes: w_up_DF (layers, D, F) and w_down_FD (layers, F, D) are stacks of (fan_in, fan_out) matrices; each matrix
is one tensor for the clip and for Newton–Schulz.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optim
import sharding
from optim import muon_mvr

RNG = np.random.default_rng(1)
SHAPES = {"blocks": {"w_up_DF": (2, 8, 12), "w_down_FD": (2, 12, 8), "attn_norm": (2, 8)}, "embed_VD": (16, 8)}
STEPS = 6
SCALES = (0.05, 0.5, 2.0, 0.1, 1.0, 0.3)  # the per-matrix clip ‖c‖_F > 1: inactive at 0.05, active at 2.0
DEFAULTS = dict(gamma=0.025, beta=0.95, weight_decay=0.1, adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8)


def tree(scale=1.0):
  return jax.tree.map(lambda s: scale * RNG.standard_normal(s), SHAPES, is_leaf=lambda x: isinstance(x, tuple))


P0 = tree()
GRADS = [tree(s) for s in SCALES]
PREV = [tree(s) for s in SCALES]  # g̃_t for MVR2; g̃_1 is ignored (zero in the reference)


def np_ns(x, a=3.4445, b=-4.7750, c=2.0315, steps=5, eps=1e-7):
  """Keller's quintic Newton–Schulz, wide orientation, float64."""
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if tall else x


def np_muon_mvr(grads, prevs, mode, lr, gamma, beta, wd, b1=0.9, b2=0.95, eps=1e-8):
  """Per hidden matrix: c = g + γ·β/(1−β)·(g − g̃) with g̃ = 0 at t = 1, g̃ = g_{t−1} (MVR1) or the given
  ∇f(x_{t−1}, ξ_t) (MVR2); c ← c/‖c‖_F if ‖c‖_F > 1; M ← βM + (1−β)c; W ← W − lr·(0.2·√max(A,B)·NS(M) + wd·W).
  Embedding and norm scales: AdamW (b1, b2, eps), decay on the embedding only (optim.muon's AdamW group)."""
  w = jax.tree.map(np.copy, P0)
  m = jax.tree.map(np.zeros_like, P0)
  v = jax.tree.map(np.zeros_like, P0)
  last = jax.tree.map(np.zeros_like, P0)
  out = []
  for t, (g, gt) in enumerate(zip(grads, prevs), start=1):
    for name in ("w_up_DF", "w_down_FD"):
      for i in range(2):
        gi = g["blocks"][name][i]
        prev = np.zeros_like(gi) if t == 1 else (last["blocks"][name][i] if mode == "mvr1" else gt["blocks"][name][i])
        c = gi + gamma * beta / (1 - beta) * (gi - prev)
        n = np.linalg.norm(c)
        c = c / n if n > 1 else c
        M = m["blocks"][name]
        M[i] = beta * M[i] + (1 - beta) * c
        W = w["blocks"][name]
        W[i] = W[i] - lr * (0.2 * np.sqrt(max(W[i].shape)) * np_ns(M[i]) + wd * W[i])
    for get, decay in ((lambda d: d["blocks"]["attn_norm"], 0.0), (lambda d: d["embed_VD"], wd)):
      gi, mi, vi, wi = get(g), get(m), get(v), get(w)
      mi[...] = b1 * mi + (1 - b1) * gi
      vi[...] = b2 * vi + (1 - b2) * gi * gi
      wi[...] = wi - lr * ((mi / (1 - b1 ** t)) / (np.sqrt(vi / (1 - b2 ** t)) + eps) + decay * wi)
    last = g
    out.append(jax.tree.map(np.copy, w))
  return out


@functools.cache
def injected(mode):
  """One compiled program per mode; the numeric hyperparameters (γ included) are state (inject_hyperparams)."""
  tx = optax.inject_hyperparams(muon_mvr, static_args=("ns_steps",))(learning_rate=0.0, mode=mode, **DEFAULTS)
  return tx, jax.jit(tx.update)


def run_ours(mode, grads, prevs, **hp):
  tx, step = injected(mode)
  with jax.enable_x64(True):
    params = jax.tree.map(jnp.asarray, P0)
    state = tx.init(params)
    for k, v in {**DEFAULTS, **hp}.items():
      state.hyperparams[k] = jnp.asarray(v, jnp.float64)
    kinds = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    out = []
    for k, g in enumerate(grads):
      extra = {"prev_grads": jax.tree.map(jnp.asarray, prevs[k])} if mode == "mvr2" else {}
      updates, state = step(jax.tree.map(jnp.asarray, g), state, params, **extra)
      params = optax.apply_updates(params, updates)
      assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == kinds
      out.append(jax.tree.map(np.asarray, params))
  return out


@pytest.mark.parametrize("mode", ["mvr1", "mvr2"])
@pytest.mark.parametrize("gamma, lr", [(0.025, 0.02), (0.1, 0.005)])
def test_equals_float64_reference(mode, gamma, lr):
  want = np_muon_mvr(GRADS, PREV, mode, lr=lr, gamma=gamma, beta=0.95, wd=0.1)
  got = run_ours(mode, GRADS, PREV, learning_rate=lr, gamma=gamma)
  for k in range(STEPS):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"step {k + 1}"),
                 got[k], want[k])
  assert float(np.abs(got[-1]["blocks"]["w_up_DF"] - P0["blocks"]["w_up_DF"]).max()) > 1e-3


def test_mvr2_fed_the_previous_gradients_is_mvr1_and_zero_gradients_stay_finite():
  mvr1 = run_ours("mvr1", GRADS, None, learning_rate=0.02)
  mvr2 = run_ours("mvr2", GRADS, [tree()] + GRADS[:-1], learning_rate=0.02)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-12), mvr2, mvr1)
  zeros = [jax.tree.map(np.zeros_like, P0)] * 2
  out = run_ours("mvr2", zeros, zeros, learning_rate=0.02, weight_decay=0.0)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), out[-1], P0)


def test_registry_and_errors():
  assert optim.needs_prev_grads("muon_mvr", {"mode": "mvr2"}) and not optim.needs_prev_grads("muon_mvr")
  with pytest.raises(optim.MarsError, match="'mvr1' \\(approximate\\) or 'mvr2' \\(exact\\)"):
    muon_mvr(0.02, mode="exact")
  tx = muon_mvr(0.02, mode="mvr2")
  p = {"w": jnp.ones((4, 6))}
  with pytest.raises(optim.MarsError, match="needs update\\(..., prev_grads=...\\)"):
    tx.update(p, tx.init(p), p)


SPECS = {"blocks": {"w_up_DF": P(None, "fsdp", "tensor"), "w_down_FD": P(None, "tensor", "fsdp"),
                    "attn_norm": P(None, "tensor")}, "embed_VD": P("tensor", "fsdp")}
SHARDED = {"blocks": {"w_up_DF": (2, 16, 32), "w_down_FD": (2, 32, 16), "attn_norm": (2, 16)}, "embed_VD": (32, 16)}


def test_sharded_and_distributed_equal_one_device_and_keep_shardings():
  """MVR2 on fsdp=4,tensor=2 (Auto axes), with the replicated Newton–Schulz and with `distributed=True` (each
  device orthogonalizes whole matrices of its share, `optim.distributed`): the parameters after 3 steps equal
  one device's; updates and state keep the parameters' shardings. The step pins its output shardings, as the
  train step does: on Auto axes, left free, XLA replicates the momentum that feeds Newton–Schulz's gather
  (no Nesterov here) and, without weight decay, the update."""
  params = jax.tree.map(lambda s: jnp.asarray(RNG.standard_normal(s), jnp.float32), SHARDED,
                        is_leaf=lambda x: isinstance(x, tuple))
  grads = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)), params) for k in range(4)]
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, SPECS)

  def run(tx, params, grads):
    state = tx.init(params)
    kinds = jax.tree.map(lambda a: (a.dtype, a.sharding), state)
    pinned = (jax.tree.map(lambda a: a.sharding, params), jax.tree.map(lambda a: a.sharding, state))
    step = jax.jit(lambda g, s, p, pg: tx.update(g, s, p, prev_grads=pg), out_shardings=pinned)
    for g, pg in zip(grads[1:], grads[:-1]):
      u, state = step(g, state, params, pg)
      params = optax.apply_updates(params, u)
    assert jax.tree.map(lambda a: (a.dtype, a.sharding), state) == kinds
    return u, params

  _, ref = run(muon_mvr(0.02, mode="mvr2"), params, grads)
  for distributed in (False, True):
    with jax.set_mesh(mesh):
      u, out = run(muon_mvr(0.02, mode="mvr2", distributed=distributed), put(params), [put(g) for g in grads])
    jax.tree.map(lambda a, s: np.testing.assert_equal(a.sharding.spec, s), u, SPECS)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), out, ref)
