"""BAdam: block coordinate descent with Adam as the inner solver.

Luo, Yu & Li, "BAdam: A Memory Efficient Full Parameter Optimization Method for Large Language Models", arXiv
2404.02827, NeurIPS 2024; Ledzy/BAdam `src/badam/block_optim.py`, class `BlockOptimizer`.

The parameters are split into D blocks (by default one per transformer layer). One block is active at a time; the
inner optimizer runs K = `switch_every` steps on it, its state (moments and bias-correction count) is discarded, and
the next block starts from a fresh state. Every other parameter gets an update of exactly zero.

Layers are stacked on a leading axis (models/transformer.py: `params["blocks"][name]` is (L, ...)), so layer i is
index i of every stacked leaf. The inner optimizer sees a *view* of one block: each stacked leaf sliced at the
active layer (shape leaf.shape[1:], taken with a dynamic index kept in the state, so switching never recompiles),
always-active leaves whole, and whole-leaf blocks in shared slots. Its state therefore holds one block's moments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim.hparams import Beta, Choices, Count, NonNegative, NonNegativeInt
from optim.needs import Blockwise, Inactive, Needs
from optim.registry import decay_mask, register
from optim.trees import leaf_name, path_name

ORDERS = ("descending", "ascending", "random", "fixed")
Order = Annotated[str, Choices(ORDERS)]  # a factory's `order`
LABELS = ("layers", "embedding", "head", "active", "frozen")
PyTree = Any


class BAdamError(ValueError):
  """A BAdam configuration or parameter tree that does not define blocks."""


class BAdamState(NamedTuple):
  """BAdam's state: the update count, the block the next update trains, and the inner state over its view."""

  # int32: updates taken so far (the reference's global_step)
  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count in typeshed
  block: jax.Array  # int32: the block the next update trains (position in the block list, see `badam`)
  inner_state: optax.OptState  # the inner optimizer's state over one block's view


def _matches(params, patterns) -> Any:
  """Bool tree: `patterns(params)` if callable, else whether the leaf's path contains one of the substrings.

  A substring that no leaf's path contains is refused (BAdamError), as the trainer's --freeze refuses one.
  """
  if callable(patterns):
    return patterns(params)
  if isinstance(patterns, str):
    patterns = (patterns,)
  names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  unmatched = [s for s in patterns if not any(s in n for n in names)]
  if unmatched:
    raise BAdamError(f"always_active={list(patterns)!r}: {', '.join(map(repr, unmatched))} matches no parameter "
                     f"(paths look like {', '.join(names[:3])})")
  return jax.tree_util.tree_map_with_path(lambda p, _: any(s in path_name(p) for s in patterns), params)


def switches_before(step: int | jax.Array, switch_every: int | jax.Array) -> int | jax.Array:
  """J = ⌊(t+1)/K⌋ − ⌊1/K⌋: the block switches before update number t (0-based), K = `switch_every`.

  See `block_index`; update t ends with a switch when switches_before(t + 1) != switches_before(t).

  Args:
    step: t, the update number (0-based; a Python int or a traced one).
    switch_every: K, updates per block.

  Returns:
    J, the number of switches before update t.
  """
  return (step + 1) // switch_every - 1 // switch_every


def badam_labels(params: PyTree, *, stacked: str | Callable = "blocks", include_embedding: bool = False,
                 include_head: bool = False, always_active: Sequence[str] | Callable = ()) -> Any:
  """What `badam(blocks="layers")` does with each leaf: one of LABELS.

  active     always trained: the path contains a string of `always_active` (or `always_active(params)` says so);
             the reference's `active_modules`. Checked first, so it can take a whole stacked leaf out of the blocks.
  layers     stacked: under the top-level key `stacked` (models/transformer.py's "blocks"), or where
             `stacked(params)` is True; leading axis = layer. Layer i of every such leaf is block i.
  embedding  other leaves whose path contains "embed" (the reference's regex): one block before the layers if
             `include_embedding`, else frozen. A tied output head is this table.
  head       every remaining leaf (untied head, final norm): one block after the layers if `include_head`
             (the reference's "lm_head and others"), else frozen.
  frozen     never updated, as in the reference (`final_norm` by default: name it in `always_active` to train it).

  Args:
    params: the parameter tree.
    stacked: the top-level key of the stacked layers (default "blocks"), or a function of the params giving a
      bool tree.
    include_embedding: the embedding leaves form a block instead of being frozen (default False).
    include_head: the remaining leaves form a block instead of being frozen (default False).
    always_active: substrings of leaf paths (or a function of the params giving a bool tree) trained at every step.

  Returns:
    The params' structure with one of `LABELS` per leaf.
  """
  if callable(stacked):
    is_stacked = stacked(params)
  else:
    is_stacked = jax.tree_util.tree_map_with_path(lambda p, _: bool(p) and path_name(p[:1]) == stacked, params)
  active = _matches(params, always_active)

  def label(path, _, s, a):
    if a:
      return "active"
    if s:
      return "layers"
    if "embed" in path_name(path):
      return "embedding" if include_embedding else "frozen"
    return "head" if include_head else "frozen"
  return jax.tree_util.tree_map_with_path(label, params, is_stacked, active)


def block_index(step: int | jax.Array, num_blocks: int, *, switch_every: int | jax.Array = 50,
                order: str = "descending", seed: int | jax.Array = 0,
                start_block: int | jax.Array | None = None) -> jax.Array:
  """The block that update number `step` (0-based) trains, as int32; works on traced steps.

  Timing as in the reference: after its n-th update (n = global_step, already incremented) it switches when
  (n + 1) % K == 0, so the first block runs K − 1 updates and every later one K (K = 1: a new block every update).
  The switch count before update t is j = ⌊(t+1)/K⌋ − ⌊1/K⌋, and the block is
    descending: (s − j) mod D, s = D − 1 by default (the reference's default order: last layer first)
    ascending:  (s + j) mod D, s = 0 by default
    random:     permutation_e[j mod D], e = ⌊j/D⌋: each block-epoch visits all D blocks once, in a fresh order drawn
                from (seed, e) (the reference reshuffles with torch.randperm when its order list runs out)
    fixed:      s (needs `start_block`; the reference fails without it)

  Args:
    step: t, the update number (0-based).
    num_blocks: D, the number of blocks.
    switch_every: K, updates per block (default 50, the reference class's).
    order: one of `ORDERS` (default "descending").
    seed: the "random" order's stream (default 0).
    start_block: s, the first block (ascending, descending) or the only one (fixed); None: the order's default.

  Returns:
    The block's position in the block list, int32.

  Raises:
    BAdamError: when `order` is not one of `ORDERS`.

  References:
    Luo, Yu and Li, "BAdam: A Memory Efficient Full Parameter Optimization Method for Large Language Models", 2024,
      arXiv 2404.02827 (NeurIPS 2024), Algorithm 1; reference code Ledzy/BAdam `src/badam/block_optim.py`
      (`BlockOptimizer`).
  """
  step = jnp.asarray(step, jnp.int32)
  j = cast(jax.Array, switches_before(step, switch_every))  # an array: step is one
  if order == "descending":
    return ((num_blocks - 1 if start_block is None else start_block) - j) % num_blocks
  if order == "ascending":
    return ((0 if start_block is None else start_block) + j) % num_blocks
  if order == "fixed":
    return jnp.asarray(start_block, jnp.int32) + 0 * j
  if order == "random":
    key = jax.random.fold_in(jax.random.key(seed), j // num_blocks)
    return jax.random.permutation(key, num_blocks)[j % num_blocks].astype(jnp.int32)
  raise BAdamError(f"unknown BAdam order {order!r}; choose from {', '.join(ORDERS)}")


class _Plan(NamedTuple):
  """Static block layout of a parameter tree (leaf positions are those of `treedef`'s flattening)."""
  treedef: Any
  num_blocks: int
  stacked: tuple[int, ...]  # leaves whose layer `block - layer_offset` is in the block list
  num_layers: int
  layer_offset: int
  active: tuple[int, ...]
  slots: tuple[tuple[str, tuple[int, ...], Any, np.ndarray, tuple[int, ...]], ...]  # name, shape, dtype, table, leaves
  whole: dict[int, tuple[int, int]]  # whole-leaf leaf -> (slot, block)


def _has_stacked(tree, stacked) -> bool:
  if callable(stacked):
    return any(jax.tree.leaves(stacked(tree)))
  return any(bool(p) and path_name(p[:1]) == stacked for p, _ in jax.tree_util.tree_leaves_with_path(tree))


def _each_leaf(tree, include_embedding, always_active):
  """blocks="leaves": every leaf its own block, in flattening order.

  `always_active` leaves train at every step, and leaves whose path contains "embed" are frozen unless
  `include_embedding` (as with blocks="layers").
  """
  active = jax.tree.leaves(_matches(tree, always_active))
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  ids, n = [], 0
  for (path, _), a in zip(flat, active):
    if a:
      ids.append("active")
    elif "embed" in path_name(path) and not include_embedding:
      ids.append("frozen")
    else:
      ids.append(n)
      n += 1
  return jax.tree_util.tree_unflatten(treedef, ids)


def block_plan(tree: PyTree, blocks: str | Callable, stacked: str | Callable, include_embedding: bool,
               include_head: bool, always_active: Sequence[str] | Callable) -> _Plan:
  """The static block layout of a parameter tree (`badam`'s arguments; BREAD builds on it).

  Args:
    tree: the parameter tree (its arrays, or their shapes).
    blocks: "auto", "layers", "leaves" or a function of the params giving block ids (`badam`).
    stacked: the top-level key of the stacked layers, or a function of the params giving a bool tree.
    include_embedding: put the embedding leaves in a block (blocks="layers" only).
    include_head: put the remaining leaves in a block (blocks="layers" only).
    always_active: substrings of leaf paths (or a function giving a bool tree) trained at every step.

  Returns:
    The layout: the stacked leaves and their layer count, the always-active leaves, and the whole-leaf blocks'
    shared slots.

  Raises:
    BAdamError: when the tree is empty; include_head is given with blocks="leaves", or include_embedding /
      include_head with a label function; blocks="layers" finds no stacked leaves or stacked leaves of different
      layer counts; or a label function gives an invalid label or no block id at all.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths, leaves = [p for p, _ in flat], [x for _, x in flat]
  if not leaves:
    raise BAdamError("BAdam needs the parameters themselves at init: its state holds one block's view (slices of "
                     "the stacked layers, slots for whole leaves), not trees shaped like the parameters, so it cannot "
                     "be built on an empty tree or on optax.tree.map_params' placeholder; map its state with "
                     "jax.tree.map")
  if blocks == "auto":
    blocks = "layers" if _has_stacked(tree, stacked) else "leaves"
  if blocks == "leaves":
    if include_head:
      raise BAdamError("include_head applies to blocks='layers' (with blocks='leaves' every non-embedding leaf is a "
                       "block already)")
    labels = _each_leaf(tree, include_embedding, always_active)
    blocks, include_embedding, always_active = (lambda _: labels), False, ()
  stacked_ix: list[int] = []
  active_ix: list[int] = []
  groups: dict[int, list[int]] = {}  # block key -> whole leaves
  if blocks == "layers":
    labels = treedef.flatten_up_to(badam_labels(  # type: ignore[attr-defined]  # jaxlib ships no PyTreeDef stub
tree, stacked=stacked, include_embedding=include_embedding,
                                                include_head=include_head, always_active=always_active))
    for i, lab in enumerate(labels):
      if lab == "layers":
        stacked_ix.append(i)
      elif lab == "active":
        active_ix.append(i)
      elif lab in ("embedding", "head"):
        groups.setdefault(0 if lab == "embedding" else 2, []).append(i)
    if not stacked_ix:
      raise BAdamError(f"blocks='layers' found no stacked leaves under {stacked!r}; pass stacked= (the key or a "
                       "function giving the stacked-layer leaves) or blocks=label_fn")
    sizes = {np.shape(leaves[i])[0] if np.ndim(leaves[i]) else 0 for i in stacked_ix}
    if len(sizes) != 1 or 0 in sizes:
      raise BAdamError(f"stacked leaves must share one leading (layer) axis, got sizes {sorted(sizes)}")
    num_layers = sizes.pop()
    layer_offset = 1 if 0 in groups else 0
    positions = [layer_offset + num_layers if k == 2 else 0 for k in sorted(groups)]  # embedding first
  else:
    if include_embedding or include_head:
      raise BAdamError("include_embedding/include_head apply to blocks='layers'; with a label_fn give those leaves "
                       "their own block id")
    num_layers, layer_offset = 0, 0
    # a function here: "auto" and "leaves" became "layers" or a function above (badam checks the names)
    label_fn = cast(Callable, blocks)
    for i, lab in enumerate(treedef.flatten_up_to(label_fn(tree))):  # type: ignore[attr-defined]  # no stub
      if lab == "active":
        active_ix.append(i)
      elif lab == "frozen" or lab is None:
        pass
      elif isinstance(lab, (int, np.integer)) and not isinstance(lab, bool) and lab >= 0:
        groups.setdefault(int(lab), []).append(i)
      else:
        where = path_name(paths[i]) or "the array"
        raise BAdamError(f"label_fn gave {lab!r} for {where}; use a block id >= 0, 'active' or 'frozen'")
    if not groups:
      raise BAdamError("label_fn gave no leaf a block id; at least one block is needed")
    positions = list(range(len(groups)))  # block ids in increasing order
  num_blocks = num_layers + len(groups)
  block_of_group = dict(zip(sorted(groups), positions))
  # Whole-leaf blocks share slots: the r-th leaf of a block with a given (name, shape, dtype) uses slot (key, r),
  # so blocks of the same structure (layers not stacked, say) need one block's worth of state.
  slot_ids: dict[tuple, int] = {}
  slots: list[tuple[str, tuple[int, ...], Any, np.ndarray, list[int]]] = []
  whole: dict[int, tuple[int, int]] = {}
  for g in sorted(groups):
    b = block_of_group[g]
    seen: dict[tuple, int] = {}
    for i in groups[g]:
      key = (leaf_name(paths[i]), tuple(np.shape(leaves[i])), jnp.result_type(leaves[i]))
      r = seen[key] = seen.get(key, -1) + 1
      if (key, r) not in slot_ids:
        slot_ids[(key, r)] = len(slots)
        slots.append((key[0], key[1], key[2], np.zeros(num_blocks, np.int32), []))
      s = slot_ids[(key, r)]
      slots[s][4].append(i)
      slots[s][3][b] = len(slots[s][4])  # case 0 of the select is zeros (block not using the slot)
      whole[i] = (s, b)
  slot_table = tuple((n, sh, dt, tab, tuple(ls)) for n, sh, dt, tab, ls in slots)
  return _Plan(treedef, num_blocks, tuple(stacked_ix), num_layers, layer_offset, tuple(active_ix), slot_table, whole)


def _layer(plan: _Plan, block):
  """(whether `block` is a layer block, its layer index clipped into range)."""
  k = block - plan.layer_offset
  return (k >= 0) & (k < plan.num_layers), jnp.clip(k, 0, max(plan.num_layers - 1, 0))


def _gather(plan: _Plan, leaves, block):
  """One block's view {"params": tree like the parameters (None off the view), "slots": {i: {name: leaf}}}."""
  is_layer, k = _layer(plan, block)
  main: list[Any] = [None] * len(leaves)
  for i in plan.stacked:
    main[i] = jnp.where(is_layer, jax.lax.dynamic_index_in_dim(leaves[i], k, 0, keepdims=False), 0)
  for i in plan.active:
    main[i] = leaves[i]
  slots = {}
  for s, (name, shape, dtype, table, members) in enumerate(plan.slots):
    cases = [jnp.zeros(shape, dtype)] + [jnp.asarray(leaves[i], dtype) for i in members]
    slots[str(s)] = {name: jax.lax.select_n(jnp.asarray(table)[block], *cases)}
  return {"params": jax.tree_util.tree_unflatten(plan.treedef, main), "slots": slots}


def _scatter(plan: _Plan, view, like, block):
  """Full-tree updates from a view's updates: the active block's entries, exact zeros everywhere else."""
  is_layer, k = _layer(plan, block)
  main = plan.treedef.flatten_up_to(view["params"])
  # A select on a never-true traced predicate gives exact zeros that keep g's sharding; a constant zeros array
  # would take whatever sharding GSPMD picks for it.
  out = [jnp.where(block < 0, g, 0) for g in like]
  for i in plan.stacked:
    placed = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(like[i]), main[i].astype(like[i].dtype), k, 0)
    out[i] = jnp.where(is_layer, placed, 0).astype(like[i].dtype)
  for i in plan.active:
    out[i] = main[i].astype(like[i].dtype)
  for i, (s, b) in plan.whole.items():
    u = view["slots"][str(s)][plan.slots[s][0]]
    out[i] = jnp.where(block == b, u, 0).astype(like[i].dtype)
  return jax.tree_util.tree_unflatten(plan.treedef, out)


def badam(inner: optax.GradientTransformation, *, blocks: str | Callable = "auto", switch_every: int | jax.Array = 50,
          order: str = "descending", seed: int | jax.Array = 0, start_block: int | jax.Array | None = None,
          include_embedding: bool = False, include_head: bool = False, always_active: Sequence[str] | Callable = (),
          stacked: str | Callable = "blocks") -> optax.GradientTransformation:
  """BAdam around an elementwise inner optimizer (adam, adamw, ...): only the active block moves.

  For block-epoch after block-epoch, for each block b in `order` (paper Alg. 1; reference `BlockOptimizer.step`):
    θ_b ← θ_b + inner(g_b) for K = `switch_every` updates, the inner state starting from inner.init each time
    (with Adam: m, v ← 0 and the bias-correction count t ← 0, so m̂ = m/(1−β1^t), v̂ = v/(1−β2^t) restart);
    the always-active leaves step with it; every other parameter gets an update of exactly 0.
  Switch timing and orders are those of the reference: see `block_index` (the first block runs K − 1 updates).

  State: the inner state over one block's view: per stacked leaf one slice, shaped leaf.shape[1:]; always-active
  leaves whole; whole-leaf blocks in slots keyed by (leaf name, shape, dtype), shared across blocks, so blocks of
  equal structure cost one block (different structures cost their union). The view is a dict
  {"params": the parameter tree with the non-view leaves None, "slots": {"i": {leaf name: array}}}.
  The train step still differentiates every parameter (unlike the reference, whose frozen leaves stop backprop);
  the saving is optimizer-state memory. An inner whose init depends on parameter values is initialised on zeros.
  Under `optax.inject_hyperparams`, list callable `blocks`, `always_active` or `stacked` in `static_args` (it
  treats callables as schedules); switch_every, seed and start_block may be injected (traced) numbers.

  Args:
    inner: any optax transform whose state is elementwise-shaped like its input (scale_by_adam + decayed
      weights, say); its masks see the view (param-like names, see above), so name-based masks work, and weight
      decay inside it touches the active block only. Keep learning-rate schedules OUTSIDE (`badam_adamw` does):
      a schedule inside `inner` would restart with its state at every switch.
    blocks: "layers": one block per layer of the stacked leaves, plus an embedding block first and a head block
      last when asked (`badam_labels` lists each leaf's fate). "leaves": every leaf is a block, in flattening
      order (a bare array is one block: Adam restarted every K updates), `always_active` and embeddings (frozen
      unless `include_embedding`) as with "layers". "auto" (default): "layers" when the tree has stacked leaves
      under `stacked`, else "leaves", so any parameter tree works; pass blocks="layers" to get an error instead
      when the stacked key is missing. Or a function of the params giving each leaf a block id (int ≥ 0; blocks
      ordered by id), "active" or "frozen"; such blocks are whole leaves.
    switch_every: K, updates per block (≥ 1; default 50).
    order: one of ORDERS (default "descending").
    seed: the "random" order's stream.
    start_block: first block (ascending/descending) or the only one (fixed, where it is required).
    include_embedding: put the embedding leaves in a block instead of freezing them (blocks="layers" only).
    include_head: put the head leaves in a block instead of freezing them (blocks="layers" only).
    always_active: substrings of leaf paths (or a function of the params giving a bool tree) trained at every step,
      like the reference's `active_modules`; their inner state also restarts at every switch, as there.
    stacked: the top-level key of the stacked layers, or a function of the params giving a bool tree.

  Returns:
    A transformation whose update is the inner update on the active block's entries and exact zeros elsewhere,
    with a `BAdamState`. Its init and update raise `BAdamError` when the tree defines no blocks (`block_plan`) or a
    Python `start_block` lies outside them.

  Raises:
    BAdamError: when `order` or `blocks` is unknown, a Python `switch_every` is below 1, order "fixed" has no
      `start_block`, or order "random" has one.

  References:
    Luo, Yu and Li, "BAdam: A Memory Efficient Full Parameter Optimization Method for Large Language Models", 2024,
      arXiv 2404.02827 (NeurIPS 2024), Algorithm 1; reference code Ledzy/BAdam `src/badam/block_optim.py`
      (`BlockOptimizer`).
  """
  if order not in ORDERS:
    raise BAdamError(f"unknown BAdam order {order!r}; choose from {', '.join(ORDERS)}")
  if blocks not in ("auto", "layers", "leaves") and not callable(blocks):
    raise BAdamError(f"blocks must be 'auto', 'layers', 'leaves' or a function of the params giving block ids, "
                     f"got {blocks!r}")
  if isinstance(switch_every, (int, float)) and switch_every < 1:
    raise BAdamError(f"switch_every must be a positive number of updates, got {switch_every}")
  if order == "fixed" and start_block is None:
    raise BAdamError("order='fixed' trains one block forever: pass start_block=<its index>")
  if order == "random" and start_block is not None:
    raise BAdamError("start_block applies to ascending/descending/fixed orders; 'random' draws every block-epoch")

  def plan_of(tree):
    plan = block_plan(tree, blocks, stacked, include_embedding, include_head, always_active)
    if isinstance(start_block, (int, np.integer)) and not 0 <= start_block < plan.num_blocks:
      raise BAdamError(f"start_block={start_block} is outside the {plan.num_blocks} blocks")
    return plan

  def index(step, plan):
    return block_index(step, plan.num_blocks, switch_every=switch_every, order=order, seed=seed,
                       start_block=start_block)

  def fresh(plan, leaves):
    return inner.init(jax.tree.map(jnp.zeros_like, _gather(plan, leaves, jnp.int32(0))))

  def init(params):
    plan = plan_of(params)
    count = jnp.zeros([], jnp.int32)
    return BAdamState(count, index(count, plan).astype(jnp.int32), fresh(plan, plan.treedef.flatten_up_to(params)))

  def update(updates, state, params=None):
    plan = plan_of(updates)
    grads = plan.treedef.flatten_up_to(updates)
    view_p = None if params is None else _gather(plan, plan.treedef.flatten_up_to(params), state.block)
    view_u, inner_state = inner.update(_gather(plan, grads, state.block), state.inner_state, view_p)
    count = optax.safe_increment(state.count)
    nxt = index(count, plan).astype(jnp.int32)
    # the reference: (global_step + 1) % K == 0 after global_step += 1
    switch = switches_before(count, switch_every) != switches_before(state.count, switch_every)
    inner_state = jax.tree.map(lambda f, s: jnp.where(switch, f, s), fresh(plan, grads), inner_state)
    return _scatter(plan, view_u, grads, state.block), BAdamState(count, nxt, inner_state)

  return optax.GradientTransformation(init, update)


# the block layout the trainer's blockwise step runs (layer blocks only); other values need full gradients
BLOCKWISE_DEFAULTS = {"include_embedding": False, "include_head": False, "always_active": ()}


def blockwise_needs(hp: dict, inactive: Inactive | None = None) -> Needs:
  """`badam_adamw`'s (and `bread_adamw`'s) declaration for the trainer: a blockwise step, or why not.

  A blockwise step when its block layout is the default one (`BLOCKWISE_DEFAULTS`), else why not.

  Args:
    hp: every hyperparameter of the optimizer, defaults filled in.
    inactive: the layers above the active one (`optim.needs.Inactive`: BREAD), or None.

  Returns:
    `Needs(blockwise=...)`, or `Needs(not_blockwise="KEY=VALUE")` naming the first hyperparameter that rules it out.
  """
  for key, default in BLOCKWISE_DEFAULTS.items():
    if hp[key] not in (default, list(default) if isinstance(default, tuple) else default):
      return Needs(not_blockwise=f"{key}={hp[key]}")
  return Needs(blockwise=Blockwise(hp["switch_every"], hp["order"], hp["seed"], hp["start_block"], hp["b1"],
                                   hp["b2"], hp["eps"], hp["weight_decay"], inactive))


@register("badam", needs=blockwise_needs)
def badam_adamw(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, b2: Beta = 0.95, eps: NonNegative = 1e-8,
                weight_decay: NonNegative = 0.1, switch_every: Count = 50, order: Order = "descending",
                seed: NonNegativeInt = 0, start_block: NonNegativeInt | None = None, include_embedding: bool = False,
                include_head: bool = False, always_active: Sequence[str] = (),
                mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """BAdam with AdamW inside, the learning rate (and its schedule) outside the per-block restarts.

    active block:  θ ← θ − lr_t·(m̂/(√v̂ + eps) + weight_decay·θ)   (m̂, v̂ over the updates since the last switch)
    all others:    θ ← θ

  Betas are the house AdamW's (0.9, 0.95); the reference's examples wrap torch Adam(W) with its defaults
  (0.9, 0.999). Weight decay follows `mask` (default `decay_mask`: not on norms); the reference meant the same
  but its LayerNorm test never matches a tensor, so there norm scales decay too. Other arguments: `badam`.

  Args:
    learning_rate: the learning rate or schedule, outside the per-block restarts.
    b1: AdamW's β1 (default 0.9).
    b2: AdamW's β2 (default 0.95).
    eps: AdamW's ε (default 1e-8).
    weight_decay: decoupled weight decay of the active block (default 0.1).
    switch_every: K, updates per block (default 50).
    order: one of `ORDERS` (default "descending").
    seed: the "random" order's stream (default 0).
    start_block: the first (or, fixed, the only) block; None: the order's default.
    include_embedding: put the embedding leaves in a block instead of freezing them (default False).
    include_head: put the head leaves in a block instead of freezing them (default False).
    always_active: substrings of leaf paths trained at every step (the reference's `active_modules`).
    mask: where weight decay applies: a bool tree or a function of the params; None: `decay_mask`.

  Returns:
    The chain of `badam` over AdamW and the learning rate.

  References:
    Luo, Yu and Li, "BAdam: A Memory Efficient Full Parameter Optimization Method for Large Language Models", 2024,
      arXiv 2404.02827 (NeurIPS 2024), Algorithm 1; reference code Ledzy/BAdam `src/badam/block_optim.py`
      (`BlockOptimizer`).
  """
  inner = optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                      optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask))
  return optax.chain(badam(inner, switch_every=switch_every, order=order, seed=seed, start_block=start_block,
                           include_embedding=include_embedding, include_head=include_head,
                           always_active=tuple(always_active)),
                     optax.scale_by_learning_rate(learning_rate))
