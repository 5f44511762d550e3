"""Per-layer statistics of a parameter-like tree (params, grads, updates), split along stacked layers and experts.

A leaf whose leading logical axes are "layers" / "expert" (a scanned stack of blocks, a bank of experts) gets one
number per layer (and expert) instead of one for the whole stack, as Levanter's `WatchConfig` splits its norms along
scanned layers. Everything here is a pure function of arrays: it runs inside a jitted step on any mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optim.trees import named_leaves, path_name

PyTree = Any
Names = tuple | None  # a leaf's logical axis names, e.g. ("layers", "embed", "mlp"); None: unknown

SPLIT = ("layers", "expert")

# each statistic of x (upcast) over `axes`
_STATS: dict[str, Callable[[jax.Array, tuple[int, ...]], jax.Array]] = {
  "rms": lambda x, axes: jnp.sqrt(jnp.mean(jnp.square(x), axis=axes)),
  "norm": lambda x, axes: jnp.sqrt(jnp.sum(jnp.square(x), axis=axes)),
  "mean": lambda x, axes: jnp.mean(x, axis=axes),
  "std": lambda x, axes: jnp.std(x, axis=axes),
  "abs_mean": lambda x, axes: jnp.mean(jnp.abs(x), axis=axes),
  "max_abs": lambda x, axes: jnp.max(jnp.abs(x), axis=axes),
}
STATS = tuple(_STATS)


def kept_axes(names: Names, split: tuple[str, ...] = SPLIT) -> int:
  """The number of leading axes of a leaf that are named in `split` (up to the first that is not).

  Args:
    names: the leaf's logical axis names, e.g. ("layers", "expert", "embed", "mlp") (`sharding.logical_names`);
      None when unknown.
    split: the names of the axes a statistic is kept along (default `SPLIT`: "layers", "expert").

  Returns:
    2 for ("layers", "expert", "embed", "mlp"), 1 for ("layers", "embed", "heads"), 0 for ("embed", "vocab") and
    for None.
  """
  n = 0
  for name in names or ():
    if name not in split:
      break
    n += 1
  return n


def _upcast(x: jax.Array) -> jax.Array:
  """The array in float64 if it is float64, else in float32 (bfloat16, float16 and integers upcast)."""
  return jnp.asarray(x, jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def _is_names(x: Any) -> bool:
  return x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))


def _named_axes(axes: PyTree | None, names: list[str]) -> dict[str, Names]:
  """{path name: logical names} for `names`, from a tree of name tuples (or None for every leaf)."""
  if axes is None:
    return dict.fromkeys(names)
  flat = {path_name(p): a for p, a in jax.tree_util.tree_leaves_with_path(axes, is_leaf=_is_names)}
  missing = [n for n in names if n not in flat]
  if missing:
    raise ValueError(f"the axes tree has no names for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
  return {n: flat[n] for n in names}


def _reduced(x: jax.Array, names: Names, split: tuple[str, ...]) -> tuple[int, ...]:
  """The axes a statistic of x sums over: all but the leading ones named in `split`."""
  return tuple(range(min(kept_axes(names, split), x.ndim), x.ndim))


def tree_stats(tree: PyTree, axes: PyTree | None = None, *, split: tuple[str, ...] = SPLIT,
               stats: tuple[str, ...] = ("rms", "norm")) -> dict[str, dict[str, jax.Array]]:
  """Statistics of each leaf of a tree, one per layer (and expert) where the leaf stacks them.

  Each statistic reduces over every axis but the leaf's kept leading axes (`kept_axes`): an (L, D, F) leaf
  ("layers", "embed", "mlp") gives arrays of shape (L,), an (L, E, D, F) leaf (L, E), an unsplit leaf a scalar.
  Computed in float32 (bfloat16 and float16 upcast), float64 leaves in float64.

    rms = √mean(x²)   norm = √Σx² (Frobenius)   mean   std = √mean((x − mean)²)   abs_mean = mean|x|   max_abs = max|x|

  Args:
    tree: params, grads or updates: any pytree of arrays; None leaves are skipped.
    axes: a tree like `tree` whose leaves are tuples of logical axis names or None (no split), matched by path name
      (`optim.trees.path_name`, so an `nnx.State` matches nested dicts); default None, no leaf is split.
    split: the names of the leading axes kept (default `SPLIT`).
    stats: the statistics, names in `STATS` (default ("rms", "norm")).

  Returns:
    {path name ("blocks/wq_DQ"): {statistic: array of the leaf's kept leading axes}}.

  Raises:
    ValueError: when a statistic is unknown, or `axes` names no axes for a leaf of `tree`.

  References:
    Levanter `callbacks/watch.py` (`WatchConfig`: norms split along scanned layers); nanodo `get_metrics` (per-leaf
      rms, std and mean of grads, params and updates).
  """
  unknown = [s for s in stats if s not in _STATS]
  if unknown:
    raise ValueError(f"unknown statistics {unknown}; choose from {', '.join(STATS)}")
  leaves = named_leaves(tree)
  names = _named_axes(axes, list(leaves))
  out = {}
  for name, x in leaves.items():
    x = _upcast(x)
    reduce = _reduced(x, names[name], split)
    out[name] = {s: _STATS[s](x, reduce) for s in stats}
  return out


def relative_update(updates: PyTree, params: PyTree, axes: PyTree | None = None, *, split: tuple[str, ...] = SPLIT,
                    eps: float = 1e-30) -> dict[str, jax.Array]:
  """The relative update ‖ΔW‖_F / ‖W‖_F of each leaf, one per layer (and expert) where the leaf stacks them.

  ‖ΔW‖_F / max(‖W‖_F, eps): 0 where both are 0; where W = 0 and ΔW ≠ 0, ‖ΔW‖_F / eps (large and finite in float32
  for any update norm below 1e8).

  Args:
    updates: the step's updates (what `optax.apply_updates` adds); None leaves are skipped.
    params: the parameters the updates apply to (before the step), with a leaf for every leaf of `updates`.
    axes: logical axis names per leaf, as `tree_stats` takes them; default None, no split.
    split: the names of the leading axes kept (default `SPLIT`).
    eps: the least denominator (default 1e-30).

  Returns:
    {path name: the ratio, shaped like the leaf's kept leading axes}, in float32 (float64 for float64 leaves).

  Raises:
    ValueError: when `params` lacks a leaf of `updates`, or `axes` names no axes for one.

  References:
    Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv 2502.16982 (update RMS matched to AdamW's);
      Levanter `callbacks/watch.py` (the update-to-parameter norm ratio it logs).
  """
  u_leaves, p_leaves = named_leaves(updates), named_leaves(params)
  missing = [n for n in u_leaves if n not in p_leaves]
  if missing:
    raise ValueError(f"params have no leaf {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
  names = _named_axes(axes, list(u_leaves))
  out = {}
  for name, u in u_leaves.items():
    u, w = _upcast(u), _upcast(p_leaves[name])
    reduce = _reduced(u, names[name], split)
    un = jnp.sqrt(jnp.sum(jnp.square(u), axis=reduce))
    wn = jnp.sqrt(jnp.sum(jnp.square(w), axis=reduce))
    out[name] = un / jnp.maximum(wn, eps)
  return out


def histograms(tree: PyTree, *, bins: int = 32, lo: float = -8.0, hi: float = 2.0) -> dict[str, jax.Array]:
  """Histograms of log10|x| of each leaf, over the whole leaf.

  `bins` equal bins over [lo, hi]; values below lo (zeros included) count in the first bin, values above hi (and
  ±inf) in the last; NaNs are not counted, so a histogram that sums to less than the leaf's size flags them.

  Args:
    tree: any pytree of arrays; None leaves are skipped.
    bins: the number of bins (static; default 32).
    lo: log10 of the first bin's lower edge (default -8.0).
    hi: log10 of the last bin's upper edge (default 2.0).

  Returns:
    {path name: int32 counts of shape (bins,)}.

  Raises:
    ValueError: when `bins` < 1 or `hi` <= `lo`.

  References:
    Levanter `callbacks/watch.py` (`include_histograms`, off by default for their cost).
  """
  if bins < 1 or not hi > lo:
    raise ValueError(f"need bins >= 1 and hi > lo, got bins={bins}, lo={lo}, hi={hi}")
  out = {}
  for name, x in named_leaves(tree).items():
    x = _upcast(x)
    t = (jnp.log10(jnp.abs(x)) - lo) * (bins / (hi - lo))
    idx = jnp.floor(jnp.clip(t, 0, bins - 1)).astype(jnp.int32)  # clip first: -inf (zeros) cannot be cast
    idx = jnp.where(jnp.isnan(x), -1, idx)
    # a comparison per bin summed over the leaf (fused by XLA), not a scatter: the same program on any sharding
    hits = idx[..., None] == jnp.arange(bins, dtype=jnp.int32)
    out[name] = jnp.sum(hits, axis=tuple(range(x.ndim)), dtype=jnp.int32)
  return out
