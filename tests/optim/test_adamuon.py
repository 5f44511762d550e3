"""AdaMuon against pytorch_optimizer 4.1.0's `AdaMuon` (site-packages/pytorch_optimizer/optimizer/muon/adamuon.py),
float64, 6 steps, the whole factory (AdaMuon on hidden matrices, AdamW on the head and a bias); against a float64
NumPy reference of the paper's Algorithm 1 (arXiv 2507.11005 v3) and of the authors' code (Chongjie-Si/AdaMuon,
gpt2/models/optimizers/adamuon.py), written from their equations; then the optax contract (stacks = separate
matrices, sharded == unsharded on 8 devices with and without distributed Newton–Schulz, zero gradients,
inject_hyperparams).

The oracle and the paper differ (optim/adamuon.py): the oracle has no sign before Newton–Schulz, no Nesterov,
β1 = 0.9 ≠ β2 = 0.95, a bias-corrected V and eps 1e-10; the paper orthogonalizes sign(M) and uses one β, the
authors' code adds Nesterov. Our defaults are the authors' code; each source is matched in its own setting, and
the oracle's "sign" setting patches its Newton–Schulz input to sign(M) (the paper's sign-stabilized direction).

Layouts: torch weights are (out, in), ours (in, out) = (fan_in, fan_out): torch gets our transposes, one matrix
per element of a stack. Newton–Schulz: the oracle's runs in bfloat16 (its `dtype` default; the authors' code
too); its module's reference is patched to dtype=float64 and ours runs with ns_eps=0 (it divides by
max(‖X‖_F, 1e-7), we by ‖X‖_F + ns_eps), so both run the same float64 iteration: measured ≤ 1.4e-15 on O(1)
weights, asserted 1e-12; the NumPy references (dividing by ‖X‖_F + 1e-7 as the authors' code does) ≤ 2.3e-16.
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
from pytorch_optimizer.optimizer.muon import adamuon as po_adamuon
from sharded_steps import assert_stack_is_separate, run_steps, sine_grads

import sharding
from optim import adamuon

RNG = np.random.default_rng(0)
# w_up: a stack of two wide (fan_in 6 < fan_out 10) matrices, w_down: tall; head and bias go to AdamW
SHAPES = {"w_up": (2, 6, 10), "w_down": (10, 6), "head": (6, 4), "bias": (10,)}
MATRICES = ("w_up", "w_down")
STEPS = 6
SCALES = (1.0, 0.3, 2.0, 0.05, 1.0, 0.5)
HP = dict(learning_rate=0.02, weight_decay=0.1, adam_learning_rate=3e-3, adam_b1=0.9, adam_b2=0.999,
          adam_weight_decay=0.05)


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


def run_oracle(monkeypatch, *, betas, eps, use_adjusted_lr, sign=False):
  ns64 = functools.partial(po_adamuon.zero_power_via_newton_schulz_5, dtype=torch.float64)
  monkeypatch.setattr(po_adamuon, "zero_power_via_newton_schulz_5",
                      (lambda g, **kw: ns64(torch.sign(g), **kw)) if sign else ns64)
  params = to_torch(P0)
  groups = [dict(params=params[:3], use_muon=True, lr=HP["learning_rate"], weight_decay=HP["weight_decay"]),
            dict(params=params[3:4], use_muon=False, lr=HP["adam_learning_rate"],
                 weight_decay=HP["adam_weight_decay"]),
            dict(params=params[4:], use_muon=False, lr=HP["adam_learning_rate"], weight_decay=0.0)]  # a bias
  opt = po_adamuon.AdaMuon(groups, betas=betas, eps=eps, use_adjusted_lr=use_adjusted_lr,
                           adamw_betas=(HP["adam_b1"], HP["adam_b2"]), foreach=False)
  out = []
  for g in GRADS:
    for p, gi in zip(params, to_torch(g)):
      p.grad = gi
    opt.step()
    out.append(from_torch(params))
  return out


NUMERIC = dict(beta=0.95, b2=0.95, eps=1e-8, ns_eps=1e-7, adam_eps=1e-8, **HP)


@functools.cache
def injected(nesterov, sign, bias_correction, scale):
  """One compiled update per structure; every numeric hyperparameter is injected state."""
  tx = optax.inject_hyperparams(adamuon, static_args=("ns_steps",))(
      nesterov=nesterov, sign=sign, bias_correction=bias_correction, scale=scale, **NUMERIC)
  return tx, jax.jit(tx.init), jax.jit(tx.update)


def run_ours(params, grads, *, nesterov=True, sign=True, bias_correction=False, scale="moonlight", **hp):
  _, init, step = injected(nesterov, sign, bias_correction, scale)
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


def assert_trajectories_equal(got, want, atol=1e-12):
  moved = 0.0
  for k in range(STEPS):
    for name in SHAPES:
      np.testing.assert_allclose(got[k][name], want[k][name], rtol=0, atol=atol, err_msg=f"step {k + 1} {name}")
      moved = max(moved, float(np.abs(want[k][name] - P0[name]).max()))
  assert moved > 1e-2  # the weights did move


# name: (oracle kwargs, our kwargs). The oracle's AdamW group shares its eps. eps 1e-2 makes the bias correction
# (≡ eps·√(1−β2^t) in place of eps, the rescale cancelling the rest) and eps's two places visible.
ORACLE = dict(nesterov=False, sign=False, bias_correction=True, beta=0.9, b2=0.95)
SETTINGS = {
    "oracle_defaults": (dict(betas=(0.9, 0.95), eps=1e-10, use_adjusted_lr=True), dict(eps=1e-10, adam_eps=1e-10)),
    "keller_lr": (dict(betas=(0.9, 0.95), eps=1e-10, use_adjusted_lr=False),
                  dict(eps=1e-10, adam_eps=1e-10, scale="keller")),
    "large_eps": (dict(betas=(0.9, 0.95), eps=1e-2, use_adjusted_lr=True), dict(eps=1e-2, adam_eps=1e-2)),
    "sign": (dict(betas=(0.95, 0.9), eps=1e-2, use_adjusted_lr=True, sign=True),
             dict(beta=0.95, b2=0.9, eps=1e-2, adam_eps=1e-2, sign=True)),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_matches_pytorch_optimizer_adamuon(monkeypatch, setting):
  theirs, ours = SETTINGS[setting]
  assert_trajectories_equal(run_ours(P0, GRADS, ns_eps=0.0, **{**ORACLE, **ours}), run_oracle(monkeypatch, **theirs))


def np_ns(x, a=3.4445, b=-4.7750, c=2.0315, steps=5, eps=1e-7):
  """Keller's quintic Newton–Schulz, float64, X/(‖X‖_F + eps) first, on the wide orientation."""
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if tall else x


def np_adamuon(code: bool, beta=0.95, eps=1e-8):
  """Per hidden matrix (each of a stack): the paper's Algorithm 1 (code=False): M ← βM + G, O = NS(sign(M)); or
  the authors' code (code=True): M ← βM + (1−β)G, O = NS(sign(βM + (1−β)G)); then V ← βV + (1−β)O⊙O,
  Ô = O/(√V + eps), W ← W − lr·(0.2·√(mn)/(‖Ô‖_F + eps)·Ô + wd·W). Head and bias: AdamW (bias not decayed)."""
  w = {k: v.copy() for k, v in P0.items()}
  m, v = ({k: np.zeros_like(x) for k, x in P0.items()} for _ in range(2))
  mats = [("w_up", 0), ("w_up", 1), ("w_down", ())]
  out = []
  for t, g in enumerate(GRADS, start=1):
    for name, i in mats:
      gi = g[name][i]
      m[name][i] = beta * m[name][i] + ((1 - beta) * gi if code else gi)
      o = np_ns(np.sign(beta * m[name][i] + (1 - beta) * gi if code else m[name][i]))
      v[name][i] = beta * v[name][i] + (1 - beta) * o * o
      o_hat = o / (np.sqrt(v[name][i]) + eps)
      step = 0.2 * np.sqrt(o.size) / (np.linalg.norm(o_hat) + eps) * o_hat
      w[name][i] = w[name][i] - HP["learning_rate"] * (step + HP["weight_decay"] * w[name][i])
    for name, wd in (("head", HP["adam_weight_decay"]), ("bias", 0.0)):
      b1, b2 = HP["adam_b1"], HP["adam_b2"]
      m[name] = b1 * m[name] + (1 - b1) * g[name]
      v[name] = b2 * v[name] + (1 - b2) * g[name] ** 2
      adam = m[name] / (1 - b1 ** t) / (np.sqrt(v[name] / (1 - b2 ** t)) + 1e-8)
      w[name] = w[name] - HP["adam_learning_rate"] * (adam + wd * w[name])
    out.append({k: x.copy() for k, x in w.items()})
  return out


@pytest.mark.parametrize("eps", [1e-8, 1e-2])
def test_defaults_are_the_authors_code(eps):
  assert_trajectories_equal(run_ours(P0, GRADS, eps=eps), np_adamuon(code=True, eps=eps))


def test_without_nesterov_it_is_the_papers_algorithm():
  """The paper's classic M ← βM + G and our EMA differ by the factor 1−β, which sign() removes."""
  assert_trajectories_equal(run_ours(P0, GRADS, nesterov=False), np_adamuon(code=False))


def test_the_settings_are_distinguishable():
  """What the tests above pin differs by ≫ 1e-12 (pairs of the settings above, one flag apart, at eps 1e-2): Nesterov,
  the sign, and the bias correction."""
  last = lambda **kw: run_ours(P0, GRADS, eps=1e-2, **kw)[-1]["w_up"]
  for a, b in ((dict(), dict(nesterov=False)),
               (dict(nesterov=False, sign=False, bias_correction=True), dict(nesterov=False, bias_correction=True)),
               (dict(nesterov=False), dict(nesterov=False, bias_correction=True))):
    assert np.abs(last(**a) - last(**b)).max() > 1e-4, (a, b)


def test_a_stack_is_separate_matrices():
  """(E, m, n) experts: each matrix has its own momentum, sign, Newton–Schulz, V and norm."""
  assert_stack_is_separate(run_ours)


def test_zero_gradients_stay_finite_and_leave_the_weights():
  zeros = [jax.tree.map(np.zeros_like, P0)] * 3
  out = run_ours(P0, zeros, weight_decay=0.0, adam_weight_decay=0.0)
  jax.tree.map(np.testing.assert_array_equal, out[-1], P0)


def test_without_sign_complex_matrices_work():
  """sign=False: V accumulates |O|², real; complex matrices train (with sign they are refused at init)."""
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((4, 6)) + 1j * rng.standard_normal((4, 6)), jnp.complex64)
  tx = adamuon(1e-2, sign=False, weight_decay=0.0)
  updates, state = jax.jit(tx.update)(w, tx.init(w), w)
  assert updates.dtype == jnp.complex64 and bool(jnp.isfinite(updates).all())
  assert state.inner_states["muon"].inner_state[0].nu.dtype == jnp.float32
  np.testing.assert_allclose(np.sqrt(np.mean(np.abs(updates) ** 2)), 0.2 * 1e-2, rtol=1e-5)  # RMS 0.2·lr


SPECS = {"w_up": P(None, "fsdp", "tensor"), "w_down": P(None, "tensor", "fsdp"), "attn_norm": P(None, "tensor")}
SHARDED_SHAPES = {"w_up": (2, 16, 32), "w_down": (2, 32, 16), "attn_norm": (2, 16)}
SHARDED_PARAMS = {k: RNG.standard_normal(sh).astype(np.float32) for k, sh in SHARDED_SHAPES.items()}


@functools.cache
def single_device_run():
  params = jax.tree.map(jnp.asarray, SHARDED_PARAMS)
  return run_steps(adamuon(1e-2), params, sine_grads(params, 3))[1]


@pytest.mark.parametrize("distributed", [False, True])
def test_sharded_updates_equal_unsharded_and_keep_shardings(distributed):
  """3 steps on 8 devices (fsdp=4, tensor=2, Explicit axes) equal 1 device, with per-leaf or distributed Newton–
  Schulz; updates and state keep the parameters' shardings and dtypes."""
  mesh = sharding.make_mesh("fsdp=4,tensor=2", explicit=True)
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in SHARDED_PARAMS.items()}
  with jax.set_mesh(mesh):
    u, p_sharded, state = run_steps(adamuon(1e-2, distributed=distributed), params, sine_grads(params, 3))
  for k, spec in SPECS.items():
    assert u[k].sharding.spec == spec and p_sharded[k].sharding.spec == spec, k
  nu = state.inner_states["muon"].inner_state[0].nu
  assert nu["w_up"].sharding.spec == SPECS["w_up"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), p_sharded,
               single_device_run())
