"""Parameters with logical axis names: the one constructor the dense and MoE blocks build their weights with, and the one
product they apply them by."""

from __future__ import annotations

from flax import nnx


def param(rngs: nnx.Rngs, shape, names, std, dtype):
  """A Param with logical axis `names`: truncated normal of `std`, ones for std 0 (norm scales), zeros for None
  (biases)."""
  init = (nnx.initializers.zeros if std is None else
          nnx.initializers.truncated_normal(std) if std else nnx.initializers.ones)
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


def matmul(x, w, dt):
  """x @ w for a weight variable `w` in compute dtype `dt`. A weight that computes its own product (a quantized weight
  of models/quant.py, which may quantize x too; an adapter of models/peft.py, in factorized form) is asked to; any other
  is read whole (`w[...]`)."""
  if hasattr(w, "matmul"):
    return w.matmul(x, dt)
  return x @ w[...].astype(dt)
