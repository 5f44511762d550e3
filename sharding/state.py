"""Create model and optimizer state directly sharded, and shard input batches.

Pattern: build the state abstractly (`nnx.eval_shape` / `jax.eval_shape`), derive each leaf's
NamedSharding from its logical names via rules.py, then create it inside `jax.jit` with those
`out_shardings`, so no device ever holds an unsharded copy.

Parameters are plain nested dicts of arrays (what optax and researchers see); the model's
graphdef turns them back into a module with `nnx.merge(graphdef, params)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import DATA, mesh_scope
from sharding.rules import logical_to_spec

if TYPE_CHECKING:
  import optax

PyTree = Any


def _nest(flat: dict[tuple, Any]) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = value
  return out


def logical_names(model_fn: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, dict, dict]:
  """(graphdef, abstract params, logical names) of the module `model_fn()` builds, without allocating it.

  Only `nnx.Param`s: other variables (an MoE router's selection bias) are `buffers`, kept beside the
  params and out of the optimizer (`init_buffers`).

  Args:
    model_fn: builds the module, e.g. `lambda: Transformer(config, rngs=nnx.Rngs(0))`.

  Returns:
    (graphdef, abstract params, logical names): the params as nested dicts of `jax.ShapeDtypeStruct`s, the names as
    nested dicts of tuples like them (`variable_names`).
  """
  graphdef, abstract, *_ = nnx.split(nnx.eval_shape(model_fn), nnx.Param, ...)
  flat = nnx.to_flat_state(abstract)
  shapes = {p: jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in flat}
  names = {p: variable_names(v) for p, v in flat}
  return graphdef, _nest(shapes), _nest(names)


def variable_names(v: nnx.Variable) -> tuple:
  """A variable's logical axis names (its `out_sharding` metadata; unnamed axes None).

  Args:
    v: the variable, concrete or abstract.

  Returns:
    One name per dimension; all None when the variable has no `out_sharding`.
  """
  return tuple(v.get_metadata().get("out_sharding") or (None,) * len(v.shape))


def param_shardings(abstract_params: PyTree, names: PyTree, mesh: Mesh | None) -> PyTree:
  """Each parameter's NamedSharding from its logical names; mesh None: everything on the first device.

  Args:
    abstract_params: the parameters (shapes are read), e.g. `logical_names(model_fn)[1]`.
    names: their logical names, a tree like them with tuple leaves (`logical_names(model_fn)[2]`).
    mesh: the mesh, or None for one device.

  Returns:
    A tree like `abstract_params` of NamedShardings (SingleDeviceShardings when `mesh` is None).
  """
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, abstract_params)
  return jax.tree.map(lambda a, n: NamedSharding(mesh, logical_to_spec(n, mesh, a.shape)), abstract_params, names,
                      is_leaf=lambda x: isinstance(x, tuple))


def place_variables(state: nnx.State, mesh: Mesh) -> nnx.State:
  """`state` with every variable's value on `mesh` by its logical names (`out_sharding` metadata).

  Parameters and other variables alike, e.g. the frozen base weights of an adapted model (models/peft.py).

  Args:
    state: an `nnx.State`.
    mesh: the mesh.

  Returns:
    The state, every variable's value a jax.Array with its sharding.
  """
  return jax.tree.map(lambda v: v.replace(jax.device_put(v.get_value(), _variable_sharding(v, mesh))), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def _variable_sharding(v: nnx.Variable, mesh: Mesh | None):
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(mesh, logical_to_spec(variable_names(v), mesh, v.shape))


def init_params(model_fn: Callable[[], nnx.Module], mesh: Mesh) -> tuple[nnx.GraphDef, dict, dict]:
  """The parameters created directly with their shardings, inside jit: no device holds an unsharded copy.

  Args:
    model_fn: builds the module.
    mesh: the mesh.

  Returns:
    (graphdef, params, shardings): params as nested dicts of jax.Arrays, shardings a tree like them.
  """
  graphdef, abstract, names = logical_names(model_fn)
  shardings = param_shardings(abstract, names, mesh)
  with mesh_scope(mesh):
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(model_fn(), nnx.Param)), out_shardings=shardings)()
  return graphdef, params, shardings


def init_buffers(model_fn: Callable[[], nnx.Module], mesh: Mesh) -> dict:
  """The module's non-Param variables as a nested dict, replicated on `mesh` ({} if it has none).

  A model with buffers is rebuilt with `nnx.merge(graphdef, params, buffers)`; they are state that
  the training loop updates itself (e.g. `models.moe.update_router_bias`), never the optimizer.

  Args:
    model_fn: builds the module.
    mesh: the mesh.

  Returns:
    The buffers, as `nnx.to_pure_dict` gives them.
  """
  abstract = nnx.state(nnx.eval_shape(model_fn), nnx.Not(nnx.Param))
  if not jax.tree.leaves(abstract):
    return {}
  replicated = NamedSharding(mesh, P())
  with mesh_scope(mesh):
    return jax.jit(lambda: nnx.to_pure_dict(nnx.state(model_fn(), nnx.Not(nnx.Param))),
                   out_shardings=replicated)()


def shardings_like_params(tree: PyTree, params: PyTree, shardings: PyTree, mesh: Mesh) -> PyTree:
  """Shardings for a tree whose parameter-shaped leaves (an optimizer's moments, say) sit under the parameter's path.

  Such a leaf takes its parameter's sharding; a leaf shaped like the parameter's trailing dimensions (one layer of a
  stack: BAdam's per-block moments) takes the spec of those dimensions; any other leaf is replicated.

  Args:
    tree: the tree to shard, e.g. an optax state (concrete or abstract leaves).
    params: the parameters.
    shardings: their shardings, a tree like `params`.
    mesh: the mesh.

  Returns:
    A tree like `tree` of NamedShardings.
  """
  by_path = {tuple(p): (leaf.shape, s) for (p, leaf), s in
             zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings))}
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf):
    shape = np.shape(leaf)
    for k in range(len(path)):
      hit = by_path.get(tuple(path[k:]))
      if hit is None:
        continue
      if hit[0] == shape:
        return hit[1]
      drop = len(hit[0]) - len(shape)
      if 0 < drop and hit[0][drop:] == shape:
        spec = tuple(hit[1].spec) + (None,) * (len(hit[0]) - len(hit[1].spec))
        return NamedSharding(mesh, P(*spec[drop:]))
    return replicated

  return jax.tree_util.tree_map_with_path(pick, tree)


def zero1_shardings(shardings: PyTree, shapes: PyTree, axis: str = DATA) -> PyTree:
  """ZeRO-1: each leaf further split over mesh `axis` on its first dimension that can take it.

  That is the first dimension that does not use `axis` yet and whose size divides by all its mesh axes, `axis`
  included (appended as the minor one). A leaf already split over `axis`, a scalar, or one with no such dimension
  (sizes prime to the axis size) keeps its sharding: that state stays replicated over `axis`.

  Args:
    shardings: the optimizer state's NamedShardings (`shardings_like_params`).
    shapes: the state's leaves (shapes are read), a tree like `shardings`.
    axis: the mesh axis to split over; default "data".

  Returns:
    A tree like `shardings` of NamedShardings.

  References:
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2019, arXiv
      1910.02054 (stage 1: optimizer state partitioning). MaxText's `add_data_to_sharding`
      (`shard_optimizer_over_data`), the same rule.
  """
  def split(sh: NamedSharding, leaf):
    size = sh.mesh.shape.get(axis, 1)
    shape = np.shape(leaf)
    spec = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    if size == 1 or any(axis in e for e in entries):
      return sh
    for dim, e in enumerate(entries):
      if shape[dim] % (size * math.prod(sh.mesh.shape[a] for a in e)) == 0:
        spec[dim] = e + (axis,) if e else axis
        while spec[-1] is None:
          spec.pop()
        return NamedSharding(sh.mesh, P(*spec))
    return sh
  return jax.tree.map(split, shardings, shapes)


def init_train_state(model_fn: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh,
                     zero1: bool = False) -> tuple[nnx.GraphDef, dict, dict]:
  """The train state {"step", "params", "opt_state"}, all created sharded.

  Plus "buffers" (replicated, see `init_buffers`) if the model has non-Param variables. A train step jitted with
  these shardings gets from XLA the collectives that move gradients into the state's shards and updates back to the
  parameters.

  Args:
    model_fn: builds the module.
    tx: any optax GradientTransformation; its state leaves shaped like a parameter take that parameter's sharding
      (see `shardings_like_params`).
    mesh: the mesh.
    zero1: further split the optimizer state over the `data` axis (`zero1_shardings`) while the parameters stay
      replicated there; default False.

  Returns:
    (graphdef, state, state_shardings), state_shardings a tree like state.
  """
  graphdef, params, p_sh = init_params(model_fn, mesh)
  buffers = init_buffers(model_fn, mesh)
  state, shardings = _with_optimizer(params, p_sh, tx, mesh, zero1)
  if buffers:  # non-Param variables: in the state (so checkpointed), not in the optimizer
    replicated = NamedSharding(mesh, P())
    state["buffers"], shardings["buffers"] = buffers, jax.tree.map(lambda _: replicated, buffers)
  return graphdef, state, shardings


def _with_optimizer(params, p_sh, tx, mesh: Mesh, zero1: bool):
  """({"step", "params", "opt_state"}, their shardings): the optimizer state created sharded like `params`."""
  abstract_opt = jax.eval_shape(tx.init, params)
  o_sh = shardings_like_params(abstract_opt, params, p_sh, mesh)
  if zero1:
    o_sh = zero1_shardings(o_sh, abstract_opt)
  with mesh_scope(mesh):
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  replicated = NamedSharding(mesh, P())
  state = {"step": jax.device_put(np.int32(0), replicated), "params": params, "opt_state": opt_state}
  return state, {"step": replicated, "params": p_sh, "opt_state": o_sh}


def variable_shardings(state: nnx.State, mesh: Mesh | None) -> dict:
  """Each variable's NamedSharding from its logical names; mesh None: everything on the first device.

  As `param_shardings`, for the variables of an existing state.

  Args:
    state: an `nnx.State`.
    mesh: the mesh, or None for one device.

  Returns:
    A plain dict like `nnx.to_pure_dict(state)` of shardings.
  """
  return nnx.to_pure_dict(jax.tree.map(lambda v: _variable_sharding(v, mesh), state,
                                      is_leaf=lambda x: isinstance(x, nnx.Variable)))


def train_state_of(model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh, zero1: bool = False
                   ) -> tuple[nnx.GraphDef, dict, dict]:
  """`init_train_state` for a model that already exists (loaded, or adapted by models/peft.py).

  Its `nnx.Param`s are "params", every other variable is a "buffer" (the frozen base weights of an adapted model
  included), and both are placed on `mesh` by their logical names, not replicated (a frozen base is as large as the
  model).

  Args:
    model: the module.
    tx: any optax GradientTransformation, its state sharded like the parameters (`shardings_like_params`).
    mesh: the mesh.
    zero1: further split the optimizer state over the `data` axis (`zero1_shardings`); default False.

  Returns:
    (graphdef, state, state_shardings) as `init_train_state`'s.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # flax: one State per filter
  p_sh, b_sh = variable_shardings(params, mesh), variable_shardings(rest, mesh)
  state, shardings = _with_optimizer(jax.device_put(nnx.to_pure_dict(params), p_sh), p_sh, tx, mesh, zero1)
  if jax.tree.leaves(b_sh):
    state["buffers"], shardings["buffers"] = jax.device_put(nnx.to_pure_dict(rest), b_sh), b_sh
  return graphdef, state, shardings


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
  """Rows of a (batch, ...) array split over the data axes of `mesh`.

  Args:
    mesh: the mesh.
    shape: the global array's shape.

  Returns:
    The NamedSharding of the logical `batch` axis on the first dimension, the rest replicated.
  """
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (len(shape) - 1), mesh, shape))


def shard_batch(batch: PyTree, mesh: Mesh) -> PyTree:
  """Place host arrays (each process's rows of the global batch) on the mesh, split over the data axes.

  Args:
    batch: host arrays, this process's rows; the processes' rows together make the global batch.
    mesh: the mesh.

  Returns:
    Global jax.Arrays of (processes × local rows) rows, laid out by `batch_sharding`.
  """
  def put(x):
    x = np.asarray(x)
    if jax.process_count() == 1:
      return jax.device_put(x, batch_sharding(mesh, x.shape))
    global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
    return jax.make_array_from_process_local_data(batch_sharding(mesh, global_shape), x, global_shape)
  return jax.tree.map(put, batch)


def process_rows(mesh: Mesh, shape: Sequence[int]) -> np.ndarray:
  """The rows of a global (batch, ...) array that this process's devices hold under `batch_sharding`.

  What a loader reading only its own rows reads (`local_batch` places them).

  Args:
    mesh: the mesh.
    shape: the global array's shape.

  Returns:
    The row indices, sorted.
  """
  index = batch_sharding(mesh, tuple(shape)).addressable_devices_indices_map(tuple(shape))
  # jax types the values Index | None; they are devices_indices_map's, never None
  return np.unique(np.concatenate([np.arange(shape[0])[i[0]] for i in index.values()]))  # type: ignore[index]


def local_batch(batch: PyTree, mesh: Mesh, rows: np.ndarray, size: int) -> PyTree:
  """Host arrays holding some rows of a global batch, as global arrays split over the data axes of `mesh`.

  Each device gets its rows from this process's copy.

  Args:
    batch: host arrays, rows `rows` of the global batch, in that order.
    mesh: the mesh.
    rows: the global row indices held, sorted (`process_rows`).
    size: the global batch's rows.

  Returns:
    Global jax.Arrays of `size` rows, laid out by `batch_sharding`.
  """
  def put(x):
    x = np.asarray(x)
    shape = (size,) + x.shape[1:]
    sh = batch_sharding(mesh, shape)
    if len(rows) == size:
      return jax.device_put(x, sh) if jax.process_count() == 1 else jax.make_array_from_callback(
          shape, sh, lambda index: x[index])
    return jax.make_array_from_callback(
        shape, sh, lambda index: x[(np.searchsorted(rows, np.arange(size)[index[0]]),) + tuple(index[1:])])
  return jax.tree.map(put, batch)


def global_batch(batch: PyTree, mesh: Mesh) -> PyTree:
  """Host arrays holding the whole global batch as global arrays whose rows are split over the data axes of `mesh`.

  The batch is the same on every process (`get_batch` is a pure function of (seed, step)); each process copies onto
  its devices only the rows those devices hold, whatever their layout over processes.

  Args:
    batch: host arrays, the whole global batch.
    mesh: the mesh.

  Returns:
    Global jax.Arrays, laid out by `batch_sharding`.
  """
  def put(x):
    x = np.asarray(x)
    sh = batch_sharding(mesh, x.shape)
    if jax.process_count() == 1:
      return jax.device_put(x, sh)
    return jax.make_array_from_callback(x.shape, sh, lambda index: x[index])
  return jax.tree.map(put, batch)
