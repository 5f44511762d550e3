"""Parameter-tree helpers every optimizer shares: names from key paths, and the checks that reject bad trees at `init`.

The checks turn input an optimizer cannot handle (complex parameters, a label tree that does not fit) into one clear
error at `init`.

Any pytree is a parameter tree: a bare array (its key path is empty), nested dicts, lists, tuples, NamedTuples,
`None` leaves (empty subtrees), flax `nnx.State`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


def key_name(key: Any) -> str:
  """One key of a path as text: a dict key, attribute name or sequence index.

  Args:
    key: one entry of a `jax.tree_util` key path (`DictKey`, `GetAttrKey`, `SequenceKey`, ...).

  Returns:
    The entry's `key`, `name` or `idx` as text; `str(key)` for any other entry.
  """
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _keys(path) -> list:
  """The path without flax Variable wrappers.

  An `nnx.State` of Variables (what `nnx.Optimizer` hands to `init`) flattens each leaf through `.value`, the plain
  arrays it hands to `update` do not; both must name one leaf.
  """
  return [k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]


def path_name(path: jax.tree_util.KeyPath) -> str:
  """A key path as slash-separated text, flax Variable wrappers (`.value`) left out.

  Args:
    path: a `jax.tree_util` key path.

  Returns:
    'blocks/attn/wq' for a key path; '' for a bare array (the empty path).
  """
  return "/".join(key_name(k) for k in _keys(path))


def named_leaves(tree: PyTree) -> dict[str, Any]:
  """{path name: leaf} of a tree's leaves (None leaves are empty subtrees, so left out).

  Args:
    tree: any pytree; a flat dict keyed by path names gives itself back.

  Returns:
    The leaves by `path_name`, in the tree's flattening order.
  """
  return {path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def leaf_name(path: jax.tree_util.KeyPath) -> str:
  """The last key of a path ('wq'); '' for a bare array.

  Args:
    path: a `jax.tree_util` key path.

  Returns:
    The last key as text (flax Variable wrappers left out), or '' for the empty path.
  """
  keys = _keys(path)
  return key_name(keys[-1]) if keys else ""


class ParameterTreeError(ValueError):
  """A parameter tree an optimizer cannot take (complex leaves, labels that do not fit)."""


def is_named_vector(path: jax.tree_util.KeyPath) -> bool:
  """Whether the leaf's name ends in a one-letter shape suffix (`m_O`, `d_O`, `q_bias_Q`).

  Such a leaf is a vector per layer, however many stack axes it has: a scale or offset, like a norm (no weight decay,
  not orthogonalized). The adapters of models/peft.py name their per-output magnitude and diagonal so.

  Args:
    path: the leaf's `jax.tree_util` key path.

  Returns:
    True when the leaf's name is longer than two characters and ends in "_" and an upper-case letter.
  """
  name = leaf_name(path)
  return len(name) > 2 and name[-2] == "_" and name[-1].isupper()


def is_hidden_matrix(path: jax.tree_util.KeyPath, leaf: Any) -> bool:
  """Whether a leaf is a hidden weight matrix: what the matrix optimizers (Muon and its family) orthogonalize.

  Decided by parameter name, then rank: rank >= 2, no "embed", "head", "norm" or "bias" in the path, and not a named
  vector (`is_named_vector`). `optim.muon_labels` labels these leaves "muon".

  Args:
    path: the leaf's `jax.tree_util` key path.
    leaf: the leaf (an array or anything with a shape).

  Returns:
    True for a hidden weight matrix (or a stack of them), False for embeddings, the output head, norms, biases and
    vectors.
  """
  name = path_name(path).lower()
  hidden = not any(s in name for s in ("embed", "head", "norm", "bias"))
  return hidden and jnp.ndim(leaf) >= 2 and not is_named_vector(path)


def tree_bytes(tree: PyTree) -> int:
  """Bytes of a tree's array leaves (concrete or abstract, e.g. `jax.eval_shape(tx.init, params)`).

  Args:
    tree: a pytree whose leaves have `shape` and `dtype` (arrays or `jax.ShapeDtypeStruct`s).

  Returns:
    The sum over the leaves of their element count times their dtype's item size.
  """
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def cast_like(tree: PyTree, like: PyTree) -> PyTree:
  """`tree` with each leaf cast to the dtype of the matching leaf of `like` (same structure).

  Args:
    tree: a pytree of arrays.
    like: a pytree of the same structure whose leaves give the dtypes.

  Returns:
    `tree`'s leaves, each `astype` the matching leaf's dtype.
  """
  return jax.tree.map(lambda x, ref: x.astype(ref.dtype), tree, like)


def reject_complex(tx: optax.GradientTransformation, name: str, why: str) -> optax.GradientTransformation:
  """`tx` whose init raises ParameterTreeError on complex parameters (instead of NaN or a silent wrong answer later).

  Args:
    tx: the transformation to guard (a `GradientTransformationExtraArgs` stays one).
    name: the optimizer's name, for the error message.
    why: why it cannot take complex parameters, for the error message.

  Returns:
    A transformation with `tx`'s state and update, unchanged, whose `init` raises `ParameterTreeError` naming (up
    to three of) the complex leaves.
  """
  def init(params):
    bad = [path_name(p) or "<array>" for p, x in jax.tree_util.tree_leaves_with_path(params)
           if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.complexfloating)]
    if bad:
      raise ParameterTreeError(f"{name} does not support complex parameters ({why}); got complex "
                               f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}")
    return tx.init(params)

  if isinstance(tx, optax.GradientTransformationExtraArgs):
    return optax.GradientTransformationExtraArgs(init, tx.update)
  return optax.GradientTransformation(init, tx.update)


def resolve_labels(labels: PyTree | Callable[[PyTree], PyTree], params: PyTree, allowed: tuple[str, ...],
                   owner: str) -> Any:
  """The label tree of `labels`, expanded to one label per leaf and checked against the params.

  `labels` may be a prefix of the params (as optax.partition reads it). Checking that it fits the params and uses only
  `allowed` labels gives a clear ParameterTreeError at init instead of a state that does not match the parameters.

  Args:
    labels: a tree of labels, the params' structure or a prefix of it, or a function of the params returning one.
    params: the parameter tree.
    allowed: the labels the optimizer knows.
    owner: the optimizer's name, for the error messages.

  Returns:
    The params' structure with one label per leaf.

  Raises:
    ParameterTreeError: when the label tree is not the params' structure or a prefix of it, or uses a label not in
      `allowed`.
  """
  tree = labels(params) if callable(labels) else labels
  try:
    full = jax.tree.map(lambda lab, p: jax.tree.map(lambda _: lab, p), tree, params)
  except (ValueError, TypeError) as e:
    raise ParameterTreeError(f"{owner}: the label tree does not match the parameters (it must be the params' "
                             f"structure or a prefix of it): {str(e).splitlines()[0]}") from None
  used = set(jax.tree.leaves(full))
  if not used <= set(allowed):
    raise ParameterTreeError(f"{owner}: unknown labels {sorted(map(str, used - set(allowed)))}; "
                             f"use {', '.join(map(repr, allowed))}")
  return full


def replicated(x: jax.Array) -> jax.Array:
  """X replicated on the current mesh (`jax.set_mesh`): each device then holds whole matrices.

  For the optimizers that factor or rotate them (SOAP, Kron) as `orthogonalize` does.

  Args:
    x: an array.

  Returns:
    x resharded (an Explicit mesh) or constrained (otherwise) to be replicated; x itself off a mesh or on one device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  if jax.sharding.AxisType.Explicit in mesh.axis_types:
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec())
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def sharded_like(x: jax.Array, ref: jax.Array) -> jax.Array:
  """X back in ref's sharding on an Explicit mesh (which types it); elsewhere the partitioner propagates it.

  Args:
    x: an array of `ref`'s shape.
    ref: the array whose sharding x takes.

  Returns:
    x resharded to `ref`'s partition spec on an Explicit mesh; x itself elsewhere.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return x
  return jax.sharding.reshard(x, jax.typeof(ref).sharding.spec)
