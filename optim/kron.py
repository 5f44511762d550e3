"""PSGD-Kron: preconditioned SGD with a Kronecker-factored preconditioner fitted online.

Xi-Lin Li, "Preconditioned stochastic gradient descent", arXiv 1512.04202; "Black box Lie group preconditioners for
SGD", arXiv 2211.04422; lixilinx/psgd_torch, evanatyourservice/psgd_jax; oracle: pytorch_optimizer 4.1.0 `Kron`.

Each matrix G (m, n) gets upper-triangular factors Q_L (m, m), Q_R (n, n) and the preconditioner
P = Q_Lᵀ Q_L ⊗ Q_Rᵀ Q_R, applied as P·G = Q_Lᵀ Q_L G Q_Rᵀ Q_R. A factor whose dimension exceeds `max_size_triangular`
or has size 1 (or that `memory_save_mode` picks) is diagonal, q (d,), acting as q²; a vector (ndim 1) has one
diagonal factor, as in the oracle; a scalar is a vector of length 1. Leaves with ndim ≥ 3 are stacks (..., m, n):
every matrix has its own factors (stored as (..., m, m) / (..., m)), fitted and applied per matrix (vmapped; on the
CPU the fit, whose triangular solves batched can deadlock, maps one matrix at a time: `optim.linalg.map_stack`) — the
oracle would instead give such a tensor one factor per dimension, the repo's convention is per layer / expert.

Fitting Q (one step of Li's Lie-group update, normalized step size `precond_lr`), from h = the debiased momentum
(or the gradient) and a Gaussian V with h's shape:
  A = Q_L h Q_Rᵀ,   B̄ = Q_L⁻ᵀ V Q_R⁻¹,   for Q_L: T₁ = A Aᵀ, T₂ = B̄ B̄ᵀ  (Q_R: AᵀA, B̄ᵀB̄)
  triangular: Q ← Q − precond_lr · triu(T₁ − T₂) / (‖T₁ + T₂‖₂,lower bound + tiny) · Q
  diagonal:   q ← q − precond_lr · (T₁ − T₂) ⊙ q / (max|T₁ + T₂| + tiny)      (T's = row / column sums of A², B̄²)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.hparams import Beta, Choices, Fraction, NonNegative, NonNegativeInt, Positive
from optim.linalg import map_stack
from optim.registry import UnknownOptimizerError, decay_mask, register
from optim.trees import reject_complex, replicated, sharded_like

MEMORY_SAVE_MODES = (None, "one_diag", "smart_one_diag", "all_diag")
PRECOND_DTYPES = ("float32", "bfloat16", "float16")  # `precond_dtype` by name (None: each leaf's)
TINY = float(jnp.finfo(jnp.float32).tiny)  # the oracle's eps: torch.finfo(torch.bfloat16).tiny, equal to fp32's
_mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
PyTree = Any


class KronError(UnknownOptimizerError):
  """A PSGD-Kron setting that cannot work (a ValueError; the train CLI prints it as one line)."""


class KronState(NamedTuple):
  """PSGD-Kron's state: the step count, the PRNG key, the update counter, the momentum and the factors."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 steps taken
  key: jax.Array  # uint32[2] PRNG key from `seed`, fixed: step t draws from fold_in(key, t) (`kron_draws`)
  update_counter: jax.Array  # int32 steps since the last preconditioner update (the oracle's counter)
  mu: optax.Updates  # momentum, shaped (and sharded) like the params
  # Shaped like the params tree (optax.tree.map_params finds them, as SOAP's factors), each leaf replicated:
  # (..., d, d) upper-triangular or (..., d) diagonal; a vector's one factor is q_l, its q_r an empty (0,) array
  q_l: optax.Params  # the factor of the rows (fan_in) axis
  q_r: optax.Params  # the factor of the columns (fan_out) axis


def precond_update_prob_schedule(max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001,
                                 flat_start: float = 500) -> Callable[[jax.typing.ArrayLike], jax.Array]:
  """The oracle's update-probability schedule of the step n (steps taken).

  clip(max_prob·exp(−decay·(n − flat_start)), min_prob, max_prob), in float32 as the oracle: with the defaults 1 up
  to step 500, 0.03 from step 4007 on.

  Args:
    max_prob: the probability up to `flat_start` (default 1).
    min_prob: the floor (default 0.03).
    decay: the exponential decay rate per step (default 0.001).
    flat_start: the step the decay starts from (default 500).

  Returns:
    The schedule, a function of the step count returning a float32 probability.
  """
  def schedule(n):
    n = jnp.asarray(n, jnp.float32)
    return jnp.clip(max_prob * jnp.exp(-decay * (n - flat_start)), min_prob, max_prob)
  return schedule


def _split(shape) -> tuple[tuple, tuple]:
  """(stack, core) of a leaf's shape: matrices are the trailing two axes; a vector is one core; a scalar is (1,)."""
  if len(shape) >= 2:
    return tuple(shape[:-2]), tuple(shape[-2:])
  return (), tuple(shape) or (1,)


def _triangular(core, max_size: int, memory_save_mode) -> tuple[bool, ...]:
  """Per core dimension: True for a triangular factor.

  Vectors: diagonal. `one_diag` makes the larger dimension's factor diagonal (on a tie fan_in's, which is torch's
  (out, in) last axis, as the oracle's argsort picks); `smart_one_diag` only when it is strictly larger; `all_diag`
  all.
  """
  if len(core) < 2:
    return (False,)
  larger = 0 if core[0] >= core[1] else 1
  diag = [memory_save_mode == "all_diag"] * 2
  if memory_save_mode == "one_diag" or (memory_save_mode == "smart_one_diag" and core[0] != core[1]):
    diag[larger] = True
  return tuple(not d and 1 < size <= max_size for size, d in zip(core, diag))


def kron_draws(key: jax.Array, count: int | jax.Array, like: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
  """The step's random numbers (the step with `count` steps before it): the balance coin's u and one V per leaf.

  u is uniform (float32); V is standard normal, one per array of the list `like` (the leaves in tree order, in the
  preconditioner's dtype).

  V is one float32 draw of all the leaves' sizes together, cut in leaf order and cast to each leaf's dtype (one
  threefry call to compile, not one per leaf): a stack and its matrices given as consecutive separate leaves get
  the same numbers, and a seed gives the same V in every precision.

  Args:
    key: the state's fixed PRNG key (from `seed`).
    count: the steps taken before this one.
    like: arrays whose shapes and dtypes the V's take.

  Returns:
    (u, [V per array of `like`]).
  """
  k_balance, k_noise = jax.random.split(jax.random.fold_in(key, count))
  u = jax.random.uniform(k_balance, (), jnp.float32)
  if not like:
    return u, []
  flat = jax.random.normal(k_noise, (sum(math.prod(x.shape) for x in like),), jnp.float32)
  ends = itertools.accumulate(math.prod(x.shape) for x in like)
  return u, [flat[e - math.prod(x.shape):e].reshape(x.shape).astype(x.dtype) for x, e in zip(like, ends)]


def _norm_lower_bound(a):
  """A cheap lower bound of the spectral norm of the symmetric matrix `a` (Li: ‖a‖₂ ≤ √2 × it in practice).

  ‖x·a‖ for x the normalized product a·r of a with its heaviest row r, after scaling a by max|a|. (The oracle also
  forms the candidate from the heaviest column and keeps the one whose sum of squares is larger: for the symmetric
  T₁ + T₂ both are the same up to rounding.)
  """
  max_abs = jnp.max(jnp.abs(a))
  a = a / jnp.where(max_abs > 0, max_abs, 1.0)
  row = jax.lax.dynamic_index_in_dim(a, jnp.argmax(jnp.sum(a * a, axis=1)), 0, keepdims=False)
  x = _mm(a, row)
  x = x / jnp.maximum(jnp.linalg.norm(x), jnp.finfo(a.dtype).tiny)
  return max_abs * jnp.linalg.norm(_mm(x, a))


def _apply(qs, tri, x):
  """Q x, factor by factor: A = Q_L x Q_Rᵀ (diagonal factors scale rows / columns)."""
  if x.ndim == 1:
    return qs[0] * x
  ql, qr = qs
  x = _mm(ql, x) if tri[0] else ql[:, None] * x
  return _mm(x, qr.T) if tri[1] else x * qr[None, :]


def _precondition(qs, tri, g):
  """P g = Q_Lᵀ Q_L g Q_Rᵀ Q_R (diagonal factors: q² scalings) for one matrix or vector."""
  if g.ndim == 1:
    return qs[0] * qs[0] * g
  ql, qr = qs
  g = _mm(ql.T, _mm(ql, g)) if tri[0] else (ql * ql)[:, None] * g
  return _mm(_mm(g, qr.T), qr) if tri[1] else g * (qr * qr)[None, :]


def _fit(qs, tri, h, v, lr):
  """One update of the factors of one matrix or vector from the pair (h, V) (module docstring)."""
  a = _apply(qs, tri, h)
  if h.ndim == 1:
    b = v / qs[0]
    sums = [(a * a, b * b)]
  else:
    ql, qr = qs
    solve = jax.lax.linalg.triangular_solve
    b = solve(ql, v, left_side=True, lower=False, transpose_a=True) if tri[0] else v / ql[:, None]  # Q_L⁻ᵀ V
    b = solve(qr, b, left_side=False, lower=False) if tri[1] else b / qr[None, :]  # · Q_R⁻¹
    sums = [(_mm(a, a.T), _mm(b, b.T)) if tri[0] else (jnp.sum(a * a, 1), jnp.sum(b * b, 1)),
            (_mm(a.T, a), _mm(b.T, b)) if tri[1] else (jnp.sum(a * a, 0), jnp.sum(b * b, 0))]
  new = []
  for q, t, (t1, t2) in zip(qs, tri, sums):
    if t:
      new.append(q - _mm(lr * jnp.triu(t1 - t2) / (_norm_lower_bound(t1 + t2) + TINY), q))
    else:
      new.append(q - lr * (t1 - t2) * q / (jnp.max(jnp.abs(t1 + t2)) + TINY))
  return tuple(new)


def _balance(qs):
  """Rescale a matrix's factors to equal max|q| (their geometric mean); P is unchanged."""
  norms = jnp.stack([jnp.max(jnp.abs(q)) for q in qs])
  mean = jnp.prod(norms) ** (1.0 / len(qs))
  return tuple(q * (mean / n) for q, n in zip(qs, norms))


def scale_by_kron(b1: float = 0.9, *,
                  preconditioner_update_probability: float | Callable[[jax.Array], jax.Array] | None = None,
                  max_size_triangular: int = 8192, memory_save_mode: str | None = None, precond_lr: float = 0.1,
                  precond_init_scale: float = 1.0, balance_prob: float = 0.01,
                  momentum_into_precond_update: bool = True, mu_dtype: jax.typing.DTypeLike | None = None,
                  precond_dtype: str | None = "float32", seed: int = 0) -> optax.GradientTransformation:
  """PSGD-Kron's direction: momentum, preconditioned by the online-fitted Kronecker factors, RMS-capped at 1.1.

    m ← β1·m + (1−β1)·g;   m̂ = m/(1−β1ᵗ)
    with the schedule's counter: fit Q on (m̂ or g, V) (module docstring), after balancing the factors with
      probability `balance_prob`;   u = P m̂;   u ← u · min(1, 1.1/(RMS(u) + 1e-6))   (per matrix)

  `preconditioner_update_probability` p (a number, a function of the step count, or None: the oracle's
  `precond_update_prob_schedule()`) drives the oracle's deterministic counter: c ← c + 1, update when c ≥ 1/p
  (then c ← 0), i.e. every ⌈1/p⌉ steps, not a coin. The balance coin and V come from `seed` (`kron_draws`).
  Factor shapes (`max_size_triangular`, `memory_save_mode`) are fixed at init. `precond_dtype` (a dtype name, or
  None for each leaf's dtype) holds Q, V and the preconditioning; `mu_dtype` the momentum (default the param's).

  Args:
    b1: momentum β1 (default 0.9).
    preconditioner_update_probability: p, a number or a function of the step count; None: the oracle's schedule.
    max_size_triangular: a dimension above it gets a diagonal factor (static; default 8192).
    memory_save_mode: None, "one_diag", "smart_one_diag" or "all_diag" (which factors are diagonal).
    precond_lr: the factors' normalized step size (default 0.1).
    precond_init_scale: the factors' initial scale, Q = scale^(1/ndim)·I (default 1).
    balance_prob: probability per preconditioner update of balancing the factors' norms first (default 0.01).
    momentum_into_precond_update: fit Q on the debiased momentum (True, default) or on the gradient.
    mu_dtype: the momentum's dtype (default: the parameter's).
    precond_dtype: a dtype name for Q, V and the preconditioning (default "float32"; None: each leaf's dtype).
    seed: the PRNG seed of V and the balance coin (default 0).

  Returns:
    A transformation whose update is the capped P m̂, in the gradient's dtype and sharding, with a `KronState`; its
    init rejects complex parameters.

  Raises:
    KronError: when `max_size_triangular` is an array (injected: it must be static) or `memory_save_mode` is not
      one of `MEMORY_SAVE_MODES`.

  References:
    Xi-Lin Li, "Preconditioned stochastic gradient descent", arXiv 1512.04202; "Black box Lie group preconditioners
      for SGD", arXiv 2211.04422; reference code lixilinx/psgd_torch, evanatyourservice/psgd_jax; oracle
      pytorch_optimizer 4.1.0 `Kron`.
  """
  if isinstance(max_size_triangular, jax.Array):  # optax.inject_hyperparams made it an array (traced in update)
    raise KronError("Kron's max_size_triangular fixes the factors' shapes (triangular or diagonal): make it static, "
                    "optax.inject_hyperparams(kron, static_args=('max_size_triangular',))")
  if memory_save_mode not in MEMORY_SAVE_MODES:
    raise KronError(f"memory_save_mode must be one of {', '.join(map(str, MEMORY_SAVE_MODES))}, "
                    f"got {memory_save_mode!r}")
  prob = precond_update_prob_schedule() if preconditioner_update_probability is None else \
      preconditioner_update_probability
  pdtype = lambda x: jnp.dtype(precond_dtype or x.dtype)

  def factors(x):
    stack, core = _split(x.shape)
    scale = precond_init_scale ** (1.0 / len(core))
    tri = _triangular(core, max_size_triangular, memory_save_mode)
    make = lambda d, t: jnp.broadcast_to(scale * (jnp.eye(d) if t else jnp.ones(d)), stack + ((d, d) if t else (d,)))
    return tuple(replicated(make(d, t).astype(pdtype(x))) for d, t in zip(core, tri))

  def init(params):
    leaves, treedef = jax.tree.flatten(params)
    qs = [factors(x) for x in leaves]
    return KronState(count=jnp.zeros([], jnp.int32), key=jax.random.PRNGKey(seed),
                     update_counter=jnp.zeros([], jnp.int32),
                     mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params),
                     q_l=treedef.unflatten([q[0] for q in qs]),
                     q_r=treedef.unflatten([q[1] if len(q) > 1 else jnp.zeros((0,), q[0].dtype) for q in qs]))

  def update(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu = jax.tree.map(lambda m, g: (b1 * m + (1.0 - b1) * g).astype(m.dtype), state.mu, updates)
    grads, treedef = jax.tree.flatten(updates)
    m_hat = [replicated((m / (1.0 - b1 ** count)).astype(pdtype(g)))
             for m, g in zip(treedef.flatten_up_to(mu), grads)]
    fit_on = m_hat if momentum_into_precond_update else [replicated(g.astype(pdtype(g))) for g in grads]
    # triangular or diagonal as the state's factors are (fixed at init, so an injected max_size cannot change it)
    qs_in = [(l,) if len(_split(g.shape)[1]) == 1 else (l, r) for g, l, r in
             zip(grads, treedef.flatten_up_to(state.q_l), treedef.flatten_up_to(state.q_r))]
    tris = [tuple(q.ndim - len(_split(g.shape)[0]) == 2 for q in qs) for g, qs in zip(grads, qs_in)]

    p = jnp.asarray(prob(state.count) if callable(prob) else prob)
    p = p.astype(jnp.promote_types(p.dtype, jnp.float32))
    counter = state.update_counter + 1
    do_update = (p > 0) & (counter.astype(p.dtype) >= 1.0 / p)

    def fit(qs_all):
      u, vs = kron_draws(state.key, state.count, fit_on)
      do_balance = u < balance_prob
      new = []
      for h, v, qs, tri in zip(fit_on, vs, qs_all, tris):
        stack, core = _split(h.shape)
        h, v = h.reshape(stack + core), replicated(v.astype(h.dtype)).reshape(stack + core)
        if len(core) == 2:
          qs = jax.tree.map(lambda a, b: jnp.where(do_balance, a, b), map_stack(_balance, stack, qs, lapack=False), qs)
        # one matrix at a time on the CPU: `_fit`'s triangular solves, batched, can deadlock there (optim.linalg)
        new.append(map_stack(lambda q, hh, vv, tri=tri: _fit(q, tri, hh, vv, precond_lr), stack, qs, h, v))
      return tuple(new)

    qs_all = jax.lax.cond(do_update, fit, lambda qs_all: qs_all, tuple(qs_in))
    out = []
    for g, h, qs, tri in zip(grads, m_hat, qs_all, tris):
      stack, core = _split(g.shape)

      def direction(q, x, tri=tri):
        u = _precondition(q, tri, x)
        return u * jnp.minimum(1.1 / (jnp.sqrt(jnp.mean(u * u)) + 1e-6), 1.0)

      u = map_stack(direction, stack, qs, h.reshape(stack + core), lapack=False)
      out.append(sharded_like(u.reshape(g.shape).astype(g.dtype), g))
    q_r = [qs[1] if len(qs) > 1 else r for qs, r in zip(qs_all, treedef.flatten_up_to(state.q_r))]
    state = KronState(count=count, key=state.key, update_counter=jnp.where(do_update, 0, counter), mu=mu,
                      q_l=treedef.unflatten([qs[0] for qs in qs_all]), q_r=treedef.unflatten(q_r))
    return treedef.unflatten(out), state

  return reject_complex(optax.GradientTransformation(init, update), "Kron", "its oracle refuses complex parameters")


@register("kron")
def kron(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, weight_decay: NonNegative = 0.0,
         preconditioner_update_probability: Fraction | None = None, max_size_triangular: NonNegativeInt = 8192,
         memory_save_mode: Annotated[str, Choices(MEMORY_SAVE_MODES)] | None = None, precond_lr: Positive = 0.1,
         precond_init_scale: NonNegative = 1.0, balance_prob: Fraction = 0.01,
         momentum_into_precond_update: bool = True, mu_dtype: jax.typing.DTypeLike | None = None,
         precond_dtype: Annotated[str, Choices(PRECOND_DTYPES)] | None = "float32", seed: NonNegativeInt = 0,
         mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """PSGD-Kron (Li, arXiv 1512.04202 / 2211.04422) on every leaf, with decoupled weight decay.

    W ← W − lr·(u + weight_decay·W),   u = min(1, 1.1/RMS(P m̂))·P m̂   (`scale_by_kron`)

  Oracle (pytorch_optimizer 4.1.0 `Kron`) differences: stacks (ndim ≥ 3) get per-matrix factors (the oracle one
  factor per axis); decay follows `decay_mask` (names; the oracle decays every ndim ≥ 2 tensor); the triangular
  solve runs in `precond_dtype` (the oracle's always in float32); the RMS cap is applied before casting to the
  param's dtype; no `min_ndim_triangular` (always 2) or `maximize`; complex parameters are refused, as there.

  Args:
    learning_rate: a number or schedule.
    b1: momentum β1 (the oracle's `momentum`).
    weight_decay: decoupled decay on `mask`'s leaves (default 0).
    preconditioner_update_probability: p of the update counter (every ⌈1/p⌉ steps); None: the oracle's
      schedule, 1 for 500 steps then exp(−0.001·(n − 500)) down to 0.03.
    max_size_triangular: a dimension above it gets a diagonal factor (static; fixed at init).
    memory_save_mode: None, "one_diag", "smart_one_diag" or "all_diag" (which factors are diagonal).
    precond_lr: the factors' normalized step size (default 0.1).
    precond_init_scale: the factors' initial scale (Q = scale^(1/ndim)·I; default 1).
    balance_prob: probability per preconditioner update of balancing the factors' norms first.
    momentum_into_precond_update: fit Q on the debiased momentum (True, default) or on the gradient.
    mu_dtype: dtype name of the momentum (None: the param's).
    precond_dtype: dtype name of the preconditioner (default "float32"; None: the param's).
    seed: the PRNG seed of V and the balance coin.
    mask: where weight decay applies: a bool tree or a function of the params; None = `decay_mask`.

  Returns:
    The chain of `scale_by_kron`, decoupled weight decay and the learning rate.

  References:
    Xi-Lin Li, "Preconditioned stochastic gradient descent", arXiv 1512.04202; "Black box Lie group preconditioners
      for SGD", arXiv 2211.04422; reference code lixilinx/psgd_torch, evanatyourservice/psgd_jax; oracle
      pytorch_optimizer 4.1.0 `Kron`.
  """
  tx = scale_by_kron(b1, preconditioner_update_probability=preconditioner_update_probability,
                     max_size_triangular=max_size_triangular, memory_save_mode=memory_save_mode,
                     precond_lr=precond_lr, precond_init_scale=precond_init_scale, balance_prob=balance_prob,
                     momentum_into_precond_update=momentum_into_precond_update, mu_dtype=mu_dtype,
                     precond_dtype=precond_dtype, seed=seed)
  return optax.chain(tx, optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask),
                     optax.scale_by_learning_rate(learning_rate))
