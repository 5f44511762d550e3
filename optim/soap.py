"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner.

Vyas, Morwani, Zhao, Shapira, Brandfonbrener, Janson, Kakade, "SOAP: Improving and Stabilizing Shampoo using Adam",
arXiv 2409.11321; nikhilvyas/SOAP; oracle: pytorch_optimizer 4.1.0 `SOAP`, optimizer/soap.py.

Every matrix G (m, n) keeps Shampoo's factors and their eigenbases Q_L (m, m), Q_R (n, n); step t (t = 1, 2, …):

  t = 1:  L = (1−β_s)·G Gᵀ,  R = (1−β_s)·Gᵀ G,  Q_L, Q_R = their eigenvectors (eigh), by decreasing eigenvalue;
          no update (U = 0; the moments stay 0), so that no gradient is ever projected on a basis made from itself.
  t ≥ 2:  G' = Q_Lᵀ G Q_R;  m ← β1·m + (1−β1)·G;  v ← β2·v + (1−β2)·G'²
          U = c_t · Q_L (Q_Lᵀ m Q_R / (√v + eps)) Q_Rᵀ,   c_t = √(1−β2^(t−1)) / (1−β1^(t−1))   (Adam counts from t = 2)
          L ← β_s·L + (1−β_s)·G Gᵀ,  R ← β_s·R + (1−β_s)·Gᵀ G          (after the update, as the oracle)
          every `precondition_frequency` steps (t−1 ≡ 0): one power-iteration step per factor, Q ← qr(L·Q[:, order])
          with `order` the columns by decreasing dᵢ = (Qᵀ L Q)ᵢᵢ, and v's rows (columns for R) reordered alike.

m is kept in the original basis (projected with the current Q at each use, i.e. rotated exactly whenever Q changes);
v lives in the eigenbasis and is only reordered with it: a rotated second moment has no elementwise form (the paper
and its code do the same). A dimension above `max_precondition_dim` is left unrotated (Q = identity, no factor).

A rank-deficient factor (the larger side of a single G, rows that never see a gradient) has a null space whose
eigenvectors eigh and QR pick from rounding noise: the oracle's steps then depend on bits that differ between devices,
batch layouts and fusions (a jitted nnx training step and the same step by hand part within two steps). Here the
first basis gives them a canonical one instead (`_eigenbasis`); a factor of full numerical rank (eigenvalues above
32·ε·λ_max) gets exactly the oracle's eigenvectors. A refresh of a factor still rank-deficient then (a tall G with
m/n > precondition_frequency + 1) takes QR's pick for those columns, as the oracle; exact zero rows (an embedding's
unseen tokens) keep their canonical eᵢ through it.

Leaves: matrices and stacks of them (ndim ≥ 2, leading axes = layers or experts: one SOAP per matrix) are rotated;
norm scales, biases, named vectors (`soap_labels`) and leaves with ndim ≤ 1 get the same steps with Q = identity,
i.e. Adam that skips step 1 — the oracle's `precondition_1d=False`. Embeddings and the head are matrices: rotated on
their model dimension, and on the vocabulary too when it is ≤ `max_precondition_dim` (the oracle, which sees every
parameter, does the same). On a mesh every device computes each matrix's rotation whole (factors and bases
replicated, as `optim.newton_schulz.orthogonalize`); moments and updates keep the parameters' shardings. On the CPU
a stack's eigh and QR run one matrix at a time (`optim.linalg.per_matrix`: jaxlib 0.10's batched kernels can
deadlock a step on several simulated devices).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.hparams import Beta, Count, NonNegative
from optim.linalg import per_matrix
from optim.registry import UnknownOptimizerError, decay_mask, register
from optim.trees import is_named_vector, path_name, reject_complex, replicated, resolve_labels, sharded_like

_mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
# An eigenvalue ≤ _NULL·ε·λ_max is rounding noise: the null eigenvalues of a computed G Gᵀ
# measured ≤ 2·ε·λ_max (float32 and float64, d up to 2048); a genuine eigenvalue that small has an eigenvector
# no better than noise in that dtype anyway.
_NULL = 32
_T = lambda x: jnp.swapaxes(x, -1, -2)
PyTree = Any


class SoapError(UnknownOptimizerError):
  """A SOAP setting that cannot work (a ValueError; the train CLI prints it as one line)."""


class SoapState(NamedTuple):
  """SOAP's state: the step count, the moments, and per matrix Shampoo's factors and their eigenbases."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 steps taken
  mu: optax.Updates  # first moment of the gradient, original basis, shaped (and sharded) like the params
  nu: optax.Updates  # second moment of the rotated gradient (eigenbasis), shaped (and sharded) like the params
  # Shaped like the params tree (optax.tree.map_params finds them, as Adafactor's factored moments), each leaf
  # (..., d, d) replicated, or an empty (0,) array where that side is not rotated (a vector, d > max dim)
  factor_l: optax.Params  # L = EMA(G Gᵀ)
  factor_r: optax.Params  # R = EMA(Gᵀ G)
  basis_l: optax.Params  # Q_L, the eigenbasis of L in use
  basis_r: optax.Params  # Q_R


def soap_labels(params: PyTree) -> optax.Params:
  """"soap" for matrices and stacks of them, "adam" (Q = identity) for norm scales, biases and other vectors.

  "soap": ndim ≥ 2 (hidden weights, embeddings, the head); "adam": norm scales, biases and named vectors (by name,
  however they are stacked) and leaves with ndim ≤ 1.

  Args:
    params: the parameter tree.

  Returns:
    The params' structure with "soap" or "adam" per leaf.
  """
  def label(path, p):
    name = path_name(path).lower()
    vector = "norm" in name or "bias" in name or is_named_vector(path) or jnp.ndim(p) < 2
    return "adam" if vector else "soap"
  return jax.tree_util.tree_map_with_path(label, params)


def _project(x, bases, back=False):
  """Q_Lᵀ x Q_R (back: Q_L x Q_Rᵀ) over the last two axes; a None basis is the identity."""
  ql, qr = bases
  if ql is not None:
    x = _mm(ql if back else _T(ql), x)
  if qr is not None:
    x = _mm(x, _T(qr) if back else qr)
  return x


def _eigenbasis(f):
  """Eigenvectors of the symmetric f (..., d, d) by decreasing eigenvalue, canonical on a numerical null space.

  The oracle's eigh (with its 1e-30·I), except on a numerical null space (eigenvalues ≤ 32·ε·λ_max, e.g. L = G Gᵀ of
  one tall G), whose eigenvectors eigh picks by rounding (another device layout, batch or fusion picks others, and
  SOAP's steps depend on the choice): those columns are the canonical basis of that null space, the eigenvectors of
  C·diag(d, …, 1)·C (C its projector), continuous in f. A factor of full numerical rank gets exactly eigh's columns.
  """
  d = f.shape[-1]
  eye = jnp.eye(d, dtype=f.dtype)
  w, q = per_matrix(jnp.linalg.eigh, f + 1e-30 * eye)
  w, q = w[..., ::-1], q[..., ::-1]
  kept = w > _NULL * jnp.finfo(f.dtype).eps * w[..., :1]  # a prefix of the columns
  qk = q * kept[..., None, :].astype(f.dtype)
  c = eye - _mm(qk, _T(qk))
  _, n = per_matrix(jnp.linalg.eigh, _mm(c * jnp.arange(d, 0, -1, dtype=f.dtype), c))
  shift = (jnp.arange(d) - jnp.sum(kept, axis=-1, keepdims=True)) % d  # the null space's columns after the kept
  n = jnp.take_along_axis(n[..., ::-1], shift[..., None, :], axis=-1)
  return jnp.where(kept[..., None, :], q, n)


def _power_step(f, q, v, axis: int):
  """One power-iteration step from the basis q: the columns of f·q by decreasing Rayleigh quotient qᵢᵀ f qᵢ, then QR.

  v's `axis` (the one that q rotates) is reordered alike.
  """
  fq = _mm(f, q)
  order = jnp.argsort(-jnp.sum(q * fq, axis=-2), axis=-1, stable=True)  # (..., d)
  v = jnp.take_along_axis(v, order[..., :, None] if axis == -2 else order[..., None, :], axis=axis)
  q, _ = per_matrix(jnp.linalg.qr, jnp.take_along_axis(fq, order[..., None, :], axis=-1))
  return q, v


def _norm_axes(ndim: int, matrix: bool) -> tuple[int, ...]:
  """The axes of one tensor of the oracle (a matrix of a stack, a vector of stacked vectors)."""
  return tuple(range(max(ndim - (2 if matrix else 1), 0), ndim))


def scale_by_soap(b1: float = 0.95, b2: float = 0.95, shampoo_beta: float | None = None, eps: float = 1e-8, *,
                  precondition_frequency: int = 10, max_precondition_dim: int = 10000, correct_bias: bool = True,
                  normalize_gradient: bool = False,
                  labels: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """SOAP's direction U (see the module docstring), without learning rate or weight decay.

  Args:
    b1: Adam's decay rate for m (default 0.95).
    b2: Adam's decay rate for the rotated v (default 0.95).
    shampoo_beta: decay rate of the factors L, R (None: b2, as the oracle).
    eps: added to √v (not to the bias-corrected √v̂: the effective eps is eps/√(1−β2^(t−1)), as the oracle).
    precondition_frequency: steps between eigenbasis refreshes (the first basis comes from eigh at step 1).
    max_precondition_dim: a dimension above it is not rotated (static: it fixes the state's shapes).
    correct_bias: c_t as above; False: c_t = 1.
    normalize_gradient: U ← U / (RMS(U) + eps) per matrix (per vector for the "adam" leaves) before c_t.
    labels: "soap" / "adam" per leaf, a tree or a function of the params (default `soap_labels`).

  Returns:
    A transformation whose update is U (zero at step 1), with a `SoapState`; its init rejects complex parameters.

  Raises:
    SoapError: when `max_precondition_dim` is not a positive integer, a numeric `precondition_frequency` is below 1,
      or a numeric `shampoo_beta` lies outside [0, 1].

  References:
    Vyas, Morwani, Zhao, Shapira, Brandfonbrener, Janson and Kakade, "SOAP: Improving and Stabilizing Shampoo using
      Adam", 2024, arXiv 2409.11321; reference code nikhilvyas/SOAP; oracle pytorch_optimizer 4.1.0 `SOAP`.
  """
  if not (isinstance(max_precondition_dim, numbers.Integral) and max_precondition_dim >= 1):
    raise SoapError(f"max_precondition_dim must be a positive integer (static), got {max_precondition_dim!r}")
  if isinstance(precondition_frequency, numbers.Real) and not precondition_frequency >= 1:
    raise SoapError(f"precondition_frequency must be >= 1, got {precondition_frequency!r}")
  if isinstance(shampoo_beta, numbers.Real) and not 0 <= shampoo_beta <= 1:
    raise SoapError(f"shampoo_beta must lie in [0, 1], got {shampoo_beta!r}")
  beta_s = b2 if shampoo_beta is None else shampoo_beta
  labels_fn = soap_labels if labels is None else labels

  def sides(x, kind):
    matrix = kind == "soap" and x.ndim >= 2
    return tuple(matrix and d <= max_precondition_dim for d in x.shape[-2:]) if matrix else (False, False)

  def init(params):
    def leaf(x, kind):
      acc = jnp.promote_types(x.dtype, jnp.float32)
      sides_ok = sides(x, kind)
      zeros = lambda d, ok: replicated(jnp.zeros(x.shape[:-2] + (d, d), acc)) if ok else jnp.zeros((0,), acc)
      eye = lambda d, ok: replicated(jnp.broadcast_to(jnp.eye(d, dtype=acc), x.shape[:-2] + (d, d))) if ok else \
          jnp.zeros((0,), acc)
      dims = x.shape[-2:] if x.ndim >= 2 else (0, 0)
      return (*(zeros(d, ok) for d, ok in zip(dims, sides_ok)), *(eye(d, ok) for d, ok in zip(dims, sides_ok)))

    labels = resolve_labels(labels_fn, params, ("soap", "adam"), "SOAP")
    per_leaf = jax.tree.map(leaf, params, labels)
    pick = lambda i: jax.tree.map(lambda _, t: t[i], params, per_leaf)
    return SoapState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(jnp.zeros_like, params),
                     nu=jax.tree.map(jnp.zeros_like, params), factor_l=pick(0), factor_r=pick(1), basis_l=pick(2),
                     basis_r=pick(3))

  def update(updates, state, params=None):
    del params
    grads = jax.tree.leaves(updates)
    present = lambda tree: [x if x.ndim >= 2 else None for x in jax.tree.leaves(tree)]  # None: not rotated
    factors = list(zip(present(state.factor_l), present(state.factor_r)))
    bases = list(zip(present(state.basis_l), present(state.basis_r)))
    mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
    kinds = jax.tree.leaves(resolve_labels(labels_fn, updates, ("soap", "adam"), "SOAP"))
    first = state.count == 0
    out, new_mu, new_nu, new_factors = [], [], [], []
    for g, m0, v0, fs, qs, kind in zip(grads, mus, nus, factors, bases, kinds):
      acc = jnp.promote_types(g.dtype, jnp.float32)
      # hyperparameters in the compute dtype, so that a Python float and an injected array give the same bits (a
      # factor's null-space eigenvectors follow its last bits: tests/optim/test_soap.py)
      beta1, beta2, beta_f, tiny = (jnp.asarray(h, acc) for h in (b1, b2, beta_s, eps))
      gather = replicated if any(f is not None for f in fs) else (lambda x: x)
      g32, m, v = (gather(x.astype(acc)) for x in (g, m0, v0))
      m_new = beta1 * m + (1 - beta1) * g32
      v_new = beta2 * v + (1 - beta2) * jnp.square(_project(g32, qs))
      u = _project(_project(m_new, qs) / (jnp.sqrt(v_new) + tiny), qs, back=True)
      if normalize_gradient:
        axes = _norm_axes(u.ndim, kind == "soap" and u.ndim >= 2)
        u = u / (jnp.sqrt(jnp.mean(jnp.square(u), axis=axes, keepdims=True)) + tiny)
      if correct_bias:
        t = jnp.maximum(state.count, 1).astype(acc)  # Adam's step: t − 1 (step 1 only builds the factors)
        u = u * (jnp.sqrt(1 - beta2 ** t) / (1 - beta1 ** t))
      out.append(jnp.where(first, jnp.zeros_like(u), u))
      new_mu.append(jnp.where(first, m, m_new))
      new_nu.append(jnp.where(first, v, v_new))
      fl, fr = fs
      new_factors.append((None if fl is None else beta_f * fl + (1 - beta_f) * _mm(g32, _T(g32)),
                          None if fr is None else beta_f * fr + (1 - beta_f) * _mm(_T(g32), g32)))

    def eig_all(factors, bases, nus):
      return [tuple(None if f is None else _eigenbasis(f) for f in fs) for fs in factors], nus

    def qr_all(factors, bases, nus):
      new_bases, new_nus = [], []
      for (fl, fr), (ql, qr), v in zip(factors, bases, nus):
        if fl is not None:
          ql, v = _power_step(fl, ql, v, -2)
        if fr is not None:
          qr, v = _power_step(fr, qr, v, -1)
        new_bases.append((ql, qr))
        new_nus.append(v)
      return new_bases, new_nus

    refresh = (state.count % precondition_frequency) == 0
    branch = jnp.where(first, 0, jnp.where(refresh, 1, 2))
    bases, new_nu = jax.lax.switch(branch, (eig_all, qr_all, lambda f, b, v: (b, v)), new_factors, bases, new_nu)
    cast = lambda xs, refs: [sharded_like(x.astype(r.dtype), r) for x, r in zip(xs, refs)]
    like = lambda tree, xs: jax.tree.unflatten(jax.tree.structure(tree), xs)
    side = lambda tree, pairs, i: like(tree, [old if p[i] is None else p[i]
                                              for old, p in zip(jax.tree.leaves(tree), pairs)])
    return like(updates, cast(out, grads)), SoapState(
        count=optax.safe_increment(state.count), mu=like(state.mu, cast(new_mu, mus)),
        nu=like(state.nu, cast(new_nu, nus)), factor_l=side(state.factor_l, new_factors, 0),
        factor_r=side(state.factor_r, new_factors, 1), basis_l=side(state.basis_l, bases, 0),
        basis_r=side(state.basis_r, bases, 1))

  return reject_complex(optax.GradientTransformation(init, update), "SOAP",
                        "its eigenbases are real, as the oracle's, which refuses complex parameters")


@register("soap")
def soap(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.95, b2: Beta = 0.95,
         shampoo_beta: Beta | None = None, eps: NonNegative = 1e-8, weight_decay: NonNegative = 0.01,
         precondition_frequency: Count = 10, max_precondition_dim: Count = 10000, correct_bias: bool = True,
         normalize_gradient: bool = False, mask: PyTree | Callable[[PyTree], PyTree] | None = None,
         labels: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """SOAP (Vyas et al., 2024, arXiv 2409.11321): Adam in the eigenbasis of Shampoo's factors, on every leaf.

    W ← W − lr·(U + weight_decay·W)      (U = `scale_by_soap`; W unchanged at step 1, decay included)

  Defaults are the oracle's, which are the official README's recommendation (lr 3e-3, betas (0.95, 0.95), weight
  decay 0.01, frequency 10); the official soap.py's class defaults have since moved (betas (0.9, 0.95),
  shampoo_beta 0.95, frequency 2). Differences from the oracle (pytorch_optimizer 4.1.0 `SOAP`):
  - decay: optax's W − lr·(U + λW); the oracle decays after the step, (W − lr·U)(1 − lr·λ), a difference of
    lr²·λ·U per step; and `mask` spares norms and biases where the oracle decays every parameter;
  - leaves with ndim ≥ 3 are stacks of matrices (per layer / expert), where the oracle gives a tensor one factor
    per dimension; no `merge_dims` / `data_format` (they reshape conv kernels) and no `precondition_1d`;
  - the null space of a rank-deficient factor gets a canonical basis (module docstring), not eigh's / QR's noise;
  - its QR runs in float32 whatever the parameters' dtype, its eigh in the parameters' (float64 where that fails);
    here both run in the factors' dtype: float32, or float64 for float64 parameters.
  Under `optax.inject_hyperparams` list `max_precondition_dim` in `static_args` (`optim.registry.STATIC_ARGS`);
  the betas, eps, decay, frequency and lr are injectable.

  Args:
    learning_rate: a number or an optax schedule.
    b1: as `scale_by_soap` (default 0.95).
    b2: as `scale_by_soap` (default 0.95).
    shampoo_beta: as `scale_by_soap` (None: b2).
    eps: as `scale_by_soap` (default 1e-8).
    weight_decay: decoupled, on the leaves of `mask` (default 0.01).
    precondition_frequency: as `scale_by_soap` (default 10).
    max_precondition_dim: as `scale_by_soap` (static; default 10000).
    correct_bias: as `scale_by_soap` (default True).
    normalize_gradient: as `scale_by_soap` (default False).
    mask: where weight decay applies: a bool tree or a function of the params; None: `optim.registry.decay_mask`,
      which spares norms, biases and named vectors.
    labels: as `scale_by_soap`.

  Returns:
    The chain of `scale_by_soap`, the decay (skipped at step 1, as the oracle skips step 1 entirely) and the
    learning rate.

  References:
    Vyas, Morwani, Zhao, Shapira, Brandfonbrener, Janson and Kakade, "SOAP: Improving and Stabilizing Shampoo using
      Adam", 2024, arXiv 2409.11321; reference code nikhilvyas/SOAP; oracle pytorch_optimizer 4.1.0 `SOAP`.
  """
  return optax.chain(
      scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency=precondition_frequency,
                    max_precondition_dim=max_precondition_dim, correct_bias=correct_bias,
                    normalize_gradient=normalize_gradient, labels=labels),
      optax.conditionally_mask(optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask),
                               lambda step: step > 0),  # the oracle skips step 1 entirely
      optax.scale_by_learning_rate(learning_rate))
