"""Scion: momentum, then the linear minimization oracle (LMO) of a norm ball chosen per layer type.

Pethick et al., "Training Deep Learning Models with Norm-Constrained LMOs", arXiv 2502.07529; LIONS-EPFL/scion.

For a direction d and the unit ball of a norm, the LMO argmin_{‖x‖≤1} ⟨d, x⟩ is −lmo(d) with lmo(d) below; each
layer moves along ρ·lmo(d), ρ (`scale`) being the ball's radius. Layouts: every matrix is (fan_in, fan_out)
(torch's (out, in) transposed); leading axes (layers, experts) are a stack, each matrix on its own. The paper's
"column" of a torch weight (one input unit's weights, e.g. one token's embedding) is a ROW here.

  spectral  RMS→RMS operator norm:  √(fan_out/fan_in)·NS(d)  (normalized; √fan_out·NS(d) unnormalized)
  colnorm   1→RMS (one-hot inputs): each row (input unit) d_i·√fan_out/‖d_i‖₂, also ÷fan_in if normalized
  rownorm   RMS→∞:                  each column (output unit) d_j/‖d_j‖₂, also ÷√fan_in if normalized
  sign      ℓ∞ (max-norm) ball:     sign(d), ÷fan_in if normalized (RMS→∞ on the head)
  bias_rms  RMS ball of a vector:   d/RMS(d) over the last axis (norm gains, biases; stacked per layer)

NS is quintic Newton–Schulz (`optim.muon.orthogonalize_tree`); the column/row/RMS denominators add `eps` (1e-8)
after the normalization factors, as the reference code does (so every LMO maps 0 to 0: no division by zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.hparams import Beta, Choices, NonNegative, NonNegativeInt, Positive
from optim.muon import orthogonalize_tree
from optim.newton_schulz import Coeffs
from optim.registry import UnknownOptimizerError, register
from optim.trees import is_named_vector, path_name, resolve_labels

LMOS = ("spectral", "colnorm", "rownorm", "sign", "bias_rms")
MATRIX_LMOS = ("spectral", "colnorm", "rownorm")  # defined on matrices only
Lmo = Annotated[str, Choices(LMOS)]  # a factory's `*_lmo`
LAYER_TYPES = ("hidden", "embed", "head", "vector")
PyTree = Any


class ScionError(UnknownOptimizerError):
  """A Scion setting that cannot work (a ValueError; the train CLI prints it as one line)."""


class ScionState(NamedTuple):
  """Scion's state: the step count and the averaged gradient d."""

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed; int32 steps taken
  mu: optax.Updates  # the averaged gradient d (the paper's d), shaped (and sharded) like the parameters


def _sumsq(x, axis):
  return jnp.sum(jnp.real(x * jnp.conj(x)), axis=axis, keepdims=True)  # |x|², also complex


def lmo_direction(d: jax.Array, lmo: str, *, normalized: bool = True, eps: float = 1e-8) -> jax.Array:
  """lmo(d) of one leaf for every LMO but "spectral" (see the module docstring), in at least float32.

  Matrix LMOs read the last two axes as (fan_in, fan_out); "bias_rms" normalizes over the last axis (a 0-d
  leaf by its modulus); "sign" on a leaf with fewer than 2 axes is never normalized (it has no fan_in).

  Args:
    d: the direction, one leaf.
    lmo: "colnorm", "rownorm", "sign" or "bias_rms".
    normalized: divide by the fan_in factor (module docstring; default True).
    eps: added to the colnorm / rownorm / bias_rms denominators (default 1e-8).

  Returns:
    lmo(d), d's shape, in d's dtype promoted to at least float32.

  Raises:
    ScionError: when a matrix LMO gets a leaf with fewer than two axes, or `lmo` is unknown (or "spectral").

  References:
    Pethick et al., "Training Deep Learning Models with Norm-Constrained LMOs", 2025, arXiv 2502.07529; reference
      code LIONS-EPFL/scion.
  """
  x = d.astype(jnp.promote_types(d.dtype, jnp.float32))
  if lmo == "sign":
    out = jnp.sign(x)  # x/|x| for complex entries: the LMO of the complex max-modulus ball
    return out / d.shape[-2] if normalized and d.ndim >= 2 else out
  if lmo == "bias_rms":
    rms = jnp.sqrt(_sumsq(x, -1) / x.shape[-1]) if x.ndim else jnp.abs(x)
    return x / (rms + eps)
  if x.ndim < 2:
    raise ScionError(f"Scion's {lmo!r} LMO needs a matrix (or a stack of them), got shape {d.shape}; label "
                     "vectors 'vector' (scion_labels)")
  fan_in, fan_out = x.shape[-2:]
  if lmo == "colnorm":  # the reference's ColNorm: per torch column = per row here, RMS over fan_out
    rms = jnp.sqrt(_sumsq(x, -1)) / math.sqrt(fan_out)
    return x / ((rms * fan_in if normalized else rms) + eps)
  if lmo == "rownorm":  # the reference's RowNorm: per torch row = per column here, norm over fan_in
    norm = jnp.sqrt(_sumsq(x, -2))
    return x / ((norm * math.sqrt(fan_in) if normalized else norm) + eps)
  raise ScionError(f"unknown Scion LMO {lmo!r}; choose from {', '.join(LMOS)}")


def spectral_scale(fan_in: int, fan_out: int, normalized: bool = True) -> float:
  """The spectral LMO's factor on NS(d): √(fan_out/fan_in) (RMS→RMS norm) or √fan_out (unnormalized).

  Args:
    fan_in: the matrix's input dimension.
    fan_out: the matrix's output dimension.
    normalized: the RMS→RMS factor (default True) or the unnormalized one.

  Returns:
    The factor.
  """
  return math.sqrt(fan_out / fan_in) if normalized else math.sqrt(fan_out)


def scale_by_scion(lmo: str = "spectral", *, momentum: float = 0.1, scale: float = 1.0, normalized: bool = True,
                   eps: float = 1e-8, coeffs: Coeffs = "quintic", ns_steps: int = 5, ns_eps: float = 1e-7,
                   ns_dtype: jax.typing.DTypeLike | None = None, mu_dtype: jax.typing.DTypeLike | None = None,
                   distributed: bool = False) -> optax.GradientTransformation:
  """D ← (1−α)·d + α·g (α = `momentum`, Scion's convention: α = 1 keeps no history); returns scale·lmo(d).

  The spectral LMO's Newton–Schulz is `optim.newton_schulz.orthogonalize`: X/(‖X‖_F + ns_eps), then the polynomial
  ns_steps times, in ns_dtype (default: d's dtype).

  Args:
    lmo: "spectral", "colnorm", "rownorm", "sign" or "bias_rms" (module docstring), for every leaf.
    momentum: α, the new gradient's weight (1 − the usual momentum β).
    scale: ρ, the norm ball's radius.
    normalized: divide by the fan_in factor (the paper's choice for every layer but the input one).
    eps: added to the colnorm / rownorm / bias_rms denominators.
    coeffs: the spectral LMO's Newton–Schulz coefficients (default "quintic").
    ns_steps: the spectral LMO's Newton–Schulz iterations (static; default 5).
    ns_eps: the spectral LMO's Newton–Schulz eps (default 1e-7).
    ns_dtype: the spectral LMO's Newton–Schulz dtype (default: d's dtype).
    mu_dtype: dtype of d (default: the parameter's).
    distributed: the spectral LMO's Newton–Schulz once per matrix across the mesh (`optim.distributed`).

  Returns:
    A transformation whose update is scale·lmo(d) in the gradient's dtype, with a `ScionState`; its update raises
    `ScionError` when a matrix LMO meets a leaf with fewer than two axes.

  Raises:
    ScionError: when `lmo` is not one of `LMOS`.

  References:
    Pethick et al., "Training Deep Learning Models with Norm-Constrained LMOs", 2025, arXiv 2502.07529; reference
      code LIONS-EPFL/scion.
  """
  if lmo not in LMOS:
    raise ScionError(f"unknown Scion LMO {lmo!r}; choose from {', '.join(LMOS)}")

  def init(params):
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params)
    return ScionState(count=jnp.zeros([], jnp.int32), mu=mu)

  def update(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: ((1.0 - momentum) * m + momentum * g).astype(m.dtype), state.mu, updates)
    if lmo == "spectral":
      for leaf in jax.tree.leaves(mu):
        if leaf.ndim < 2:
          raise ScionError(f"Scion's 'spectral' LMO needs a matrix (or a stack of them), got shape {leaf.shape}; "
                           "label vectors 'vector' (scion_labels)")
      o = orthogonalize_tree(mu, coeffs=coeffs, steps=ns_steps, eps=ns_eps, compute_dtype=ns_dtype,
                             distributed=distributed)
      o = jax.tree.map(lambda o_: o_ * spectral_scale(o_.shape[-2], o_.shape[-1], normalized), o)
    else:
      o = jax.tree.map(lambda m: lmo_direction(m, lmo, normalized=normalized, eps=eps), mu)
    out = jax.tree.map(lambda o_, g: (scale * o_).astype(g.dtype), o, updates)
    return out, ScionState(count=optax.safe_increment(state.count), mu=mu)

  return optax.GradientTransformation(init, update)


def scion_labels(params: PyTree) -> optax.Params:
  """The layer type of every leaf, by parameter name, then rank.

  "vector" for norms, biases, named vectors (`m_O`: `is_named_vector`) and leaves with fewer than 2 axes; "embed"
  for names containing "embed" (the input layer); "head" for "head" (the output layer); "hidden" for the other
  matrices and stacks of them. A tied embedding (used as the head too) is "embed"; relabel it to take the head's
  LMO instead.

  Args:
    params: the parameter tree.

  Returns:
    The params' structure with one of `LAYER_TYPES` per leaf.
  """
  def label(path, p):
    name = path_name(path).lower()
    if "norm" in name or "bias" in name or jnp.ndim(p) < 2 or is_named_vector(path):
      return "vector"
    return "embed" if "embed" in name else "head" if "head" in name else "hidden"
  return jax.tree_util.tree_map_with_path(label, params)


@register("scion")
def scion(learning_rate: optax.ScalarOrSchedule, *, momentum: Beta = 0.1, constrained: bool = True,
          weight_decay: NonNegative = 0.0, hidden_scale: Positive = 3.0, embed_scale: Positive = 1.0,
          head_scale: Positive = 10.0, vector_scale: Positive = 1.0, hidden_lmo: Lmo = "spectral",
          embed_lmo: Lmo = "colnorm", head_lmo: Lmo = "sign", vector_lmo: Lmo = "bias_rms", eps: NonNegative = 1e-8,
          coeffs: Coeffs = "quintic", ns_steps: NonNegativeInt = 5, ns_eps: NonNegative = 1e-7,
          ns_dtype: jax.typing.DTypeLike | None = None, mu_dtype: jax.typing.DTypeLike | None = None,
          labels: PyTree | Callable[[PyTree], PyTree] | None = None,
          distributed: bool = False) -> optax.GradientTransformation:
  """Scion: per layer type, the LMO of its norm ball applied to the averaged gradient (`scale_by_scion`).

    d ← (1−α)·d + α·g                                          (α = momentum)
    constrained (SCG, Frank–Wolfe):  W ← (1−lr)·W − lr·ρ·lmo(d)        (W stays in the ball of radius ρ)
    unconstrained (uSCG):            W ← W − lr·(ρ·lmo(d) + weight_decay·W)

  Layer types by `labels` (default `scion_labels`; a tree, a prefix of the params' tree or a function of the
  params): "hidden" (hidden_lmo, hidden_scale), "embed" (embed_lmo, embed_scale; never normalized by fan_in: the
  paper's input-layer choice), "head" (head_lmo, head_scale) and "vector" (vector_lmo, vector_scale; "bias_rms" or
  "sign"). The defaults are the paper's GPT norms (LIONS-EPFL/scion examples/shallow-nanogpt, untied: ColNorm
  embedding radius 1, Spectral hidden radius 3, Sign head radius 10; momentum 0.1 as its README advises) and the
  reference class's constrained mode; its nanoGPT with a tied head uses hidden_scale=50, head_scale=3000 and
  lr 2⁻¹². `weight_decay` (decoupled, times lr) acts in the unconstrained mode only and never on "vector" leaves;
  the constrained mode shrinks every leaf, as the paper's does.

  Differences from the references: the reference class (LIONS-EPFL/scion `Scion`) defaults to momentum 1.0 and
  has no weight decay; pytorch_optimizer 4.1.0 `SCION` defaults to constraint=False, scale 1.0 per group, divides
  Newton–Schulz's input by max(‖X‖_F, 1e-7) (here ‖X‖_F + ns_eps, the reference's) and iterates in bf16 (both
  references; here in d's dtype unless `ns_dtype`). Under `optax.inject_hyperparams` list `ns_steps` (and a
  `labels` function) in `static_args`; α, the scales, weight_decay, eps and ns_eps are injectable.

  Args:
    learning_rate: the learning rate or schedule.
    momentum: α, the new gradient's weight (default 0.1).
    constrained: the constrained mode (SCG; default True) or the unconstrained one (uSCG).
    weight_decay: decoupled, times lr; the unconstrained mode only, never on "vector" leaves (default 0).
    hidden_scale: ρ of the "hidden" leaves (default 3).
    embed_scale: ρ of the "embed" leaves (default 1).
    head_scale: ρ of the "head" leaves (default 10).
    vector_scale: ρ of the "vector" leaves (default 1).
    hidden_lmo: the "hidden" leaves' LMO (default "spectral").
    embed_lmo: the "embed" leaves' LMO (default "colnorm").
    head_lmo: the "head" leaves' LMO (default "sign").
    vector_lmo: the "vector" leaves' LMO, "bias_rms" (default) or "sign".
    eps: added to the colnorm / rownorm / bias_rms denominators (default 1e-8).
    coeffs: the spectral LMO's Newton–Schulz coefficients (default "quintic").
    ns_steps: Newton–Schulz iterations (static; default 5).
    ns_eps: Newton–Schulz's eps (default 1e-7).
    ns_dtype: Newton–Schulz's dtype (default: d's).
    mu_dtype: dtype of d (default: the parameter's).
    labels: the layer type per leaf (a tree, a prefix, or a function of the params); None: `scion_labels`.
    distributed: the spectral LMO's Newton–Schulz once per matrix across the mesh (`optim.distributed`).

  Returns:
    The `optax.partition` of the four layer types, each `scale_by_scion`, decay (the constrained mode's shrink) and
    the learning rate.

  Raises:
    ScionError: when a hidden / embed / head LMO is not a matrix or sign LMO, or `vector_lmo` is not "bias_rms" or
      "sign".

  References:
    Pethick et al., "Training Deep Learning Models with Norm-Constrained LMOs", 2025, arXiv 2502.07529; reference
      code LIONS-EPFL/scion.
  """
  for kind, name in (("hidden", hidden_lmo), ("embed", embed_lmo), ("head", head_lmo)):
    if name not in LMOS or name == "bias_rms":
      raise ScionError(f"Scion's {kind}_lmo must be one of {', '.join(LMOS[:-1])}, got {name!r}")
  if vector_lmo not in ("bias_rms", "sign"):
    raise ScionError(f"Scion's vector_lmo must be 'bias_rms' or 'sign', got {vector_lmo!r}")
  ns: dict[str, Any] = dict(momentum=momentum, eps=eps, coeffs=coeffs, ns_steps=ns_steps, ns_eps=ns_eps,
                            ns_dtype=ns_dtype, mu_dtype=mu_dtype, distributed=distributed)
  shrink = 1.0 if constrained else weight_decay

  def group(lmo, scale, normalized, decay):
    return optax.chain(scale_by_scion(lmo, scale=scale, normalized=normalized, **ns), optax.add_decayed_weights(decay),
                       optax.scale_by_learning_rate(learning_rate))

  groups = {"hidden": group(hidden_lmo, hidden_scale, True, shrink),
            "embed": group(embed_lmo, embed_scale, False, shrink),
            "head": group(head_lmo, head_scale, True, shrink),
            "vector": group(vector_lmo, vector_scale, False, 1.0 if constrained else 0.0)}
  label_fn = lambda p: resolve_labels(scion_labels if labels is None else labels, p, LAYER_TYPES, "Scion")
  return optax.partition(groups, label_fn)
