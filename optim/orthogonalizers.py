"""Pluggable orthogonalizers for the Muon family: what `scale_by_muon(orthogonalize=..., split=...)` takes.

An orthogonalizer is any function of a matrix stack x (..., m, n) -> an array of the same shape: Newton–Schulz
(`optim.newton_schulz.orthogonalize`, the default), the exact polar factor (`svd_polar`), or a researcher's own
polar-factor method, which drops in without copying Muon (distributed Muon hands it whole matrices too).

A split says which matrices a parameter holds: `split(path, shape) -> (axis, sizes) | None` cuts a leaf along
axis -1 (fan_out) or -2 (fan_in) into blocks of `sizes`, each orthogonalized (and shape-scaled) as a matrix of
its own, then put back in place:
  heads(head_dim)   per-head Newton–Schulz: w_q, w_k, w_v (D, N·H) in N column blocks of H, w_o (N·H, D) in row
                    blocks (modded-nanogpt and Dion's `num_heads` option; per-head Muon of arXiv 2502.16982 §A)
  fused(sizes)      a fused projection (D, N·H + 2·K·H) in its q, k, v blocks (Dion's `split_sizes`)
Leaves a split returns None for stay whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optim.linalg import per_matrix
from optim.trees import path_name

Split = Callable[[str, tuple], "tuple[int, tuple[int, ...]] | None"]
PyTree = Any


def svd_polar(x: jax.Array) -> jax.Array:
  """The exact polar factor U Vᵀ of each matrix of x (..., m, n), by SVD in at least float32 (0 maps to 0).

  On the CPU one matrix of a stack at a time (`optim.linalg.per_matrix`: jaxlib 0.10's batched SVD can deadlock a
  multi-device step). A rank-deficient matrix gives U_r V_rᵀ (singular values below max(m, n)·eps·σ_max dropped).

  Args:
    x: a matrix or a stack of them (..., m, n).

  Returns:
    The polar factor of each matrix, in x's shape and dtype.
  """
  acc = jnp.promote_types(x.dtype, jnp.float32)
  u, s, vt = per_matrix(lambda a: jnp.linalg.svd(a, full_matrices=False), x.astype(acc))
  keep = (s > s[..., :1] * jnp.finfo(acc).eps * max(x.shape[-2:])).astype(acc)  # rank-deficient: U_r V_rᵀ
  return ((u * keep[..., None, :]) @ vt).astype(x.dtype)


def _matches(path: str, names: Sequence[str]) -> bool:
  leaf = path.rsplit("/", 1)[-1].lower()
  return any(leaf == n or leaf.startswith(n + "_") for n in names)


def heads(head_dim: int, *, columns: Sequence[str] = ("wq", "wk", "wv"), rows: Sequence[str] = ("wo",)) -> Split:
  """Per-head split: leaves named `columns` in column blocks, `rows` in row blocks, each of `head_dim`.

  `columns` have fan_out = heads·head_dim, `rows` fan_in = heads·head_dim; a name matches a leaf 'wq' or 'wq_DQ'.

  Args:
    head_dim: the block size H, each head's width.
    columns: leaf names cut along fan_out (axis -1; default w_q, w_k, w_v).
    rows: leaf names cut along fan_in (axis -2; default w_o).

  Returns:
    The split, `split(path name, shape) -> (axis, (head_dim,) * heads) | None`; it raises `ValueError` on a matching
    leaf whose cut axis is not a multiple of `head_dim`.

  Raises:
    ValueError: when `head_dim` < 1.

  References:
    Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982, §A (per-head Muon); modded-nanogpt and
      microsoft/dion's `num_heads` option.
  """
  if head_dim < 1:
    raise ValueError(f"head_dim must be >= 1, got {head_dim}")

  def split(path: str, shape: tuple):
    axis = -1 if _matches(path, columns) else -2 if _matches(path, rows) else None
    if axis is None:
      return None
    if shape[axis] % head_dim:
      raise ValueError(f"per-head split: {path} has {shape[axis]} {'columns' if axis == -1 else 'rows'}, "
                       f"not a multiple of head_dim {head_dim}")
    return axis, (head_dim,) * (shape[axis] // head_dim)
  return split


def fused(sizes: Sequence[int], *, names: Sequence[str] = ("wqkv",), axis: int = -1) -> Split:
  """A fused projection's blocks: leaves named `names` cut along `axis` into `sizes` (e.g. (N·H, K·H, K·H)).

  Args:
    sizes: the blocks' sizes along `axis`, in order (microsoft/dion's `split_sizes`).
    names: the fused leaves' names (default "wqkv").
    axis: -1 (fan_out, the default) or -2 (fan_in).

  Returns:
    The split, `split(path name, shape) -> (axis, sizes) | None`; it raises `ValueError` on a matching leaf whose
    `axis` does not have `sum(sizes)` entries.

  Raises:
    ValueError: when `axis` is not -1 or -2, or `sizes` is empty or has a size < 1.
  """
  sizes = tuple(int(s) for s in sizes)
  if axis not in (-1, -2) or not sizes or min(sizes) < 1:
    raise ValueError(f"fused split needs axis -1 or -2 and positive sizes, got axis={axis}, sizes={sizes}")

  def split(path: str, shape: tuple):
    if not _matches(path, names):
      return None
    if shape[axis] != sum(sizes):
      raise ValueError(f"fused split: {path} has {shape[axis]} along axis {axis}, the sizes {sizes} sum to "
                       f"{sum(sizes)}")
    return axis, sizes
  return split


def _blocks(x, axis: int, sizes: tuple[int, ...]) -> tuple[list, list]:
  """X's blocks as stacks, and for each block (its stack index, its position in the stack).

  One stack per distinct block size, the blocks on a new axis before the matrix axes.
  """
  if len(set(sizes)) == 1:  # equal blocks (heads): one reshape, no slicing
    n, s = len(sizes), sizes[0]
    if axis == -1:
      stack = jnp.moveaxis(x.reshape(x.shape[:-1] + (n, s)), -2, -3)
    else:
      stack = x.reshape(x.shape[:-2] + (n, s, x.shape[-1]))
    return [stack], [(0, i) for i in range(n)]
  parts = jnp.split(x, np.cumsum(sizes)[:-1], axis=axis)
  order = sorted(set(sizes))
  stacks = [jnp.stack([p for p, s in zip(parts, sizes) if s == size], axis=-3) for size in order]
  where, seen = [], dict.fromkeys(order, 0)
  for s in sizes:
    where.append((order.index(s), seen[s]))
    seen[s] += 1
  return stacks, where


def _unblocks(stacks: list, where: list, axis: int, shape: tuple):
  if len(stacks) == 1 and [w[1] for w in where] == list(range(len(where))):
    o = stacks[0]
    if axis == -1:
      return jnp.moveaxis(o, -3, -2).reshape(shape)
    return o.reshape(shape)
  return jnp.concatenate([jnp.take(stacks[k], i, axis=-3) for k, i in where], axis=axis)


def split_apply(tree: PyTree, split: Split, run: Callable[[list], list],
                scale: Callable[[int, int], float]) -> PyTree:
  """`run` on every leaf's blocks at once, each block scaled by `scale(fan_in, fan_out)` of its own shape, put back.

  Unsplit leaves go to `run` whole and are scaled by their own shape.

  Args:
    tree: a pytree of matrix stacks (..., fan_in, fan_out).
    split: `split(path name, shape) -> (axis, sizes) | None`, a leaf's blocks (`heads`, `fused`).
    run: a list of matrix stacks -> their orthogonalized stacks (e.g. distributed), all at once.
    scale: `scale(fan_in, fan_out)`, the factor on each block (leaf) of that shape.

  Returns:
    The tree with every leaf orthogonalized block by block and scaled, in its own shape.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat: list[jax.Array] = []
  plans: list[tuple[Any, list[int], Any]] = []  # (None or (axis, shape), ids in flat, the blocks' places)
  for path, x in leaves:
    cut = split(path_name(path), tuple(x.shape))
    if cut is None:
      plans.append((None, [len(flat)], None))
      flat.append(x)
      continue
    axis, sizes = cut
    stacks, where = _blocks(x, axis, tuple(sizes))
    plans.append(((axis, tuple(x.shape)), list(range(len(flat), len(flat) + len(stacks))), where))
    flat.extend(stacks)
  done = [o * scale(o.shape[-2], o.shape[-1]) for o in run(flat)]
  out = []
  for cut, ids, where in plans:
    out.append(done[ids[0]] if cut is None else _unblocks([done[i] for i in ids], where, cut[0], cut[1]))
  return jax.tree.unflatten(treedef, out)
