"""THE table from logical axis names to mesh axes. Models name logical axes only.

Weights and activations use different logical names, because they shard differently: a
weight's `embed` dimension is split over `fsdp` (ZeRO-3), while an activation's batch is split
over every data axis and its `act_embed` stays whole.

Resolution (`logical_to_spec`): each logical name takes the mesh axes of its rule that are
larger than 1, not manual (inside a shard_map, e.g. `sharding.replicas`) and not already used
by an earlier dimension of the same array; a dimension
whose size does not divide by the product of its mesh axes is an error, never a silent
replication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import CONTEXT, DATA, EXPERT, FSDP, STAGE, TENSOR

RULES: dict[str, tuple[str, ...]] = {
    # weights
    "vocab": (TENSOR,),
    "embed": (FSDP,),
    "mlp": (TENSOR,),
    "heads": (TENSOR,),
    "kv_heads": (TENSOR,),
    "kv": (),  # head_dim
    "layers": (STAGE,),  # the layer stack: consecutive layers per pipeline stage (sharding/pipeline.py)
    "norm": (),
    "adapter": (),  # a low-rank adapter's rank axis (models/peft.py): small, never sharded
    "expert": (EXPERT,),
    # activations
    "batch": (DATA, FSDP, EXPERT),
    "seq": (CONTEXT,),  # context parallelism: each device holds T/C positions (zig-zag, sharding/context.py)
    "act_stage": (STAGE,),  # the pipeline loop state: one microbatch slot per stage
    "act_embed": (),
    "act_heads": (TENSOR,),
    "act_kv_heads": (TENSOR,),
    "act_mlp": (TENSOR,),
    "act_vocab": (TENSOR,),
}


class ShardingError(ValueError):
  """A shape that the mesh cannot split as the rules ask."""


def logical_to_spec(names: Sequence[str | None], mesh: Mesh | AbstractMesh, shape: Sequence[int] | None = None,
                    rules: dict[str, tuple[str, ...]] = RULES) -> P:
  """PartitionSpec for an array whose dimensions carry logical `names` (None = replicated).

  Each name takes the mesh axes of its rule that are larger than 1, not manual and not used by an earlier dimension
  (module docstring); trailing unsplit dimensions are left out of the spec.

  Args:
    names: one logical axis name per dimension, None for a replicated one.
    mesh: the mesh, concrete or abstract (`jax.sharding.get_abstract_mesh()` inside jit).
    shape: the array's shape, to check that every split dimension divides; default None, unchecked.
    rules: {logical name: mesh axes}; default RULES.

  Returns:
    The PartitionSpec.

  Raises:
    ShardingError: when a name has no rule, or a dimension's size does not divide by the product of its mesh axes.
  """
  used: set[str] = set(getattr(mesh, "manual_axes", ()))  # inside a shard_map: its manual axes are not GSPMD's
  spec: list[str | tuple[str, ...] | None] = []
  for dim, name in enumerate(names):
    if name is None:
      spec.append(None)
      continue
    if name not in rules:
      raise ShardingError(f"logical axis {name!r} has no rule in sharding/rules.py (known: {sorted(rules)})")
    axes = tuple(a for a in rules[name] if mesh.shape.get(a, 1) > 1 and a not in used)
    used.update(axes)
    if shape is not None and axes:
      n = math.prod(mesh.shape[a] for a in axes)
      if shape[dim] % n:
        raise ShardingError(f"dimension {dim} ({name!r}, size {shape[dim]}) of shape {tuple(shape)} "
                            f"does not divide by mesh axes {axes} of total size {n}")
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def named_sharding(names: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None) -> NamedSharding:
  """The NamedSharding on `mesh` of an array whose dimensions carry logical `names` (`logical_to_spec`).

  Args:
    names: one logical axis name per dimension, None for a replicated one.
    mesh: the mesh.
    shape: the array's shape, to check that every split dimension divides; default None, unchecked.

  Returns:
    `NamedSharding(mesh, logical_to_spec(names, mesh, shape))`.
  """
  return NamedSharding(mesh, logical_to_spec(names, mesh, shape))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding hint for an activation inside jit; a no-op outside a mesh context (jax.set_mesh).

  Args:
    x: the activation.
    names: the logical axis names of its dimensions.

  Returns:
    `x` under `with_sharding_constraint` to the spec of `names`, or `x` itself outside a mesh or on one device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or all(n == 1 for n in mesh.shape.values()):
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, mesh, x.shape))
