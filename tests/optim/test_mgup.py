"""MGUP-AdamW, MGUP-Lion, MGUP-Muon and Cautious-MGUP against float64 NumPy references written from the MGUP
equations (shared/reference/optimizers.md §5; MaeChd/MGUP), 6 steps, float64 on both sides; α = γ = 1 MGUP-AdamW
against pytorch_optimizer's AdamW-form update (its MARS with γ = 0), which also pins eps on the uncorrected √v."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from pytorch_optimizer import MARS

import optim

STEPS, LR, WD = 6, 0.01, 0.1
SHAPES = {"w_DF": (2, 6, 10), "embed_VD": (12, 6), "final_norm": (6,)}  # a stack, a matrix, a vector
DECAYS = {"w_DF": True, "embed_VD": True, "final_norm": False}  # decay_mask: no decay on norms


def tensors(x: np.ndarray):
  """Index tuples of a leaf's tensors: each matrix of a stack (last two axes), or the whole of a vector."""
  return list(np.ndindex(x.shape[:-2])) if x.ndim >= 2 else [()]


def np_mgup(u, g, tau, alpha, gamma):
  """φ: α on the int(τ·N) largest u·g of each tensor (stable ranking: ties by lower flat index), γ elsewhere."""
  s, phi = u * g, np.full(u.shape, float(gamma))
  for i in tensors(s):
    flat = s[i].ravel()
    top = np.zeros(flat.size, bool)
    top[np.argsort(-flat, kind="stable")[:int(tau * flat.size)]] = True
    phi[i] = np.where(top.reshape(s[i].shape), alpha, gamma)
  return phi


def np_cautious_mgup(u, g, alpha, gamma):
  return np.where(u * g >= 0, alpha, gamma)


def np_ns(x, steps=5, eps=1e-7, abc=(3.4445, -4.7750, 2.0315)):
  """Newton–Schulz quintic on one matrix, float64: X/(‖X‖_F + eps), then X ← aX + (bA + cA²)X, A = XXᵀ (wide side)."""
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + eps)
  a, b, c = abc
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if tall else x


def inputs(seed, scale=1.0, zeros=False):
  """Weights and STEPS gradients; scale·(±U[0.5, 1.5]) keeps |g| away from 0 (and ‖g‖ ≤ 1 for scale 0.02);
  `zeros` puts exact zeros in every gradient (u·g = 0: the ≥ of Cautious-MGUP)."""
  rng = np.random.default_rng(seed)
  w0 = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
  grads = []
  for _ in range(STEPS):
    g = {k: scale * rng.choice([-1.0, 1.0], s) * rng.uniform(0.5, 1.5, s) for k, s in SHAPES.items()}
    if zeros:
      for v in g.values():
        v.reshape(-1)[::5] = 0.0
    grads.append(g)
  return w0, grads


def np_adamw(w0, grads, phi_fn, b1=0.9, b2=0.95, eps=1e-8):
  """MGUP_AdamW.step: p ← p − lr·wd·p; m, v EMAs; u = m/(√v + eps); p ← p − lr·√(1−β2^t)/(1−β1^t)·φ(u, g)⊙u."""
  w, m, v, out = dict(w0), {k: 0.0 for k in w0}, {k: 0.0 for k in w0}, []
  for t, g in enumerate(grads, start=1):
    for k in w:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      u = m[k] / (np.sqrt(v[k]) + eps)
      w[k] = w[k] - LR * WD * w[k] * DECAYS[k] - LR * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * phi_fn(u, g[k]) * u
    out.append(dict(w))
  return out


def run(tx, w0, grads, state_hook=None):
  """Our trajectory in float64 (call inside jax.enable_x64): one jitted update, STEPS steps."""
  w = {k: jnp.asarray(v) for k, v in w0.items()}
  state, update, out = tx.init(w), jax.jit(tx.update), []
  for g in grads:
    if state_hook:
      state_hook(state)
    u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, w)
    w = optax.apply_updates(w, u)
    assert all(x.dtype == jnp.float64 for x in w.values())
    out.append({k: np.asarray(v) for k, v in w.items()})
  return out


def assert_trajectories(ours, want, atol):
  for t, (a, b) in enumerate(zip(ours, want, strict=True)):
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=0, atol=atol, err_msg=f"step {t + 1} {k}")


def test_mgup_adamw_topk_and_plain_form_against_numpy_and_pytorch_optimizer():
  """One injected program: (τ, α, γ) = (0.3, 2, 0.1) against the NumPy MGUP-AdamW; then α = γ = 1 (no mask)
  against NumPy and pytorch_optimizer.MARS(mars_type="adamw", gamma=0, optimize_1d=True): with γ = 0 its
  corrected gradient is g (‖g‖ ≤ 1: no clip) and its step is lr·√(1−β2^t)/(1−β1^t)·m/(√(v + 1e-15) + eps), decay
  p ← p(1 − lr·wd) — the reference AdamW form (its 1e-15 inside the root moves the update ≲ 1e-12 here). eps = 1e-3
  is comparable to √v, so eps on √v̂ (optax) instead would miss the oracle by far more than the tolerance."""
  w0, grads = inputs(0, scale=0.02)
  eps = 1e-3
  want_topk = np_adamw(w0, grads, lambda u, g: np_mgup(u, g, 0.3, 2.0, 0.1), eps=eps)
  want_plain = np_adamw(w0, grads, lambda u, g: 1.0, eps=eps)
  params = [torch.nn.Parameter(torch.tensor(w0[k])) for k in SHAPES]
  opt = MARS([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95),
             gamma=0.0, mars_type="adamw", optimize_1d=True, weight_decay=WD, eps=eps, foreach=False)
  theirs = []
  for g in grads:
    for p, k in zip(params, SHAPES):
      p.grad = torch.tensor(g[k])
    opt.step()
    theirs.append({k: p.detach().numpy().copy() for p, k in zip(params, SHAPES)})
  with jax.enable_x64(True):
    tx = optax.inject_hyperparams(optim.mgup_adamw)(learning_rate=LR, eps=eps, tau=0.3, alpha=2.0, gamma=0.1)
    ours_topk = run(tx, w0, grads)

    def no_mask(state):
      state.hyperparams["alpha"] = state.hyperparams["gamma"] = jnp.asarray(1.0, jnp.float64)
    ours_plain = run(tx, w0, grads, no_mask)
  assert_trajectories(ours_topk, want_topk, 1e-12)
  assert_trajectories(ours_plain, want_plain, 1e-12)
  assert_trajectories(theirs, want_plain, 1e-11)
  gap = max(np.abs(a[k] - b[k]).max() for a, b in zip(ours_topk, ours_plain) for k in a)
  assert gap > 1e-3  # the mask matters at this tolerance
  optax_form = np.abs(want_plain[0]["w_DF"] - np_adamw_optax_eps_first_step(w0, grads, eps)).max()
  assert optax_form > 1e-4  # eps on √v̂ would be visibly different


def np_adamw_optax_eps_first_step(w0, grads, eps, b1=0.9, b2=0.95):
  """optax.adamw's first step on w_DF: m̂/(√v̂ + eps) with bias-corrected moments."""
  g = grads[0]["w_DF"]
  mhat, vhat = g, g ** 2  # t = 1: m̂ = g, v̂ = g²
  return w0["w_DF"] - LR * WD * w0["w_DF"] - LR * mhat / (np.sqrt(vhat) + eps)


def test_cautious_mgup_adamw_against_numpy():
  """policy="cautious": α where u·g ≥ 0 (zeros included), γ elsewhere; no sort."""
  w0, grads = inputs(1, zeros=True)
  want = np_adamw(w0, grads, lambda u, g: np_cautious_mgup(u, g, 1.5, 0.25))
  with jax.enable_x64(True):
    ours = run(optim.mgup_adamw(LR, policy="cautious", alpha=1.5, gamma=0.25), w0, grads)
  assert_trajectories(ours, want, 1e-12)


def test_mgup_lion_against_numpy():
  """MGUP_Lion: p ← p − lr·wd·p; c = sign(β1·m + (1−β1)·g); p ← p − lr·φ(c, g)⊙c; m ← β2·m + (1−β2)·g."""
  w0, grads = inputs(2)
  b1, b2, lr = 0.9, 0.99, 1e-3
  w, m, want = dict(w0), {k: 0.0 for k in w0}, []
  for g in grads:
    for k in w:
      c = np.sign(b1 * m[k] + (1 - b1) * g[k])
      w[k] = w[k] - lr * WD * w[k] * DECAYS[k] - lr * np_mgup(c, g[k], 0.5, 2.0, 0.1) * c
      m[k] = b2 * m[k] + (1 - b2) * g[k]
    want.append(dict(w))
  with jax.enable_x64(True):
    ours = run(optim.mgup_lion(lr), w0, grads)  # defaults: τ = 0.5, α = 2, γ = 0.1, betas (0.9, 0.99), wd 0.1
  assert_trajectories(ours, want, 1e-12)


def test_mgup_muon_against_numpy_and_adamw_group_unmasked():
  """MGUP_Muon on the stack (each matrix alone): B ← μB + G; Gn = G + μB; φ = MGUP(Gn, G); O = NS5(Gn);
  W ← W − lr·(0.2·√max(A, B)·φ⊙O + wd·W). The embedding and the norm go to AdamW with no mask: equal to
  `optim.muon`'s AdamW group (classic momentum there too) on the same gradients."""
  w0, grads = inputs(3)
  mu, lr = 0.95, 0.02
  w, B, want = w0["w_DF"], np.zeros(SHAPES["w_DF"]), []
  for g in grads:
    G = g["w_DF"]
    B = mu * B + G
    Gn = G + mu * B
    O = np.stack([np_ns(Gn[i]) for i in range(2)])
    phi = np_mgup(Gn, G, 0.5, 2.0, 0.1)
    w = w - lr * (0.2 * np.sqrt(10) * phi * O + WD * w)
    want.append(w)
  with jax.enable_x64(True):
    ours = run(optim.mgup_muon(lr, beta=mu), w0, grads)
    plain = run(optim.muon(lr, beta=mu, momentum="classic"), w0, grads)
  for t in range(STEPS):
    np.testing.assert_allclose(ours[t]["w_DF"], want[t], rtol=0, atol=1e-10, err_msg=f"step {t + 1}")
    for k in ("embed_VD", "final_norm"):
      np.testing.assert_allclose(ours[t][k], plain[t][k], rtol=0, atol=1e-15, err_msg=f"step {t + 1} {k}")
  assert np.abs(ours[-1]["w_DF"] - plain[-1]["w_DF"]).max() > 1e-3  # the Muon group is masked
