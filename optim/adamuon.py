"""AdaMuon: Newton–Schulz of the momentum's sign, an element-wise second moment on it, and an RMS-aligned rescale.

Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005: Newton–Schulz of the sign of the momentum, an
element-wise Adam-style second moment on the orthogonalized update, and an RMS-aligned rescale that gives every
matrix's update the RMS of Adam's (0.2), so AdamW's learning rate carries over.

Three sources differ (tests/optim/test_adamuon.py checks each):
  paper, Algorithm 1 (v3): M ← β·M + G; O = NS(sign(M)); V ← β·V + (1−β)·O⊙O; Ô = O ⊘ (√V + ε);
                           W ← W − η·(0.2·√(mn)/‖Ô‖_F · Ô + λ·W)                      (one β for M and V)
  authors' code (Chongjie-Si/AdaMuon, gpt2/models/optimizers/adamuon.py): the same with Nesterov EMA momentum,
                           ε = 1e-8 also in ‖Ô‖_F + ε;  sign(EMA) = sign(M), so the two momenta agree
  pytorch_optimizer 4.1.0 `AdaMuon`: no sign, no Nesterov, β1 = 0.9 and β2 = 0.95 apart, V bias-corrected
                           (√(V/(1−β2^t)) + ε), ε = 1e-10; its `use_adjusted_lr=False` swaps 0.2·√max(m, n)
                           for Keller's √max(1, fan_out/fan_in)
Our defaults are the authors' code (sign, Nesterov, β2 = β = 0.95, ε = 1e-8, no bias correction).
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
from optim.normuon import check_matrix, frobenius, momentum_direction
from optim.registry import register
from optim.trees import reject_complex

PyTree = Any


class AdaMuonState(NamedTuple):
  """AdaMuon's state: the step count, the momentum and the element-wise second moment."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 step counter
  mu: optax.Updates  # momentum, shaped (and sharded) like the parameters
  nu: optax.Updates  # element-wise second moment of O, like the parameters (real dtype)


def scale_by_adamuon(beta: float = 0.95, b2: float = 0.95, *, nesterov: bool = True, sign: bool = True,
                     eps: float = 1e-8, bias_correction: bool = False, scale: str = "moonlight",
                     coeffs: Coeffs = "quintic", ns_steps: int = 5, ns_eps: float = 1e-7,
                     ns_dtype: jax.typing.DTypeLike | None = None, method: str = "standard",
                     mu_dtype: jax.typing.DTypeLike | None = None,
                     distributed: bool = False) -> optax.GradientTransformation:
  """Orthogonalized sign of the momentum, normalized by an element-wise second moment, RMS-aligned.

    M ← β·M + (1−β)·G;  U = β·M + (1−β)·G (Nesterov) or M;  O = NS(sign(U)) (or NS(U) without `sign`)
    V ← b2·V + (1−b2)·O⊙O;   V̂ = V/(1 − b2^t) with `bias_correction`, else V
    Ô = O ⊘ (√V̂ + eps);      update = shape_scale(scale)·√min(m, n)·Ô / (‖Ô‖_F + eps)     (per matrix)

  √min(m, n) is the Frobenius norm of an orthogonal m×n matrix: with scale "moonlight" (0.2·√max) the update
  has Frobenius norm 0.2·√(mn), the paper's RMS alignment. Leaves must have ndim ≥ 2 (stacks of matrices, each
  on its own). `ns_eps` is Newton–Schulz's eps; `coeffs`, `ns_steps`, `ns_dtype`, `method`, `distributed` go to
  `orthogonalize_tree`. With `sign`, complex parameters are refused at init (a sign has no complex meaning).

  Args:
    beta: the momentum β (default 0.95).
    b2: the second moment's β (default 0.95).
    nesterov: U = β·M + (1−β)·G (default) or M.
    sign: orthogonalize sign(U) (default) or U.
    eps: in √V̂ + eps and ‖Ô‖_F + eps (default 1e-8).
    bias_correction: divide V by 1 − b2^t (default False).
    scale: the shape scale, a name in `optim.muon.SHAPE_SCALES` (default "moonlight").
    coeffs: the Newton–Schulz coefficients (default "quintic").
    ns_steps: Newton–Schulz iterations (static; default 5).
    ns_eps: Newton–Schulz's eps (default 1e-7).
    ns_dtype: the Newton–Schulz iteration's dtype (default: the update's).
    method: "standard" or "gram" Newton–Schulz.
    mu_dtype: the momentum's dtype (default: the parameter's).
    distributed: orthogonalize each matrix once across the mesh's devices (`optim.distributed`).

  Returns:
    A transformation whose update is the RMS-aligned Ô, with an `AdaMuonState`; init and update raise `ValueError`
    on a leaf with fewer than two axes, and an unknown `scale` raises `ValueError` here (`shape_scale`).

  References:
    Si, Zhang and Shen, "AdaMuon: Adaptive Muon Optimizer", 2025, arXiv 2507.11005, Algorithm 1; reference code
      Chongjie-Si/AdaMuon.
  """
  shape_scale(scale, 1, 1)  # validates the name

  def init(params):
    def zeros(p, dtype):
      check_matrix(p, "AdaMuon")
      return jnp.zeros_like(p, dtype=dtype)
    mu = jax.tree.map(lambda p: zeros(p, mu_dtype or p.dtype), params)
    nu = jax.tree.map(lambda p: zeros(p, jnp.finfo(p.dtype).dtype), params)
    return AdaMuonState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu, u = momentum_direction(updates, state.mu, beta, nesterov)
    jax.tree.map(lambda x: check_matrix(x, "AdaMuon"), u)
    if sign:
      u = jax.tree.map(jnp.sign, u)
    o = orthogonalize_tree(u, coeffs=coeffs, steps=ns_steps, eps=ns_eps, compute_dtype=ns_dtype, method=method,
                           distributed=distributed)

    def normalize(o, v, g):
      m, n = o.shape[-2:]
      o = o.astype(jnp.promote_types(o.dtype, jnp.float32))
      sq = jnp.real(o * jnp.conj(o))
      v_new = b2 * v.astype(sq.dtype) + (1.0 - b2) * sq
      v_hat = v_new / (1.0 - b2 ** count.astype(sq.dtype)) if bias_correction else v_new
      o_hat = o / (jnp.sqrt(v_hat) + eps)
      out = o_hat * (shape_scale(scale, m, n) * math.sqrt(min(m, n)) / (frobenius(o_hat) + eps))
      return out.astype(g.dtype), v_new.astype(v.dtype)

    pairs = jax.tree.map(normalize, o, state.nu, updates)
    out = jax.tree.map(lambda _, pair: pair[0], updates, pairs)
    nu = jax.tree.map(lambda _, pair: pair[1], updates, pairs)
    return out, AdaMuonState(count=count, mu=mu, nu=nu)

  tx = optax.GradientTransformation(init, update)
  return reject_complex(tx, "AdaMuon with sign=True", "the sign of a complex number") if sign else tx


@register("adamuon")
@with_adam_group
def adamuon(learning_rate: optax.ScalarOrSchedule, *, beta: Beta = 0.95, b2: Beta = 0.95,
            weight_decay: NonNegative = 0.1, nesterov: bool = True, sign: bool = True, eps: NonNegative = 1e-8,
            bias_correction: bool = False, scale: ShapeScale = "moonlight", coeffs: Coeffs = "quintic",
            ns_steps: NonNegativeInt = 5, ns_eps: NonNegative = 1e-7, ns_dtype: jax.typing.DTypeLike | None = None,
            method: NSMethod = "standard",
            mu_dtype: jax.typing.DTypeLike | None = None, adam: AdamGroup = ADAM,
            labels: PyTree | Callable[[PyTree], PyTree] | None = None,
            distributed: bool = False) -> optax.GradientTransformation:
  """AdaMuon (arXiv 2507.11005) on hidden matrices, AdamW on the rest (`muon_with_adamw`, `muon_labels`).

    W ← W − lr·(shape_scale·√min(m, n)·Ô/(‖Ô‖_F + eps) + weight_decay·W)      (Ô: `scale_by_adamuon`)

  pytorch_optimizer 4.1.0 `AdaMuon` with its defaults is beta=0.9, b2=0.95, nesterov=False, sign=False,
  eps=1e-10, bias_correction=True, scale="moonlight" (module docstring); its Newton–Schulz runs in bfloat16 and
  divides by max(‖X‖_F, 1e-7), ours in the parameter's dtype (`ns_dtype`) and by ‖X‖_F + ns_eps. Under
  `optax.inject_hyperparams` list `ns_steps` (and a `labels` function) in `static_args`.

  Args:
    learning_rate: a number or a schedule; the AdamW group's too unless `adam_learning_rate` is given.
    beta: momentum β (default 0.95).
    b2: the second moment's β (the paper uses β for both; default 0.95).
    weight_decay: decoupled, times the unscaled lr (default 0.1).
    nesterov: U = β·M + (1−β)·G (the authors' code) or M (the paper's Algorithm 1, pytorch_optimizer).
    sign: orthogonalize sign(U) (paper and authors' code) or U (pytorch_optimizer).
    eps: in √V̂ + eps and ‖Ô‖_F + eps (default 1e-8).
    bias_correction: divide V by 1 − b2^t (pytorch_optimizer); the rescale cancels it up to eps.
    scale: Muon's shape factor (`optim.muon.shape_scale`): "moonlight" 0.2·√max(m, n) (default, the paper's
      RMS 0.2), "keller" √max(1, fan_out/fan_in) (pytorch_optimizer's use_adjusted_lr=False), ...
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
    `optim.muon.muon_with_adamw` over `scale_by_adamuon`.

  References:
    Si, Zhang and Shen, "AdaMuon: Adaptive Muon Optimizer", 2025, arXiv 2507.11005, Algorithm 1; reference code
      Chongjie-Si/AdaMuon.
  """
  core = scale_by_adamuon(beta, b2, nesterov=nesterov, sign=sign, eps=eps, bias_correction=bias_correction,
                          scale=scale, coeffs=coeffs, ns_steps=ns_steps, ns_eps=ns_eps, ns_dtype=ns_dtype,
                          method=method, mu_dtype=mu_dtype, distributed=distributed)
  return muon_with_adamw(core, learning_rate, weight_decay=weight_decay, mu_dtype=mu_dtype,
                         adam=adam, labels=labels)
