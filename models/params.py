"""Parameters with logical axis names, and the product the blocks apply them by.

`param` is the one constructor the dense and MoE blocks build their weights with; `matmul` the one product they apply
them by.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.typing import DTypeLike


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


def context_size() -> int:
  """The size of the current mesh's `context` axis (1 outside a mesh or without the axis).

  Read here rather than from sharding/context.py, which imports the attention kernels of this package.

  Returns:
    The axis size.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.shape.get("context", 1)
