"""The loss's curvature by Hessian-vector products, the loss along an update, and their overlap.

The top Hessian eigenvalues (power iteration, Lanczos), the curvature along a direction, the loss along a line, and
how much of an update lies along a given direction. `loss_fn(params) -> scalar` is the loss on one fixed held batch
(the caller closes over it), so H = ∇²loss(params) is one fixed symmetric matrix. Vectors are trees shaped (and
sharded) like the parameters; their dot products accumulate in float32 (float64 when a parameter is float64).
Everything here is pure and jit-able on any mesh: the only reductions are sums over whole leaves, which the
partitioner turns into all-reduces.

Edge of stability (Cohen et al. 2021): full-batch gradient descent at learning rate η drives λ_max(H) up to about 2/η
and holds it there; compare `top_eigenvalue` with 2/lr.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optim.trees import cast_like

PyTree = Any
LossFn = Callable[[PyTree], jax.Array]


def _acc_dtype(tree: PyTree) -> jnp.dtype:
  """float64 when a leaf of the tree is float64, else float32: the dtype dot products accumulate in."""
  wide = any(jnp.asarray(x).dtype == jnp.float64 for x in jax.tree.leaves(tree))
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _dot(a: PyTree, b: PyTree, dtype: jnp.dtype) -> jax.Array:
  """Σ over the leaves of Σ a·b, in `dtype`."""
  total = jnp.zeros((), dtype)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    total = total + jnp.sum(x.astype(dtype) * y.astype(dtype))
  return total


def _scale(tree: PyTree, c: jax.Array) -> PyTree:
  """C·tree, each leaf in its own dtype."""
  return jax.tree.map(lambda x: (x * c).astype(x.dtype), tree)


def _unit(tree: PyTree, dtype: jnp.dtype) -> PyTree:
  """The tree over its norm; the zero tree stays zero."""
  norm = jnp.sqrt(_dot(tree, tree, dtype))
  return _scale(tree, jnp.where(norm > 0, 1 / jnp.where(norm > 0, norm, 1), 0))


def _normal_like(key: jax.Array, params: PyTree) -> PyTree:
  """Standard normal entries in a tree shaped, typed and (on an Explicit mesh) sharded like `params`.

  Each leaf is drawn in its parameter's sharding (each device draws its own shard); threefry's partitionable draws
  make the values the same on any mesh.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      jax.random.normal(k, p.shape, p.dtype, out_sharding=jax.typeof(p).sharding.spec if explicit else None)
      for k, p in zip(keys, leaves)])


def _project_out(w: PyTree, basis: PyTree, dtype: jnp.dtype) -> PyTree:
  """W less its components along the rows of the stacked basis (k, ...) (classical Gram–Schmidt; zero rows add none)."""
  coef = jnp.zeros((jax.tree.leaves(basis)[0].shape[0],), dtype)
  for b, x in zip(jax.tree.leaves(basis), jax.tree.leaves(w)):
    # an elementwise product summed, not a tensordot: a contraction over sharded axes needs an out_sharding on an
    # Explicit mesh, a reduction does not (and XLA fuses the product into it)
    coef = coef + jnp.sum(b.astype(dtype) * x.astype(dtype)[None], axis=tuple(range(1, b.ndim)))
  return jax.tree.map(lambda x, b: (x.astype(dtype) - jnp.tensordot(coef, b.astype(dtype), axes=1)).astype(x.dtype),
                      w, basis)


def hvp(loss_fn: LossFn, params: PyTree, v: PyTree) -> PyTree:
  """The Hessian-vector product H·v, forward-over-reverse: the directional derivative of ∇loss along v.

  Costs about two to three gradient computations, and the memory of one with its tangents; H is never formed.

  Args:
    loss_fn: the loss as a function of the parameters alone, `loss_fn(params) -> scalar`.
    params: the point where H = ∇²loss_fn(params) is taken (any pytree of float arrays).
    v: a tree shaped like `params` (cast to the parameters' dtypes).

  Returns:
    H·v, a tree like `params` in the parameters' dtypes.

  References:
    Pearlmutter, "Fast Exact Multiplication by the Hessian", Neural Computation 6(1), 1994.
  """
  return jax.jvp(jax.grad(loss_fn), (params,), (cast_like(v, params),))[1]


def top_eigenvalue(loss_fn: LossFn, params: PyTree, *, iters: int = 20, key: jax.Array | None = None,
                   unroll: bool = False) -> tuple[jax.Array, PyTree]:
  """The Hessian's eigenvalue of largest magnitude and its eigenvector, by power iteration.

    v₀ ~ N(0, I)/‖·‖;   v_{k+1} = H·v_k / ‖H·v_k‖  (k < iters);   λ = v_itersᵀ H v_iters

  The eigenvalue is the Rayleigh quotient of the final unit vector, so it keeps its sign (a negative λ means the
  sharpest direction is one of negative curvature). The error of λ shrinks like (λ₂/λ₁)^(2·iters), with λ₂ the
  eigenvalue of second-largest magnitude; when −λ₁ is also an eigenvalue the iteration does not settle. A vector
  with H·v = 0 is kept (λ = 0). `iters + 1` Hessian-vector products.

  Args:
    loss_fn: the loss as a function of the parameters alone, `loss_fn(params) -> scalar`.
    params: the point where H = ∇²loss_fn(params) is taken.
    iters: power iterations (static; default 20).
    key: the PRNG key of the start vector (default `jax.random.key(0)`).
    unroll: unroll the iterations into straight-line code (a bigger program; no loop around the products'
      collectives, which on XLA:CPU's simulated devices deadlocked inside a train step).

  Returns:
    (λ, v): λ a scalar in float32 (float64 when a parameter is float64), v the unit eigenvector estimate, a tree
    like `params`.

  References:
    Ghorbani, Krishnan and Xiao, "An Investigation into Neural Net Optimization via Hessian Eigenvalue Density",
      ICML 2019, arXiv 1901.10159.
    Cohen et al., "Gradient Descent on Neural Networks Typically Occurs at the Edge of Stability", ICLR 2021, arXiv
      2103.00065 (λ_max against 2/lr).
  """
  key = jax.random.key(0) if key is None else key
  dtype = _acc_dtype(params)

  def step(_, carry):
    v, _, _ = carry
    hv = hvp(loss_fn, params, v)
    norm = jnp.sqrt(_dot(hv, hv, dtype))
    new = jax.tree.map(lambda a, b: jnp.where(norm > 0, a, b), _unit(hv, dtype), v)
    return new, _dot(v, hv, dtype), v

  # one more step than `iters`, whose product H·v gives the Rayleigh quotient: one Hessian-vector product in the program
  v = _unit(_normal_like(key, params), dtype)
  _, eigenvalue, v = jax.lax.fori_loop(0, iters + 1, step, (v, jnp.zeros((), dtype), v), unroll=unroll or None)
  return eigenvalue, v


def lanczos(loss_fn: LossFn, params: PyTree, *, iters: int = 16, key: jax.Array | None = None,
            unroll: bool = False) -> jax.Array:
  """The Ritz values of the Hessian after `iters` Lanczos steps with full reorthogonalization.

    v₀ ~ N(0, I)/‖·‖;   w = H·v_j;   α_j = v_jᵀw;   w ← w − Σ_{i≤j} (v_iᵀw)·v_i (twice);   β_j = ‖w‖;
    v_{j+1} = w/β_j

  The Ritz values are the eigenvalues of the tridiagonal T (diagonal α, off-diagonal β); the leading ones converge
  first to the top eigenvalues of H, and with `iters` equal to the number of parameters they are all of H's
  eigenvalues. Projecting w against the whole stored basis (not only the last two vectors) keeps the basis orthogonal
  in finite precision, so no spurious copies of converged eigenvalues appear. Breakdown — β_j at the rounding level
  of ‖T‖, β_j ≤ ε·max_{i≤j}(|α_i|, β_i) (the Krylov space is invariant, e.g. when H has fewer distinct eigenvalues
  than `iters`) — sets β_j = 0 and restarts from a fresh random vector orthogonal to the basis, so T stays block
  diagonal, its eigenvalues remain eigenvalues of H, and no division by zero can produce NaN.

  Memory: the basis is a stacked tree (iters, ...) like the parameters, in their dtypes: it holds `iters` copies of
  the parameters (run it on float32 parameters: a bfloat16 basis is orthogonal only to bfloat16's precision).
  `iters` Hessian-vector products.

  Args:
    loss_fn: the loss as a function of the parameters alone, `loss_fn(params) -> scalar`.
    params: the point where H = ∇²loss_fn(params) is taken.
    iters: Lanczos steps, the number of Ritz values (static; default 16); at most the number of parameters.
    key: the PRNG key of the start vector and of any restart (default `jax.random.key(0)`).
    unroll: unroll the iterations into straight-line code (`top_eigenvalue`'s `unroll`).

  Returns:
    The `iters` Ritz values, descending, in float32 (float64 when a parameter is float64).

  Raises:
    ValueError: when `iters` is below 1 or above the number of parameters.

  References:
    Lanczos, "An iteration method for the solution of the eigenvalue problem of linear differential and integral
      operators", J. Res. Nat. Bur. Standards 45, 1950.
    Ghorbani, Krishnan and Xiao, "An Investigation into Neural Net Optimization via Hessian Eigenvalue Density",
      ICML 2019, arXiv 1901.10159 (Lanczos on the Hessian of a network).
  """
  size = sum(x.size for x in jax.tree.leaves(params))
  if not 1 <= iters <= size:
    raise ValueError(f"lanczos needs 1 <= iters <= the number of parameters ({size}), got iters={iters}")
  key = jax.random.key(0) if key is None else key
  dtype = _acc_dtype(params)
  eps = jnp.finfo(dtype).eps
  reorthogonalized = lambda w, basis: _project_out(_project_out(w, basis, dtype), basis, dtype)

  def step(j, carry):
    basis, w, alphas, betas, broke = carry
    # v_j: the last residual over its norm, or after a breakdown (and at j = 0) a random vector orthogonal to the basis
    # (one site that draws, for the start and the restarts: each draw is a sizeable program)
    v = jax.lax.cond(broke, lambda: _unit(reorthogonalized(_normal_like(jax.random.fold_in(key, j), params), basis),
                                          dtype),
                     lambda: _scale(w, 1 / jnp.sqrt(_dot(w, w, dtype))))
    basis = jax.tree.map(lambda b, x: b.at[j].set(x), basis, v)
    w = hvp(loss_fn, params, v)
    alphas = alphas.at[j].set(_dot(v, w, dtype))
    w = reorthogonalized(w, basis)
    beta = jnp.sqrt(_dot(w, w, dtype))
    broke = beta <= eps * jnp.maximum(jnp.max(jnp.abs(alphas)), jnp.max(betas))
    return basis, w, alphas, betas.at[j].set(jnp.where(broke, 0, beta)), broke

  # (iters, ...) per leaf, sharded like the parameter along its own axes
  basis = jax.tree.map(lambda p: jnp.broadcast_to(jnp.zeros_like(p), (iters, *p.shape)), params)
  zeros = jnp.zeros((iters,), dtype)
  carry = (basis, jax.tree.map(jnp.zeros_like, params), zeros, zeros, jnp.array(True))
  _, _, alphas, betas, _ = jax.lax.fori_loop(0, iters, step, carry, unroll=unroll or None)
  off = betas[:-1]
  tridiagonal = jnp.diag(alphas) + jnp.diag(off, 1) + jnp.diag(off, -1)
  return jnp.linalg.eigvalsh(tridiagonal)[::-1]


def directional_curvature(loss_fn: LossFn, params: PyTree, u: PyTree) -> jax.Array:
  """The curvature of the loss along u, the Rayleigh quotient uᵀHu / uᵀu.

  Args:
    loss_fn: the loss as a function of the parameters alone, `loss_fn(params) -> scalar`.
    params: the point where H = ∇²loss_fn(params) is taken.
    u: a direction, a tree like `params` (e.g. the update about to be applied).

  Returns:
    uᵀHu / uᵀu, a scalar in float32 (float64 when a parameter is float64); 0 for u = 0.

  References:
    Pearlmutter, "Fast Exact Multiplication by the Hessian", Neural Computation 6(1), 1994 (the product H·u).
  """
  dtype = _acc_dtype(params)
  u = cast_like(u, params)
  uu = _dot(u, u, dtype)
  uhu = _dot(u, hvp(loss_fn, params, u), dtype)
  return jnp.where(uu > 0, uhu / jnp.where(uu > 0, uu, 1), 0)


def overlap(v: PyTree, u: PyTree) -> jax.Array:
  """The squared cosine between two trees, (vᵀu)² / (‖v‖²‖u‖²): the share of u that lies along v (and of v along u).

  With v the top Hessian eigenvector and u an update: how much of the step goes along the sharpest direction
  (Gur-Ari et al. find that the gradient lives mostly in the top eigenspace).

  Args:
    v: a tree of float arrays.
    u: a tree of v's structure and shapes.

  Returns:
    The squared cosine in [0, 1], in float32 (float64 when a leaf of v or u is float64); 0 when v or u is zero.

  References:
    Gur-Ari, Roberts and Dyer, "Gradient Descent Happens in a Tiny Subspace", 2018, arXiv 1812.04754.
  """
  dtype = _acc_dtype((v, u))
  vv, uu, vu = _dot(v, v, dtype), _dot(u, u, dtype), _dot(v, u, dtype)
  ok = (vv > 0) & (uu > 0)
  # the cosine first: (vᵀu)² alone overflows float32 long before the cosine does
  cos = vu / jnp.where(ok, jnp.sqrt(vv) * jnp.sqrt(uu), 1)
  return jnp.where(ok, cos * cos, 0)


def interpolate(loss_fn: LossFn, params: PyTree, u: PyTree, alphas: Sequence[float] | jax.Array, *,
                unroll: bool = False) -> jax.Array:
  """The loss along a direction, loss(params + α·u) for each α: a one-dimensional slice of the landscape.

  With u the update of a step, α = 1 is the step taken and α = 0 the current loss; a curve that rises before α = 1
  means the step overshoots along u. The losses are evaluated one after another (`jax.lax.map`), so the program holds
  one copy of the loss however many α there are.

  Args:
    loss_fn: the loss as a function of the parameters alone, `loss_fn(params) -> scalar`.
    params: the starting point.
    u: the direction, a tree like `params`.
    alphas: the step multiples α, a sequence of numbers (e.g. a static tuple) or a 1-D array.
    unroll: evaluate the losses in straight-line code instead of a loop (`top_eigenvalue`'s `unroll`).

  Returns:
    The losses, shape (len(alphas),), in the dtype `loss_fn` returns.

  References:
    Goodfellow, Vinyals and Saxe, "Qualitatively Characterizing Neural Network Optimization Problems", ICLR 2015,
      arXiv 1412.6544 (the loss along a line in parameter space).
  """
  u = cast_like(u, params)
  point = lambda a: jax.tree.map(lambda p, d: p + a.astype(p.dtype) * d, params, u)
  alphas = jnp.asarray(alphas, _acc_dtype(params))
  if unroll:
    return jnp.stack([loss_fn(point(alphas[i])) for i in range(alphas.shape[0])])
  return jax.lax.map(lambda a: loss_fn(point(a)), alphas)
