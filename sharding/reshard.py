"""Move a live train state (parameters and any optax state) to another mesh and layout, in-process.

DynaTrain (Wang, Zhang et al., "DynaTrain: Fast Online Parallelism Switching for Elastic LLM Training",
arXiv 2605.18815) describes every distributed state in one global coordinate space and reshards
by intersecting each device's old and new boxes. A `jax.Array` already is that global object, so
here a switch is: derive the new layout from the logical names exactly as `init_train_state` does
(parameters from their names on the new mesh, optimizer leaves like their parameter via
`shardings_like_params`, the rest replicated), then `jax.device_put` to it, which works across
mesh shapes and device subsets (8 -> 4 devices) and copies values bit for bit.

The new step can be compiled before the switch from `state_shardings` and `abstract_state`
(`jax.jit(step).lower(abstract_state(...), ...).compile()`), so the switch itself costs only the
transfer. `moved_bytes` is the traffic lower bound of a switch: the bytes each device must receive
that it does not already hold (the geometric intersection of `devices_indices_map` boxes).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from sharding.state import param_shardings, shardings_like_params, zero1_shardings

PyTree = Any


class ReshardError(ValueError):
  """A state, logical-name tree or sharding tree that does not fit the requested switch."""


def state_shardings(state: PyTree, names: PyTree, mesh: Mesh, *, zero1: bool = False) -> dict:
  """The shardings `init_train_state(..., zero1=zero1)` would give `state` on `mesh`.

  Args:
    state: {"params": ..., <any other keys>: ...}, concrete or abstract (ShapeDtypeStruct) leaves.
    names: the logical axis names of `state["params"]` (`sharding.logical_names(model_fn)[2]`).
    mesh: the target mesh (any shape, any devices).
    zero1: also split "opt_state" over the data axis (`zero1_shardings`), as `init_train_state(zero1=True)`.

  Returns:
    A tree like `state` of NamedShardings on `mesh`: params from `names` (sharding/rules.py), every other leaf
    shaped like a parameter and under its path ("opt_state" moments, "prev_params") takes that parameter's sharding,
    "buffers" and anything else (the step, counters) are replicated.

  Raises:
    ReshardError: when `state` is not a dict with a "params" entry, or `names` does not match `state["params"]`.
  """
  if not isinstance(state, dict) or "params" not in state:
    raise ReshardError(f"a train state is a dict with a 'params' entry, got {type(state).__name__}"
                       + (f" with keys {sorted(state)}" if isinstance(state, dict) else ""))
  params = state["params"]
  is_name = lambda x: isinstance(x, tuple)
  if jax.tree.structure(params) != jax.tree.structure(names, is_leaf=is_name):  # type: ignore[operator]  # jaxlib stub
    raise ReshardError("the logical-name tree does not match state['params']; pass the names of the model that "
                       "built this state (sharding.logical_names(model_fn)[2])")
  p_sh = param_shardings(params, names, mesh)
  out = {}
  for key, tree in state.items():
    if key == "params":
      out[key] = p_sh
    elif key == "buffers":  # non-Param variables: always replicated (init_buffers)
      out[key] = jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)
    else:
      out[key] = shardings_like_params(tree, params, p_sh, mesh)
      if zero1 and key == "opt_state":
        out[key] = zero1_shardings(out[key], tree)
  return out


def abstract_state(state: PyTree, shardings: PyTree) -> PyTree:
  """ShapeDtypeStructs of `state` carrying `shardings`: the arguments to lower a step for a new layout.

  Args:
    state: the train state, concrete or abstract leaves.
    shardings: the target shardings, a tree like `state` (`state_shardings`).

  Returns:
    A tree like `state` of `jax.ShapeDtypeStruct`s, each with its leaf's shape and dtype and its target sharding.
  """
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s), state, shardings)


def reshard(state: PyTree, new_mesh: Mesh | None = None, names: PyTree = None, *, shardings: PyTree = None,
            donate: bool = False) -> PyTree:
  """`state` moved to `new_mesh` with the layout `state_shardings(state, names, new_mesh)`, values bit-exact.

  Args:
    state: the train state ({"step", "params", "opt_state"} or any dict with "params").
    new_mesh: the target mesh; it may use other devices than the current one (fewer, more, permuted).
    names: logical names of the params (needed unless `shardings` is given).
    shardings: precomputed target shardings (from `state_shardings`, e.g. used to compile the new step).
    donate: free the source buffers (peak memory is still old + new state, as all leaves move at once);
      the old `state` must not be used afterwards.

  Returns:
    The new state, every leaf a jax.Array with its target sharding.

  Raises:
    ReshardError: when neither `shardings` nor both `new_mesh` and `names` are given, `shardings` lie on another mesh
      than `new_mesh`, or their tree does not match the state's.
  """
  if shardings is None:
    if new_mesh is None or names is None:
      raise ReshardError("reshard needs new_mesh and names (or precomputed shardings=state_shardings(...))")
    shardings = state_shardings(state, names, new_mesh)
  elif new_mesh is not None:
    meshes = {s.mesh for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)}
    if meshes - {new_mesh}:
      raise ReshardError("shardings= lie on another mesh than new_mesh; compute them with state_shardings(state, "
                         "names, new_mesh)")
  if jax.tree.structure(state) != jax.tree.structure(shardings):  # type: ignore[operator]  # jaxlib stub
    raise ReshardError("shardings= do not match the state's tree; compute them with state_shardings(state, names, "
                       "mesh) for this state")
  new = jax.device_put(state, shardings, donate=donate)
  if donate:  # device_put donates only where it can: free each source once its copy has landed, unless the
    jax.block_until_ready(new)  # copy reuses some of its buffers (a replica already on a target device)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
      if isinstance(a, jax.Array) and not a.is_deleted() and not _buffers(a) & _buffers(b):
        a.delete()
  return new


def _buffers(x: jax.Array) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _box(index: tuple[slice, ...], shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _overlap(a, b) -> int:
  return int(np.prod([max(0, min(hi1, hi2) - max(lo1, lo2)) for (lo1, hi1), (lo2, hi2) in zip(a, b)]))


def moved_bytes(state: PyTree, old: PyTree, new: PyTree) -> int:
  """Bytes that must cross between devices to go from shardings `old` to `new` (a lower bound on traffic).

    moved = sum over leaves, over devices d of the new sharding:  |new box(d)| − |old box(d) ∩ new box(d)|

  times the item size; |·| counts elements, box(d) is d's index range (`Sharding.devices_indices_map`),
  old box(d) = ∅ if d held nothing. Replicas are counted once per receiving device.

  Args:
    state: the train state (concrete or abstract leaves: only shapes and dtypes are read).
    old: its current shardings, a tree like `state`.
    new: its target shardings, a tree like `state`.

  Returns:
    The bytes all devices together must receive.

  References:
    Wang, Zhang et al., "DynaTrain: Fast Online Parallelism Switching for Elastic LLM Training", 2026, arXiv
      2605.18815 (resharding as the intersection of each device's old and new boxes).
  """
  total = 0
  for leaf, s_old, s_new in zip(jax.tree.leaves(state), jax.tree.leaves(old, is_leaf=_is_sharding),
                                jax.tree.leaves(new, is_leaf=_is_sharding)):
    shape = np.shape(leaf)
    held = {d: _box(i, shape) for d, i in s_old.devices_indices_map(shape).items()}
    for d, index in s_new.devices_indices_map(shape).items():
      need = _box(index, shape)
      size = _overlap(need, need)
      total += (size - (_overlap(need, held[d]) if d in held else 0)) * np.dtype(leaf.dtype).itemsize
  return total


def _is_sharding(x) -> bool:
  return isinstance(x, Sharding)
