"""MGUP: momentum–gradient alignment update policy for AdamW, Lion and Muon.

Da Chang & Ganzhao Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization", NeurIPS 2025;
code MaeChd/MGUP.

Per tensor (per matrix of a stack, see `optim.alignment`), the K = ⌊τ·N⌋ coordinates with the largest signed
u⊙g take α·u, the rest γ·u; u is the base optimizer's direction, g the raw gradient. The reference code's
defaults τ = 0.5, α = 2, γ = 0.1; the paper's Eq. 3 (α = 1/τ, γ = τ) is `alpha="1/tau", gamma="tau"`.
`policy="cautious"` is Cautious-MGUP (α where u·g ≥ 0, γ elsewhere; no sort). Decoupled weight decay is
added after the mask, so it is never masked, and multiplies the raw learning rate, as in the reference.

House defaults for betas, eps and weight decay are this repo's `adamw` / `lion` / `muon` ones, so MGUP
runs compare with them at equal settings; the reference classes' defaults differ (listed per factory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import jax
import jax.numpy as jnp
import optax

from optim.adam_group import ADAM, AdamGroup, with_adam_group
from optim.alignment import Factor, Policy, Scalar, mgup_policy, with_alignment_mask
from optim.hparams import NON_NEGATIVE, POSITIVE, Beta, NonNegative, NonNegativeInt
from optim.muon import MomentumForm, ShapeScale, muon_with_adamw, scale_by_muon
from optim.newton_schulz import Coeffs, NSMethod
from optim.registry import decay_mask, register

PyTree = Any


def scale_by_reference_adam(b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                            mu_dtype: jax.typing.DTypeLike | None = None) -> optax.GradientTransformation:
  """Adam as the MGUP and C-Optim reference code (and the old transformers.AdamW they derive from) write it.

    m ← β1·m + (1−β1)·g;   v ← β2·v + (1−β2)·g²;   u = √(1−β2^t)/(1−β1^t) · m/(√v + eps)

  eps sits on the UNcorrected √v; optax.scale_by_adam (and torch.optim.AdamW) put it on √v̂, which is this
  with eps·√(1−β2^t) in place of eps: the two agree once eps ≪ √v. State: optax.ScaleByAdamState.

  Args:
    b1: β1, the first moment's decay (default 0.9).
    b2: β2, the second moment's decay (default 0.95).
    eps: added to the uncorrected √v (default 1e-8).
    mu_dtype: the first moment's dtype (default: the parameter's).

  Returns:
    A transformation whose update is u, in the gradient's dtype, with an `optax.ScaleByAdamState`.

  References:
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025,
      arXiv 2606.17526, Eq. 3; reference code MaeChd/MGUP (`MGUP_AdamW.py`); kyleliang919/C-Optim (`c_adamw.py`).
  """
  def init(params):
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu = jax.tree.map(lambda m, g: (b1 * m + (1 - b1) * g).astype(m.dtype), state.mu, updates)
    nu = jax.tree.map(lambda v, g: (b2 * v + (1 - b2) * jnp.square(g)).astype(v.dtype), state.nu, updates)
    t = count.astype(jnp.promote_types(optax.tree.dtype(updates, "highest"), jnp.float32))  # f64 in x64 tests
    step = jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    out = jax.tree.map(lambda m, v, g: (step * m / (jnp.sqrt(v) + eps)).astype(g.dtype), mu, nu, updates)
    return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


@register("mgup_adamw")
def mgup_adamw(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, b2: Beta = 0.95, eps: NonNegative = 1e-8,
               weight_decay: NonNegative = 0.1, tau: Scalar = 0.5, alpha: Annotated[Factor, POSITIVE] = 2.0,
               gamma: Annotated[Factor, NON_NEGATIVE] = 0.1, policy: Policy = "topk",
               mu_dtype: jax.typing.DTypeLike | None = None,
               mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """MGUP-AdamW (MGUP/MGUP_AdamW.py `AdamW`; `CMGUP_AdamW` with policy="cautious").

    u = m/(√v + eps) (`scale_by_reference_adam`),  φ = MGUP(u, g; τ, α, γ)
    W ← W − lr·(√(1−β2^t)/(1−β1^t) · φ ⊙ u + weight_decay·W)        (decay not masked, not bias-scaled)

  House defaults (0.9, 0.95), eps 1e-8, weight_decay 0.1 as `adamw` (reference class: betas (0.9, 0.999), eps 1e-6,
  weight_decay 0, correct_bias True).

  Args:
    learning_rate: the learning rate or schedule.
    b1: β1 (default 0.9).
    b2: β2 (default 0.95).
    eps: added to the uncorrected √v (default 1e-8).
    weight_decay: decoupled weight decay, never masked (default 0.1).
    tau: MGUP's τ, the boosted fraction of each tensor (default 0.5).
    alpha: MGUP's α, the factor on the selected coordinates (default 2.0; "1/tau" for the paper's form).
    gamma: MGUP's γ, the factor on the others (default 0.1; "tau" for the paper's form).
    policy: "topk" (MGUP) or "cautious" (Cautious-MGUP, `CMGUP_AdamW`).
    mu_dtype: the first moment's dtype (default: the parameter's).
    mask: decay mask tree or function (default `decay_mask`: norms and biases are not decayed).

  Returns:
    The chain of the masked reference Adam, decoupled weight decay and the learning rate.

  References:
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025,
      arXiv 2606.17526, Eq. 3; reference code MaeChd/MGUP (`MGUP_AdamW.py`).
  """
  return optax.chain(
      with_alignment_mask(scale_by_reference_adam(b1, b2, eps, mu_dtype),
                          mgup_policy(policy, tau=tau, alpha=alpha, gamma=gamma)),
      optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask),
      optax.scale_by_learning_rate(learning_rate))


@register("mgup_lion")
def mgup_lion(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, b2: Beta = 0.99,
              weight_decay: NonNegative = 0.1, tau: Scalar = 0.5, alpha: Annotated[Factor, POSITIVE] = 2.0,
              gamma: Annotated[Factor, NON_NEGATIVE] = 0.1, policy: Policy = "topk",
              mu_dtype: jax.typing.DTypeLike | None = None,
              mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """MGUP-Lion (MGUP/MGUP_Lion.py).

    c = sign(β1·m + (1−β1)·g),  φ = MGUP(c, g),  W ← W − lr·(φ ⊙ c + weight_decay·W),  m ← β2·m + (1−β2)·g

  House defaults betas (0.9, 0.99) and weight_decay 0.1 as `lion` (reference class: betas (0.9, 0.99),
  weight_decay 0; its experiments used (0.95, 0.98)); the rest as `mgup_adamw`.

  Args:
    learning_rate: the learning rate or schedule.
    b1: β1, the interpolation whose sign is the update (default 0.9).
    b2: β2, the momentum's decay (default 0.99).
    weight_decay: decoupled weight decay, never masked (default 0.1).
    tau: MGUP's τ (default 0.5).
    alpha: MGUP's α (default 2.0; "1/tau" for the paper's form).
    gamma: MGUP's γ (default 0.1; "tau" for the paper's form).
    policy: "topk" (MGUP) or "cautious" (Cautious-MGUP).
    mu_dtype: the momentum's dtype (default: the parameter's).
    mask: decay mask tree or function (default `decay_mask`).

  Returns:
    The chain of the masked `optax.scale_by_lion`, decoupled weight decay and the learning rate.

  References:
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025,
      arXiv 2606.17526, Eq. 3; reference code MaeChd/MGUP (`MGUP_Lion.py`).
  """
  return optax.chain(
      with_alignment_mask(optax.scale_by_lion(b1, b2, mu_dtype),
                          mgup_policy(policy, tau=tau, alpha=alpha, gamma=gamma)),
      optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask),
      optax.scale_by_learning_rate(learning_rate))


@register("mgup_muon")
@with_adam_group
def mgup_muon(learning_rate: optax.ScalarOrSchedule, *, beta: Beta = 0.95, weight_decay: NonNegative = 0.1,
              momentum: MomentumForm = "classic", nesterov: bool = True, coeffs: Coeffs = "quintic",
              ns_steps: NonNegativeInt = 5, eps: NonNegative = 1e-7, scale: ShapeScale = "moonlight",
              ns_dtype: jax.typing.DTypeLike | None = None, method: NSMethod = "standard",
              mu_dtype: jax.typing.DTypeLike | None = None, adam: AdamGroup = ADAM,
              labels: PyTree | Callable[[PyTree], PyTree] | None = None, distributed: bool = False,
              tau: Scalar = 0.5, alpha: Annotated[Factor, POSITIVE] = 2.0,
              gamma: Annotated[Factor, NON_NEGATIVE] = 0.1, policy: Policy = "topk") -> optax.GradientTransformation:
  """MGUP-Muon (MGUP/MGUP_Muon.py): Moonlight Muon with the MGUP mask applied AFTER orthogonalization.

    B ← μB + G;  Gn = G + μB (Nesterov);  φ = MGUP(Gn, G);  O = NS(Gn)
    Muon group:  W ← W − lr·(0.2·√max(A, B) · φ ⊙ O + weight_decay·W)     (decay with the unscaled lr)
    AdamW group: as `optim.muon`'s (embeddings, head, norms, vectors by `labels`), NO mask (the reference
                 leaves it commented out)

  The mask comes from the pre-orthogonalization Nesterov direction, so it does not enter NS
  (`scale_by_muon(mask_fn=..., mask_at="post")`). Arguments as `optim.muon` (reference class: lr 1e-3,
  wd 0.1, momentum 0.95, Nesterov, 5 NS steps in bf16, AdamW betas (0.95, 0.95), eps 1e-8), except the
  default momentum form, "classic" as in the reference ("ema" gives the same update up to NS's eps: NS
  removes the (1−β) factor and the top-K ranking ignores it). tau, alpha, gamma, policy: as `mgup_adamw`.
  `distributed` goes to `scale_by_muon`.

  Args:
    learning_rate: the learning rate or schedule of both groups unless `adam_learning_rate` is given.
    beta: μ, the momentum coefficient (default 0.95).
    weight_decay: decoupled weight decay, never masked (default 0.1).
    momentum: "classic" (default, as the reference) or "ema" (`optim.muon.scale_by_muon`).
    nesterov: Nesterov momentum (default True).
    coeffs: the Newton–Schulz coefficients (default "quintic").
    ns_steps: Newton–Schulz iterations (static; default 5).
    eps: added to the Frobenius norm before Newton–Schulz (default 1e-7).
    scale: the shape scale (default "moonlight": 0.2·√max(A, B)).
    ns_dtype: the Newton–Schulz iteration's dtype (default: the update's).
    method: "standard" or "gram" Newton–Schulz.
    mu_dtype: the momentum's (and AdamW's first moment's) dtype (default: the parameter's).
    adam: the AdamW group (`optim.adam_group.AdamGroup`), given as the keyword arguments adam_learning_rate,
      adam_b1, adam_b2, adam_eps, adam_weight_decay.
    labels: "muon" / "adam" per leaf (a tree, a prefix, or a function of the params); None: `optim.muon_labels`.
    distributed: orthogonalize each matrix once across the mesh's devices (`scale_by_muon`).
    tau: MGUP's τ (default 0.5).
    alpha: MGUP's α (default 2.0; "1/tau" for the paper's form).
    gamma: MGUP's γ (default 0.1; "tau" for the paper's form).
    policy: "topk" (MGUP) or "cautious" (Cautious-MGUP).

  Returns:
    `optim.muon.muon_with_adamw` over `scale_by_muon(mask_fn=MGUP, mask_at="post")`.

  References:
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025,
      arXiv 2606.17526, Eq. 3; reference code MaeChd/MGUP (`MGUP_Muon.py`).
    Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982 (the Moonlight Muon it builds on).
  """
  core = scale_by_muon(beta, momentum=momentum, nesterov=nesterov, coeffs=coeffs, ns_steps=ns_steps, eps=eps,
                       scale=scale, ns_dtype=ns_dtype, method=method, mu_dtype=mu_dtype,
                       mask_fn=mgup_policy(policy, tau=tau, alpha=alpha, gamma=gamma), mask_at="post",
                       distributed=distributed)
  return muon_with_adamw(core, learning_rate, weight_decay=weight_decay, mu_dtype=mu_dtype,
                         adam=adam,
                         labels=labels)
