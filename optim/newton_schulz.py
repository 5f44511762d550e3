"""Newton–Schulz orthogonalization: the approximate polar factor U Vᵀ of X = U Σ Vᵀ, batched.

Each iteration applies an odd polynomial to the singular values, X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X,
after X is scaled to spectral norm ≤ 1 by its Frobenius norm. Shapes: (..., m, n), all leading axes
are batch (a stack of layers, of experts); tall matrices are transposed so the Gram side is m ≤ n.

Two iterations compute the same polynomial:
- `standard`: per step XXᵀ (2m²n), A·A (2m³), B·X (2m²n) FLOPs.
- `gram`: iterate on the m×m Gram matrix R = XXᵀ and accumulate Q with X_k = Q·X₀, one final
  Q·X₀ product (R₀ and the product: 4m²n; per step ≈ 8m³). It wins when n ≳ 1.5m; where it
  would cost more (near-square matrices) the standard iteration runs instead. In exact arithmetic
  both give p(σ) on every singular value; `restart` re-forms X and R every k steps, bounding the
  rounding that accumulates in Q and R (needed in bf16, rarely in fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from optim.hparams import Choices

COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # Keller Jordan's quintic (KellerJordan/Muon): steep at 0, σ → ~[0.68, 1.13] after 5 steps.
    "quintic": ((3.4445, -4.7750, 2.0315),),
    # Polar Express (Amsel et al., arXiv 2505.16932), 5 per-step rows as used in modded-nanogpt.
    "polar_express": (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    # leloykun's tuned per-step rows (optax calls this set "dion").
    "tuned5": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Convergent 2x - 1.5x³ + 0.5x⁵ (modded-nanogpt track 3 with 12 steps): σ → 1, slowly near 0.
    "cubic": ((2.0, -1.5, 0.5),),
}
# Polar Express divides by (1 + 2e-2)·‖X‖_F so rounding cannot push σ past its polynomial's range.
NORM_SAFETY = {"polar_express": 1.02}
# Newton–Schulz coefficients as the factories take them: a name in COEFFICIENTS or rows of (a, b, c). An alias, so the
# registry's annotation check (optim.registry.get_optimizer) leaves a table through as it does a name.
Coeffs = str | Sequence
METHODS = ("standard", "gram")  # the two iterations above
NSMethod = Annotated[str, Choices(METHODS)]  # a factory's `method`


def coefficient_table(coeffs: str | Sequence, steps: int) -> np.ndarray:
  """(steps, 3) rows (a, b, c): a named set or an explicit table; a short table repeats its last row.

  Args:
    coeffs: a name in `COEFFICIENTS` ("quintic", "polar_express", "tuned5", "cubic") or rows of (a, b, c).
    steps: the number of Newton–Schulz iterations (static: a Python int, not a tracer).

  Returns:
    A float64 (steps, 3) array, row k the coefficients of iteration k; rows past the table's end repeat its last row,
    rows past `steps` are dropped.

  Raises:
    ValueError: when `coeffs` names no set, is not rows of three, or `steps` < 1.
    TypeError: when `steps` is traced (under `optax.inject_hyperparams` without `static_args=('ns_steps',)`).
  """
  if isinstance(coeffs, str):
    if coeffs not in COEFFICIENTS:
      raise ValueError(f"unknown Newton-Schulz coefficients {coeffs!r}; named sets: {', '.join(COEFFICIENTS)}")
    coeffs = COEFFICIENTS[coeffs]
  rows = np.atleast_2d(np.asarray(coeffs, np.float64))
  if rows.shape[-1] != 3 or rows.ndim != 2:
    raise ValueError(f"coefficients must be rows of (a, b, c), got shape {rows.shape}")
  if isinstance(steps, jax.core.Tracer):
    raise TypeError("Newton-Schulz steps must be static: under optax.inject_hyperparams pass "
                    "static_args=('ns_steps',)")
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  return np.concatenate([rows, np.repeat(rows[-1:], max(steps - len(rows), 0), axis=0)])[:steps]


def ns_flops(m: int, n: int, steps: int, method: str = "standard") -> float:
  """Matmul FLOPs of one orthogonalization of an m×n matrix (either orientation).

  Args:
    m: one side of the matrix.
    n: the other side.
    steps: the number of iterations.
    method: "standard" or "gram" (see the module docstring); "gram" counts the cheaper of the two, as
      `orthogonalize` runs it (default "standard").

  Returns:
    The FLOPs of the iteration's matrix products (the normalization and the polynomial's sums not counted).
  """
  m, n = min(m, n), max(m, n)
  standard = steps * (4.0 * m * m * n + 2.0 * m ** 3)
  if method == "standard":
    return standard
  # R₀ and Q·X₀ (4m²n); step 0: R² and R update (6m³); middle steps: R², Z·Q, R update (8m³); last: R², Z·Q (4m³)
  gram = 4.0 * m * m * n + (6.0 + 8.0 * max(steps - 2, 0) + (4.0 if steps > 1 else 0.0)) * m ** 3
  return min(gram, standard)


def _products(dtype):
  """(matmul, round) for an iteration stored in `dtype`.

  Products and the fused sums around them (b·A + c·A², a·X + B·X, as torch's addmm) are computed in at least fp32
  with fp32 coefficients, and each stored matrix is rounded to `dtype` once. `reduce_precision` rather than a cast
  round-trip, which XLA may fold away in one place and not another (the same product then enters two terms at
  different precisions).
  """
  acc = jnp.promote_types(dtype, jnp.float32)
  fi = jnp.finfo(dtype)
  rnd = (lambda y: y) if acc == dtype else (
      lambda y: jax.lax.reduce_precision(y, exponent_bits=fi.nexp, mantissa_bits=fi.nmant))
  mm = lambda p, q: jnp.matmul(p.astype(dtype), q.astype(dtype), preferred_element_type=acc)
  return mm, rnd


def _adjoint(x):
  """Xᴴ: the conjugate transpose of each matrix (the transpose for real x, where conj is the identity).

  With it the polynomial maps a complex X = U Σ Vᴴ to U p(Σ) Vᴴ, so the iteration unitarizes complex matrices too.
  """
  return jnp.conj(jnp.swapaxes(x, -1, -2))


def _standard(x, table):
  mm, rnd = _products(x.dtype)

  def step(x, abc):
    a, b, c = abc[0], abc[1], abc[2]
    A = rnd(mm(x, _adjoint(x)))
    return rnd(a * x + mm(rnd(b * A + c * mm(A, A)), x)), None

  return jax.lax.scan(step, rnd(x.astype(table.dtype)), table)[0]


def _gram(x, table):
  """The same polynomial through the m×m side.

  With Z_k = aI + bR_k + cR_k², X_{k+1} = Z_k X_k, so Q_{k+1} = Z_k Q_k and R_{k+1} = Z_k R_k Z_k (Z_k is a
  polynomial in R_k: they commute).
  """
  mm, rnd = _products(x.dtype)
  eye = jnp.eye(x.shape[-2], dtype=table.dtype)
  poly = lambda R, abc: rnd(abc[0] * eye + abc[1] * R + abc[2] * mm(R, R))
  R = rnd(mm(x, _adjoint(x)))
  Q = poly(R, table[0])
  if len(table) > 1:
    R = rnd(mm(Q, rnd(mm(R, Q))))

    def step(carry, abc):
      Q, R = carry
      Z = poly(R, abc)
      return (rnd(mm(Z, Q)), rnd(mm(Z, rnd(mm(R, Z))))), None

    (Q, R), _ = jax.lax.scan(step, (Q, R), table[1:-1])
    Q = rnd(mm(poly(R, table[-1]), Q))
  return rnd(mm(Q, x))


def orthogonalize(x: jax.Array, *, coeffs: str | Sequence = "quintic", steps: int = 5, eps: float = 1e-7,
                  compute_dtype: jax.typing.DTypeLike | None = None, method: str = "standard",
                  restart: int | None = None) -> jax.Array:
  """Approximate U Vᵀ of every matrix in `x` (..., m, n) (U Vᴴ if complex); returns x's shape and dtype.

  X is scaled by its Frobenius norm (Polar Express: by 1.02 times it), then each step applies
  X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X (module docstring). On a mesh every device gathers whole matrices and iterates
  locally; the result comes back in x's sharding. Unknown coefficients, a traced `steps`, an unknown `method` or a
  real compute dtype for a complex x raise `ValueError` / `TypeError` from the helpers.

  Args:
    x: a matrix or a stack of them (..., m, n), real or complex.
    coeffs: "quintic", "polar_express", "tuned5", "cubic", or a (steps, 3) table of (a, b, c) (default "quintic").
    steps: iterations (static; default 5). A named set with fewer rows repeats its last row.
    eps: added to the Frobenius norm before dividing (default 1e-7 as in the torch references).
    compute_dtype: dtype of the iteration (e.g. jnp.bfloat16); default: x's dtype. A complex x needs a complex one.
    method: "standard" or "gram" (see the module docstring).
    restart: with "gram", re-form X = Q·X₀ and R every `restart` steps.

  Returns:
    The approximate polar factor of each matrix, in x's shape and dtype.

  Raises:
    ValueError: when x has fewer than two axes.

  References:
    Keller Jordan, Muon (the "quintic" coefficients; reference code KellerJordan/Muon).
    Amsel et al., "The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm",
      2025, arXiv 2505.16932 (the "polar_express" rows; as used in KellerJordan/modded-nanogpt).
  """
  if x.ndim < 2:
    raise ValueError(f"orthogonalize needs a matrix (or a stack of them), got shape {x.shape}")
  kwargs = dict(coeffs=coeffs, steps=steps, eps=eps, compute_dtype=compute_dtype, method=method, restart=restart)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _orthogonalize(x, **kwargs)
  # On a mesh (jax.set_mesh), every device gathers whole matrices once and iterates locally: left to
  # the partitioner, a split matrix puts collectives inside the loop body (an all-reduce of XXᵀ per
  # step), which costs more traffic and can deadlock XLA:CPU's simulated devices. The result comes
  # back in x's sharding (a local slice). Splitting the work over devices is a separate, swappable
  # piece (ZeRO-style distributed Muon), not this function's.
  explicit = jax.sharding.AxisType.Explicit in mesh.axis_types
  if explicit:
    spec = jax.typeof(x).sharding.spec
    out = _orthogonalize(jax.sharding.reshard(x, P()), **kwargs)
    return jax.sharding.reshard(out, spec)
  whole = lambda y: jax.lax.with_sharding_constraint(y, P())
  return whole(_orthogonalize(whole(x), **kwargs))


def _orthogonalize(x, *, coeffs, steps, eps, compute_dtype, method, restart):
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; use 'standard' or 'gram'")
  table = coefficient_table(coeffs, steps)
  safety = NORM_SAFETY.get(coeffs, 1.0) if isinstance(coeffs, str) else 1.0
  tall = x.shape[-2] > x.shape[-1]
  X = jnp.swapaxes(x, -1, -2) if tall else x
  dtype = jnp.dtype(compute_dtype or x.dtype)
  if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
    raise ValueError(f"a complex matrix needs a complex compute dtype, got {dtype}")
  acc = jnp.promote_types(X.dtype, jnp.float32)  # normalise in at least fp32, whatever the iteration's dtype
  Xa = X.astype(acc)
  norm = jnp.sqrt(jnp.sum(jnp.real(Xa * jnp.conj(Xa)), axis=(-2, -1), keepdims=True))  # |x|², also complex
  X = (Xa / (norm * safety + eps)).astype(dtype)
  m, n = X.shape[-2:]
  use_gram = method == "gram" and ns_flops(m, n, steps, "gram") < ns_flops(m, n, steps)
  table = jnp.asarray(table, jnp.promote_types(dtype, jnp.float32))
  if use_gram:
    for start in range(0, steps, restart or steps):
      X = _gram(X, table[start:start + (restart or steps)]).astype(dtype)
  else:
    X = _standard(X, table).astype(dtype)
  X = jnp.swapaxes(X, -1, -2) if tall else X
  return X.astype(x.dtype)
