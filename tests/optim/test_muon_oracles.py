"""Muon against installed oracles: torch.optim.Muon (bf16 Newton–Schulz, two shape rules), optax.contrib.muon
(bias-corrected Nesterov: the difference is pinned), pytorch_optimizer's Gram Newton–Schulz; and the
iteration's accuracy against the float64 polar factor and singular values.

Layouts: torch weights are (out, in), ours (in, out) = fan_in × fan_out, so torch's W is compared with our Wᵀ
(Newton–Schulz is transpose-equivariant, and both shape rules read fan_out/fan_in). Shapes: O is an
orthogonalized update, U the Newton–Schulz input (Nesterov momentum), m̂ optax's bias-corrected input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from optax import contrib as optax_contrib
from pytorch_optimizer.optimizer.utils import matrix as po_matrix
from pytorch_optimizer.optimizer.utils import zero_power_via_gram_newton_schulz
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz  # its bf16 NS, for the repro

import optim
from optim import COEFFICIENTS, orthogonalize, scale_by_muon

QUINTIC = COEFFICIENTS["quintic"][0]  # (3.4445, -4.7750, 2.0315): torch.optim.Muon's default, optax's 'standard'
BETA, LR, WD, STEPS = 0.95, 0.02, 0.1, 6

# Newton–Schulz accuracy, as ‖O − O_exact‖_F / ‖O_exact‖_F against the exact float64 iteration on the same input
# (a sum over all entries: steadier than one entry's error). bf16: torch.optim.Muon's own bf16 iteration measured
# 1.25–1.51% on Gaussian (64, 160) and (160, 64) matrices, 1.33–1.57% on the momenta of the trajectories below;
# bf16's unit roundoff is 2⁻⁸ ≈ 0.4% per rounding. 2% bounds the oracle's own error — asserted on every step of
# the trajectories, so the bound stays tied to the oracle. fp32: measured ≤ 1.3e-6 max |entry| (entries ≲ 0.45):
# roundoff 6e-8 times the iteration's gain (≤ 3.4 per step near σ = 0); 5e-6 leaves 4× for other inputs.
BF16_REL = 0.02
FP32_NS = 5e-6

ortho = jax.jit(orthogonalize, static_argnames=("coeffs", "steps", "eps", "compute_dtype", "method", "restart"))


def _ns_fp64(u: np.ndarray, rows=(QUINTIC,), steps: int = 5, eps: float = 1e-7) -> np.ndarray:
  """The Newton–Schulz iteration from its equations, float64, wide orientation, one matrix."""
  tall = u.shape[0] > u.shape[1]
  x = u.T if tall else u
  x = x / (np.linalg.norm(x) + eps)
  for i in range(steps):
    a, b, c = rows[min(i, len(rows) - 1)]
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


def _spectral(x: np.ndarray, fn) -> np.ndarray:
  """U·diag(fn(σ))·Vᵀ of every matrix in x (..., m, n), float64, as f(XXᵀ)·X with f(λ) = fn(√λ)/√λ from the
  eigendecomposition of the small Gram side (an SVD in this process is ~100× slower: torch's OpenMP threads and
  OpenBLAS's contend)."""
  tall = x.shape[-2] > x.shape[-1]
  xw = np.swapaxes(x, -1, -2) if tall else x
  lam, q = np.linalg.eigh(xw @ np.swapaxes(xw, -1, -2))
  s = np.sqrt(lam)  # Gaussian inputs: full rank, well conditioned
  out = (q * (fn(s) / s)[..., None, :]) @ np.swapaxes(q, -1, -2) @ xw
  return np.swapaxes(out, -1, -2) if tall else out


def _polar(x: np.ndarray) -> np.ndarray:
  """U Vᵀ of X = U Σ Vᵀ."""
  return _spectral(x, np.ones_like)


def _predicted(x: np.ndarray, rows, steps: int, eps: float = 0.0) -> np.ndarray:
  """U p(Σ/(‖X‖_F + eps)) Vᵀ: the polynomial iteration applied to each normalised singular value (batched)."""
  norm = np.linalg.norm(x, axis=(-2, -1))[..., None] + eps

  def p(s):
    s = s / norm
    for i in range(steps):
      a, b, c = rows[min(i, len(rows) - 1)]
      s = a * s + b * s ** 3 + c * s ** 5
    return s

  return _spectral(x, p)


def test_reference_spectral_functions_agree_with_the_svd():
  """The float64 references below (polar factor, predicted output) against numpy's SVD, wide and tall, batched."""
  x = np.random.default_rng(7).standard_normal((2, 24, 40))
  u, sv, vt = np.linalg.svd(x, full_matrices=False)
  np.testing.assert_allclose(_polar(x), u @ vt, atol=1e-13, rtol=0)
  np.testing.assert_allclose(np.swapaxes(_polar(np.swapaxes(x, -1, -2)), -1, -2), u @ vt, atol=1e-13, rtol=0)
  s = sv / np.linalg.norm(x, axis=(-2, -1))[..., None]
  for _ in range(5):
    s = QUINTIC[0] * s + QUINTIC[1] * s ** 3 + QUINTIC[2] * s ** 5
  np.testing.assert_allclose(_predicted(x, [QUINTIC], 5), (u * s[..., None, :]) @ vt, atol=1e-13, rtol=0)


# --- 1. torch.optim.Muon --------------------------------------------------------------------------------

TORCH_SHAPES = ((64, 160), (160, 64))  # torch layout (out, in): a wide and a tall weight


def _torch_factor(adjust_lr_fn, out_dim: int, in_dim: int) -> float:
  """torch's _adjust_lr factor, from its docstring: √max(1, A/B) ("original"/None) or 0.2·√max(A, B)."""
  return max(1.0, out_dim / in_dim) ** 0.5 if adjust_lr_fn is None else 0.2 * max(out_dim, in_dim) ** 0.5


def _inputs():
  rng = np.random.default_rng(0)
  w0 = [rng.standard_normal(s) for s in TORCH_SHAPES]  # O(1) weights: a decay slip (lr·s·wd·W) is visible
  return w0, [[rng.standard_normal(s) for s in TORCH_SHAPES] for _ in range(STEPS)]


@functools.cache
def _torch_run(adjust_lr_fn):
  """torch.optim.Muon in float64 (NS in bf16, as always there). Per step and weight: W_torch; the gap a relative
  NS error of 1 allows, Σ_{j≤k} lr·s·‖O_exact,j‖_F (W_k = (1 − lr·wd)·W_{k−1} − lr·s·O_k on both sides with the
  same momenta, and 1 − lr·wd < 1); and torch's relative NS error, its applied O (read back from the float64 step)
  against the exact float64 iteration on the same U."""
  w0, grads = _inputs()
  params = [torch.nn.Parameter(torch.tensor(w)) for w in w0]
  opt = torch.optim.Muon(params, lr=LR, weight_decay=WD, momentum=BETA, nesterov=True, adjust_lr_fn=adjust_lr_fn)
  factors = [_torch_factor(adjust_lr_fn, *s) for s in TORCH_SHAPES]
  momenta = [np.zeros(s) for s in TORCH_SHAPES]
  weights, allowed, errors = [], np.zeros((STEPS, 2)), np.zeros((STEPS, 2))
  for k, g in enumerate(grads):
    before = [p.detach().numpy().copy() for p in params]
    for p, gi in zip(params, g):
      p.grad = torch.tensor(gi)
    opt.step()
    weights.append([p.detach().numpy().copy() for p in params])
    for i, gi in enumerate(g):
      momenta[i] = BETA * momenta[i] + (1 - BETA) * gi
      exact = _ns_fp64((1 - BETA) * gi + BETA * momenta[i])
      applied = (before[i] * (1 - LR * WD) - weights[k][i]) / (LR * factors[i])
      errors[k, i] = np.linalg.norm(applied - exact) / np.linalg.norm(exact)
      allowed[k, i] = (allowed[k - 1, i] if k else 0.0) + LR * factors[i] * np.linalg.norm(exact)
  return weights, allowed, errors


def _gaps(scale: str, adjust_lr_fn, ns_dtype):
  """‖W_ours.T − W_torch‖_F per step and weight: our chain on the same gradients, float64 weights and momenta (only
  Newton–Schulz differs from torch), weights (in, out) = torch's transpose."""
  w0, grads = _inputs()
  torch_weights, allowed, torch_errors = _torch_run(adjust_lr_fn)
  gaps = np.zeros((STEPS, 2))
  with jax.enable_x64(True):
    tx = optax.chain(scale_by_muon(BETA, momentum="ema", nesterov=True, scale=scale, ns_dtype=ns_dtype),
                     optax.add_decayed_weights(WD), optax.scale_by_learning_rate(LR))
    ours = {str(i): jnp.asarray(w.T) for i, w in enumerate(w0)}
    state, update = tx.init(ours), jax.jit(tx.update)
    for k, g in enumerate(grads):
      updates, state = update({str(i): jnp.asarray(gi.T) for i, gi in enumerate(g)}, state, ours)
      ours = optax.apply_updates(ours, updates)
      for i in range(2):
        gaps[k, i] = np.linalg.norm(np.asarray(ours[str(i)]).T - torch_weights[k][i])
  return gaps, allowed, torch_errors


RULES = pytest.mark.parametrize("scale, adjust_lr_fn", [("keller", None), ("moonlight", "match_rms_adamw")])


@RULES
def test_torch_muon_trajectories_with_fp32_newton_schulz(scale, adjust_lr_fn):
  """Ours in fp32 is the exact iteration (to ~1e-6 relative; 1e-5 allowed), so its O differs from torch's by torch's
  bf16 error. Measured: gap / allowed ≤ 1.37% (step 1), falling to 0.57% by step 6."""
  gaps, allowed, torch_errors = _gaps(scale, adjust_lr_fn, None)
  assert BF16_REL / 4 < torch_errors.max() <= BF16_REL  # the oracle's noise is what the bound assumes
  bound = allowed * (BF16_REL + 1e-5)
  assert (gaps <= bound).all(), f"gap / bound per step and weight:\n{gaps / bound}"


@RULES
def test_torch_muon_trajectories_with_bf16_newton_schulz(scale, adjust_lr_fn):
  """Two bf16 iterations, each within BF16_REL of the exact one, differ by at most 2·BF16_REL. (With bf16-rounded
  coefficients ours ran another polynomial and differed by 6.6%; fp32 coefficients fixed it.)"""
  gaps, allowed, _ = _gaps(scale, adjust_lr_fn, jnp.bfloat16)
  bound = allowed * 2 * BF16_REL
  assert (gaps <= bound).all(), f"gap / bound per step and weight:\n{gaps / bound}"


def test_bf16_newton_schulz_is_as_accurate_as_torchs():
  """One matrix: torch's bf16 error vs the exact iteration is 1.41%; ours must be as good (it was 5.89% while
  its coefficients were rounded to bf16)."""
  x = np.random.default_rng(1).standard_normal((64, 160))
  exact = _ns_fp64(x)
  rel = lambda o: np.linalg.norm(np.asarray(o, np.float64) - exact) / np.linalg.norm(exact)
  assert rel(torch_newton_schulz(torch.tensor(x), QUINTIC, 5, 1e-7).double()) <= BF16_REL
  assert rel(ortho(jnp.asarray(x, jnp.float32), compute_dtype=jnp.bfloat16)) <= BF16_REL


# --- 2. optax.contrib.muon (0.2.8) ------------------------------------------------------------------------

OPTAX_SHAPES = {"wide": (64, 160), "tall": (160, 64)}  # (fan_in, fan_out): keller factors √2.5 and 1


@functools.cache
def _optax_and_ours():
  """Per step: optax's O, ours from scale_by_muon, and our orthogonalize run on optax's m̂ computed here from its
  equations (m_t = β·m_{t−1} + (1−β)·g_t;  m̂ = β·m_t/(1−β^{t+1}) + (1−β)·g_t/(1−β^t)). optax 0.2.8 does not
  export scale_by_shape (it lives in optax.contrib._muon), so optax's O is read from its public alias with lr 1 and
  no decay: muon(1.0) = chain(scale_by_muon, scale_by_shape, add_decayed_weights(0), scale_by_learning_rate(1)),
  whose update is −(shape factor)·NS(m̂)."""
  rng = np.random.default_rng(2)
  params = {k: jnp.zeros(s, jnp.float32) for k, s in OPTAX_SHAPES.items()}
  theirs_tx = optax_contrib.muon(1.0, beta=BETA)  # eps 1e-8; every 2-D leaf routes to its Muon branch
  ours_tx = scale_by_muon(BETA, momentum="ema", nesterov=True, scale="keller", eps=1e-8)
  theirs_state, ours_state = theirs_tx.init(params), ours_tx.init(params)
  theirs_update, ours_update = jax.jit(theirs_tx.update), jax.jit(ours_tx.update)
  m = {k: np.zeros(s) for k, s in OPTAX_SHAPES.items()}
  steps = []
  for t in range(1, STEPS + 1):
    g = {k: rng.standard_normal(s).astype(np.float32) for k, s in OPTAX_SHAPES.items()}
    theirs, theirs_state = theirs_update(g, theirs_state, params)
    ours, ours_state = ours_update(g, ours_state, params)
    from_mhat = {}
    for k, (fan_in, fan_out) in OPTAX_SHAPES.items():
      m[k] = BETA * m[k] + (1 - BETA) * g[k]
      mhat = BETA * m[k] / (1 - BETA ** (t + 1)) + (1 - BETA) * g[k] / (1 - BETA ** t)
      o = ortho(jnp.asarray(mhat, jnp.float32), eps=1e-8)
      from_mhat[k] = np.asarray(o) * optim.shape_scale("keller", fan_in, fan_out)
    steps.append(({k: -np.asarray(v) for k, v in theirs.items()}, jax.tree.map(np.asarray, ours), from_mhat))
  return steps


def test_optax_muon_agrees_at_step_one_then_differs_by_its_bias_correction():
  """At t = 1 both Newton–Schulz inputs are multiples of g (ours (1−β²)·g, optax's (1 + β/(1+β))·g), so the outputs
  agree to fp32; from t = 2 optax's bias correction weights g_1 against g_t differently (t = 2: β²/(1+β) = 0.46 for
  us, 0.37 for optax) and the updates differ by 9.6% at t = 2 falling to 4.3% at t = 6 (relative Frobenius; as
  the corrections → 1, m̂ → β·m_t + (1−β)·g_t, ours): pinned > 2% for t = 2…6."""
  for t, (theirs, ours, _) in enumerate(_optax_and_ours(), start=1):
    for k in OPTAX_SHAPES:
      if t == 1:
        np.testing.assert_allclose(ours[k], theirs[k], atol=FP32_NS * 1.6, rtol=0)  # 1.6 ≥ √2.5, the shape factor
      else:
        gap = np.linalg.norm(ours[k] - theirs[k]) / np.linalg.norm(theirs[k])
        assert gap > 0.02, (t, k, gap)


def test_orthogonalize_on_optax_bias_corrected_momentum_reproduces_optax():
  """optax = our orthogonalize (eps 1e-8) of its m̂ times the keller factor, every step: the only difference is m̂."""
  for theirs, _, from_mhat in _optax_and_ours():
    for k in OPTAX_SHAPES:
      np.testing.assert_allclose(from_mhat[k], theirs[k], atol=FP32_NS * 1.6, rtol=0)


def test_muon_alias_matches_optax_at_step_one_with_weight_decay():
  """Both aliases: W ← W − lr·(s·O + wd·W), decay times the unscaled lr, keller shape factor."""
  rng = np.random.default_rng(3)
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in OPTAX_SHAPES.items()}
  grads = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in OPTAX_SHAPES.items()}
  theirs_tx = optax_contrib.muon(LR, beta=BETA, weight_decay=WD)
  ours_tx = optim.muon(LR, beta=BETA, weight_decay=WD, scale="keller", eps=1e-8)
  theirs, _ = jax.jit(theirs_tx.update)(grads, theirs_tx.init(params), params)
  ours, _ = jax.jit(ours_tx.update)(grads, ours_tx.init(params), params)
  for k in OPTAX_SHAPES:
    np.testing.assert_allclose(ours[k], theirs[k], atol=LR * FP32_NS * 1.6, rtol=0)


# --- 3. pytorch_optimizer's Gram Newton–Schulz; accuracy against the polar factor ------------------------------

def test_coefficient_names_differ_from_pytorch_optimizers():
  """Its 'original' is our 'quintic' (Keller's); its 'quintic' is our 'tuned5' (leloykun's per-step rows)."""
  theirs = po_matrix.NS_COEFFICIENTS
  np.testing.assert_array_equal(theirs["original"], COEFFICIENTS["quintic"])
  np.testing.assert_array_equal(theirs["quintic"], COEFFICIENTS["tuned5"])


GRAM_SHAPES = ((64, 256), (3, 48, 200), (256, 64))


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("coeffs", ["quintic", "tuned5"])
def test_gram_and_standard_match_pytorch_optimizer_gram_newton_schulz_fp32(shape, coeffs):
  """zero_power_via_gram_newton_schulz (what its Muon runs for ns_method="gram_newton_schulz", there in float16;
  called here with dtype=float32), 5 steps, same coefficient rows. Normalisation: it divides by
  clamp(‖X‖_F, eps), we by ‖X‖_F + eps, so eps=0 on our side. Restarts: it re-forms the Gram matrix after
  step 2 (reset_steps=(2,)), ours every `restart` steps; all are the same polynomial in exact arithmetic."""
  x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
  m, n = sorted(shape[-2:])
  assert optim.ns_flops(m, n, 5, "gram") < optim.ns_flops(m, n, 5)  # "gram" really takes the Gram path here
  rows = [tuple(r) for r in COEFFICIENTS[coeffs]]
  theirs = zero_power_via_gram_newton_schulz(torch.tensor(x), num_steps=5, weights=rows, dtype=torch.float32)
  theirs = theirs.double().numpy()
  for method, restart in (("gram", None), ("gram", 2), ("standard", None)):
    ours = np.asarray(ortho(jnp.asarray(x), coeffs=coeffs, method=method, restart=restart, eps=0.0), np.float64)
    np.testing.assert_allclose(ours, theirs, atol=FP32_NS, rtol=0, err_msg=f"{method} restart={restart}")
  np.testing.assert_allclose(theirs, _predicted(x.astype(np.float64), rows, 5), atol=FP32_NS, rtol=0)


@pytest.mark.parametrize("shape", GRAM_SHAPES)
def test_float64_gram_is_exact_but_pytorch_optimizer_normalises_in_fp32(shape):
  """In float64 ours follows the predicted singular values to 1e-15 (measured ≤ 2e-15); pytorch_optimizer's Gram
  function computes `g.float()` before normalising, so its float64 run carries fp32 input rounding (measured
  3.0e-8–1.1e-7: 6e-8 roundoff times the iteration's gain). Pinned: above 1e-9 and below 1e-6."""
  x = np.random.default_rng(5).standard_normal(shape)
  want = _predicted(x, [QUINTIC], 5)
  theirs = zero_power_via_gram_newton_schulz(torch.tensor(x), num_steps=5, weights=QUINTIC, dtype=torch.float64)
  theirs = theirs.numpy()
  with jax.enable_x64(True):
    for method in ("gram", "standard"):
      ours = np.asarray(ortho(jnp.asarray(x), method=method, eps=0.0))
      assert ours.dtype == np.float64
      np.testing.assert_allclose(ours, want, atol=1e-12, rtol=0, err_msg=method)
  assert 1e-9 < np.abs(theirs - want).max() < 1e-6


@pytest.mark.parametrize("shape", GRAM_SHAPES[:2])
def test_fp32_accuracy_against_the_polar_factor(shape):
  """cubic (2, −1.5, 0.5) × 12 converges to the polar factor U Vᵀ (σ/‖X‖_F ≥ 0.06 here: doubling, then quadratic);
  quintic × 5 against U p⁵(Σ/(‖X‖_F + 1e-7)) Vᵀ. fp32, ours standard and gram and pytorch_optimizer's Gram:
  measured ≤ 3.2e-7 (cubic; bound 1e-6) and ≤ 7.7e-7 (quintic; bound FP32_NS)."""
  x = np.random.default_rng(6).standard_normal(shape)
  polar = _polar(x)
  cubic = [tuple(r) for r in COEFFICIENTS["cubic"]]
  np.testing.assert_allclose(_predicted(x, cubic, 12), polar, atol=1e-12, rtol=0)  # 12 steps do converge
  x32 = jnp.asarray(x, jnp.float32)
  for coeffs, steps, want, atol in (("cubic", 12, polar, 1e-6), ("quintic", 5, _predicted(x, [QUINTIC], 5, 1e-7),
                                                                  FP32_NS)):
    rows = [tuple(r) for r in COEFFICIENTS[coeffs]]
    results = {method: ortho(x32, coeffs=coeffs, steps=steps, method=method) for method in ("standard", "gram")}
    results["pytorch_optimizer"] = zero_power_via_gram_newton_schulz(
        torch.tensor(x, dtype=torch.float32), num_steps=steps, weights=rows, dtype=torch.float32)
    for name, got in results.items():
      np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=0, err_msg=f"{coeffs} {name}")
