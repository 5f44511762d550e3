"""Spectra of matrix parameters (and of grads, updates): spectral norm, singular values, orthogonality, rank.

A leaf of ndim >= 2 is a stack of matrices (..., m, n): the leading axes (layers, experts) are batch, as
`optim.muon` treats Muon's parameters, and every result keeps them. All of it is a pure function of arrays that runs
inside a jitted step on any mesh; on an Explicit mesh each matrix is first gathered whole (its leading axes keep
their sharding), as the factorizations need, and on an Auto mesh the partitioner does the same.
Computed in float32 (bfloat16 and float16 upcast), float64 inputs in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from optim.trees import path_name

PyTree = Any


def _matrices(w: jax.Array) -> jax.Array:
  """W upcast (float32, or float64 for float64), with whole matrices on each device where its type shards them."""
  if w.ndim < 2:
    raise ValueError(f"expected a stack of matrices (..., m, n), got shape {w.shape}")
  w = jnp.asarray(w, jnp.float64 if w.dtype == jnp.float64 else jnp.float32)
  sharding = jax.typeof(w).sharding
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))
    if any(a is not None for a in spec[-2:]):  # an Explicit mesh: QR, eigh and SVD need the matrix axes whole
      w = jax.sharding.reshard(w, NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], None, None)))
  return w


def _gram(w: jax.Array) -> jax.Array:
  """The smaller Gram matrix of each matrix: W Wᵀ (m×m) when m <= n, else WᵀW (n×n)."""
  if w.shape[-2] <= w.shape[-1]:
    return jnp.einsum("...ik,...jk->...ij", w, w)
  return jnp.einsum("...ki,...kj->...ij", w, w)


def _normalized(v: jax.Array) -> jax.Array:
  """The vectors v / ‖v‖ along the last axis; 0 for v = 0."""
  norm = jnp.linalg.norm(v, axis=-1, keepdims=True)
  return v / jnp.where(norm > 0, norm, 1)


def _orthonormal(y: jax.Array) -> jax.Array:
  """An orthonormal basis of each matrix's column space (..., m, l), m >= l: its left singular vectors.

  Not QR's Q, which a range finder usually takes: JAX 0.10's QR does not trace on a batch-sharded stack under an
  Explicit mesh (its triangular mask gets the wrong sharding); the SVD does, at the same O(m l²) order of cost.
  """
  return jnp.linalg.svd(y, full_matrices=False)[0]


def spectral_norm(w: jax.Array, *, iters: int = 20, key: jax.Array | None = None) -> jax.Array:
  """The top singular value σ₁ of each matrix, by power iteration on WᵀW.

  v ← WᵀW v / ‖WᵀW v‖, `iters` times, then σ₁ ≈ ‖W v‖: a lower bound on σ₁ whose error shrinks like
  (σ₂/σ₁)^(2·iters), so slowly for a spectrum with no gap at its top (`singular_values` is exact there).

  Args:
    w: a stack of matrices (..., m, n).
    iters: power iterations (static; default 20).
    key: a PRNG key for the start vector, one Gaussian vector shared by the stack; default None, a deterministic
      start (the all-ones vector perturbed by a Gaussian from PRNG key 0).

  Returns:
    σ₁ of each matrix, shape w.shape[:-2]; 0 for a zero matrix.

  References:
    Golub and Van Loan, "Matrix Computations", 4th ed., 2013, §8.2.1 (the power method); Miyato et al., "Spectral
      Normalization for Generative Adversarial Networks", ICLR 2018 (power iteration on a weight's spectral norm).
  """
  w = _matrices(w)
  n = w.shape[-1]
  if key is None:
    start = 1 + 0.5 * jax.random.normal(jax.random.PRNGKey(0), (n,), w.dtype)
  else:
    start = jax.random.normal(key, (n,), w.dtype)
  v = _normalized(jnp.ones_like(w[..., 0, :]) * start)  # (..., n), sharded like the stack's leading axes

  def step(_, v):
    return _normalized(jnp.einsum("...mn,...m->...n", w, jnp.einsum("...mn,...n->...m", w, v)))

  v = jax.lax.fori_loop(0, iters, step, v)
  return jnp.linalg.norm(jnp.einsum("...mn,...n->...m", w, v), axis=-1)


def singular_values(w: jax.Array, *, exact_max: int = 1024, rank: int = 64, oversample: int = 10,
                    power_iters: int = 2, key: jax.Array | None = None) -> jax.Array:
  """The singular values of each matrix, descending: all of them, or the top `rank` of a large matrix.

  With k = min(m, n) <= exact_max, all k: √max(eigvalsh(G), 0) of the smaller Gram matrix G. Squaring loses the
  small ones: a singular value below about σ₁·√ε (ε the dtype's epsilon, σ₁·3e-4 in float32) is rounding noise.
  Otherwise the top min(rank, k) by a randomized range finder: Y = WΩ with a Gaussian Ω of rank + oversample columns,
  `power_iters` subspace iterations re-orthonormalizing each product (by its left singular vectors), then the
  singular values of QᵀW; each is a lower bound on the true one, accurate where the spectrum decays past the rank.

  Args:
    w: a stack of matrices (..., m, n).
    exact_max: the largest k computed exactly (static; default 1024).
    rank: how many singular values the randomized method returns (static; default 64).
    oversample: extra columns of the random test matrix (static; default 10).
    power_iters: subspace iterations of the randomized method (static; default 2).
    key: the PRNG key of the random test matrix, one shared by the stack; default None, PRNG key 0.

  Returns:
    Shape w.shape[:-2] + (k,) (exact) or w.shape[:-2] + (min(rank, k),) (randomized), descending, in float32
    (float64 for float64 input).

  References:
    Halko, Martinsson and Tropp, "Finding Structure with Randomness", SIAM Review 53(2), 2011, Alg. 4.4 (randomized
      subspace iteration) and Alg. 5.1 (the direct SVD of QᵀW).
  """
  w = _matrices(w)
  m, n = w.shape[-2:]
  k = min(m, n)
  if k <= exact_max:
    eig = jnp.linalg.eigvalsh(_gram(w))
    return jnp.sqrt(jnp.maximum(eig, 0))[..., ::-1]
  cols = min(rank + oversample, k)
  omega = jax.random.normal(jax.random.PRNGKey(0) if key is None else key, (n, cols), w.dtype)
  q = _orthonormal(jnp.einsum("...mn,nl->...ml", w, omega))  # (..., m, l)
  for _ in range(power_iters):
    z = _orthonormal(jnp.einsum("...mn,...ml->...nl", w, q))  # (..., n, l)
    q = _orthonormal(jnp.einsum("...mn,...nl->...ml", w, z))
  b = jnp.einsum("...ml,...mn->...ln", q, w)  # (..., l, n)
  return jnp.linalg.svd(b, compute_uv=False)[..., :min(rank, k)]


def quantiles(sv: jax.Array, qs: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), *,
              descending: bool = False) -> jax.Array:
  """Quantiles of singular values (or any values) along the last axis, by linear interpolation.

  Values already in descending order (`singular_values`' output, `descending=True`) are read at the interpolation
  points directly, without a sort.

  Args:
    sv: values (..., k), e.g. from `singular_values`.
    qs: the quantile levels in [0, 1] (default the minimum, quartiles and maximum).
    descending: whether `sv` is sorted in descending order along its last axis (then no sort is made).

  Returns:
    Shape sv.shape[:-1] + (len(qs),).

  References:
    Hyndman and Fan, "Sample Quantiles in Statistical Packages", The American Statistician 50(4), 1996 (definition
      7, NumPy's and `jnp.quantile`'s default).
  """
  if not descending:
    return jnp.moveaxis(jnp.quantile(sv, jnp.asarray(qs, sv.dtype), axis=-1), 0, -1)
  ascending = sv[..., ::-1]
  k = sv.shape[-1]
  pos = np.asarray(qs, np.float64) * (k - 1)  # definition 7: the value at position q·(k − 1) of the sorted values
  lo = np.floor(pos).astype(int)
  hi = np.minimum(lo + 1, k - 1)
  frac = jnp.asarray(pos - lo, sv.dtype)
  return ascending[..., lo] * (1 - frac) + ascending[..., hi] * frac


def orthogonality_error(w: jax.Array) -> jax.Array:
  """How far each matrix is from a scaled semi-orthogonal one, free of its scale.

  With k = min(m, n) and Ŵ = W·√k / ‖W‖_F, G the smaller Gram matrix of Ŵ (k×k): ‖G − I_k‖_F / √k. Since
  tr G = k, this is the standard deviation of the squared singular values over their mean: 0 exactly when all k are
  equal (what Newton–Schulz aims at), at most √(k − 1) (rank one), and unchanged by the update's scale (a learning
  rate, Muon's shape scale), so it needs no knowledge of it. An update that includes decoupled weight decay carries
  lr·wd·W in it, which moves it off zero. A zero matrix gives 1.

  Args:
    w: a stack of matrices (..., m, n).

  Returns:
    The error of each matrix, shape w.shape[:-2].

  References:
    Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024 (Newton–Schulz towards U Vᵀ);
      Bernstein and Newhouse, "Old Optimizer, New Norm: An Anthology", 2024, arXiv 2409.20325 (steepest descent in
      the spectral norm: all singular values of the update equal).
  """
  w = _matrices(w)
  k = min(w.shape[-2:])
  norm = jnp.linalg.norm(w, axis=(-2, -1), keepdims=True)
  g = _gram(w * (math.sqrt(k) / jnp.where(norm > 0, norm, 1)))
  return jnp.linalg.norm(g - jnp.eye(k, dtype=w.dtype), axis=(-2, -1)) / math.sqrt(k)


def effective_rank(sv: jax.Array) -> jax.Array:
  """The effective rank exp(H(p)) of singular values, p = σ / Σσ, along the last axis.

  H(p) = −Σ pᵢ log pᵢ with 0·log 0 = 0: between 1 (one nonzero σ) and k (all equal). A zero matrix gives 0 (no NaN).
  From the top-`rank` values of `singular_values` it is the effective rank of that truncation.

  Args:
    sv: singular values (..., k), non-negative.

  Returns:
    Shape sv.shape[:-1].

  References:
    Roy and Vetterli, "The effective rank: A measure of effective dimensionality", EUSIPCO 2007.
  """
  total = jnp.sum(sv, axis=-1, keepdims=True)
  p = sv / jnp.where(total > 0, total, 1)
  plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1)), 0)
  return jnp.where(total[..., 0] > 0, jnp.exp(-jnp.sum(plogp, axis=-1)), 0)


def matrix_spectra(tree: PyTree, *, quantile_levels: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                   exact_max: int = 1024, rank: int = 64, iters: int = 20,
                   select: Callable[[str], bool] | None = None) -> dict[str, dict[str, jax.Array]]:
  """The spectra of every matrix leaf (ndim >= 2) of a tree, per matrix of its stack.

  spectral_norm: σ₁, the top value of `singular_values` (exact when min(m, n) <= exact_max; else the larger of two
  lower bounds, the randomized top value and `spectral_norm`'s power iteration). sv_quantiles and effective_rank: of
  all singular values, or of the top `rank` for a larger matrix (in float32 the values below about σ₁·3e-4 are
  rounding noise, which a low-rank matrix's effective rank counts a little). orthogonality_error: `orthogonality_error`.

  Args:
    tree: params, grads or updates: any pytree of arrays; None leaves and leaves with fewer than 2 axes are skipped.
    quantile_levels: the levels of `sv_quantiles` (default the minimum, quartiles and maximum).
    exact_max: the largest min(m, n) whose singular values are all computed (`singular_values`; default 1024).
    rank: how many singular values a larger matrix gets (`singular_values`; default 64).
    iters: power iterations for a larger matrix's spectral norm (`spectral_norm`; default 20).
    select: `select(path name) -> bool`, the leaves to include (e.g. Muon's: those `optim.muon_labels` calls
      "muon"); default None, every leaf of ndim >= 2.

  Returns:
    {path name: {"spectral_norm", "orthogonality_error", "effective_rank": shape w.shape[:-2];
    "sv_quantiles": shape w.shape[:-2] + (len(quantile_levels),)}}.

  References:
    Halko, Martinsson and Tropp 2011, Alg. 4.4 (`singular_values`); Roy and Vetterli 2007 (`effective_rank`).
  """
  out = {}
  for path, w in jax.tree_util.tree_leaves_with_path(tree):
    name = path_name(path)
    if w.ndim < 2 or (select is not None and not select(name)):
      continue
    sv = singular_values(w, exact_max=exact_max, rank=rank)
    top = sv[..., 0]
    if min(w.shape[-2:]) > exact_max:
      top = jnp.maximum(top, spectral_norm(w, iters=iters))
    out[name] = {"spectral_norm": top, "orthogonality_error": orthogonality_error(w),
                 "effective_rank": effective_rank(sv),
                 "sv_quantiles": quantiles(sv, quantile_levels, descending=True)}
  return out
