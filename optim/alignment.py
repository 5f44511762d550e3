"""Momentum–gradient alignment masks (MGUP, Cautious-MGUP, Cautious) and the wrapper that applies one.

Each policy looks at the signed product s = u ⊙ g of a base optimizer's update direction u and the raw
gradient g it received, and returns a per-coordinate factor φ; the applied update is φ ⊙ u.

  MGUP (top-K):   K = ⌊τ·N⌋ coordinates with the LARGEST signed s get α, the rest γ   (Chang & Yuan, MGUP)
  Cautious-MGUP:  α where s ≥ 0, γ elsewhere                                     (MGUP repo, CMGUP_AdamW)
  Cautious:       c = (s > 0);  φ = c / max(mean(c), floor)  ("mean", the C-Optim single-tensor code)
                  or φ = c·N / (Σc + 1)                        ("count", C-Optim's first form, pytorch_optimizer)
                                                               (Liang et al., arXiv 2411.16085)

"Per tensor" means per matrix: a leaf with ndim ≥ 2 is a stack of matrices over its last two axes (leading
axes stack layers or experts, as `optim.muon` reads them), each with its own N = rows·cols, K and mean; a
leaf with ndim ≤ 1 is one tensor of N = size elements. Shape letters: B = the leading (stack) axes of a leaf,
N = the elements of one tensor.

Top-K is exact and deterministic: the selected coordinates are the first K of the ranking by s descending,
ties broken by lower flat (row-major) index within the matrix, -0.0 counted as 0.0. K may be a traced
value (τ under `optax.inject_hyperparams`): one stable sort per matrix of the float's order-preserving
integer key, then everything above the K-th key plus the ties up to the K-th position (`topk_mask`). A
Python τ gives K = int(τ·N) as in the reference code; a traced τ gives ⌊τ·N⌋ in τ's dtype (under
inject_hyperparams the parameters' dtype: pass hyperparam_dtype=jnp.float32 for bf16 parameters, else τ is
rounded to bf16 before K is taken). On a mesh the sort gathers each matrix whole, once, outside any loop.
(A counting radix select keeps the leaf sharded and needs only per-matrix all-reduces, but its unrolled
rounds compiled far slower than the sort on XLA:CPU; loops around collectives are not an option there.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from optim.hparams import Choices
from optim.trees import reject_complex

MaskFn = Callable[[jax.Array, jax.Array], jax.Array]
# A hyperparameter as the factories take it: a Python number or an (injected, traced) array; and α or γ, which may
# also be the paper's tie to τ ("1/tau", "tau"). Aliases, so the registry's annotation check
# (optim.registry.get_optimizer) leaves them to these functions' own checks.
Scalar = float | jax.Array
Factor = float | str | jax.Array
NORMALIZATIONS = ("mean", "count")
POLICIES = ("topk", "cautious")  # MGUP, Cautious-MGUP (`mgup_policy`)
Normalization = Annotated[str, Choices(NORMALIZATIONS)]  # a factory's `normalize`
Policy = Annotated[str, Choices(POLICIES)]  # a factory's `policy`


class AlignmentError(ValueError):
  """A mask policy or hyperparameter the alignment masks do not accept."""


def _axes(x) -> tuple[int, ...]:
  """The axes of one tensor: the last two (a stack of matrices) or all of them (ndim ≤ 1)."""
  return (x.ndim - 2, x.ndim - 1) if x.ndim >= 2 else tuple(range(x.ndim))


def _ordered_key(s):
  """An unsigned integer with the order of the float s (-0.0 folded into 0.0).

  Sign bit set for s ≥ 0, all bits flipped for s < 0.
  """
  s = s.astype(jnp.promote_types(s.dtype, jnp.float32))
  s = jnp.where(s == 0, jnp.zeros_like(s), s)
  bits = jnp.finfo(s.dtype).bits
  utype = jnp.uint64 if bits == 64 else jnp.uint32
  b = jax.lax.bitcast_convert_type(s, utype)
  sign = jnp.asarray(1 << (bits - 1), utype)
  return jnp.where(b >= sign, ~b, b | sign)


def topk_mask(score: jax.Array, fraction: float | jax.Array) -> jax.Array:
  """Boolean mask of the K = ⌊fraction·N⌋ largest scores of each tensor (ties: lower flat index first).

  `fraction` is a Python float (K = int(fraction·N), as the reference's `int(mask_ratio * numel)`) or a
  traced scalar. On a mesh each tensor is gathered whole for the sort and the mask comes back in the
  score's sharding (as `orthogonalize` does), so a sharded leaf selects what the unsharded one selects.

  Args:
    score: the scores; a tensor is a matrix of the last two axes (ndim ≥ 2) or the whole array (module docstring).
    fraction: τ, the fraction of each tensor's elements selected; a Python number must lie in [0, 1].

  Returns:
    A boolean array of score's shape (and sharding), True on each tensor's K selected elements.

  Raises:
    AlignmentError: when a Python `fraction` lies outside [0, 1].
  """
  if isinstance(fraction, (int, float)) and not 0.0 <= fraction <= 1.0:
    raise AlignmentError(f"the top-K fraction tau must lie in [0, 1], got {fraction}")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _topk(score, fraction)
  if jax.sharding.AxisType.Explicit in mesh.axis_types:
    spec = jax.typeof(score).sharding.spec
    return jax.sharding.reshard(_topk(jax.sharding.reshard(score, P()), fraction), spec)
  whole = lambda y: jax.lax.with_sharding_constraint(y, P())
  return whole(_topk(whole(score), fraction))


def _topk(score, fraction):
  """One stable sort per tensor by descending key; T = the K-th key, J = its flat index.

  The selection is key > T, plus the tied keys (= T) at flat indices ≤ J, which the stable sort placed before
  position K.
  """
  axes = _axes(score)
  n = math.prod(score.shape[a] for a in axes)
  if isinstance(fraction, (int, float)):
    k = jnp.asarray(int(fraction * n), jnp.int32)
  else:
    k = jnp.clip(jnp.floor(fraction * n), 0, n).astype(jnp.int32)
  key_BN = _ordered_key(score).reshape(score.shape[:score.ndim - len(axes)] + (n,))
  index_BN = jax.lax.broadcasted_iota(jnp.int32, key_BN.shape, key_BN.ndim - 1)
  descending_BN, order_BN = jax.lax.sort((~key_BN, index_BN), dimension=key_BN.ndim - 1, num_keys=1,
                                         is_stable=True)
  at_B1 = jnp.broadcast_to(jnp.clip(k - 1, 0, n - 1), key_BN.shape[:-1] + (1,))
  threshold_B1 = ~jnp.take_along_axis(descending_BN, at_B1, axis=-1)
  last_B1 = jnp.take_along_axis(order_BN, at_B1, axis=-1)
  chosen = (key_BN > threshold_B1) | ((key_BN == threshold_B1) & (index_BN <= last_B1))
  return (chosen & (k > 0)).reshape(score.shape)


def _check(u, g):
  if jnp.shape(u) != jnp.shape(g):
    raise AlignmentError(f"the update {jnp.shape(u)} and the gradient {jnp.shape(g)} must have one shape")
  return u * g


def mgup_mask(u: jax.Array, g: jax.Array, tau: float | jax.Array = 0.5, alpha: float | jax.Array = 2.0,
              gamma: float | jax.Array = 0.1) -> jax.Array:
  """MGUP's φ: α on the ⌊τ·N⌋ largest u⊙g of each tensor, γ elsewhere (dtype of u).

  u and g of different shapes, or a Python τ outside [0, 1], raise `AlignmentError` (the shape check, `topk_mask`).

  Args:
    u: the base optimizer's update direction.
    g: the raw gradient, u's shape.
    tau: τ, the boosted fraction of each tensor (default 0.5).
    alpha: α, the factor on the selected coordinates (default 2.0, the reference code's).
    gamma: γ, the factor on the others (default 0.1, the reference code's).

  Returns:
    φ, u's shape and dtype.

  References:
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025,
      arXiv 2606.17526, Eq. 3; reference code MaeChd/MGUP.
  """
  return jnp.where(topk_mask(_check(u, g), tau), alpha, gamma).astype(u.dtype)


def cautious_mgup_mask(u: jax.Array, g: jax.Array, alpha: float | jax.Array = 2.0,
                       gamma: float | jax.Array = 0.1) -> jax.Array:
  """Cautious-MGUP's φ: α where u·g ≥ 0, γ elsewhere (the reference code's ≥; its README writes >).

  Args:
    u: the base optimizer's update direction.
    g: the raw gradient, u's shape (else `AlignmentError`).
    alpha: α, the factor on the aligned coordinates (default 2.0).
    gamma: γ, the factor on the others (default 0.1).

  Returns:
    φ, u's shape and dtype.

  References:
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025,
      arXiv 2606.17526, Eq. 3; reference code MaeChd/MGUP. (`CMGUP_AdamW`)
  """
  return jnp.where(_check(u, g) >= 0, alpha, gamma).astype(u.dtype)


def cautious_mask(u: jax.Array, g: jax.Array, floor: float | jax.Array = 1e-3, normalize: str = "mean") -> jax.Array:
  """Cautious φ: c = (u·g > 0) rescaled per tensor, by 1/max(mean(c), floor) ("mean") or N/(Σc + 1) ("count").

  A tensor with no aligned coordinate gets φ = 0, never a division by zero.

  Args:
    u: the base optimizer's update direction.
    g: the raw gradient, u's shape (else `AlignmentError`).
    floor: the smallest mean(c) divided by ("mean"; default 1e-3).
    normalize: "mean" (the C-Optim single-tensor code) or "count" (C-Optim's first form, pytorch_optimizer).

  Returns:
    φ, u's shape and dtype.

  Raises:
    AlignmentError: when `normalize` is not one of `NORMALIZATIONS`.

  References:
    Liang, Chen, Liu and Liu, "Cautious Optimizers: Improving Training with One Line of Code", 2024,
      arXiv 2411.16085; reference code kyleliang919/C-Optim.
  """
  if normalize not in NORMALIZATIONS:
    raise AlignmentError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
  c = (_check(u, g) > 0).astype(jnp.promote_types(u.dtype, jnp.float32))
  axes = _axes(c)
  if normalize == "mean":
    phi = c / jnp.maximum(jnp.mean(c, axis=axes, keepdims=True), floor)
  else:
    n = math.prod(c.shape[a] for a in axes)
    phi = c * (n / (jnp.sum(c, axis=axes, keepdims=True) + 1.0))
  return phi.astype(u.dtype)


def mgup_policy(policy: str = "topk", *, tau: float | jax.Array = 0.5, alpha: float | str | jax.Array = 2.0,
                gamma: float | str | jax.Array = 0.1) -> MaskFn:
  """mask_fn(u, g) for MGUP: policy "topk" (MGUP) or "cautious" (Cautious-MGUP: α where u·g ≥ 0).

  alpha="1/tau" and gamma="tau" tie them to τ as in the paper's Eq. 3 (α = 1/τ, γ = τ; the reference code's
  defaults are α = 2, γ = 0.1); tied, they follow an injected τ.

  Args:
    policy: "topk" (MGUP) or "cautious" (Cautious-MGUP).
    tau: τ, the boosted fraction ("topk"); a Python number must lie in [0, 1], in (0, 1] with alpha="1/tau".
    alpha: α, the factor on the selected (aligned) coordinates, or "1/tau" (default 2.0).
    gamma: γ, the factor on the others, or "tau" (default 0.1).

  Returns:
    The mask function `mask_fn(u, g) -> φ` (`mgup_mask` or `cautious_mgup_mask`).

  Raises:
    AlignmentError: when a Python τ lies outside its range, `policy` is unknown, or a string α or γ is not "1/tau"
      or "tau" respectively.

  References:
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025,
      arXiv 2606.17526, Eq. 3; reference code MaeChd/MGUP.
  """
  if isinstance(tau, (int, float)) and not (0.0 < tau <= 1.0 if alpha == "1/tau" else 0.0 <= tau <= 1.0):
    raise AlignmentError(f"MGUP's tau (the boosted fraction) must lie in {'(0' if alpha == '1/tau' else '[0'}, 1], "
                         f"got {tau}")
  alpha, gamma = _tied(alpha, "1/tau", lambda: 1.0 / tau), _tied(gamma, "tau", lambda: tau)
  if policy == "topk":
    return lambda u, g: mgup_mask(u, g, tau, alpha, gamma)
  if policy == "cautious":
    return lambda u, g: cautious_mgup_mask(u, g, alpha, gamma)
  raise AlignmentError(f"unknown MGUP policy {policy!r}; use 'topk' (MGUP) or 'cautious' (Cautious-MGUP)")


def _tied(value: Factor, word: str, tie: Callable[[], Scalar]) -> Scalar:
  if isinstance(value, str):
    if value != word:
      raise AlignmentError(f"a string here must be {word!r} (the paper's choice), got {value!r}")
    return tie()
  return value


def cautious_policy(*, floor: float | jax.Array = 1e-3, normalize: str = "mean") -> MaskFn:
  """mask_fn(u, g) for Cautious (see `cautious_mask`).

  Args:
    floor: the smallest mean(c) divided by ("mean"; default 1e-3).
    normalize: "mean" or "count" (`cautious_mask`).

  Returns:
    The mask function `mask_fn(u, g) -> φ`.

  Raises:
    AlignmentError: when `normalize` is not one of `NORMALIZATIONS`.

  References:
    Liang, Chen, Liu and Liu, "Cautious Optimizers: Improving Training with One Line of Code", 2024,
      arXiv 2411.16085; reference code kyleliang919/C-Optim.
  """
  if normalize not in NORMALIZATIONS:
    raise AlignmentError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
  return lambda u, g: cautious_mask(u, g, floor, normalize)


def with_alignment_mask(inner: optax.GradientTransformation, mask_fn: MaskFn) -> optax.GradientTransformation:
  """`inner`'s update u multiplied by φ = mask_fn(u, g), per leaf, where g is the raw gradient `inner` received.

  Put it first in a chain, and decoupled weight decay after it, so decay is never masked:

    optax.chain(with_alignment_mask(base, mask_fn), optax.add_decayed_weights(wd, mask),
                optax.scale_by_learning_rate(lr))   # W ← W − lr·(φ ⊙ u + wd·W)

  The state is `inner`'s; φ has each leaf's shape and sharding.

  Args:
    inner: the base optimizer's direction (e.g. `optax.scale_by_adam()`).
    mask_fn: the policy, `mask_fn(u, g) -> φ` (`mgup_policy`, `cautious_policy`).

  Returns:
    A transformation with `inner`'s init and state whose update is φ ⊙ u; its init rejects complex parameters (it
    compares the signs of u·g).
  """
  def update(updates, state, params=None):
    u, state = inner.update(updates, state, params)
    return jax.tree.map(lambda u_, g: u_ * mask_fn(u_, g), u, updates), state

  return reject_complex(optax.GradientTransformation(inner.init, update), "an alignment mask (MGUP, Cautious)",
                        "it compares the signs of u·g")
