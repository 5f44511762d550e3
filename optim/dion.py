"""Dion: a rank-r orthonormalized update by power iteration with error feedback.

Ahn et al., "Dion: Distributed Orthonormalized Updates", arXiv 2504.05295; microsoft/dion.

A rank-r orthonormalized update from one step of power iteration per optimizer step, warm-started from the last
step's right factor, with error feedback: what the rank-r factor leaves of the momentum stays in it. Per matrix
(every (m, n) of a stack (..., m, n) on its own), in the orientation B (L, S) with L ≥ S (below), Q (S, r):

  B ← M + G;   P ← orth(B Q)   (L, r), PᵀP = I;   R ← Bᵀ P   (S, r)
  M ← B − (1−μ)·P Rᵀ                                     (error feedback; the rank-r part decays by μ)
  Q ← R / (‖R_:,j‖ + eps)                                (column normalization)
  update = scale·P Qᵀ,   r = ⌈rank_fraction·min(m, n)⌉

Orientation: P lies on the longer side of the matrix, ties to fan_out, as microsoft/dion `dion_reference.py`
does (it transposes torch's (out, in) weight when out < in; `dion_simple.py` never transposes). In our
(fan_in, fan_out) layout: a tall matrix (m > n) is B = M and Q is (n, r); otherwise B = Mᵀ and Q is (m, r).
So Q has shape (..., min(m, n), r) and is a warm start of B's leading right singular vectors.

orth(P) is the Q factor of P's thin QR with R's diagonal positive (unique for P of full column rank):
- `distributed=False`: Householder QR (`jnp.linalg.qr`), columns' signs fixed.
- `distributed=True`: CholeskyQR2, two passes of P ← P L⁻ᵀ with L Lᵀ = PᵀP + s·I. With P's rows split over a mesh
  axis, PᵀP (r × r) is the only collective of a pass; with B's other side split, P = B Q and the column norms
  of R are the reductions; R = Bᵀ P reduces over P's rows. The full matrix is never gathered: all collectives
  are all-reduces of P-, R-, r×r- or r-sized partial sums (GSPMD inserts them; the explicit-axes path gives it
  the shardings of P and R, derived from the momentum's). The shift s = u·tr(G)/r (u: the compute dtype's
  machine epsilon) moves a full-rank P's result by O(u); where Cholesky still fails (P rank-deficient), the pass
  is redone with s = √u·tr(G), which every positive semi-definite Gram survives. The two passes end in the
  QR factor with positive diagonal, so the two methods agree to rounding (times P's condition number).
On the CPU both run their LAPACK kernels on one matrix of a stack at a time (`optim.linalg.per_matrix`): jaxlib 0.10's
batched kernels can deadlock a step on several simulated devices.
State sharding: M as its parameter; Q may be sharded any way (each output keeps its input's sharding), its natural
spec, `right_factor_spec`, splits Q's rows like the parameter's shorter side and needs no extra collective (a
replicated Q costs one all-gather of R per step). Axes the parameter is replicated over (data) carry nothing.
Zero P (a zero momentum, or B Q = 0): PᵀP = 0 is replaced by I before Cholesky (no NaN), the step's P is 0, the
update 0, and Q is kept (as the reference's `fix_all_zero_or_nan` keeps Q_init); Householder's arbitrary basis of
a zero matrix is zeroed the same way.

Shape scale: the reference's lr·√(fan_out/fan_in) (`scale="spectral"`, `optim.muon.shape_scale`); the other
kinds there can be chosen. Q starts as N(0, 1) from `seed` and the parameter's path (crc32), in float32 then cast:
the same on every sharding (JAX's partitionable threefry).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optim.adam_group import ADAM, AdamGroup, with_adam_group
from optim.hparams import Beta, NonNegative, NonNegativeInt, Range
from optim.linalg import per_matrix
from optim.muon import ShapeScale, muon_with_adamw, shape_scale
from optim.registry import UnknownOptimizerError, register
from optim.trees import path_name, reject_complex

PyTree = Any


class DionError(UnknownOptimizerError):
  """A Dion setting that cannot work (a ValueError; the train CLI prints it as one line)."""


class DionState(NamedTuple):
  """Dion's state: the step count, the momentum M and the right factors Q."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 steps taken
  mu: optax.Updates  # momentum M, shaped (and sharded) like the parameters
  q: optax.Updates  # right factor Q per matrix: (..., min(m, n), r)


def dion_rank(shape: tuple[int, ...], rank_fraction: float) -> int:
  """R = ⌈rank_fraction · min(m, n)⌉ of a (..., m, n) matrix (at least 1).

  Args:
    shape: the parameter's shape (..., m, n).
    rank_fraction: the fraction of min(m, n) kept, in (0, 1].

  Returns:
    r, between 1 and min(m, n).
  """
  s = min(shape[-2:])
  return max(1, min(s, math.ceil(rank_fraction * s - 1e-9)))


def right_factor_spec(spec: P, shape: tuple[int, ...]) -> P:
  """Q's natural PartitionSpec for a (..., m, n) parameter with PartitionSpec `spec`.

  The stack axes as the parameter's, Q's rows split like the parameter's shorter side (the side Q spans), the rank
  axis whole. With it the distributed step needs no collective to keep Q (a replicated Q costs one all-gather of R
  per step).

  Args:
    spec: the parameter's PartitionSpec (missing trailing entries are None).
    shape: the parameter's shape (..., m, n).

  Returns:
    Q's PartitionSpec, for its shape (..., min(m, n), r).
  """
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  short = entries[-1] if shape[-2] > shape[-1] else entries[-2]
  return P(*entries[:-2], short, None)


def _swap(x):
  return jnp.swapaxes(x, -1, -2)


def _householder(p):
  """Thin QR's Q factor of p (..., L, r) with the signs that make R's diagonal non-negative; zero flag."""
  q, r = per_matrix(jnp.linalg.qr, p)
  d = jnp.diagonal(r, axis1=-2, axis2=-1)
  q = q * jnp.where(d < 0, -1, 1).astype(q.dtype)[..., None, :]
  zero = jnp.sum(p * p, axis=(-2, -1), keepdims=True) == 0
  return jnp.where(zero, 0, q), zero


def _inverse_cholesky_factor(g, t):
  """L⁻¹ for L Lᵀ = g + s·I of Grams g (..., r, r) with traces t (..., 1, 1).

  The shifts are the module docstring's; I where t = 0.
  """
  r = g.shape[-1]
  eye = jnp.eye(r, dtype=g.dtype)
  u = jnp.finfo(g.dtype).eps
  chol = lambda shift: jnp.linalg.cholesky(jnp.where(t > 0, g + shift * eye, eye))
  low = chol(u * t / r)
  fine = jnp.all(jnp.isfinite(low), axis=(-2, -1), keepdims=True)
  low = jnp.where(fine, low, chol(jnp.sqrt(u) * t))
  return jax.scipy.linalg.solve_triangular(low, jnp.broadcast_to(eye, low.shape), lower=True)


def _cholesky_pass(p, gram_spec):
  g = _constrain(jnp.einsum("...li,...lj->...ij", p, p), gram_spec)  # (..., r, r): a reduction over p's rows
  t = jnp.trace(g, axis1=-2, axis2=-1)[..., None, None]
  low_inv = per_matrix(_inverse_cholesky_factor, g, t)  # r×r work, repeated on every device
  return p @ _swap(low_inv), t == 0  # p L⁻ᵀ: local on p's rows


def _cholesky_qr2(p, gram_spec):
  """CholeskyQR2 of p (..., L, r): the Q factor with R's diagonal positive; zero flag (p = 0)."""
  q, zero = _cholesky_pass(p, gram_spec)
  q, _ = _cholesky_pass(q, gram_spec)
  return jnp.where(zero, 0, q), zero


def _constrain(x, spec):
  return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def _specs(spec, ndim: int, tall: bool):
  """(P's, R's, the Gram's) PartitionSpecs from the momentum's `spec` (None: leave them to the partitioner)."""
  if spec is None:
    return None, None, None
  e = tuple(spec) + (None,) * (ndim - len(spec))
  long, short = (e[-2], e[-1]) if tall else (e[-1], e[-2])
  return P(*e[:-2], long, None), P(*e[:-2], short, None), P(*e[:-2], None, None)


def _step(m, g, q, beta, eps, *, cholesky: bool, spec=None):
  """One Dion step of a stack (..., m, n): (new momentum, new Q, P Qᵀ in the (m, n) layout)."""
  cdt = jnp.promote_types(m.dtype, jnp.float32)
  tall = m.shape[-2] > m.shape[-1]
  p_spec, r_spec, gram_spec = _specs(spec, m.ndim, tall)
  b = m.astype(cdt) + g.astype(cdt)
  b = b if tall else _swap(b)  # (..., L, S)
  p = _constrain(b @ q.astype(cdt), p_spec)  # (..., L, r)
  p, zero = _cholesky_qr2(p, gram_spec) if cholesky else _householder(p)
  r = _constrain(_swap(b) @ p, r_spec)  # (..., S, r)
  m_new = b - (1 - beta) * (p @ _swap(r))
  q_new = r / (jnp.sqrt(jnp.sum(r * r, axis=-2, keepdims=True)) + eps)
  q_new = _constrain(jnp.where(zero, q.astype(cdt), q_new), r_spec)
  u = p @ _swap(q_new)
  back = (lambda x: x) if tall else _swap
  return back(m_new).astype(m.dtype), q_new.astype(q.dtype), back(u)


def _step_tree(ms, gs, qs, beta, eps, *, distributed: bool):
  """`_step` on every leaf.

  On a mesh with Explicit axes it runs under `auto_axes`, each output pinned to its input's type sharding, and
  `distributed` shards P and R as the momentum (`_specs`); on Auto axes the partitioner propagates the inputs'
  shardings (from the jit boundary) itself.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = () if mesh.empty else tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
                                         if t == AxisType.Explicit)
  if not explicit or AxisType.Manual in mesh.axis_types:
    return [_step(m, g, q, beta, eps, cholesky=distributed) for m, g, q in zip(ms, gs, qs)]
  specs = [jax.typeof(m).sharding.spec if distributed else None for m in ms]

  def run(ms, gs, qs, beta, eps):
    return [_step(m, g, q, beta, eps, cholesky=distributed, spec=s) for m, g, q, s in zip(ms, gs, qs, specs)]

  out_specs = [tuple(jax.typeof(x).sharding.spec for x in (m, q, g)) for m, g, q in zip(ms, gs, qs)]
  return jax.sharding.auto_axes(run, axes=explicit, out_sharding=out_specs)(ms, gs, qs, beta, eps)


def scale_by_dion(beta: float = 0.95, *, rank_fraction: float = 1.0, eps: float = 1e-8, scale: str = "spectral",
                  seed: int = 0, mu_dtype: jax.typing.DTypeLike | None = None,
                  distributed: bool = False) -> optax.GradientTransformation:
  """Dion's direction scale·P Qᵀ for every leaf (a stack of matrices (..., m, n)); see the module docstring.

  Args:
    beta: μ, the momentum kept of the rank-r part (error feedback keeps the rest whole).
    rank_fraction: r = ⌈rank_fraction·min(m, n)⌉ (1.0 the reference's default; 0.25 recommended at scale).
      It fixes Q's shape: static (`optim.registry.STATIC_ARGS`).
    eps: added to R's column norms.
    scale: `optim.muon.shape_scale` kind; "spectral" = √(fan_out/fan_in), the reference's.
    seed: Q's initial N(0, 1) draw (with the parameter's path).
    mu_dtype: dtype of M and Q (default: the parameter's). The step computes in float32 at least.
    distributed: orthonormalize by CholeskyQR2 on P where it lies (see the module docstring).

  Returns:
    A transformation whose update is scale·P Qᵀ per matrix, with a `DionState`; its init rejects complex parameters
    and raises `DionError` on a leaf with fewer than two axes.

  Raises:
    TypeError: when `rank_fraction` is traced (list it in `static_args` under `optax.inject_hyperparams`).
    DionError: when `rank_fraction` lies outside (0, 1] or `scale` is not a shape-scale kind.

  References:
    Ahn et al., "Dion: Distributed Orthonormalized Updates", 2025, arXiv 2504.05295; reference code microsoft/dion
      (`dion_reference.py`).
  """
  if isinstance(rank_fraction, jax.core.Tracer):
    raise TypeError("Dion's rank_fraction fixes the shape of Q: make it static, "
                    "optax.inject_hyperparams(dion, static_args=('rank_fraction',))")
  rank_fraction = float(rank_fraction)
  if not 0 < rank_fraction <= 1:
    raise DionError(f"Dion's rank_fraction must lie in (0, 1], got {rank_fraction}")
  try:
    shape_scale(scale, 1, 1)  # validates the name
  except ValueError as e:
    raise DionError(f"Dion: {e}") from None

  def init(params):
    def leaf(path, p):
      if jnp.ndim(p) < 2:
        raise DionError(f"Dion got a parameter of shape {jnp.shape(p)}; route vectors to AdamW (muon_labels)")
      key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path_name(path).encode()) & 0x7FFFFFFF)
      shape = p.shape[:-2] + (min(p.shape[-2:]), dion_rank(p.shape, rank_fraction))
      return jax.random.normal(key, shape, jnp.float32).astype(mu_dtype or p.dtype)
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params)
    return DionState(count=jnp.zeros([], jnp.int32), mu=mu, q=jax.tree_util.tree_map_with_path(leaf, params))

  def update(updates, state, params=None):
    del params
    gs, treedef = jax.tree.flatten(updates)
    ms, qs = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.q)
    out = _step_tree(ms, gs, qs, jnp.asarray(beta), jnp.asarray(eps), distributed=distributed)
    u = [(o * shape_scale(scale, g.shape[-2], g.shape[-1])).astype(g.dtype) for (_, _, o), g in zip(out, gs)]
    unflat = lambda i: jax.tree.unflatten(treedef, [o[i] for o in out])
    return jax.tree.unflatten(treedef, u), DionState(count=optax.safe_increment(state.count), mu=unflat(0),
                                                     q=unflat(1))

  return reject_complex(optax.GradientTransformation(init, update), "Dion",
                        "its QR, Cholesky and column norms are those of real matrices, as in the paper")


@register("dion")
@with_adam_group
def dion(learning_rate: optax.ScalarOrSchedule, *, beta: Beta = 0.95,
         rank_fraction: Annotated[float, Range(0, 1, open_low=True)] = 1.0, weight_decay: NonNegative = 0.01,
         eps: NonNegative = 1e-8, scale: ShapeScale = "spectral", seed: NonNegativeInt = 0,
         mu_dtype: jax.typing.DTypeLike | None = None, adam: AdamGroup = ADAM,
         labels: PyTree | Callable[[PyTree], PyTree] | None = None,
         distributed: bool = False) -> optax.GradientTransformation:
  """Dion on hidden matrices, AdamW on the rest (`optim.muon.muon_with_adamw`, routed by `muon_labels`).

    Dion group:  W ← W − lr·(scale·P Qᵀ + weight_decay·W)     (`scale_by_dion`; the reference's
                 X ← X(1 − lr·wd) − lr·√(fan_out/fan_in)·P Qᵀ)
    AdamW group: optax.adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, adam_eps,
                 adam_weight_decay or weight_decay), no decay on norms.

  Defaults are microsoft/dion's (`dion_reference.py`: mu 0.95, weight_decay 0.01, rank_fraction 1.0, eps 1e-8; its
  lr 0.01), with one power iteration (its default `power_iters=1`) and an exact QR (it defaults to randomized
  Cholesky QR, "rcqr", whose P can differ from ours in column signs only, to which P Qᵀ and P Rᵀ are invariant).
  Not offered: its `rank_multiple_of` rounding, decoupled (compressed) data-parallel gradient sync, power_iters > 1.
  Under `optax.inject_hyperparams` list `rank_fraction` (and a `labels` function) in `static_args`; `seed` and the
  floats are injectable.

  Args:
    learning_rate: the learning rate or schedule of both groups unless `adam_learning_rate` is given.
    beta: μ, the momentum kept of the rank-r part (default 0.95).
    rank_fraction: r = ⌈rank_fraction·min(m, n)⌉ (static; default 1.0).
    weight_decay: decoupled weight decay of both groups unless `adam_weight_decay` is given (default 0.01).
    eps: added to R's column norms (default 1e-8).
    scale: the shape scale (default "spectral", the reference's √(fan_out/fan_in)).
    seed: Q's initial draw (default 0).
    mu_dtype: dtype of M and Q, and of AdamW's first moment (default: the parameter's).
    adam: the AdamW group (`optim.adam_group.AdamGroup`), given as the keyword arguments adam_learning_rate,
      adam_b1, adam_b2, adam_eps, adam_weight_decay.
    labels: "muon" / "adam" per leaf (a tree, a prefix, or a function of the params); None: `optim.muon_labels`.
    distributed: orthonormalize by CholeskyQR2 on P where it lies (`scale_by_dion`).

  Returns:
    `optim.muon.muon_with_adamw` over `scale_by_dion`.

  References:
    Ahn et al., "Dion: Distributed Orthonormalized Updates", 2025, arXiv 2504.05295; reference code microsoft/dion
      (`dion_reference.py`).
  """
  core = scale_by_dion(beta, rank_fraction=rank_fraction, eps=eps, scale=scale, seed=seed, mu_dtype=mu_dtype,
                       distributed=distributed)
  return muon_with_adamw(core, learning_rate, weight_decay=weight_decay, mu_dtype=mu_dtype,
                         adam=adam, labels=labels)
