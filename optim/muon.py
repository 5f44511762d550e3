"""Muon (Jordan et al., 2024; Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982).

Every Muon parameter is a stack of matrices (..., fan_in, fan_out): leading axes (layers, experts)
are batch, and each matrix is orthogonalized on its own with a shape scale from its own shape.
Routing (which parameters get Muon) is a label function over parameter paths, `muon_labels`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.adam_group import ADAM, AdamGroup, with_adam_group
from optim.hparams import Beta, Choices, NonNegative, NonNegativeInt
from optim.newton_schulz import Coeffs, NSMethod, orthogonalize
from optim.orthogonalizers import Split
from optim.registry import register
from optim.trees import is_hidden_matrix, reject_complex, resolve_labels

SHAPE_SCALES = ("keller", "moonlight", "spectral", "none")
MOMENTA = ("ema", "classic")  # the momentum forms of `scale_by_muon`
ShapeScale = Annotated[str, Choices(SHAPE_SCALES)]  # a factory's `scale`
MomentumForm = Annotated[str, Choices(MOMENTA)]  # a factory's `momentum`
PyTree = Any


def shape_scale(kind: str, fan_in: int, fan_out: int) -> float:
  """Factor on an orthogonalized (fan_in, fan_out) update.

  keller:    √max(1, fan_out/fan_in)      (KellerJordan/Muon, optax's default)
  moonlight: 0.2·√max(fan_in, fan_out)    (update RMS ≈ 0.2, AdamW's: reuse its lr and wd)
  spectral:  √(fan_out/fan_in)            (Dion's default; spectral-norm steepest descent)
  none:      1

  Args:
    kind: "keller", "moonlight", "spectral" or "none" (`SHAPE_SCALES`).
    fan_in: the matrix's input dimension (its rows in the (fan_in, fan_out) layout).
    fan_out: the matrix's output dimension.

  Returns:
    The factor.

  Raises:
    ValueError: when `kind` is not one of `SHAPE_SCALES`.

  References:
    KellerJordan/Muon (keller); Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982, Lemma 1 and
      Eq. 4 (moonlight: update RMS 0.2, AdamW's); microsoft/dion `adjust_lr="spectral_norm"` (spectral).
  """
  if kind == "keller":
    return math.sqrt(max(1.0, fan_out / fan_in))
  if kind == "moonlight":
    return 0.2 * math.sqrt(max(fan_in, fan_out))
  if kind == "spectral":
    return math.sqrt(fan_out / fan_in)
  if kind == "none":
    return 1.0
  raise ValueError(f"unknown shape scale {kind!r}; choose from {', '.join(SHAPE_SCALES)}")


class MuonState(NamedTuple):
  """Muon's state: the step count and the momentum buffer."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 step counter
  mu: optax.Updates  # momentum buffer, shaped (and sharded) like the parameters


def scale_by_muon(beta: float = 0.95, *, momentum: str = "ema", nesterov: bool = True,
                  coeffs: Coeffs = "quintic", ns_steps: int = 5, eps: float = 1e-7, scale: str = "moonlight",
                  ns_dtype: jax.typing.DTypeLike | None = None, method: str = "standard",
                  mu_dtype: jax.typing.DTypeLike | None = None,
                  mask_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None, mask_at: str = "post",
                  distributed: bool = False, orthogonalize: Callable[[jax.Array], jax.Array] | None = None,
                  split: Split | None = None) -> optax.GradientTransformation:
  """Momentum, then Newton–Schulz orthogonalization of each matrix, then a shape scale.

    ema:      M ← β·M + (1−β)·G;   U = β·M + (1−β)·G (Nesterov) or M      (KellerJordan/Muon, torch.optim.Muon)
    classic:  M ← β·M + G;         U = β·M + G (Nesterov) or M            (Moonlight, MGUP, Dion)
    O = NS(U) (`orthogonalize` with coeffs, ns_steps, eps, ns_dtype, method), times `shape_scale(scale, ...)`.

  The two momentum forms differ only by the factor (1−β) on U, which NS's normalization removes
  (up to eps). Leaves must have ndim ≥ 2; route others elsewhere (see `muon`). Give `ns_dtype` and
  `mu_dtype` as names ("bfloat16") under `optax.inject_hyperparams`, which calls any callable.

  Alignment policies (MGUP, Cautious) plug in as `mask_fn(u, g) -> φ`, per leaf, from the
  pre-orthogonalization direction U and the raw gradient G: `mask_at="post"` returns φ ⊙ scale·NS(U)
  (MGUP-Muon), `"pre"` returns scale·NS(φ ⊙ U) (C-Optim's Cautious-Muon).
  `distributed=True` hands each device whole matrices of equal-shape groups and runs one batched
  Newton–Schulz there instead of repeating every matrix on every device (`optim.distributed`).

  Pluggable (`optim.orthogonalizers`): `orthogonalize`, any function of a matrix stack (..., m, n) -> same shape,
  replaces Newton–Schulz (coeffs, ns_steps, eps, ns_dtype and method then go unused), distributed or not;
  `split(path, shape) -> (axis, sizes) | None` cuts leaves into blocks that are orthogonalized and shape-scaled
  as matrices of their own (`orthogonalizers.heads(head_dim)`: per-head; `orthogonalizers.fused(sizes)`: fused
  QKV). Under `optax.inject_hyperparams` list both in `static_args` (injection calls any callable).

  Args:
    beta: the momentum coefficient β (default 0.95).
    momentum: "ema" or "classic" (the forms above).
    nesterov: whether U is the Nesterov look-ahead (default True) or the momentum itself.
    coeffs: the Newton–Schulz coefficients: a name in `optim.newton_schulz.COEFFICIENTS` or rows of (a, b, c).
    ns_steps: Newton–Schulz iterations (static; default 5).
    eps: added to the Frobenius norm before Newton–Schulz divides by it (default 1e-7).
    scale: the shape scale, a name in `SHAPE_SCALES` (default "moonlight": update RMS 0.2).
    ns_dtype: the Newton–Schulz iteration's dtype (e.g. "bfloat16"); default: the update's.
    method: "standard" or "gram", the Newton–Schulz iteration (`optim.newton_schulz`).
    mu_dtype: the momentum buffer's dtype; default: the parameter's.
    mask_fn: an alignment policy `mask_fn(u, g) -> φ` per leaf (MGUP, Cautious); None: no mask.
    mask_at: "post" (φ ⊙ scale·NS(U), MGUP-Muon) or "pre" (scale·NS(φ ⊙ U), Cautious-Muon).
    distributed: orthogonalize each matrix once across the devices of the current mesh (`optim.distributed`).
    orthogonalize: a function of a matrix stack replacing Newton–Schulz (`optim.orthogonalizers`); None: NS.
    split: `split(path name, shape) -> (axis, sizes) | None`, cutting leaves into blocks orthogonalized on their own.

  Returns:
    A transformation whose update is the shape-scaled orthogonalized momentum of each leaf (masked by `mask_fn`'s φ
    when given), in the gradient's dtype; its state is a `MuonState`. With `mask_fn` its init rejects complex
    parameters. Its update raises `ValueError` on a leaf with fewer than two axes.

  Raises:
    ValueError: when `momentum`, `mask_at` or `scale` is not a known name, or `orthogonalize` / `split` is given but
      not callable.

  References:
    Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024 (blog post; reference code
      KellerJordan/Muon, the "ema" form).
    Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982, Eq. 1–4 (the "classic" form and the
      "moonlight" scale; MoonshotAI/Moonlight).
    Chang and Yuan, "A Momentum-Gradient Alignment Update Policy for Stochastic Optimization" (MGUP), NeurIPS 2025
      (mask_at="post"; MaeChd/MGUP `MGUP_Muon.py`).
    Liang et al., "Cautious Optimizers", 2024, arXiv 2411.16085 (mask_at="pre"; kyleliang919/C-Optim `c_muon.py`).
  """
  if momentum not in MOMENTA:
    raise ValueError(f"momentum must be 'ema' or 'classic', got {momentum!r}")
  if mask_at not in ("pre", "post"):
    raise ValueError(f"mask_at must be 'pre' or 'post', got {mask_at!r}")
  shape_scale(scale, 1, 1)  # validates the name
  for name, fn in (("orthogonalize", orthogonalize), ("split", split)):
    if fn is not None and not callable(fn):
      raise ValueError(f"{name} must be a function (optim.orthogonalizers), got {fn!r}")

  def init(params):
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params)
    return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

  def update(updates, state, params=None):
    del params
    g_w = 1.0 - beta if momentum == "ema" else 1.0
    mu = jax.tree.map(lambda m, g: (beta * m + g_w * g).astype(m.dtype), state.mu, updates)
    u = jax.tree.map(lambda m, g: beta * m + g_w * g, mu, updates) if nesterov else mu
    for leaf in jax.tree.leaves(u):
      if leaf.ndim < 2:
        raise ValueError(f"Muon got a parameter of shape {leaf.shape}; route vectors to AdamW (muon_labels)")
    phi = jax.tree.map(mask_fn, u, updates) if mask_fn is not None else None
    if phi is not None and mask_at == "pre":
      u = jax.tree.map(lambda u_, f: u_ * f, u, phi)
    o = orthogonalize_tree(u, coeffs=coeffs, steps=ns_steps, eps=eps, compute_dtype=ns_dtype, method=method,
                           distributed=distributed, fn=orthogonalize, split=split,
                           scale=lambda fan_in, fan_out: shape_scale(scale, fan_in, fan_out))
    if phi is not None and mask_at == "post":
      o = jax.tree.map(lambda o_, f: o_ * f, o, phi)
    return jax.tree.map(lambda o_, g: o_.astype(g.dtype), o, updates), MuonState(
        count=optax.safe_increment(state.count), mu=mu)

  tx = optax.GradientTransformation(init, update)
  if mask_fn is None:
    return tx
  return reject_complex(tx, "Muon with an alignment mask (MGUP, Cautious)", "it compares the signs of u·g")


def orthogonalize_tree(tree: PyTree, *, coeffs: Coeffs = "quintic", steps: int = 5, eps: float = 1e-7,
                       compute_dtype: jax.typing.DTypeLike | None = None, method: str = "standard",
                       distributed: bool = False, fn: Callable[[jax.Array], jax.Array] | None = None,
                       split: Split | None = None,
                       scale: Callable[[int, int], float] | None = None) -> PyTree:
  """`orthogonalize` (or `fn`, any function of a matrix stack) on every leaf, each a stack of matrices.

  With `distributed`, the same result is computed once per matrix across the devices of the current mesh
  (`optim.distributed`). `split` cuts leaves into blocks orthogonalized on their own (`optim.orthogonalizers`);
  `scale(fan_in, fan_out)` multiplies each matrix (each block) by a factor of its own shape.

  Args:
    tree: a pytree of matrix stacks (..., fan_in, fan_out).
    coeffs: the Newton–Schulz coefficients (`optim.newton_schulz.orthogonalize`; default "quintic").
    steps: Newton–Schulz iterations (static; default 5).
    eps: added to the Frobenius norm before dividing (default 1e-7).
    compute_dtype: the iteration's dtype; default: each leaf's.
    method: "standard" or "gram" (`optim.newton_schulz`).
    distributed: split the matrices over the devices of the current mesh (`optim.distributed`).
    fn: a function of a matrix stack used instead of Newton–Schulz; None: `orthogonalize`.
    split: `split(path name, shape) -> (axis, sizes) | None`, the blocks of a leaf (`optim.orthogonalizers`).
    scale: `scale(fan_in, fan_out)`, the factor on each matrix (block); None: 1.

  Returns:
    The tree of orthogonalized, scaled matrix stacks, in the leaves' shapes.
  """
  kwargs: dict[str, Any] = dict(coeffs=coeffs, steps=steps, eps=eps, compute_dtype=compute_dtype, method=method)
  if distributed:
    from optim.distributed import orthogonalize_distributed
    run = lambda t: orthogonalize_distributed(t, fn=fn, **kwargs)
  else:
    run = lambda t: jax.tree.map(fn or (lambda x: orthogonalize(x, **kwargs)), t)
  scale = scale or (lambda fan_in, fan_out: 1.0)
  if split is not None:
    from optim.orthogonalizers import split_apply
    return split_apply(tree, split, run, scale)
  return jax.tree.map(lambda o: o * scale(o.shape[-2], o.shape[-1]), run(tree))


def muon_labels(params: PyTree) -> optax.Params:
  """"muon" for hidden weight matrices, "adam" for embeddings, the output head, norms, biases and vectors.

  Decided by parameter name, then rank (`optim.trees.is_hidden_matrix`); a stacked vector named with a one-letter shape
  suffix, a DoRA magnitude `m_O` of shape (layers, O), is a vector.

  Args:
    params: the parameter tree.

  Returns:
    The params' structure with "muon" on every leaf of rank ≥ 2 whose path names no "embed", "head", "norm" or "bias"
    and that is not a named vector, "adam" on every other leaf.
  """
  return jax.tree_util.tree_map_with_path(lambda path, p: "muon" if is_hidden_matrix(path, p) else "adam", params)


@register("muon")
@with_adam_group
def muon(learning_rate: optax.ScalarOrSchedule, *, beta: Beta = 0.95, weight_decay: NonNegative = 0.1,
         momentum: MomentumForm = "ema", nesterov: bool = True, coeffs: Coeffs = "quintic",
         ns_steps: NonNegativeInt = 5, eps: NonNegative = 1e-7, scale: ShapeScale = "moonlight",
         ns_dtype: jax.typing.DTypeLike | None = None, method: NSMethod = "standard",
         mu_dtype: jax.typing.DTypeLike | None = None, adam: AdamGroup = ADAM,
         labels: PyTree | Callable[[PyTree], PyTree] | None = None, distributed: bool = False,
         orthogonalize: Callable[[jax.Array], jax.Array] | None = None,
         split: Split | None = None) -> optax.GradientTransformation:
  """Muon on hidden matrices, AdamW on the rest (`optax.partition` by `labels`).

    Muon group: W ← W − lr·(scale·NS(U) + weight_decay·W)     (decay times the unscaled lr)
    AdamW group: optax.adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, adam_eps,
                 adam_weight_decay or weight_decay), no decay on norms.

  With the default Moonlight scale one learning rate and weight decay serve both groups. `labels`
  (default `muon_labels`) is a tree or a function of the params; under `optax.inject_hyperparams`
  list a function in `static_args`, since injection treats callables as schedules; `ns_steps` is a
  loop count and always goes there: `optax.inject_hyperparams(muon, static_args=("ns_steps",))`.
  `orthogonalize` and `split` plug in another polar-factor method and per-head / fused-QKV blocks
  (`scale_by_muon`, `optim.orthogonalizers`).

  Args:
    learning_rate: the learning rate (or schedule) of both groups unless `adam_learning_rate` is given.
    beta: Muon's momentum coefficient (default 0.95).
    weight_decay: decoupled weight decay of the Muon group, and of the AdamW group unless `adam_weight_decay` is
      given (default 0.1).
    momentum: "ema" or "classic" (`scale_by_muon`).
    nesterov: Nesterov momentum (default True).
    coeffs: the Newton–Schulz coefficients (default "quintic").
    ns_steps: Newton–Schulz iterations (static; default 5).
    eps: added to the Frobenius norm before Newton–Schulz (default 1e-7).
    scale: the shape scale, a name in `SHAPE_SCALES` (default "moonlight").
    ns_dtype: the Newton–Schulz iteration's dtype; default: the update's.
    method: "standard" or "gram", the Newton–Schulz iteration (`optim.newton_schulz`).
    mu_dtype: the dtype of Muon's momentum and AdamW's first moment; default: the parameter's.
    adam: the AdamW group (`optim.adam_group.AdamGroup`), given as the keyword arguments adam_learning_rate,
      adam_b1, adam_b2, adam_eps, adam_weight_decay.
    labels: "muon" / "adam" per leaf: a tree, a prefix of the params' tree, or a function of the params; None:
      `muon_labels`.
    distributed: orthogonalize each matrix once across the devices of the current mesh (`optim.distributed`).
    orthogonalize: a polar-factor method replacing Newton–Schulz (`optim.orthogonalizers`); None: Newton–Schulz.
    split: per-head / fused-QKV blocks, `split(path name, shape) -> (axis, sizes) | None` (`optim.orthogonalizers`).

  Returns:
    The optimizer: `optax.partition` of the Muon chain (`scale_by_muon`, decoupled decay, learning rate) on the
    "muon" leaves and `optax.adamw` on the "adam" leaves.

  References:
    Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024 (KellerJordan/Muon,
      `MuonWithAuxAdam`).
    Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982, Eq. 4 (the scale that lets AdamW's
      learning rate and weight decay serve both groups; MoonshotAI/Moonlight).
  """
  core = scale_by_muon(beta, momentum=momentum, nesterov=nesterov, coeffs=coeffs, ns_steps=ns_steps, eps=eps,
                       scale=scale, ns_dtype=ns_dtype, method=method, mu_dtype=mu_dtype, distributed=distributed,
                       orthogonalize=orthogonalize, split=split)
  return muon_with_adamw(core, learning_rate, weight_decay=weight_decay, mu_dtype=mu_dtype,
                         adam=adam,
                         labels=labels)


def muon_with_adamw(core: optax.GradientTransformation, learning_rate: optax.ScalarOrSchedule, *,
                    weight_decay: float, mu_dtype: jax.typing.DTypeLike | None = None,
                    adam: AdamGroup = ADAM,
                    labels: PyTree | Callable[[PyTree], PyTree] | None = None,
                    extra_args: bool = False) -> optax.GradientTransformation:
  """The Muon family's parameter groups: `core` + decoupled decay + lr on "muon" leaves, `optax.adamw` on "adam" ones.

  `core` is a Muon-style direction; `optax.adamw` has no decay on norms and its first moment in `mu_dtype`. The groups
  come from `labels` (default `muon_labels`; a tree, a prefix of the params' tree, or a function of the params).
  Shared by muon, mgup_muon, cautious_muon and muon_mvr; `extra_args` splits extra update arguments (Muon-MVR's
  `prev_grads`) per group.

  Args:
    core: the "muon" group's direction (e.g. `scale_by_muon`).
    learning_rate: the learning rate (or schedule) of both groups unless the AdamW group has its own.
    weight_decay: decoupled weight decay of the "muon" group, and of the "adam" one unless it has its own.
    mu_dtype: AdamW's first-moment dtype; default: the parameter's.
    adam: the "adam" group's settings (`optim.adam_group.AdamGroup`).
    labels: "muon" / "adam" per leaf (a tree, a prefix, or a function of the params); None: `muon_labels`. Checked
      at init (`optim.trees.resolve_labels`).
    extra_args: pass extra update keyword arguments to each group, split like the params
      (`mask_compatible_extra_args`).

  Returns:
    The `optax.partition` of the two groups.
  """
  muon_tx = optax.chain(core, optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
  adam_tx = adam.tx(learning_rate, weight_decay, mu_dtype)
  kw = {"mask_compatible_extra_args": True} if extra_args else {}
  # A label tree may be a prefix of the params (as optax.partition reads it) or a function of them; it is
  # expanded and checked at init, so a tree that does not fit fails there with one clear error.
  label_fn = lambda p: resolve_labels(muon_labels if labels is None else labels, p, ("muon", "adam"), "Muon")
  return optax.partition({"muon": muon_tx, "adam": adam_tx}, label_fn, **kw)
