"""Cautious optimizers: only the coordinates whose update agrees with the current gradient move.

Kaizhao Liang, Lizhang Chen, Bo Liu, Qiang Liu, "Cautious Optimizers: Improving Training with One Line of Code",
arXiv 2411.16085; code kyleliang919/C-Optim.

Per tensor (per matrix of a stack, see `optim.alignment`): c = (u·g > 0), φ = c / max(mean(c), floor), update
φ ⊙ u: coordinates whose update disagrees with the current gradient are dropped and the rest rescaled to keep
the mean step. `normalize="count"` uses the paper's first form, φ = c·N/(Σc + 1), which is also what
pytorch_optimizer's `cautious=True` computes. Decoupled weight decay is added after the mask (never masked) and
multiplies the raw learning rate, as in C-Optim's `c_adamw.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from optim.adam_group import ADAM, AdamGroup, with_adam_group
from optim.alignment import Normalization, Scalar, cautious_policy, with_alignment_mask
from optim.hparams import Beta, NonNegative, NonNegativeInt
from optim.mgup import scale_by_reference_adam
from optim.muon import MomentumForm, ShapeScale, muon_with_adamw, scale_by_muon
from optim.newton_schulz import Coeffs, NSMethod
from optim.registry import decay_mask, register

PyTree = Any


@register("cautious_adamw")
def cautious_adamw(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, b2: Beta = 0.95, eps: NonNegative = 1e-8,
                   weight_decay: NonNegative = 0.1, floor: Scalar = 1e-3, normalize: Normalization = "mean",
                   mu_dtype: jax.typing.DTypeLike | None = None,
                   mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """C-AdamW (C-Optim `c_adamw.py`, single-tensor path).

    u = m/(√v + eps) (`scale_by_reference_adam`: eps on the uncorrected √v, as C-Optim),  φ = Cautious(u, g)
    W ← W − lr·(√(1−β2^t)/(1−β1^t) · φ ⊙ u + weight_decay·W)

  The mask from u·g equals C-Optim's from m·g (√v + eps > 0). House defaults (0.9, 0.95), eps 1e-8, weight_decay 0.1
  as `adamw` (C-Optim's experiments: betas (0.9, 0.95), wd 0.1).

  Args:
    learning_rate: the learning rate or schedule.
    b1: β1 (default 0.9).
    b2: β2 (default 0.95).
    eps: added to the uncorrected √v (default 1e-8).
    weight_decay: decoupled weight decay, never masked (default 0.1).
    floor: as `optim.alignment.cautious_mask` (default 1e-3).
    normalize: "mean" or "count", as `optim.alignment.cautious_mask`.
    mu_dtype: the first moment's dtype (default: the parameter's).
    mask: the decay mask (default `decay_mask`).

  Returns:
    The chain of the masked reference Adam, decoupled weight decay and the learning rate.

  References:
    Liang, Chen, Liu and Liu, "Cautious Optimizers: Improving Training with One Line of Code", 2024,
      arXiv 2411.16085; reference code kyleliang919/C-Optim (`c_adamw.py`).
  """
  return optax.chain(
      with_alignment_mask(scale_by_reference_adam(b1, b2, eps, mu_dtype),
                          cautious_policy(floor=floor, normalize=normalize)),
      optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask),
      optax.scale_by_learning_rate(learning_rate))


@register("cautious_lion")
def cautious_lion(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, b2: Beta = 0.99,
                  weight_decay: NonNegative = 0.1, floor: Scalar = 1e-3, normalize: Normalization = "mean",
                  mu_dtype: jax.typing.DTypeLike | None = None,
                  mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """C-Lion: Lion's sign update, masked where it disagrees with the gradient.

    c = sign(β1·m + (1−β1)·g), φ = Cautious(c, g), W ← W − lr·(φ ⊙ c + weight_decay·W), m ← β2·m + (1−β2)·g

  House defaults as `lion` (C-Optim's C-Lion: betas (0.95, 0.98), count normalization).

  Args:
    learning_rate: the learning rate or schedule.
    b1: β1, the interpolation whose sign is the update (default 0.9).
    b2: β2, the momentum's decay (default 0.99).
    weight_decay: decoupled weight decay, never masked (default 0.1).
    floor: as `optim.alignment.cautious_mask` (default 1e-3).
    normalize: "mean" or "count", as `optim.alignment.cautious_mask`.
    mu_dtype: the momentum's dtype (default: the parameter's).
    mask: the decay mask (default `decay_mask`).

  Returns:
    The chain of the masked `optax.scale_by_lion`, decoupled weight decay and the learning rate.

  References:
    Liang, Chen, Liu and Liu, "Cautious Optimizers: Improving Training with One Line of Code", 2024,
      arXiv 2411.16085; reference code kyleliang919/C-Optim.
  """
  return optax.chain(
      with_alignment_mask(optax.scale_by_lion(b1, b2, mu_dtype), cautious_policy(floor=floor, normalize=normalize)),
      optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask),
      optax.scale_by_learning_rate(learning_rate))


@register("cautious_muon")
@with_adam_group
def cautious_muon(learning_rate: optax.ScalarOrSchedule, *, beta: Beta = 0.95, weight_decay: NonNegative = 0.1,
                  momentum: MomentumForm = "classic", nesterov: bool = True, coeffs: Coeffs = "quintic",
                  ns_steps: NonNegativeInt = 5, eps: NonNegative = 1e-7, scale: ShapeScale = "moonlight",
                  ns_dtype: jax.typing.DTypeLike | None = None, method: NSMethod = "standard",
                  mu_dtype: jax.typing.DTypeLike | None = None, adam: AdamGroup = ADAM,
                  labels: PyTree | Callable[[PyTree], PyTree] | None = None, distributed: bool = False,
                  floor: Scalar = 1e-3, normalize: Normalization = "mean") -> optax.GradientTransformation:
  """C-Muon with C-Optim's placement (`c_muon.py`): the mask multiplies the momentum BEFORE orthogonalization.

    B ← μB + G;  U = G + μB (Nesterov);  φ = Cautious(U, G);  O = NS(φ ⊙ U)
    Muon group:  W ← W − lr·(scale·O + weight_decay·W);   AdamW group: as `optim.muon`'s, no mask.

  (`scale_by_muon(mask_fn=..., mask_at="pre")`.) NS normalizes its input, so the mask's per-matrix
  rescaling cancels and only which coordinates are dropped matters. Other placements exist: the MGUP
  repo's cautious-Muon baseline and pytorch_optimizer's Muon(cautious=True) mask the ORTHOGONALIZED
  update with O·G > 0 instead. Arguments as `mgup_muon` (same default momentum form, "classic"), floor
  and normalize as `cautious_adamw`.

  Args:
    learning_rate: the learning rate or schedule of both groups unless `adam_learning_rate` is given.
    beta: μ, the momentum coefficient (default 0.95).
    weight_decay: decoupled weight decay (default 0.1).
    momentum: "classic" (default) or "ema" (`optim.muon.scale_by_muon`).
    nesterov: Nesterov momentum (default True).
    coeffs: the Newton–Schulz coefficients (default "quintic").
    ns_steps: Newton–Schulz iterations (static; default 5).
    eps: added to the Frobenius norm before Newton–Schulz (default 1e-7).
    scale: the shape scale (default "moonlight").
    ns_dtype: the Newton–Schulz iteration's dtype (default: the update's).
    method: "standard" or "gram" Newton–Schulz.
    mu_dtype: the momentum's (and AdamW's first moment's) dtype (default: the parameter's).
    adam: the AdamW group (`optim.adam_group.AdamGroup`), given as the keyword arguments adam_learning_rate,
      adam_b1, adam_b2, adam_eps, adam_weight_decay.
    labels: "muon" / "adam" per leaf (a tree, a prefix, or a function of the params); None: `optim.muon_labels`.
    distributed: orthogonalize each matrix once across the mesh's devices (`scale_by_muon`).
    floor: as `optim.alignment.cautious_mask` (default 1e-3).
    normalize: "mean" or "count", as `optim.alignment.cautious_mask`.

  Returns:
    `optim.muon.muon_with_adamw` over `scale_by_muon(mask_fn=Cautious, mask_at="pre")`.

  References:
    Liang, Chen, Liu and Liu, "Cautious Optimizers: Improving Training with One Line of Code", 2024,
      arXiv 2411.16085; reference code kyleliang919/C-Optim (`c_muon.py`).
  """
  core = scale_by_muon(beta, momentum=momentum, nesterov=nesterov, coeffs=coeffs, ns_steps=ns_steps, eps=eps,
                       scale=scale, ns_dtype=ns_dtype, method=method, mu_dtype=mu_dtype,
                       mask_fn=cautious_policy(floor=floor, normalize=normalize), mask_at="pre",
                       distributed=distributed)
  return muon_with_adamw(core, learning_rate, weight_decay=weight_decay, mu_dtype=mu_dtype,
                         adam=adam,
                         labels=labels)
