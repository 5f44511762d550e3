"""ZeRO-style distributed orthogonalization: every matrix is orthogonalized once, on one device, whole.

Left to the partitioner, a matrix split over devices is either gathered whole onto every device, which then
repeats all the others' Newton–Schulz work, or has XXᵀ all-reduced inside every iteration. Instead, as in
Dion's megabatch Muon (microsoft/dion `megabatch_base.py`), marin's `stack_batch_sharded` grug Muon, and in the
spirit of Moonlight's Distributed Muon (arXiv 2502.16982, Algorithm 1):

  1. every leaf (..., m, n) is a stack of k matrices (layers, experts); tall ones are transposed, so a group is
     keyed by (short side, long side, dtype) and w_down (F, D) joins w_up (D, F);
  2. each group is one batch X_KSL (K = Σk, S ≤ L the matrix sides), zero-padded to K' = D·⌈K/D⌉ for the D
     devices of the mesh (NS maps 0 to 0, and the padding is dropped afterwards);
  3. X_KSL is redistributed to P(all mesh axes, None, None): device d holds matrices [d·K'/D, (d+1)·K'/D), whole;
  4. one batched `orthogonalize` runs there under `shard_map` (no collective inside its loop);
  5. the result goes back the same way and each leaf takes its own sharding again.

Step 3 starts from the batch axis whole and moves one mesh axis at a time onto it (a chain of sharding
constraints whose matrix dimensions stay unconstrained): XLA's partitioner turns each move into one all-to-all
over that axis, or a local slice for an axis the matrices are replicated over, where a direct jump from
(None, fsdp, tensor) to ((fsdp, tensor), None, None) is compiled as a full all-gather ("involuntary full
rematerialization"). Per device, NS work is ⌈K/D⌉ matrices per group, not K; each all-to-all's per-device
result is that device's share of the padded group; over an axis the parameters are replicated on (data
parallelism) the results are all-gathered, 1/|fsdp·tensor| of each padded group per device, which is what
every data replica needs to apply the update anyway.

Limits. Leaves whose stack axes are split over a mesh axis (experts over `expert`, ZeRO-1 state over `data` on
the layer axis) have those axes gathered before the chain and after it (the stack axes come back whole, then
the consumer slices): correct, but that traffic is an all-gather over that axis, not an all-to-all. Padding
costs up to D−1 zero matrices per group (the tiny preset's 2-layer stacks pad 4 and 6 matrices to 8).

On Explicit meshes the same program runs under `jax.sharding.auto_axes` with each leaf's type sharding as the
output sharding; on Auto meshes each result leaves with its stack axes whole and its matrix axes to the
partitioner, which gives it its consumer's sharding (the parameter's, in an optimizer step). Not `shard_alike`:
its global group ids change the program at every lowering, so the persistent compilation cache would always
miss. With no mesh, one device, or manual axes (inside `shard_map`), this is plain per-leaf `orthogonalize`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optim.newton_schulz import ns_flops, orthogonalize

PyTree = Any


class DistributedError(ValueError):
  """Input that distributed orthogonalization cannot take."""


def batch_axes(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> tuple[str, ...]:
  """The mesh axes a group's batch is split over: all of them larger than 1, in mesh order.

  Args:
    mesh: a concrete or abstract mesh.

  Returns:
    The names of the mesh axes of size > 1.
  """
  return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)


def shape_groups(tree: PyTree) -> dict[tuple, int]:
  """{(short side, long side, dtype name): matrices K} over the leaves (arrays or shapes) of `tree`.

  Args:
    tree: a pytree of matrix stacks (..., m, n): arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    For each (short side, long side, dtype name), the number of matrices K of that group over all the leaves.
  """
  counts: dict[tuple, int] = {}
  for x in jax.tree.leaves(tree):
    counts[_key(x)] = counts.get(_key(x), 0) + math.prod(x.shape[:-2])
  return counts


def ns_flops_per_device(tree: PyTree, devices: int, steps: int = 5, method: str = "standard",
                        distributed: bool = True) -> float:
  """Newton–Schulz matmul FLOPs one device spends on `tree`.

  Σ_groups ⌈K/D⌉·ns_flops(S, L) distributed over `devices`, Σ K·ns_flops(S, L) when every device orthogonalizes every
  matrix (the per-leaf path on a mesh).

  Args:
    tree: a pytree of matrix stacks (..., m, n): arrays or `jax.ShapeDtypeStruct`s.
    devices: D, the devices the groups are split over.
    steps: Newton–Schulz iterations (default 5).
    method: "standard" or "gram" (`optim.newton_schulz.ns_flops`).
    distributed: True: each device takes ⌈K/D⌉ matrices of a group; False: every device does all K.

  Returns:
    The FLOPs of one device's matrix products.
  """
  return sum((-(-k // devices) if distributed else k) * ns_flops(s, l, steps, method)
             for (s, l, _), k in shape_groups(tree).items())


def orthogonalize_distributed(tree: PyTree, *, coeffs: str | Sequence = "quintic", steps: int = 5, eps: float = 1e-7,
                              compute_dtype: jax.typing.DTypeLike | None = None, method: str = "standard",
                              fn: Callable[[jax.Array], jax.Array] | None = None) -> PyTree:
  """`orthogonalize` of every leaf (a stack of matrices (..., m, n)), each matrix computed once in the mesh.

  Call inside `jax.jit` under `jax.set_mesh(mesh)` (Auto or Explicit axes). Returns the tree with each leaf in
  its own shape, dtype and sharding; numerically the per-leaf `orthogonalize` (same coefficients, steps, eps,
  compute dtype and method; see `optim.newton_schulz`). Without a mesh, on one device, or inside `shard_map`
  (manual axes), it is exactly that per-leaf call. `fn`, any function of a matrix stack, replaces `orthogonalize`
  (and its settings) and receives each device's whole matrices the same way (transposed to short × long).

  Args:
    tree: a pytree of matrix stacks (..., m, n).
    coeffs: the Newton–Schulz coefficients (`optim.newton_schulz.orthogonalize`; default "quintic").
    steps: Newton–Schulz iterations (static; default 5).
    eps: added to the Frobenius norm before dividing (default 1e-7).
    compute_dtype: the iteration's dtype; default: each leaf's.
    method: "standard" or "gram" (`optim.newton_schulz`).
    fn: a function of a matrix stack replacing `orthogonalize` and its settings; None: `orthogonalize`.

  Returns:
    The orthogonalized tree, each leaf in its own shape, dtype and sharding.

  Raises:
    DistributedError: when a leaf has fewer than two axes (route vectors to another optimizer: `optim.muon_labels`).

  References:
    Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982, Algorithm 1 (Distributed Muon).
    microsoft/dion `megabatch_base.py` (megabatch Muon); marin-community/marin `grugmuon.py` (`stack_batch_sharded`).
  """
  kwargs: dict[str, Any] = dict(coeffs=coeffs, steps=steps, eps=eps, compute_dtype=compute_dtype, method=method)
  fn = fn or functools.partial(orthogonalize, **kwargs)
  leaves, treedef = jax.tree.flatten(tree)
  for x in leaves:
    if jnp.ndim(x) < 2:
      raise DistributedError(f"distributed orthogonalization needs stacks of matrices (..., m, n), got shape "
                             f"{jnp.shape(x)}; route vectors to another optimizer (optim.muon_labels)")
  mesh = jax.sharding.get_abstract_mesh()
  manual = not mesh.empty and AxisType.Manual in mesh.axis_types
  if mesh.empty or manual or not batch_axes(mesh) or not leaves:
    return jax.tree.map(fn, tree)
  run = functools.partial(_distribute, axes=batch_axes(mesh), fn=fn)
  explicit = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
  if explicit:  # the partitioner plans the moves; each result is pinned to its leaf's type sharding
    specs = [jax.typeof(x).sharding.spec for x in leaves]
    run = jax.sharding.auto_axes(run, axes=explicit, out_sharding=specs)
  return jax.tree.unflatten(treedef, run(leaves))


def _key(x) -> tuple:
  m, n = x.shape[-2:]
  return (min(m, n), max(m, n), jnp.dtype(x.dtype).name)


def _distribute(leaves: list, *, axes: tuple[str, ...], fn) -> list:
  mesh = jax.sharding.get_abstract_mesh()
  devices = math.prod(mesh.shape[a] for a in axes)
  groups: dict[tuple, list[int]] = {}
  for i, x in enumerate(leaves):
    groups.setdefault(_key(x), []).append(i)
  out: list = [None] * len(leaves)
  batch_spec = P(axes, None, None)
  local_ns = jax.shard_map(fn, in_specs=batch_spec, out_specs=batch_spec)
  for (short, long, dtype), members in groups.items():
    stacks = [_as_wide_stack(leaves[i]) for i in members]
    total = sum(s.shape[0] for s in stacks)
    padded = devices * -(-total // devices)
    if padded > total:
      stacks.append(jnp.zeros((padded - total, short, long), dtype))
    x_KSL = jnp.concatenate(stacks, axis=0) if len(stacks) > 1 else stacks[0]
    for j in range(0, len(axes) + 1):  # one mesh axis at a time onto the batch axis: all-to-all or local slice
      x_KSL = _constrain(x_KSL, axes[:j])
    o_KSL = local_ns(x_KSL)  # (K'/D, S, L) per device
    for j in reversed(range(len(axes))):
      o_KSL = _constrain(o_KSL, axes[:j])
    start = 0
    for i in members:
      k = math.prod(leaves[i].shape[:-2])
      o = _from_wide_stack(o_KSL[start:start + k], leaves[i].shape)
      # Stack axes whole (as the batch axis now is); matrix axes as the consumer (the update's parameter) wants.
      out[i] = jax.lax.with_sharding_constraint(o, P(*[None] * (o.ndim - 2), P.UNCONSTRAINED, P.UNCONSTRAINED))
      start += k
  return out


def _constrain(x, axes: tuple[str, ...]):
  """Batch axis split over `axes` exactly; the matrix axes left to the partitioner."""
  return jax.lax.with_sharding_constraint(x, P(axes or None, P.UNCONSTRAINED, P.UNCONSTRAINED))


def _as_wide_stack(x):
  x = x.reshape((-1,) + x.shape[-2:])
  return jnp.swapaxes(x, -1, -2) if x.shape[-2] > x.shape[-1] else x


def _from_wide_stack(o, shape):
  m, n = shape[-2:]
  o = jnp.swapaxes(o, -1, -2) if m > n else o
  return o.reshape(shape)
