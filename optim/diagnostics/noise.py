"""The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018), from gradients at two batch sizes.

B_simple is about the batch size past which a larger batch stops shortening training much. G is the true (full-data)
gradient and Σ the per-example gradients' covariance. A batch of B examples gives a gradient G_B with
E‖G_B‖² = |G|² + tr(Σ)/B, so the squared norms at two batch sizes b_small < b_big give unbiased estimates of both
(`unbiased_estimates`). In a data-parallel step they come for free: each group (a device's micro-batch) has a gradient
of b_small examples, and their mean is the gradient of b_big = groups·b_small (`group_sq_norms`). One step's estimates
are noisy — the |G|² estimate can be negative — so average |G|² and S over steps before the ratio (`NoiseScaleEMA`,
`ema_update`). `noise_scale_from_samples` is the definition itself, from per-example gradients.

Everything but `noise_scale_from_samples` (host NumPy, float64) is pure and jit-able on any mesh; sums accumulate in
float32 (float64 when a leaf is float64).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _acc_dtype(tree: PyTree) -> jnp.dtype:
  """float64 when a leaf of the tree is float64, else float32: the dtype the sums accumulate in."""
  wide = any(jnp.asarray(x).dtype == jnp.float64 for x in jax.tree.leaves(tree))
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def unbiased_estimates(small_sq: jax.Array, big_sq: jax.Array, b_small: float,
                       b_big: float) -> tuple[jax.Array, jax.Array]:
  """Unbiased estimates of |G|² and S = tr(Σ) from squared gradient norms at two batch sizes.

  From E‖G_B‖² = |G|² + tr(Σ)/B at B = b_small and B = b_big:

    |G|² ≈ (b_big·big_sq − b_small·small_sq) / (b_big − b_small)
    S    ≈ (small_sq − big_sq) / (1/b_small − 1/b_big)

  With groups of b_small examples, small_sq the mean of the groups' squared norms and big_sq the squared norm of
  their mean (b_big examples), S is b_small times the unbiased (R − 1) trace of the groups' covariance, and |G|² is
  big_sq − S/b_big. Either estimate can be negative on a noisy batch.

  Args:
    small_sq: the squared gradient norm at batch size b_small (mean over groups: `group_sq_norms`).
    big_sq: the squared gradient norm at batch size b_big.
    b_small: the small batch size (examples).
    b_big: the big batch size (examples), larger than b_small.

  Returns:
    (|G|², S), each in the dtype of the inputs' arithmetic.

  Raises:
    ValueError: when b_small and b_big are Python numbers and not 0 < b_small < b_big.

  References:
    McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018, arXiv 1812.06162,
      Appendix A.1 (Eq. A.2).
  """
  if isinstance(b_small, int | float) and isinstance(b_big, int | float) and not 0 < b_small < b_big:
    raise ValueError(f"the noise scale needs 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
  g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
  s = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
  return g2, s


def group_sq_norms(group_grads: PyTree) -> tuple[jax.Array, jax.Array]:
  """The squared gradient norms at the group and at the whole-batch size, from the gradients of R groups.

    small_sq = (1/R) Σ_r ‖g_r‖²,   big_sq = ‖(1/R) Σ_r g_r‖²

  Args:
    group_grads: a tree whose leaves have a leading groups axis (R, ...): leaf r is the gradient of group r's mean
      loss (e.g. `jax.vmap(jax.grad(loss))` over the batch reshaped to (R, b, ...)).

  Returns:
    (small_sq, big_sq), scalars in float32 (float64 when a leaf is float64).

  References:
    McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018, arXiv 1812.06162,
      Appendix A.1 (gradients at two batch sizes from data-parallel workers).
  """
  dtype = _acc_dtype(group_grads)
  small = big = jnp.zeros((), dtype)
  for g in jax.tree.leaves(group_grads):
    g = g.astype(dtype)
    small = small + jnp.sum(g * g) / g.shape[0]
    mean = jnp.mean(g, axis=0)
    big = big + jnp.sum(mean * mean)
  return small, big


def b_simple(g2: jax.Array, s: jax.Array) -> jax.Array:
  """The simple noise scale B_simple = S / |G|², +inf where the |G|² estimate is not positive.

  The unbiased |G|² estimate is negative when the noise swamps the signal on a batch; the batch size that would
  resolve the gradient is then beyond measure, so the result is +inf there (never NaN, even for S = 0).

  Args:
    g2: the |G|² estimate (`unbiased_estimates`, or an average of them).
    s: the S = tr(Σ) estimate.

  Returns:
    S/|G|² where |G|² > 0, +inf elsewhere.

  References:
    McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018, arXiv 1812.06162,
      Eq. 2.8 (B_simple).
  """
  g2, s = jnp.asarray(g2), jnp.asarray(s)
  positive = g2 > 0
  return jnp.where(positive, s / jnp.where(positive, g2, 1), jnp.inf)


class NoiseScaleEMA(NamedTuple):
  """Exponential moving averages of the |G|² and S estimates (`ema_init`, `ema_update`)."""

  step: jax.Array  # int32: how many estimates were averaged
  g2: jax.Array  # the average of the |G|² estimates, not bias-corrected
  s: jax.Array  # the average of the S estimates, not bias-corrected


def ema_init(dtype: jax.typing.DTypeLike = jnp.float32) -> NoiseScaleEMA:
  """The state of `ema_update` before its first estimate: zero averages, step 0.

  Args:
    dtype: the averages' dtype (default float32).

  Returns:
    A `NoiseScaleEMA` of zeros.
  """
  return NoiseScaleEMA(jnp.zeros((), jnp.int32), jnp.zeros((), dtype), jnp.zeros((), dtype))


def ema_debiased(state: NoiseScaleEMA, decay: float) -> tuple[jax.Array, jax.Array]:
  """The bias-corrected averages of |G|² and S, each average over 1 − decay^step (as Adam corrects its moments).

  Args:
    state: the averages (`ema_update`), with step ≥ 1.
    decay: the decay the averages were taken with.

  Returns:
    (|G|², S) bias-corrected.

  References:
    Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, arXiv 1412.6980, Section 3 (the bias
      correction).
  """
  correction = 1 - jnp.asarray(decay, state.g2.dtype) ** state.step
  return state.g2 / correction, state.s / correction


def ema_update(state: NoiseScaleEMA, g2: jax.Array, s: jax.Array,
               decay: float) -> tuple[NoiseScaleEMA, jax.Array]:
  """One step's |G|² and S estimates folded into their moving averages, and B_simple from the averages.

    ḡ² ← decay·ḡ² + (1 − decay)·|G|²,   S̄ ← decay·S̄ + (1 − decay)·S,   B_simple = Ŝ / ĝ²

  with ĝ², Ŝ the bias-corrected averages (`ema_debiased`). McCandlish et al. average the numerator and the
  denominator separately, not the per-step ratio: a single step's |G|² estimate is noisy and can be near zero or
  negative. (The bias correction divides both by the same 1 − decay^step, so it does not change the ratio; it matters
  for the averages themselves.) `decay` may be traced.

  Args:
    state: the averages so far (`ema_init` at the start).
    g2: this step's |G|² estimate (`unbiased_estimates`).
    s: this step's S estimate.
    decay: the averages' decay in [0, 1) (e.g. 0.99).

  Returns:
    (the new state, B_simple of the bias-corrected averages, `b_simple`'s +inf where ĝ² ≤ 0).

  References:
    McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018, arXiv 1812.06162,
      Appendix A.1 (average |G|² and S separately).
  """
  d = jnp.asarray(decay, state.g2.dtype)
  new = NoiseScaleEMA(state.step + 1,
                      d * state.g2 + (1 - d) * jnp.asarray(g2, state.g2.dtype),
                      d * state.s + (1 - d) * jnp.asarray(s, state.s.dtype))
  return new, b_simple(*ema_debiased(new, decay))


def noise_scale_from_samples(per_sample_grads: PyTree) -> dict[str, float]:
  """The noise scale by its definition, from n per-example gradients, in float64 on the host.

    G = (1/n) Σ_i g_i,   tr(Σ) = 1/(n − 1) Σ_i ‖g_i − G‖²,   B_noise = tr(Σ) / ‖G‖²

  ‖G‖² here is the squared norm of the sample mean, which overestimates |G|² by tr(Σ)/n on average (B_simple from
  `unbiased_estimates` corrects for it: with groups of one example, 1/B_simple = 1/B_noise − 1/n). A zero mean
  divides by the smallest positive float64 instead of by zero.

  Args:
    per_sample_grads: a tree whose leaves have a leading examples axis (n, ...), n ≥ 2: leaf i is example i's
      gradient (e.g. `jax.vmap(jax.grad(loss), in_axes=(None, 0))`).

  Returns:
    {"trace": tr(Σ), "g2": ‖G‖², "noise_scale": B_noise, "samples": n}.

  Raises:
    ValueError: when the tree has no leaves, its leaves disagree on n, or n < 2.

  References:
    McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018, arXiv 1812.06162, Eq. 2.8
      (B_simple = tr(Σ)/|G|²).
  """
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(per_sample_grads)]
  sizes = {len(x) for x in leaves}
  if len(sizes) != 1 or min(sizes) < 2:
    raise ValueError(f"the noise scale needs n >= 2 per-example gradients in every leaf, got leading sizes "
                     f"{sorted(sizes)}")
  g = np.concatenate([x.reshape(len(x), -1) for x in leaves], axis=1)
  n = len(g)
  mean = g.mean(axis=0)
  trace = float(np.sum((g - mean) ** 2) / (n - 1))
  g2 = float(mean @ mean)
  return {"trace": trace, "g2": g2, "noise_scale": trace / max(g2, np.finfo(np.float64).tiny), "samples": n}
