"""Parameters with logical axis names, and the product the blocks apply them by.

`param` is the one constructor the dense and MoE blocks build their weights with; `matmul` the one product they apply
them by; `layer_checkpoint` what a backward pass keeps of a layer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from sharding.mesh import CONTEXT, FSDP, TENSOR


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], std: float | None,
          dtype: DTypeLike) -> nnx.Param:
  """A Param with logical axis `names`.

  Args:
    rngs: the random streams; the `params` stream draws the initial value.
    shape: the parameter's shape.
    names: one logical axis name (or None) per dimension (sharding/rules.py maps them to mesh axes).
    std: truncated normal of this standard deviation; 0: ones (norm scales); None: zeros (biases).
    dtype: the parameter dtype.

  Returns:
    The `nnx.Param`, its sharding given by `names` (not applied eagerly).
  """
  init = (nnx.initializers.zeros if std is None else
          nnx.initializers.truncated_normal(std) if std else nnx.initializers.ones)
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


def matmul(x: jax.Array, w: Any, dt: DTypeLike) -> jax.Array:
  """`x @ w` for a weight variable `w` in compute dtype `dt`.

  A weight that computes its own product (a quantized weight of models/quant.py, which may quantize x too; an adapter
  of models/peft.py, in factorized form) is asked to; any other is read whole (`w[...]`). The product runs on the 2-D
  [rows, fan_in] view of x: its weight gradient then contracts one axis, not B and T, which XLA's CPU backend does
  without transposing the activation gradient (issue 50: the 3-D form cost optlab's step ~40% of the JAX floor's
  speed). Under context parallelism (a `context` mesh axis splits T) x keeps its shape: merging B with a split T has
  no tiled sharding.

  Args:
    x: the activations, (..., fan_in).
    w: the weight variable: an `nnx.Param` of (fan_in, fan_out), or a variable with a `matmul(x, dt)` method.
    dt: the compute dtype.

  Returns:
    The product, (..., fan_out).
  """
  if hasattr(w, "matmul"):
    return w.matmul(x, dt)
  if x.ndim > 2 and context_size() == 1:
    return (x.reshape(-1, x.shape[-1]) @ w[...].astype(dt)).reshape(*x.shape[:-1], -1)
  return x @ w[...].astype(dt)


def layer_checkpoint(layer: Any, stacked: Any, dt: DTypeLike, remat: bool) -> Any:
  """A layer function as the backward pass should keep it.

  `remat`: recomputed whole (`jax.checkpoint`: only its input kept). Otherwise, when some floating-point weight of
  `stacked` is stored in another dtype than the compute dtype `dt` (a bfloat16 fine-tune computing in float32), the
  backward keeps the products' outputs and recomputes the rest (`jax.checkpoint_policies.dots_saveable`): elementwise
  work, and the weights' casts to `dt`, which a backward keeping everything would hold for every layer (a float32 copy
  of the model: twice its bfloat16 self). A layer stored in the compute dtype is returned as is.

  Args:
    layer: the layer, `layer(x, state) -> (x, aux)`.
    stacked: the layers' weights (any tree of arrays).
    dt: the compute dtype.
    remat: recompute the whole layer.

  Returns:
    The layer function to scan.
  """
  if remat:
    return jax.checkpoint(layer, prevent_cse=False)
  if not narrow_weights(stacked, dt):
    return layer
  return jax.checkpoint(layer, prevent_cse=False, policy=jax.checkpoint_policies.dots_saveable)


def narrow_weights(tree: Any, dt: DTypeLike) -> bool:
  """Whether some floating-point leaf of `tree` is stored in another dtype than the compute dtype `dt`.

  Args:
    tree: weights (any tree of arrays).
    dt: the compute dtype.

  Returns:
    True when a weight must be cast to compute.
  """
  return any(jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.dtype(dt) for a in jax.tree.leaves(tree))


def context_size() -> int:
  """The size of the current mesh's `context` axis (1 outside a mesh or without the axis).

  Read here rather than from sharding/context.py, which imports the attention kernels of this package.

  Returns:
    The axis size.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.shape.get(CONTEXT, 1)


def whole_weights() -> bool:
  """Whether the current mesh leaves every weight whole on each device: no `fsdp` or `tensor` axis above 1 (or no mesh).

  Returns:
    True when the weights are replicated.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or all(mesh.shape.get(axis, 1) == 1 for axis in (FSDP, TENSOR))
