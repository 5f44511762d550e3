"""MARS variance reduction and Muon-MVR = MARS-M: a corrected, clipped gradient fed to AdamW, Lion, Shampoo or Muon.

MARS: Yuan et al., arXiv 2411.10438, AGI-Arena/MARS. Muon-MVR = MARS-M: Chang et al., arXiv 2509.15816; Liu et al.,
arXiv 2510.21800.

Both replace the gradient g = ∇f(x_t, ξ_t) by a corrected, clipped one before the optimizer's moments:

  c = g + γ·β/(1−β)·(g − g̃),   c̃ = c / max(1, ‖c‖_F)   (per tensor)

  approx (MARS-approx, MVR1): g̃ = ∇f(x_{t−1}, ξ_{t−1}), the previous gradient, kept in the state (+1 params copy).
  exact  (MARS-exact, MVR2):  g̃ = ∇f(x_{t−1}, ξ_t), the previous parameters on the *current* batch, passed to
                              `update(..., prev_grads=g̃)`; research/train/ computes it (a second backward pass).

At the first step g̃ = 0 in both modes, so c₁ = (1 + γβ/(1−β))·g₁ before the clip: the reference code (AGI-Arena
MARS and MARS-M, MaeChd's MuonMVR) and pytorch_optimizer all start `last_grad` at zero, and the exact loop of
`MARS/train_mars.py` only fills it after the first step.

A tensor is the trailing `tensor_ndim` axes of a leaf: 2 for weights (leading axes stack layers or experts, this
repo's convention: each (fan_in, fan_out) matrix is clipped on its own, like the torch per-parameter norm), 1 for
stacked vectors (norm scales stored as (layers, D)); a leaf with fewer axes is one tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.adam_group import ADAM, AdamGroup, with_adam_group
from optim.hparams import NON_NEGATIVE, Beta, Choices, NonNegative, NonNegativeInt
from optim.muon import ShapeScale, muon_with_adamw, scale_by_muon
from optim.needs import Needs
from optim.newton_schulz import Coeffs, NSMethod
from optim.registry import UnknownOptimizerError, register
from optim.trees import path_name, reject_complex, resolve_labels

MODES = ("approx", "exact")
MVR_MODES = ("mvr1", "mvr2")  # Muon-MVR's approximate and exact corrections
VARIANTS = ("adamw", "lion", "shampoo")
PyTree = Any


class MarsError(UnknownOptimizerError):
  """A MARS / Muon-MVR setting or call that cannot work (a ValueError; the train CLI prints it as one line)."""


class MarsState(NamedTuple):
  """The MARS correction's state: the step count and, in the approximate mode, the previous gradient."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 steps taken
  last_grad: optax.Updates  # approx: the previous gradient, shaped (and sharded) like the params; exact: None


def _clip_per_tensor(c, tensor_ndim: int):
  axes = tuple(range(max(c.ndim - tensor_ndim, 0), c.ndim))
  acc = c.astype(jnp.promote_types(c.dtype, jnp.float32))
  norm = jnp.sqrt(jnp.sum(jnp.real(acc * jnp.conj(acc)), axis=axes, keepdims=True))  # ‖c‖_F, also complex
  return (acc / jnp.maximum(norm, 1.0)).astype(c.dtype)


def mars_correction(gamma: float = 0.025, beta: float = 0.95, *, mode: str = "approx",
                    tensor_ndim: int = 2) -> optax.GradientTransformationExtraArgs:
  """The MARS corrected gradient c̃ = clip(g + γ·β/(1−β)·(g − g̃), 1) per tensor (see the module docstring).

  Args:
    gamma: strength of the correction (γ = 0: c = g, only the clip remains).
    beta: the momentum β of the optimizer that follows (β1 of AdamW/Lion, Muon's β).
    mode: "approx" keeps the previous gradient in the state; "exact" needs `update(..., prev_grads=g̃)` (a tree
      like the gradients). Inside `optax.partition`, pass `mask_compatible_extra_args=True` so each group
      receives its own part of `prev_grads`; `optax.chain` and `optax.inject_hyperparams` forward it as is.
    tensor_ndim: trailing axes that form one tensor (2: matrices, 1: vectors).

  Returns:
    A transformation with extra-argument support whose update is c̃, with a `MarsState`. Its update raises
    `MarsError` when the exact mode gets no `prev_grads`, or the approximate mode gets one.

  Raises:
    MarsError: when `mode` is not one of `MODES` or `tensor_ndim` is not 1 or 2.

  References:
    Yuan, Liu, Wu, Zhou and Gu, "MARS: Unleashing the Power of Variance Reduction for Training Large Models", 2024,
      arXiv 2411.10438 (ICML 2025); reference code AGI-Arena/MARS `MARS/optimizers/mars.py`.
  """
  if mode not in MODES:
    raise MarsError(f"MARS mode must be one of {', '.join(MODES)}, got {mode!r}")
  if tensor_ndim not in (1, 2):
    raise MarsError(f"tensor_ndim must be 1 (vectors) or 2 (matrices), got {tensor_ndim!r}")

  def init(params):
    last = jax.tree.map(jnp.zeros_like, params) if mode == "approx" else None
    return MarsState(count=jnp.zeros([], jnp.int32), last_grad=last)

  def update(updates, state, params=None, *, prev_grads=None, **extra_args):
    del params, extra_args
    if mode == "exact":
      if prev_grads is None:
        raise MarsError("exact MARS/MVR needs update(..., prev_grads=...): the gradient at the previous parameters "
                        "on the current batch (research/train/ computes it), or use mode='approx'")
      started = state.count > 0  # the reference's g̃ is zero at the first step
      prev = jax.tree.map(lambda p, g: jnp.where(started, p, jnp.zeros_like(p)).astype(g.dtype), prev_grads, updates)
    else:
      if prev_grads is not None:
        raise MarsError("approximate MARS/MVR keeps its own previous gradient: pass prev_grads only with the exact "
                        "mode (mode='exact' / 'mvr2')")
      prev = state.last_grad
    k = gamma * beta / (1.0 - beta)
    c = jax.tree.map(lambda g, p: _clip_per_tensor(g + k * (g - p), tensor_ndim), updates, prev)
    last = jax.tree.map(lambda g, l: g.astype(l.dtype), updates, state.last_grad) if mode == "approx" else None
    return c, MarsState(count=optax.safe_increment(state.count), last_grad=last)

  return optax.GradientTransformationExtraArgs(init, update)


def with_global_norm_clip(tx: optax.GradientTransformation, max_norm: float,
                          args: tuple[str, ...] = ("prev_grads",)) -> optax.GradientTransformationExtraArgs:
  """`optax.chain(optax.clip_by_global_norm(max_norm), tx)` (same state) whose clip also applies to `prev_grads`.

  The extra argument `prev_grads` is clipped by its own global norm: g̃ is then exactly what the optimizer would have
  received as the gradient at the previous parameters, as in the approximate mode (which stores the clipped
  gradient) and in the reference's exact loop (`MARS/train_mars.py` clips each backward pass's gradients
  separately).

  Args:
    tx: the optimizer the clipped gradients go to.
    max_norm: the global norm the gradients (and `prev_grads`, separately) are clipped to.
    args: the extra arguments clipped as well, each by its own global norm (gradients a trainer supplies).

  Returns:
    A transformation with extra-argument support and the state (clip state, tx's state).
  """
  clip = optax.clip_by_global_norm(max_norm)
  tx = optax.with_extra_args_support(tx)

  def init(params):
    return clip.init(params), tx.init(params)

  def update(updates, state, params=None, **extra_args):
    clip_state, tx_state = state
    updates, clip_state = clip.update(updates, clip_state, params)
    for name in args:
      if extra_args.get(name) is not None:
        extra_args[name], _ = clip.update(extra_args[name], clip_state, params)
    updates, tx_state = tx.update(updates, tx_state, params, **extra_args)
    return updates, (clip_state, tx_state)

  return optax.GradientTransformationExtraArgs(init, update)


def mars_labels(params: PyTree) -> optax.Params:
  """"matrix" for weights (ndim ≥ 2), "vector" for norm scales, biases and any leaf with ndim ≤ 1.

  Weights are hidden matrices, embeddings and the head — MARS routes 2-D embeddings and head to MARS too. Norm scales
  and biases go by name, though the blocks stack them as (layers, D).

  Args:
    params: the parameter tree.

  Returns:
    The params' structure with "vector" on leaves whose path names "norm" or "bias" or with ndim < 2, "matrix" on
    the others.
  """
  def label(path, p):
    name = path_name(path).lower()
    vector = "norm" in name or "bias" in name or jnp.ndim(p) < 2
    return "vector" if vector else "matrix"
  return jax.tree_util.tree_map_with_path(label, params)


def _mars_core(variant: str, b1, b2, eps, *, matrix: bool, ns_steps: int, ns_dtype):
  if variant == "adamw" or (variant == "shampoo" and not matrix):
    return optax.scale_by_adam(b1, b2, eps)  # m̂/(√v̂ + eps) with v on c̃², as the reference code (not g²)
  if variant == "lion":
    return optax.chain(optax.ema(b1, debias=False), optax.scale_by_sign())
  # NS(m/(1−β1)) with the reference's eps: NS normalises m by (‖m‖ + eps·(1−β1)). Shape factor √max(1, fan_out/
  # fan_in): torch's max(1, rows/cols) for its (out, in) Linear weights, re-expressed for our (fan_in, fan_out).
  return scale_by_muon(b1, momentum="ema", nesterov=False, coeffs="quintic", ns_steps=ns_steps, eps=eps * (1.0 - b1),
                       scale="keller", ns_dtype=ns_dtype)


@register("mars", needs=lambda hp: Needs(update_args=frozenset({"prev_grads"} if hp["mode"] == "exact" else ())))
def mars(learning_rate: optax.ScalarOrSchedule, *, variant: Annotated[str, Choices(VARIANTS)] = "adamw",
         gamma: NonNegative = 0.025, b1: Beta = 0.95, b2: Beta = 0.99, eps: NonNegative = 1e-8,
         weight_decay: NonNegative = 0.0, mode: Annotated[str, Choices(MODES)] = "approx", optimize_1d: bool = False,
         lr_1d: Annotated[optax.ScalarOrSchedule | None, NON_NEGATIVE] = None, b1_1d: Beta = 0.9, b2_1d: Beta = 0.95,
         weight_decay_1d: NonNegative = 0.1, ns_steps: NonNegativeInt = 5,
         ns_dtype: jax.typing.DTypeLike | None = None,
         labels: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformationExtraArgs:
  """MARS (Yuan et al., 2025): the corrected gradient c̃ (`mars_correction`) feeds AdamW, Lion or Shampoo.

    m ← β1·m + (1−β1)·c̃
    adamw:   v ← β2·v + (1−β2)·c̃²;  W ← W − lr·(m̂/(√v̂ + eps) + weight_decay·W)
    lion:    W ← W − lr·(sign(m) + weight_decay·W)
    shampoo: W ← W − lr·(√max(1, fan_out/fan_in)·NS(m/(1−β1)) + weight_decay·W)   (per matrix; quintic NS)

  Groups by `labels` (default `mars_labels`): "matrix" leaves get MARS; "vector" leaves (norm scales, biases)
  get plain AdamW on the raw gradient, `optax.adamw(lr_1d, b1_1d, b2_1d, eps, weight_decay_1d)` — decayed, as in
  the reference — unless `optimize_1d`, which gives them MARS too (per vector; shampoo → its AdamW branch) with the
  main lr and weight decay. `lr_1d`: None follows `learning_rate` (a schedule included); a number or schedule
  is used as given. Defaults are the reference class's (weight_decay 0; its GPT-2 recipe uses 1e-2).
  mode="exact" needs `update(..., prev_grads=)` (see `mars_correction`). Under `optax.inject_hyperparams` list
  `ns_steps` (and a `labels` function) in `static_args`; γ, the betas, eps, lrs and decays are injectable.

  Args:
    learning_rate: the learning rate or schedule (of both groups with `optimize_1d`).
    variant: "adamw", "lion" or "shampoo" (`VARIANTS`).
    gamma: γ, the correction's strength (default 0.025).
    b1: β1, the momentum (and the correction's β) (default 0.95).
    b2: β2, AdamW's second moment (default 0.99).
    eps: AdamW's ε, also the "vector" group's; Shampoo's NS eps is eps·(1−β1) (default 1e-8).
    weight_decay: decoupled weight decay of the MARS group (default 0, the reference class's).
    mode: "approx" or "exact" (`mars_correction`).
    optimize_1d: give the "vector" leaves MARS too (default False).
    lr_1d: the "vector" group's AdamW learning rate; None follows `learning_rate`.
    b1_1d: the "vector" group's β1 (default 0.9).
    b2_1d: the "vector" group's β2 (default 0.95).
    weight_decay_1d: the "vector" group's weight decay (default 0.1).
    ns_steps: Newton–Schulz iterations of the Shampoo variant (static; default 5).
    ns_dtype: the Newton–Schulz iteration's dtype (default: the update's).
    labels: "matrix" / "vector" per leaf (a tree, a prefix, or a function of the params); None: `mars_labels`.

  Returns:
    The `optax.partition` of the two groups (extra arguments split per group); with variant "lion" its init rejects
    complex parameters.

  Raises:
    MarsError: when `variant` is not one of `VARIANTS`.

  References:
    Yuan, Liu, Wu, Zhou and Gu, "MARS: Unleashing the Power of Variance Reduction for Training Large Models", 2024,
      arXiv 2411.10438 (ICML 2025); reference code AGI-Arena/MARS `MARS/optimizers/mars.py`.
  """
  if variant not in VARIANTS:
    raise MarsError(f"MARS variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
  core = lambda matrix: _mars_core(variant, b1, b2, eps, matrix=matrix, ns_steps=ns_steps, ns_dtype=ns_dtype)
  matrix_tx = optax.chain(mars_correction(gamma, b1, mode=mode), core(True),
                          optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
  if optimize_1d:
    vector_tx = optax.chain(mars_correction(gamma, b1, mode=mode, tensor_ndim=1), core(False),
                            optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
  else:
    vector_tx = optax.adamw(learning_rate if lr_1d is None else lr_1d, b1=b1_1d, b2=b2_1d, eps=eps,
                            weight_decay=weight_decay_1d)
  label_fn = lambda p: resolve_labels(mars_labels if labels is None else labels, p, ("matrix", "vector"), "MARS")
  tx = optax.partition({"matrix": matrix_tx, "vector": vector_tx}, label_fn, mask_compatible_extra_args=True)
  return reject_complex(tx, "MARS-Lion", "the sign of a complex number") if variant == "lion" else tx


@register("muon_mvr", needs=lambda hp: Needs(update_args=frozenset({"prev_grads"} if hp["mode"] == "mvr2" else ())))
@with_adam_group
def muon_mvr(learning_rate: optax.ScalarOrSchedule, *, mode: Annotated[str, Choices(MVR_MODES)] = "mvr1",
             gamma: NonNegative = 0.025, beta: Beta = 0.95, weight_decay: NonNegative = 0.1, coeffs: Coeffs = "quintic",
             ns_steps: NonNegativeInt = 5, eps: NonNegative = 1e-7, scale: ShapeScale = "moonlight",
             ns_dtype: jax.typing.DTypeLike | None = None, method: NSMethod = "standard",
             mu_dtype: jax.typing.DTypeLike | None = None, adam: AdamGroup = ADAM,
             labels: PyTree | Callable[[PyTree], PyTree] | None = None,
             distributed: bool = False) -> optax.GradientTransformationExtraArgs:
  """Muon-MVR / MARS-M: Muon whose EMA momentum is fed the corrected, clipped gradient c̃ (`mars_correction`).

    M ← β·M + (1−β)·c̃;   W ← W − lr·(scale·NS(M) + weight_decay·W)     (no Nesterov; Moonlight scale by default)
    mode "mvr1" = approximate (g̃ the previous gradient), "mvr2" = exact (`update(..., prev_grads=)`).

  Muon-routed leaves (`muon_labels`, or `labels`) as above; the rest ("adam": embeddings, head, norms, biases) on
  AdamW exactly as in `optim.muon`. `distributed` is handed to `scale_by_muon`. Under `optax.inject_hyperparams`
  list `ns_steps` (and a `labels` function) in `static_args`.

  Args:
    learning_rate: the learning rate or schedule of both groups unless `adam_learning_rate` is given.
    mode: "mvr1" (approximate) or "mvr2" (exact).
    gamma: γ, the correction's strength (default 0.025).
    beta: β, the EMA momentum (default 0.95).
    weight_decay: decoupled weight decay (default 0.1).
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

  Returns:
    `optim.muon.muon_with_adamw` over the chain `mars_correction` → `scale_by_muon` (extra arguments split per
    group).

  Raises:
    MarsError: when `mode` is not "mvr1" or "mvr2".

  References:
    Chang, Liu and Yuan, "On the Convergence of Muon and Beyond", 2025, arXiv 2509.15816 (Muon-MVR; reference code
      MaeChd/muon-eq `MuonMVR`).
    Liu et al., MARS-M, 2025, arXiv 2510.21800 (AGI-Arena/MARS `MARS_M/optimizers/mars_m.py`).
  """
  if mode not in MVR_MODES:
    raise MarsError(f"Muon-MVR mode must be 'mvr1' (approximate) or 'mvr2' (exact), got {mode!r}")
  core = optax.chain(
      mars_correction(gamma, beta, mode="approx" if mode == "mvr1" else "exact"),
      scale_by_muon(beta, momentum="ema", nesterov=False, coeffs=coeffs, ns_steps=ns_steps, eps=eps, scale=scale,
                    ns_dtype=ns_dtype, method=method, mu_dtype=mu_dtype, distributed=distributed))
  return muon_with_adamw(core, learning_rate, weight_decay=weight_decay, mu_dtype=mu_dtype,
                         adam=adam,
                         labels=labels, extra_args=True)
