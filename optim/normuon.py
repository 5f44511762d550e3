"""NorMuon: Muon, then an Adam-style second moment per neuron on the orthogonalized update.

Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491. The second moment
evens out the neurons' update norms that Newton–Schulz leaves unequal.

Neurons. A parameter here is (..., fan_in, fan_out) and a neuron is an output unit: column j of each matrix,
which is row j of torch's (out, in) weight, the row that the paper, its code (zichongli5/NorMuon), Dion and
pytorch_optimizer normalize. Its statistic is the mean of O² over fan_in (axis −2), so the second moment of a
(..., fan_in, fan_out) leaf has shape (..., fan_out): one number per output unit of every matrix of a stack.
The layout fixes the axis, never the matrix's aspect ratio (modded-nanogpt's NorMuon once guessed it from
height vs width, which its 2025-12 record found wrong for gates and attention output heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.adam_group import ADAM, AdamGroup, with_adam_group
from optim.hparams import Beta, NonNegative, NonNegativeInt
from optim.muon import ShapeScale, muon_with_adamw, orthogonalize_tree, shape_scale
from optim.newton_schulz import Coeffs, NSMethod
from optim.registry import register

PyTree = Any


class NorMuonState(NamedTuple):
  """NorMuon's state: the step count, the momentum and the per-neuron second moment."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 step counter
  mu: optax.Updates  # momentum, shaped (and sharded) like the parameters
  nu: optax.Updates  # per-neuron second moment of O, (..., fan_out) per leaf, real, at least float32


def check_matrix(x: jax.Array, who: str) -> None:
  """Refuses a leaf that is not a matrix or a stack of them.

  Args:
    x: the leaf.
    who: the optimizer's name, for the error message.

  Raises:
    ValueError: when x has fewer than two axes (route vectors to AdamW: `muon_labels`).
  """
  if x.ndim < 2:
    raise ValueError(f"{who} got a parameter of shape {x.shape}; route vectors to AdamW (muon_labels)")


def stat_dtype(dtype: jax.typing.DTypeLike) -> jnp.dtype:
  """A real dtype of at least fp32 for a second moment of `dtype` entries (complex64 -> float32).

  Args:
    dtype: the entries' (real or complex floating) dtype.

  Returns:
    The real dtype of `dtype`'s precision, promoted to at least float32.
  """
  return jnp.promote_types(jnp.finfo(dtype).dtype, jnp.float32)


def _keep_sharding(new, old):
  """`new` in `old`'s sharding on an Explicit mesh.

  A state leaf must come out as it went in, whatever sharding its creator chose: ours from `init`, a replicated one
  from `sharding.shardings_like_params`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return new
  return jax.sharding.reshard(new, jax.typeof(old).sharding.spec)


def frobenius(x: jax.Array) -> jax.Array:
  """‖x‖_F of each matrix of a stack (..., m, n), kept as (..., 1, 1); real for complex x.

  Args:
    x: a matrix or a stack of them (..., m, n).

  Returns:
    The Frobenius norms, shaped (..., 1, 1).
  """
  return jnp.sqrt(jnp.sum(jnp.real(x * jnp.conj(x)), axis=(-2, -1), keepdims=True))


def momentum_direction(updates: PyTree, mu: PyTree, beta: float | jax.Array,
                       nesterov: bool) -> tuple[PyTree, PyTree]:
  """EMA momentum M ← β·M + (1−β)·G (in M's dtype) and the direction U = β·M + (1−β)·G (Nesterov) or M.

  Args:
    updates: the gradients G.
    mu: the momentum M, G's structure.
    beta: β.
    nesterov: whether U is the Nesterov look-ahead or M itself.

  Returns:
    (the new M, U).
  """
  mu = jax.tree.map(lambda m, g: (beta * m + (1.0 - beta) * g).astype(m.dtype), mu, updates)
  u = jax.tree.map(lambda m, g: beta * m + (1.0 - beta) * g, mu, updates) if nesterov else mu
  return mu, u


def scale_by_normuon(beta: float = 0.95, b2: float = 0.95, *, nesterov: bool = True, eps: float = 1e-10,
                     preserve_norm: bool = False, scale: str = "moonlight", coeffs: Coeffs = "quintic",
                     ns_steps: int = 5, ns_eps: float = 1e-7, ns_dtype: jax.typing.DTypeLike | None = None,
                     method: str = "standard", mu_dtype: jax.typing.DTypeLike | None = None,
                     distributed: bool = False) -> optax.GradientTransformation:
  """Muon's orthogonalized momentum with per-neuron (per output column) second-moment normalization.

    M ← β·M + (1−β)·G;  U = β·M + (1−β)·G (Nesterov) or M;  O = NS(U)           (per matrix, (fan_in, fan_out))
    v ← b2·v + (1−b2)·mean_fan_in(O²)                                          (v: one entry per column j)
    Ô = O / (√v + eps)                                                         (column j divided by √v_j + eps)
    update = shape_scale(scale)·N·Ô / (‖Ô‖_F + eps),  N = ‖O‖_F (preserve_norm) or √min(fan_in, fan_out)

  With the default N = √min and scale "moonlight" (0.2·√max) the update's Frobenius norm is 0.2·√(mn) (RMS 0.2),
  the paper's η̂ = 0.2·η·√(mn)/‖Ô‖_F. Leaves must have ndim ≥ 2 (stacks of matrices, each on its own).
  `ns_eps` is Newton–Schulz's eps (X/(‖X‖_F + ns_eps)); `coeffs`, `ns_steps`, `ns_dtype`, `method` and
  `distributed` are handed to `orthogonalize_tree`. v starts at zero and is not bias-corrected (as the paper).

  Args:
    beta: the momentum β (default 0.95).
    b2: the per-neuron second moment's β2 (default 0.95).
    nesterov: U = β·M + (1−β)·G (default) or M.
    eps: in √v + eps and ‖Ô‖_F + eps (default 1e-10).
    preserve_norm: N = ‖O‖_F instead of √min(fan_in, fan_out) (default False).
    scale: the shape scale, a name in `optim.muon.SHAPE_SCALES` (default "moonlight").
    coeffs: the Newton–Schulz coefficients (default "quintic").
    ns_steps: Newton–Schulz iterations (static; default 5).
    ns_eps: Newton–Schulz's eps (default 1e-7).
    ns_dtype: the Newton–Schulz iteration's dtype (default: the update's).
    method: "standard" or "gram" Newton–Schulz.
    mu_dtype: the momentum's dtype (default: the parameter's).
    distributed: orthogonalize each matrix once across the mesh's devices (`optim.distributed`).

  Returns:
    A transformation whose update is the normalized, scaled orthogonalized momentum, with a `NorMuonState`; init
    and update raise `ValueError` on a leaf with fewer than two axes, and an unknown `scale` raises `ValueError`
    here (`shape_scale`).

  References:
    Li, Liu, Liang, Chen and Zhao, "NorMuon: Making Muon more efficient and scalable", 2025, arXiv 2510.05491;
      reference code zichongli5/NorMuon.
  """
  shape_scale(scale, 1, 1)  # validates the name

  def init(params):
    def nu(p):
      check_matrix(p, "NorMuon")
      return jnp.mean(jnp.zeros_like(p, dtype=stat_dtype(p.dtype)), axis=-2)  # (..., fan_out), sharded as a mean
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params)
    return NorMuonState(count=jnp.zeros([], jnp.int32), mu=mu, nu=jax.tree.map(nu, params))

  def update(updates, state, params=None):
    del params
    mu, u = momentum_direction(updates, state.mu, beta, nesterov)
    jax.tree.map(lambda x: check_matrix(x, "NorMuon"), u)
    o = orthogonalize_tree(u, coeffs=coeffs, steps=ns_steps, eps=ns_eps, compute_dtype=ns_dtype, method=method,
                           distributed=distributed)

    def normalize(o, v, g):
      m, n = o.shape[-2:]
      o = o.astype(jnp.promote_types(o.dtype, v.dtype))
      v_new = b2 * v + (1.0 - b2) * jnp.mean(jnp.real(o * jnp.conj(o)), axis=-2)
      o_hat = o / (jnp.sqrt(v_new)[..., None, :] + eps)
      target = frobenius(o) if preserve_norm else math.sqrt(min(m, n))
      out = o_hat * (shape_scale(scale, m, n) * target / (frobenius(o_hat) + eps))
      return out.astype(g.dtype), _keep_sharding(v_new.astype(v.dtype), v)

    pairs = jax.tree.map(normalize, o, state.nu, updates)
    out = jax.tree.map(lambda _, pair: pair[0], updates, pairs)
    nu = jax.tree.map(lambda _, pair: pair[1], updates, pairs)
    return out, NorMuonState(count=optax.safe_increment(state.count), mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


@register("normuon")
@with_adam_group
def normuon(learning_rate: optax.ScalarOrSchedule, *, beta: Beta = 0.95, b2: Beta = 0.95,
            weight_decay: NonNegative = 0.1, nesterov: bool = True, eps: NonNegative = 1e-10,
            preserve_norm: bool = False, scale: ShapeScale = "moonlight", coeffs: Coeffs = "quintic",
            ns_steps: NonNegativeInt = 5, ns_eps: NonNegative = 1e-7, ns_dtype: jax.typing.DTypeLike | None = None,
            method: NSMethod = "standard",
            mu_dtype: jax.typing.DTypeLike | None = None, adam: AdamGroup = ADAM,
            labels: PyTree | Callable[[PyTree], PyTree] | None = None,
            distributed: bool = False) -> optax.GradientTransformation:
  """NorMuon (arXiv 2510.05491) on hidden matrices, AdamW on the rest (`muon_with_adamw`, `muon_labels`).

    W ← W − lr·(shape_scale·N·Ô/(‖Ô‖_F + eps) + weight_decay·W)      (Ô, N: `scale_by_normuon`)

  Settings of the oracle, pytorch_optimizer 4.1.0 `NorMuon` (tests/optim/test_normuon.py): its defaults
  (update_scale="preserve_norm", use_adjusted_lr=False) are preserve_norm=True, scale="keller", the authors'
  code; update_scale="match_rms" is preserve_norm=False, scale="moonlight"; use_adjusted_lr=True with
  "preserve_norm" is scale="moonlight". Its Newton–Schulz runs in bfloat16 and divides by max(‖X‖_F, 1e-7); ours
  in the parameter's dtype (`ns_dtype`) and by ‖X‖_F + ns_eps. Its eps default (1e-10) is ours. Under
  `optax.inject_hyperparams` list `ns_steps` (and a `labels` function) in `static_args`.

  Args:
    learning_rate: a number or a schedule; the AdamW group's too unless `adam_learning_rate` is given.
    beta: momentum β1 (default 0.95).
    b2: the per-neuron second moment's β2 (default 0.95).
    weight_decay: decoupled, times the unscaled lr (default 0.1).
    nesterov: U = β·M + (1−β)·G (the authors' code, pytorch_optimizer) or M (the paper's Algorithm 1).
    eps: in √v + eps and ‖Ô‖_F + eps (default 1e-10).
    preserve_norm: rescale Ô to ‖O‖_F, the authors' code ("preserve_norm" in pytorch_optimizer), instead of
      √min(m, n), the Frobenius norm of an orthogonal m×n matrix (with scale "moonlight": the paper's RMS 0.2).
    scale: Muon's shape factor (`optim.muon.shape_scale`): "moonlight" 0.2·√max(m, n) (default: AdamW's lr
      and decay serve both groups), "keller" √max(1, fan_out/fan_in) (the authors' code), "spectral", "none".
    coeffs: Newton–Schulz coefficients (`orthogonalize_tree`; default "quintic").
    ns_steps: Newton–Schulz iterations (static; default 5).
    ns_eps: Newton–Schulz's eps (default 1e-7).
    ns_dtype: Newton–Schulz's dtype (default: the update's).
    method: "standard" or "gram" Newton–Schulz.
    mu_dtype: the momentum's dtype (both groups).
    adam: the AdamW group (`optim.adam_group.AdamGroup`), given as the keyword arguments adam_learning_rate,
      adam_b1, adam_b2, adam_eps, adam_weight_decay.
    labels: "muon"/"adam" per leaf (`muon_labels`).
    distributed: orthogonalize each matrix once across the mesh's devices (`orthogonalize_tree`).

  Returns:
    `optim.muon.muon_with_adamw` over `scale_by_normuon`.

  References:
    Li, Liu, Liang, Chen and Zhao, "NorMuon: Making Muon more efficient and scalable", 2025, arXiv 2510.05491;
      reference code zichongli5/NorMuon.
  """
  core = scale_by_normuon(beta, b2, nesterov=nesterov, eps=eps, preserve_norm=preserve_norm, scale=scale,
                          coeffs=coeffs, ns_steps=ns_steps, ns_eps=ns_eps, ns_dtype=ns_dtype, method=method,
                          mu_dtype=mu_dtype, distributed=distributed)
  return muon_with_adamw(core, learning_rate, weight_decay=weight_decay, mu_dtype=mu_dtype,
                         adam=adam, labels=labels)
