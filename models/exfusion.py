"""ExFusion: a dense FFN trained as several experts fused in weight space, deployed as one dense FFN.

Ruan, Dong, Qu et al., "ExFusion: Efficient Transformer Training via Multi-Experts Fusion", arXiv 2603.27965, IEEE TMM
2026.

What the paper states (its abstract; no code is public and the method section was not readable here): at
initialisation each FFN is upcycled into E experts, each with a weight for parameter fusion; during training the
experts are fused with these weights into one FFN equivalent to the original, which computes the forward pass (a
dense FFN's cost plus the fusion); after training the learned weights fuse the experts into a single dense FFN.

The rule implemented, for each SwiGLU matrix W ∈ {W_gate (D, F), W_up (D, F), W_down (F, D)} of every dense block:
  W̄ = Σ_e α_e W_e,   α = softmax(a),   a ∈ R^E learnable per matrix and layer (0 at expansion: α_e = 1/E)
and the block computes its FFN with W̄ (`Fused.matmul`); `fuse` replaces each `Fused` by the plain weight W̄, so the
fused model computes what the trained one did, at the dense model's inference cost.

Choices of ours, stated because the paper's text was not available: α a softmax of free logits; the experts start at
W_e = W + ε_e with ε_e ~ N(0, (noise·std(W))²) drawn per entry and centred over the experts (Σ_e ε_e = 0, so the
expanded model equals the dense one exactly at α = 1/E). Without noise the copies stay identical under any
optimizer that treats them alike (∂L/∂W_e = α_e ∂L/∂W̄), and the expansion is a reparameterisation of the dense model.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

DEFAULT_TARGETS = r"blocks/w_(gate|up)_DF$|blocks/w_down_FD$"  # the dense SwiGLU matrices of every block


class ExFusionError(ValueError):
  """A model or argument ExFusion cannot use."""


def _names(v: nnx.Variable) -> tuple:
  return tuple(v.get_metadata().get("out_sharding") or (None,) * v.ndim)


class Fused(nnx.Module):
  """E experts of one weight, (..., E, I, O), and fusion logits (..., E): the weight used is Σ_e softmax(a)_e W_e.

  The experts start at W_e = W + ε_e, ε_e ~ N(0, (noise·std(W))²) per entry, centred over the experts (Σ_e ε_e = 0),
  and the logits at 0 (α_e = 1/E): the fused weight is W exactly.

  Args:
    w: the weight it replaces (..., I, O); the experts inherit its logical axis names, with "expert" before I.
    experts: E.
    noise: the perturbation's scale relative to std(W) (per matrix).
    key: the perturbation's PRNG key.
  """

  def __init__(self, w: nnx.Variable, experts: int, noise: float, key: jax.Array):
    *lead, fan_in, fan_out = w.shape
    names = _names(w)
    base = w.get_value()
    eps = jax.random.normal(key, (*lead, experts, fan_in, fan_out), base.dtype)
    eps = noise * jnp.std(base, axis=(-2, -1), keepdims=True)[..., None, :, :] * eps
    eps = eps - jnp.mean(eps, axis=-3, keepdims=True)  # Σ_e ε_e = 0: the expanded model is the dense one
    self.experts_EIO = nnx.Param(base[..., None, :, :] + eps, out_sharding=(*names[:-2], "expert", *names[-2:]),
                                 eager_sharding=False)
    self.logits_E = nnx.Param(jnp.zeros((*lead, experts), base.dtype), out_sharding=(*names[:-2], None),
                              eager_sharding=False)
    self.names = names

  def alphas(self) -> jax.Array:
    """The fusion weights α = softmax(a).

    Returns:
      (..., E), summing to 1 over E.
    """
    return jax.nn.softmax(self.logits_E[...], axis=-1)

  def weight(self) -> jax.Array:
    """W̄ = Σ_e α_e W_e, in the parameters' dtype.

    Returns:
      (..., I, O).
    """
    return jnp.einsum("...e,...eio->...io", self.alphas().astype(self.experts_EIO.dtype), self.experts_EIO[...])

  def __getitem__(self, index):
    return self.weight()[index]

  def matmul(self, x_NI: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """The projection by the fused weight: x W̄ (what the model's `matmul(x, w, dt)` calls).

    Args:
      x_NI: the input rows.
      dt: the compute dtype.

    Returns:
      x W̄ in `dt`, (N, O).
    """
    return x_NI @ self.weight().astype(dt)


def _slots(model: nnx.Module):
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      for name, value in list(vars(node).items()):
        yield node, name, "/".join(str(k) for k in (*path, name)), value


def expand(model: nnx.Module, experts: int = 4, *, noise: float = 0.01, targets: str = DEFAULT_TARGETS,
           seed: int = 0) -> nnx.Module:
  """The training form, in place: every target weight becomes `Fused`; the model's function is unchanged.

  Args:
    model: a dense transformer (changed in place).
    experts: E, the experts of each weight (default 4).
    noise: the experts' perturbation relative to std(W) (default 0.01; 0: identical copies, which stay identical).
    targets: a regular expression searched in each parameter's path (default `DEFAULT_TARGETS`: the dense SwiGLU
      matrices of every block).
    seed: the perturbations' seed (default 0).

  Returns:
    The model, each target at α = 1/E.

  Raises:
    ExFusionError: when experts < 1 or noise < 0, the model is already expanded, or `targets` matches no weight
      matrix (an MoE model's FFNs are experts already).
  """
  if experts < 1 or noise < 0:
    raise ExFusionError(f"experts must be >= 1 and noise >= 0, got experts={experts}, noise={noise}")
  if any(isinstance(n, Fused) for _, n in nnx.iter_graph(model)):
    raise ExFusionError("the model is already expanded; fuse(model) first")
  chosen = [(m, n, p, v) for m, n, p, v in _slots(model) if isinstance(v, nnx.Param) and v.ndim >= 2
            and re.search(targets, p)]
  if not chosen:
    kind = "an MoE model (its FFNs are experts already)" if getattr(getattr(model, "c", None), "moe", None) else \
        "no weight matrix"
    raise ExFusionError(f"targets {targets!r} match {kind}; ExFusion expands dense FFNs")
  for (module, name, _, param), key in zip(chosen, jax.random.split(jax.random.key(seed), len(chosen))):
    setattr(module, name, Fused(param, experts, noise, key))
  return model


def fuse(model: nnx.Module) -> nnx.Module:
  """The deployed form, in place: each `Fused` replaced by the plain weight Σ_e α_e W_e.

  Args:
    model: a model `expand` expanded (changed in place); it then computes what the trained one did, at the dense
      model's inference cost.

  Returns:
    The model.

  Raises:
    ExFusionError: when the model has no `Fused` weight.
  """
  found = False
  for module, name, _, value in list(_slots(model)):
    if isinstance(value, Fused):
      setattr(module, name, nnx.Param(value.weight(), out_sharding=value.names, eager_sharding=False))
      found = True
  if not found:
    raise ExFusionError("the model has no ExFusion experts to fuse (expand it first)")
  return model


def fusion_weights(model: nnx.Module) -> dict[str, jax.Array]:
  """The fusion weights of every `Fused` weight.

  Args:
    model: an expanded model.

  Returns:
    {path: α (..., E)}.
  """
  return {"/".join(str(k) for k in p): n.alphas() for p, n in nnx.iter_graph(model) if isinstance(n, Fused)}
