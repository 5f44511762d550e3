"""NorMuon against pytorch_optimizer 4.1.0's `NorMuon` (site-packages/pytorch_optimizer/optimizer/muon/normuon.py),
float64, 6 steps, the whole factory (NorMuon on hidden matrices, AdamW on the head and a bias), in four settings:
the oracle's defaults (= the authors' code: Nesterov, update norm preserved, Keller's lr factor), its Moonlight lr
factor, the paper's Algorithm 1 (no Nesterov, update RMS 0.2: update_scale="match_rms"), and ours (the paper's
RMS with Nesterov); then the optax contract (stacks = separate matrices, sharded == unsharded on 8 devices with
and without distributed Newton–Schulz, zero gradients, inject_hyperparams).

Layouts: torch weights are (out, in), ours (in, out) = (fan_in, fan_out): torch gets our transposes, one matrix
per element of a stack. A neuron is torch's row, our column (`optim.normuon`).

Newton–Schulz: the oracle's `zero_power_via_newton_schulz_5` runs in bfloat16 (its `dtype` default; the authors'
code too). The oracle module's reference to it is patched to the same function with dtype=float64, and ours runs
with ns_eps=0: it divides by max(‖X‖_F, 1e-7), we by ‖X‖_F + ns_eps, equal for ‖X‖_F ≥ 1e-7. So both run the
same float64 iteration and only the algorithm is compared: measured ≤ 8.9e-16 on O(1) weights, asserted 1e-12
(unpatched, its bf16 iteration is 8.8e-4 away; with our default ns_eps=1e-7, 1.9e-8).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pytorch_optimizer.optimizer.muon import normuon as po_normuon
from sharded_steps import assert_stack_is_separate, run_steps, sine_grads

import sharding
from optim import normuon

RNG = np.random.default_rng(0)
# w_up: a stack of two wide (fan_in 6 < fan_out 10) matrices, w_down: tall; head and bias go to AdamW
SHAPES = {"w_up": (2, 6, 10), "w_down": (10, 6), "head": (6, 4), "bias": (10,)}
STEPS = 6
SCALES = (1.0, 0.3, 2.0, 0.05, 1.0, 0.5)
HP = dict(learning_rate=0.02, weight_decay=0.1, adam_learning_rate=3e-3, adam_b1=0.9, adam_b2=0.95,
          adam_eps=1e-10, adam_weight_decay=0.05)


def tree(scale=1.0):
  return {k: scale * RNG.standard_normal(s) for k, s in SHAPES.items()}


P0 = tree()
GRADS = [tree(s) for s in SCALES]


def to_torch(t):
  arrays = [t["w_up"][0].T, t["w_up"][1].T, t["w_down"].T, t["head"].T, t["bias"]]
  return [torch.tensor(np.ascontiguousarray(a)) for a in arrays]


def from_torch(ts):
  a = [x.detach().numpy().copy() for x in ts]
  return {"w_up": np.stack([a[0].T, a[1].T]), "w_down": a[2].T, "head": a[3].T, "bias": a[4]}


def run_oracle(monkeypatch, *, momentum, beta2, eps, nesterov, update_scale, use_adjusted_lr):
  monkeypatch.setattr(po_normuon, "zero_power_via_newton_schulz_5",
                      functools.partial(po_normuon.zero_power_via_newton_schulz_5, dtype=torch.float64))
  params = to_torch(P0)
  groups = [dict(params=params[:3], use_muon=True, lr=HP["learning_rate"], weight_decay=HP["weight_decay"]),
            dict(params=params[3:4], use_muon=False, lr=HP["adam_learning_rate"],
                 weight_decay=HP["adam_weight_decay"]),
            dict(params=params[4:], use_muon=False, lr=HP["adam_learning_rate"], weight_decay=0.0)]  # a bias
  opt = po_normuon.NorMuon(groups, momentum=momentum, beta2=beta2, eps=eps, nesterov=nesterov,
                           update_scale=update_scale, use_adjusted_lr=use_adjusted_lr,
                           adamw_betas=(HP["adam_b1"], HP["adam_b2"]), adamw_eps=HP["adam_eps"], foreach=False)
  out = []
  for g in GRADS:
    for p, gi in zip(params, to_torch(g)):
      p.grad = gi
    opt.step()
    out.append(from_torch(params))
  return out


NUMERIC = dict(beta=0.95, b2=0.95, eps=1e-10, ns_eps=1e-7, **HP)


@functools.cache
def injected(nesterov, preserve_norm, scale):
  """One compiled update per structure; every numeric hyperparameter is injected state."""
  tx = optax.inject_hyperparams(normuon, static_args=("ns_steps",))(
      nesterov=nesterov, preserve_norm=preserve_norm, scale=scale, **NUMERIC)
  return tx, jax.jit(tx.init), jax.jit(tx.update)


def run_ours(params, grads, *, nesterov=True, preserve_norm=False, scale="moonlight", **hp):
  _, init, step = injected(nesterov, preserve_norm, scale)
  with jax.enable_x64(True):
    params = jax.tree.map(jnp.asarray, params)
    state = init(params)
    assert set(NUMERIC) <= set(state.hyperparams)
    for k, v in {**NUMERIC, **hp}.items():
      state.hyperparams[k] = jnp.asarray(v, jnp.float64)
    kinds = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    out = []
    for g in grads:
      updates, state = step(jax.tree.map(jnp.asarray, g), state, params)
      params = optax.apply_updates(params, updates)
      assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == kinds
      out.append(jax.tree.map(np.asarray, params))
  return out


# name: (oracle kwargs, our kwargs). b2 ≠ β in one setting and a large eps in another, so a swapped β or a
# misplaced eps shows.
SETTINGS = {
    "oracle_defaults": (dict(momentum=0.95, beta2=0.95, eps=1e-10, nesterov=True, update_scale="preserve_norm",
                             use_adjusted_lr=False), dict(preserve_norm=True, scale="keller")),
    "moonlight_lr": (dict(momentum=0.95, beta2=0.9, eps=1e-10, nesterov=True, update_scale="preserve_norm",
                          use_adjusted_lr=True), dict(b2=0.9, preserve_norm=True, scale="moonlight")),
    "paper": (dict(momentum=0.9, beta2=0.95, eps=1e-10, nesterov=False, update_scale="match_rms",
                   use_adjusted_lr=False), dict(beta=0.9, nesterov=False)),
    "ours": (dict(momentum=0.95, beta2=0.95, eps=1e-10, nesterov=True, update_scale="match_rms",
                  use_adjusted_lr=False), dict()),
    "ours_large_eps": (dict(momentum=0.95, beta2=0.95, eps=1e-2, nesterov=True, update_scale="match_rms",
                            use_adjusted_lr=False), dict(eps=1e-2)),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_matches_pytorch_optimizer_normuon(monkeypatch, setting):
  theirs, ours = SETTINGS[setting]
  want = run_oracle(monkeypatch, **theirs)
  got = run_ours(P0, GRADS, ns_eps=0.0, **ours)
  moved = 0.0
  for k in range(STEPS):
    for name in SHAPES:
      np.testing.assert_allclose(got[k][name], want[k][name], rtol=0, atol=1e-12, err_msg=f"step {k + 1} {name}")
      moved = max(moved, float(np.abs(want[k][name] - P0[name]).max()))
  assert moved > 1e-2  # the weights did move


def test_eps_and_nesterov_matter_at_these_tolerances():
  """The settings above are distinguishable: eps 1e-2 vs 1e-10 and Nesterov on vs off differ by ≫ 1e-12."""
  base = run_ours(P0, GRADS, ns_eps=0.0)[-1]["w_up"]
  assert np.abs(run_ours(P0, GRADS, ns_eps=0.0, eps=1e-2)[-1]["w_up"] - base).max() > 1e-4
  assert np.abs(run_ours(P0, GRADS, ns_eps=0.0, nesterov=False)[-1]["w_up"] - base).max() > 1e-3


def test_first_step_equalizes_the_output_neurons():
  """At t = 1, v = (1−b2)·mean_fan_in(O²), so every column (output neuron) of Ô has norm √fan_in/√(1−b2) (up to
  eps; here 0): the update's column norms are equal, its row norms are not. The wrong axis fails."""
  rng = np.random.default_rng(1)
  w, g = rng.standard_normal((6, 10)), {"w": rng.standard_normal((6, 10))}
  u = w - run_ours({"w": w}, [g], weight_decay=0.0, eps=0.0)[0]["w"]
  cols, rows = np.linalg.norm(u, axis=0), np.linalg.norm(u, axis=1)
  np.testing.assert_allclose(cols, cols.mean(), rtol=1e-12)
  assert rows.std() / rows.mean() > 1e-2
  np.testing.assert_allclose(np.sqrt(np.mean(u ** 2)), 0.2 * HP["learning_rate"], rtol=1e-12)  # RMS 0.2·lr


def test_a_stack_is_separate_matrices():
  """(E, m, n) experts: each matrix has its own momentum, Newton–Schulz, per-neuron v and norms."""
  assert_stack_is_separate(run_ours)


def test_zero_gradients_stay_finite_and_leave_the_weights():
  zeros = [jax.tree.map(np.zeros_like, P0)] * 3
  out = run_ours(P0, zeros, weight_decay=0.0, adam_weight_decay=0.0)
  jax.tree.map(np.testing.assert_array_equal, out[-1], P0)


def test_complex_matrices_are_normalized_by_their_modulus():
  """Newton–Schulz unitarizes a complex matrix; v accumulates |O|² (real): the step is finite, complex, RMS 0.2·lr."""
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((4, 6)) + 1j * rng.standard_normal((4, 6)), jnp.complex64)
  tx = normuon(1e-2, weight_decay=0.0)
  updates, state = jax.jit(tx.update)(w, tx.init(w), w)
  assert updates.dtype == jnp.complex64 and bool(jnp.isfinite(updates).all())
  assert state.inner_states["muon"].inner_state[0].nu.dtype == jnp.float32
  np.testing.assert_allclose(np.sqrt(np.mean(np.abs(updates) ** 2)), 0.2 * 1e-2, rtol=1e-5)
  cols = np.linalg.norm(np.asarray(updates), axis=0)
  np.testing.assert_allclose(cols, cols.mean(), rtol=1e-5)  # per output neuron, as for real matrices


SPECS = {"w_up": P(None, "fsdp", "tensor"), "w_down": P(None, "tensor", "fsdp"), "attn_norm": P(None, "tensor")}
SHARDED_SHAPES = {"w_up": (2, 16, 32), "w_down": (2, 32, 16), "attn_norm": (2, 16)}
SHARDED_PARAMS = {k: RNG.standard_normal(sh).astype(np.float32) for k, sh in SHARDED_SHAPES.items()}


@functools.cache
def single_device_run():
  params = jax.tree.map(jnp.asarray, SHARDED_PARAMS)
  return run_steps(normuon(1e-2), params, sine_grads(params, 3))[1]


@pytest.mark.parametrize("distributed", [False, True])
def test_sharded_updates_equal_unsharded_and_keep_shardings(distributed):
  """3 steps on 8 devices (fsdp=4, tensor=2, Explicit axes) equal 1 device, with per-leaf or distributed Newton–
  Schulz; updates and state keep their shardings and dtypes (v, reduced over fan_in, keeps fan_out's axis)."""
  mesh = sharding.make_mesh("fsdp=4,tensor=2", explicit=True)
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in SHARDED_PARAMS.items()}
  with jax.set_mesh(mesh):
    u, p_sharded, state = run_steps(normuon(1e-2, distributed=distributed), params, sine_grads(params, 3))
  for k, spec in SPECS.items():
    assert u[k].sharding.spec == spec and p_sharded[k].sharding.spec == spec, k
  nu = state.inner_states["muon"].inner_state[0].nu
  assert nu["w_up"].shape == (2, 32) and nu["w_up"].sharding.spec == P(None, "tensor")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), p_sharded,
               single_device_run())
