"""Cautious AdamW / Lion / Muon: against pytorch_optimizer's `cautious=True` where its formula is ours, and against
float64 NumPy references written from the C-Optim equations (shared/reference/optimizers.md §6), 6 steps.

Where pytorch_optimizer (3.x) coincides, and where it does not:
- Its rule (BaseOptimizer.apply_cautious): c = (u·g > 0), u ← u·c·N/(Σc + 1) over the WHOLE tensor: our
  normalize="count" (C-Optim's first form) on 1-D and 2-D leaves; a stacked leaf is one tensor there and one
  tensor per matrix here, so stacks are checked against NumPy only. Our default normalize="mean" (c/max(mean c,
  1e-3), C-Optim's single-tensor c_adamw.py) differs from it by the factor (Σc + 1)/Σc.
- Lion(cautious=True): decay p(1 − lr·wd), c = sign(lerp(m, g, 1−β1)), mask from c·g, m ← lerp(m, g, 1−β2): C-Lion.
- AdamW: it has no cautious AdamW class; MARS(mars_type="adamw", gamma=0, optimize_1d=True) is one (with γ = 0 its
  corrected gradient is g; ‖g‖ ≤ 1 keeps its per-tensor clip off), mask from m·g (= sign of u·g), eps on the
  uncorrected √v as C-Optim's c_adamw.py, plus 1e-15 inside its square root (≲ 1e-12 on these updates).
- Muon(cautious=True) masks the ORTHOGONALIZED update with O·g (after Newton–Schulz, EMA momentum): not C-Optim's
  placement (mask on the momentum before NS), so cautious_muon is checked against NumPy only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from pytorch_optimizer import MARS, Lion

import optim

STEPS, LR, WD = 6, 0.01, 0.1
FLAT = {"w_DF": (6, 10), "embed_VD": (12, 6), "final_norm": (6,)}  # pytorch_optimizer's tensors = ours
STACK = {"w_DF": (2, 6, 10), "embed_VD": (12, 6), "final_norm": (6,)}
DECAYS = {"w_DF": True, "embed_VD": True, "final_norm": False}  # decay_mask: no decay on norms


def inputs(shapes, seed, scale=1.0):
  """Weights and STEPS gradients scale·(±U[0.5, 1.5]): |g| away from 0, ‖g‖ ≤ 1 for scale 0.02; random signs
  every step, so momentum and gradient disagree on a good share of coordinates."""
  rng = np.random.default_rng(seed)
  w0 = {k: rng.standard_normal(s) for k, s in shapes.items()}
  grads = [{k: scale * rng.choice([-1.0, 1.0], s) * rng.uniform(0.5, 1.5, s) for k, s in shapes.items()}
           for _ in range(STEPS)]
  return w0, grads


def np_cautious(u, g, normalize="mean"):
  """φ per tensor (each matrix of a stack): c = (u·g > 0), c/max(mean c, 1e-3) or c·N/(Σc + 1)."""
  c = (u * g > 0).astype(np.float64)
  axes = (-2, -1) if c.ndim >= 2 else None
  if normalize == "mean":
    return c / np.maximum(c.mean(axis=axes, keepdims=True), 1e-3)
  n = c.shape[-2] * c.shape[-1] if c.ndim >= 2 else c.size
  return c * n / (c.sum(axis=axes, keepdims=True) + 1)


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


def run(tx, w0, grads):
  """Our trajectory in float64 (inside jax.enable_x64): one jitted update, STEPS steps."""
  w = {k: jnp.asarray(v) for k, v in w0.items()}
  state, update, out = tx.init(w), jax.jit(tx.update), []
  for g in grads:
    u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, w)
    w = optax.apply_updates(w, u)
    assert all(x.dtype == jnp.float64 for x in w.values())
    out.append({k: np.asarray(v) for k, v in w.items()})
  return out


def run_torch(make, w0, grads):
  """A pytorch_optimizer class in float64 on the same gradients; the norm in a group without decay."""
  params = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in w0.items()}
  opt = make([{"params": [params["w_DF"], params["embed_VD"]]}, {"params": [params["final_norm"]],
                                                                  "weight_decay": 0.0}])
  out = []
  for g in grads:
    for k, p in params.items():
      p.grad = torch.tensor(g[k])
    opt.step()
    out.append({k: p.detach().numpy().copy() for k, p in params.items()})
  return out


def assert_trajectories(ours, want, atol):
  for t, (a, b) in enumerate(zip(ours, want, strict=True)):
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=0, atol=atol, err_msg=f"step {t + 1} {k}")


def np_lion(w0, grads, normalize, b1=0.9, b2=0.99):
  w, m, out = dict(w0), {k: 0.0 for k in w0}, []
  for g in grads:
    for k in w:
      c = np.sign(b1 * m[k] + (1 - b1) * g[k])
      w[k] = w[k] - LR * WD * w[k] * DECAYS[k] - LR * np_cautious(c, g[k], normalize) * c
      m[k] = b2 * m[k] + (1 - b2) * g[k]
    out.append(dict(w))
  return out


def test_cautious_lion_count_equals_pytorch_optimizer_lion_cautious():
  w0, grads = inputs(FLAT, 0)
  theirs = run_torch(lambda groups: Lion(groups, lr=LR, betas=(0.9, 0.99), weight_decay=WD, cautious=True), w0,
                     grads)
  with jax.enable_x64(True):
    ours = run(optim.cautious_lion(LR, normalize="count"), w0, grads)
  assert_trajectories(ours, theirs, 1e-12)
  assert_trajectories(ours, np_lion(w0, grads, "count"), 1e-12)
  lion = run_torch(lambda groups: Lion(groups, lr=LR, betas=(0.9, 0.99), weight_decay=WD), w0, grads)
  assert np.abs(theirs[-1]["w_DF"] - lion[-1]["w_DF"]).max() > 1e-4  # caution changed the trajectory (≫ atol)


def np_adamw(w0, grads, normalize, b1=0.9, b2=0.95, eps=1e-8):
  """c_adamw.py: p ← p − lr·wd·p; m, v EMAs; p ← p − lr·√(1−β2^t)/(1−β1^t)·φ⊙m/(√v + eps), φ from m·g."""
  w, m, v, out = dict(w0), {k: 0.0 for k in w0}, {k: 0.0 for k in w0}, []
  for t, g in enumerate(grads, start=1):
    for k in w:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      step = LR * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
      w[k] = w[k] - LR * WD * w[k] * DECAYS[k] - step * np_cautious(m[k], g[k], normalize) * m[k] / (
          np.sqrt(v[k]) + eps)
    out.append(dict(w))
  return out


def test_cautious_adamw_count_equals_pytorch_optimizer_and_mean_equals_numpy():
  w0, grads = inputs(FLAT, 1, scale=0.02)
  theirs = run_torch(lambda groups: MARS(groups, lr=LR, betas=(0.9, 0.95), gamma=0.0, mars_type="adamw",
                                         optimize_1d=True, weight_decay=WD, eps=1e-8, cautious=True, foreach=False),
                     w0, grads)
  stack0, stack_grads = inputs(STACK, 2)
  with jax.enable_x64(True):
    ours_count = run(optim.cautious_adamw(LR, normalize="count"), w0, grads)
    ours_mean = run(optim.cautious_adamw(LR), stack0, stack_grads)
  assert_trajectories(ours_count, theirs, 1e-11)
  assert_trajectories(ours_count, np_adamw(w0, grads, "count"), 1e-12)
  assert_trajectories(ours_mean, np_adamw(stack0, stack_grads, "mean"), 1e-12)


def test_cautious_muon_masks_the_momentum_before_newton_schulz():
  """U = G + μB (B ← μB + G); φ = Cautious(U, G) per matrix; W ← W − lr·(0.2·√max(A, B)·NS5(φ⊙U) + wd·W).
  AdamW group unmasked: equal to `optim.muon`'s."""
  w0, grads = inputs(STACK, 3)
  mu, lr = 0.95, 0.02
  w, B, want = w0["w_DF"], np.zeros(STACK["w_DF"]), []
  for g in grads:
    G = g["w_DF"]
    B = mu * B + G
    U = G + mu * B
    masked = np_cautious(U, G) * U
    w = w - lr * (0.2 * np.sqrt(10) * np.stack([np_ns(masked[i]) for i in range(2)]) + WD * w)
    want.append(w)
  with jax.enable_x64(True):
    ours = run(optim.cautious_muon(lr, beta=mu), w0, grads)
    plain = run(optim.muon(lr, beta=mu, momentum="classic"), w0, grads)
  for t in range(STEPS):
    np.testing.assert_allclose(ours[t]["w_DF"], want[t], rtol=0, atol=1e-10, err_msg=f"step {t + 1}")
    for k in ("embed_VD", "final_norm"):
      np.testing.assert_allclose(ours[t][k], plain[t][k], rtol=0, atol=1e-15, err_msg=f"step {t + 1} {k}")
  assert np.abs(ours[-1]["w_DF"] - plain[-1]["w_DF"]).max() > 1e-3  # the Muon group is masked
