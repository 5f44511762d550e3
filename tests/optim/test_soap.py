"""SOAP against pytorch_optimizer 4.1.0's `SOAP` (site-packages/pytorch_optimizer/optimizer/soap.py), float64, 22
steps (= 2·10 + 2: at least two eigenbasis refreshes at the default frequency 10, seven at frequency 3), and the
optax contract (inject_hyperparams, sharded == unsharded, zero gradients, stable state).

Layouts: torch weights are (out, in), ours (in, out): torch gets our transposes, so its first factor is our R.
Our stack "w" (2, 6, 4) of tall matrices is two torch parameters (a stack is one SOAP per matrix: this is the
stack == separate matrices check); "wide" (4, 7) and "big" (4, 12) are wide, and "big" has a side above
max_precondition_dim = 10 (left unrotated) in the settings that set it; "attn_norm" (7,) is a vector (Adam: the
oracle's precondition_1d=False).

Two patches of the oracle (the `torch` its module sees) make an exact comparison possible:
- Its eigh is ours, `optim.soap._eigenbasis`: L₁ = (1−β_s)·G₁G₁ᵀ has rank ≤ min(m, n), so a tall or wide matrix's
  larger factor has a multiple eigenvalue 0, whose eigenvectors eigh picks by rounding (another LAPACK, or the same
  one on L₁'s other last bits, picks others), and the step-2 update (≈ the sign of the rotated gradient) depends on
  the pick; the power-iteration refreshes start from it, so it persists. Measured with torch's own eigh: parameters
  9e-3 to 4e-2 apart over these settings' 22 steps. `_eigenbasis` is eigh where the eigenvectors are defined (equal
  to torch's up to signs: `test_eigenbasis_...`) and a canonical, continuous basis of the null space. Parameters
  are compared: they do not depend on eigenvector signs (each cancels between projection and back-projection).
- Its QR input is cast to float32 (by design, for bf16); that cast is float64 here, so that only the algorithm is
  compared. Ours runs QR in the factors' dtype.
Then the trajectories agree to ≤ 3.6e-15 over 22 steps (measured, all settings; the parameters move by 0.04 to
0.4); the tolerance 1e-12 is the MARS tests'.

Weight decay: the oracle decays after its step, (W − lr·U)(1 − lr·λ) = W − lr'·(U + λ'·W) with lr' = lr·(1 − lr·λ),
λ' = λ/(1 − lr·λ): exactly `soap(lr', weight_decay=λ')` (optax's order), which is what is compared. The norm scale
is not decayed here (`decay_mask`): the oracle gets it in a second group, weight_decay 0 and lr'. Both skip the
whole of step 1 (no update, no decay).
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from pytorch_optimizer.optimizer import soap as po_soap
from sharded_steps import assert_no_hang_patterns, compile_update, lapack_calls, sharded_and_single

import models
import optim
from optim import SoapError, soap, soap_labels
from optim.registry import STATIC_ARGS
from optim.soap import _eigenbasis, _power_step

RNG = np.random.default_rng(0)
SHAPES = {"w": (2, 6, 4), "wide": (4, 7), "attn_norm": (7,), "big": (4, 12)}
STEPS = 22


def tree():
  return {k: RNG.standard_normal(s) for k, s in SHAPES.items()}


P0 = tree()
GRADS = [tree() for _ in range(STEPS)]

# oracle keyword -> value; ours take the same names (betas split, lr and decay reparametrized: module docstring)
DEFAULTS = dict(lr=3e-3, b1=0.95, b2=0.95, shampoo_beta=None, weight_decay=1e-2, precondition_frequency=10,
                max_precondition_dim=10000, correct_bias=True, normalize_gradient=False, eps=1e-8)
SETTINGS = {
    # the oracle's defaults, which are the official README's recommendation (nikhilvyas/SOAP: lr 3e-3, betas
    # (0.95, 0.95), weight decay 0.01, frequency 10; shampoo_beta = b2)
    "defaults": {},
    # a small frequency (7 refreshes), the factors' own decay β_s ≠ β2, "big"'s 12-side left unrotated
    "frequent": dict(lr=1e-2, b1=0.9, b2=0.99, shampoo_beta=0.8, eps=1e-6, weight_decay=0.1, precondition_frequency=3,
                     max_precondition_dim=10),
    # the official soap.py's class defaults today (betas (0.9, 0.95), shampoo_beta 0.95, frequency 2), in the
    # oracle's algorithm (that file has since changed its bias correction and eps: optim/soap.py's docstring)
    "official_class": dict(b1=0.9, b2=0.95, shampoo_beta=0.95, precondition_frequency=2, max_precondition_dim=10),
    # the oracle's two switches
    "plain": dict(lr=1e-2, correct_bias=False, normalize_gradient=True, precondition_frequency=3,
                  max_precondition_dim=10),
}
NUMERIC = ("b1", "b2", "shampoo_beta", "eps", "precondition_frequency")


def to_torch(t):
  arrays = [t["w"][0].T, t["w"][1].T, t["wide"].T, t["big"].T, t["attn_norm"]]
  return [torch.tensor(np.ascontiguousarray(a)) for a in arrays]


def from_torch(ts):
  a = [x.detach().numpy().copy() for x in ts]
  return {"w": np.stack([a[0].T, a[1].T]), "wide": a[2].T, "big": a[3].T, "attn_norm": a[4]}


def _our_eigh(m):
  """`torch.linalg.eigh` for the oracle: `_eigenbasis` (decreasing order) reversed; the oracle reverses it back and
  ignores the eigenvalues. m already holds the oracle's 1e-30·I, which `_eigenbasis` adds again (a no-op here)."""
  with jax.enable_x64(True):
    q = np.asarray(_jit_eigenbasis(jnp.asarray(m.numpy())))[..., ::-1]
  return None, torch.tensor(np.ascontiguousarray(q))


_jit_eigenbasis = jax.jit(_eigenbasis)


# `torch` as the oracle module sees it: its float32 QR cast is float64, its eigh is ours (module docstring)
ORACLE_TORCH = types.SimpleNamespace(**{**vars(torch), "float32": torch.float64,
                                        "linalg": types.SimpleNamespace(**{**vars(torch.linalg), "eigh": _our_eigh})})


def run_oracle(monkeypatch, hp, grads=GRADS):
  monkeypatch.setattr(po_soap, "torch", ORACLE_TORCH)
  params = to_torch(P0)
  lr, wd = hp["lr"], hp["weight_decay"]
  groups = [{"params": params[:-1]}, {"params": params[-1:], "lr": lr * (1 - lr * wd), "weight_decay": 0.0}]
  opt = po_soap.SOAP(groups, lr=lr, betas=(hp["b1"], hp["b2"]),
                     **{k: v for k, v in hp.items() if k not in ("lr", "b1", "b2")})
  out = []
  for g in grads:
    for p, gi in zip(params, to_torch(g)):
      p.grad = gi
    opt.step()
    out.append(from_torch(params))
  monkeypatch.undo()
  return out


@functools.cache
def injected(max_precondition_dim, shampoo_beta_is_none, correct_bias, normalize_gradient):
  """optax.inject_hyperparams(soap): one compiled step per structure; lr, decay, betas, eps and frequency are state."""
  tx = optax.inject_hyperparams(soap, static_args=("max_precondition_dim",))(
      learning_rate=0.0, weight_decay=0.0, b1=0.5, b2=0.5, eps=0.0, precondition_frequency=1,
      shampoo_beta=None if shampoo_beta_is_none else 0.5, max_precondition_dim=max_precondition_dim,
      correct_bias=correct_bias, normalize_gradient=normalize_gradient)
  return tx, jax.jit(tx.update)


def run_ours(hp, grads=GRADS):
  tx, step = injected(hp["max_precondition_dim"], hp["shampoo_beta"] is None, hp["correct_bias"],
                      hp["normalize_gradient"])
  lr, wd = hp["lr"], hp["weight_decay"]
  values = {k: hp[k] for k in NUMERIC if hp[k] is not None}
  values.update(learning_rate=lr * (1 - lr * wd), weight_decay=wd / (1 - lr * wd))  # the oracle's decay order
  with jax.enable_x64(True):
    params = jax.tree.map(jnp.asarray, P0)
    state = tx.init(params)
    for k, v in values.items():
      state.hyperparams[k] = jnp.asarray(v, state.hyperparams[k].dtype)
    kinds = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    out = []
    for g in grads:
      updates, state = step(jax.tree.map(jnp.asarray, g), state, params)
      params = optax.apply_updates(params, updates)
      assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == kinds
      out.append(jax.tree.map(np.asarray, params))
  return out, state


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_matches_pytorch_optimizer_soap(monkeypatch, setting):
  hp = {**DEFAULTS, **SETTINGS[setting]}
  want = run_oracle(monkeypatch, hp)
  got, state = run_ours(hp)
  for k in range(STEPS):
    for name in SHAPES:
      np.testing.assert_allclose(got[k][name], want[k][name], rtol=0, atol=1e-12, err_msg=f"step {k + 1} {name}")
  for name in SHAPES:  # step 1 changes nothing (not even decay); the weights then move
    np.testing.assert_array_equal(got[0][name], P0[name])
    assert float(np.abs(got[-1][name] - P0[name]).max()) > 1e-3, name
  soap_state = state.inner_state[0]  # "big" (4, 12): 12 > max_precondition_dim → no 12×12 factor
  big = [soap_state.factor_l["big"].shape, soap_state.factor_r["big"].shape]
  assert big == [(4, 4), (0,) if hp["max_precondition_dim"] < 12 else (12, 12)]


def test_injected_frequency_and_betas_share_one_compiled_step(monkeypatch):
  """"frequent" and "official_class" (frequency 3 and 2, other betas and decay) ran through one jitted update."""
  for setting in ("frequent", "official_class"):
    run_ours({**DEFAULTS, **SETTINGS[setting]}, GRADS[:4])
  assert injected(10, False, True, False)[1]._cache_size() == 1
  assert "max_precondition_dim" in STATIC_ARGS


def test_finite_on_zero_gradients():
  """Zero factors: eigh of 1e-30·I, QR of a zero matrix at every refresh, 0/(0 + eps): no update, no NaN."""
  hp = {**DEFAULTS, **SETTINGS["frequent"], "weight_decay": 0.0}
  got, state = run_ours(hp, [jax.tree.map(np.zeros_like, P0)] * 8)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got[-1], P0)
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state))


def test_eigenbasis_is_eigh_where_defined_and_continuous_where_not():
  """Full rank (6×6 from G 6×9): torch's eigh, decreasing, up to column signs (measured ≤ 6e-15). Rank 3 (8×8 from
  G 8×3): the first 3 columns are still eigh's, and when G moves by 1e-12 the basis moves by ≤ 8e-12 (measured,
  first order: bound 1e-10), where torch's eigh swaps the null space's columns for others (0.9 to 1.07 apart).
  Exact zero rows (an embedding's unseen tokens) get eᵢ, which a refresh keeps."""
  def apart(a, b):  # largest entry difference, each column's sign matched
    return float(np.abs(a - b * np.sign(np.einsum("...ij,...ij->...j", a, b))[..., None, :]).max())

  with jax.enable_x64(True):
    for m, n in ((6, 9), (8, 3)):
      g = RNG.standard_normal((2, m, n))
      moved = g + 1e-12 * RNG.standard_normal(g.shape)
      gram = lambda x: x @ np.swapaxes(x, -1, -2)
      ours, ours_moved = (np.asarray(_jit_eigenbasis(jnp.asarray(gram(x)))) for x in (g, moved))
      theirs, theirs_moved = (torch.linalg.eigh(torch.tensor(gram(x)))[1].numpy()[..., ::-1] for x in (g, moved))
      r = min(m, n)
      assert apart(ours[..., :r], theirs[..., :r]) < 1e-12
      np.testing.assert_allclose(np.swapaxes(ours, -1, -2) @ ours, np.broadcast_to(np.eye(m), (2, m, m)), atol=1e-14)
      assert apart(ours, ours_moved) < 1e-10
      if r < m:
        assert apart(theirs, theirs_moved) > 0.1  # what the canonical null basis is for
    np.testing.assert_array_equal(np.abs(np.asarray(_jit_eigenbasis(jnp.zeros((3, 3))))), np.eye(3)[::-1])
    g = RNG.standard_normal((2, 8, 6))
    g[:, 5:] = 0.0  # rows that saw no gradient
    q = _jit_eigenbasis(jnp.asarray(gram(g)))
    q, _ = jax.jit(_power_step, static_argnums=3)(jnp.asarray(gram(g) + gram(RNG.standard_normal((2, 8, 6)) *
                                                                          (np.arange(8) < 5)[:, None])), q, q, -2)
    np.testing.assert_allclose(np.abs(np.asarray(q)[:, 5:]), np.broadcast_to(np.eye(8)[5:], (2, 3, 8)), atol=1e-12)


def test_labels_and_state_shapes():
  model = nnx.eval_shape(lambda: models.Transformer(models.preset("tiny", tie_embeddings=False), rngs=nnx.Rngs(0)))
  labels = soap_labels(nnx.to_pure_dict(nnx.state(model)))
  assert labels["embed_VD"] == labels["head_DV"] == labels["blocks"]["w_up_DF"] == "soap"
  assert labels["final_norm"] == labels["blocks"]["attn_norm"] == "adam"
  params = {"embed": jnp.zeros((50, 8)), "experts": jnp.zeros((4, 8, 6)), "attn_norm": jnp.zeros((3, 8))}
  state = optim.scale_by_soap(max_precondition_dim=32).init(params)
  for tree in (state.factor_l, state.basis_l):
    assert jax.tree.map(jnp.shape, tree) == {"embed": (0,), "experts": (4, 8, 8), "attn_norm": (0,)}
  for tree in (state.factor_r, state.basis_r):
    assert jax.tree.map(jnp.shape, tree) == {"embed": (8, 8), "experts": (4, 6, 6), "attn_norm": (0,)}


def test_bad_settings_raise_one_clear_error():
  with pytest.raises(SoapError, match="max_precondition_dim"):
    soap(1e-3, max_precondition_dim=0)
  with pytest.raises(SoapError, match="precondition_frequency"):
    soap(1e-3, precondition_frequency=0)
  with pytest.raises(SoapError, match="shampoo_beta"):
    soap(1e-3, shampoo_beta=1.5)
  with pytest.raises(optim.UnknownOptimizerError, match="b2"):
    optim.get_optimizer("soap", 1e-3, b2=1.5)


SPECS = {"w": P(None, "fsdp", "tensor"), "attn_norm": P(None, "tensor")}
SHARDED_SHAPES = {"w": (2, 16, 32), "attn_norm": (2, 16)}


def test_sharded_updates_equal_unsharded_and_keep_shardings():
  """5 steps (frequency 2: eigh, then two QR refreshes) on 8 devices (fsdp=4, tensor=2, Explicit axes) equal
  1 device (measured: identical; every device computes whole rotations); updates and moments keep the parameters'
  shardings and dtypes, factors and bases stay replicated."""
  tx = soap(1e-2, precondition_frequency=2)
  params = {k: jnp.asarray(RNG.standard_normal(sh), jnp.float32) for k, sh in SHARDED_SHAPES.items()}
  (u, p_sharded, state), p_ref = sharded_and_single(tx, params, SPECS, steps=5)
  soap_state = state[0]
  for k, spec in SPECS.items():
    assert u[k].sharding.spec == spec and p_sharded[k].sharding.spec == spec, k
    assert soap_state.mu[k].sharding.spec == soap_state.nu[k].sharding.spec == spec, k
  factors = (soap_state.factor_l, soap_state.factor_r, soap_state.basis_l, soap_state.basis_r)
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(factors))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6),
               p_sharded, p_ref)


def test_no_batched_lapack_call_or_collective_in_a_loop():
  """The train CLI hung at its first step with SOAP on data=2,fsdp=2,tensor=2 (tiny preset): the batched eigh of a
  layer stack's factors blocked every thread of XLA:CPU's pool (optim/linalg.py). Compiled only, on the CLI's kind of
  mesh (Auto axes), stacks split over fsdp: each eigh and QR (both branches of the step) takes one matrix, and no
  collective sits in a loop."""
  params = {"w_up": jnp.ones((2, 16, 8)), "w_down": jnp.ones((3, 8, 16)), "attn_norm": jnp.ones((2, 8))}
  specs = {"w_up": P(None, "fsdp", None), "w_down": P(None, None, "fsdp"), "attn_norm": P(None, None)}
  compiled = compile_update(soap(1e-2), params, specs)
  assert {kernel for kernel, _ in lapack_calls(compiled)} >= {"lapack_ssyevd_ffi", "lapack_sgeqrf_ffi"}
  assert_no_hang_patterns(compiled)
