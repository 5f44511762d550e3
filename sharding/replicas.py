"""Replicas on the `data` axis that train apart: the pieces of parallel SGD beyond one all-reduce per step.

Synchronous data parallelism keeps one copy of the parameters and averages every step's gradients over `data`. The
algorithms here keep R = |data| copies instead, one per slice of the `data` axis, stacked on a leading replica axis
(`stack`, sharded `P("data", *the parameter's spec)`, so each replica's copy stays split over fsdp / tensor inside its
slice):

  local SGD / DiLoCo   H steps apart, then an outer step on the mean change (`outer_step`, Douillard et al. 2023)
  gossip               a step apart, then each replica averages with its neighbours: x_i <- sum_j W_ij x_j, W doubly
                       stochastic (`ring` by `ppermute`, or any given matrix); adapt then combine, x_i <- sum_j W_ij
                       (x_j - lr g_j), the variant of decentralized SGD (D-PSGD, Lian et al. 2017) whose replica mean
                       moves as plain SGD's with the mean gradient
  stale                one copy; replica w's gradient is taken at the parameters of d_w steps ago (`delays`) and the
                       mean of the delayed gradients applied: delayed SGD, the synchronous model of asynchronous workers
                       whose updates land d_w steps late (stale-synchronous parallel, Ho et al. 2013)

`map_replicas` runs a function on every replica's own copy and rows of the batch: a `shard_map` manual over `data`
only, so fsdp / tensor (and the model's own shard_maps) stay as they are inside. GSPMD cannot say "these R copies do
not talk", and a replica's step must not reduce over `data`: the manual axis makes that structural (the rules table
skips manual axes, `sharding.rules.logical_to_spec`). The mixing and averaging run on the stacked arrays with named
shardings, where GSPMD emits the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from numpy.typing import ArrayLike

from sharding.mesh import DATA

if TYPE_CHECKING:
  import optax

  from sharding.audit import Audit

AXIS = DATA
PyTree = Any


class ReplicaError(ValueError):
  """A mixing matrix, delay or layout that the replicas cannot use."""


def replica_count(mesh: Mesh) -> int:
  """R, the replicas of a mesh: the size of its `data` axis.

  Args:
    mesh: the mesh.

  Returns:
    |data|.
  """
  return mesh.shape[AXIS]


def stacked_sharding(sharding: NamedSharding) -> NamedSharding:
  """The sharding of R stacked copies of an array sharded as `sharding`: the copies split over `data`.

  Args:
    sharding: one copy's sharding.

  Returns:
    `P("data", *sharding.spec)` on the same mesh.

  Raises:
    ReplicaError: when `sharding` already uses the `data` axis (per-replica training does not combine with ZeRO-1).
  """
  spec = tuple(sharding.spec)
  if any(AXIS in (s if isinstance(s, tuple) else (s,)) for s in spec):
    raise ReplicaError(f"an array sharded {sharding.spec} already uses the {AXIS!r} axis: replicas need it whole "
                       f"(per-replica training does not combine with --zero1)")
  return NamedSharding(sharding.mesh, P(AXIS, *spec))


def stack(tree: PyTree, shardings: PyTree) -> tuple[PyTree, PyTree]:
  """R copies of every leaf of `tree` on a leading replica axis, each copy on its replica's slice of `data`.

  R = |data| of the shardings' mesh.

  Args:
    tree: the arrays to copy (parameters, say).
    shardings: their NamedShardings, a tree like `tree`.

  Returns:
    (stacked tree, its shardings): leaves (R, ...), sharded by `stacked_sharding`.
  """
  out_sh = jax.tree.map(stacked_sharding, shardings)
  r = replica_count(jax.tree.leaves(shardings)[0].mesh)
  copies = jax.jit(lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (r,) + x.shape), t), out_shardings=out_sh)
  return copies(tree), out_sh


def map_replicas(fn: Callable, args: Sequence, kinds: Sequence[str]) -> PyTree:
  """Fn on every replica at once; every output leaf gets a leading replica axis (R, ...) split over `data`.

  Call under `jax.set_mesh` inside jit. check_vma is off: a replica's outputs computed from shared inputs alone would
  otherwise be flagged as not varying over `data` (they do vary once stacked; each replica computed its own).

  Args:
    fn: the per-replica function, called with one replica's part of each argument.
    args: the arguments, pytrees.
    kinds: how each argument reaches a replica: "stacked" (R, ...) gives it its own copy (leading axis dropped),
      "rows" gives it its contiguous 1/R of the leading axis (a batch), "shared" gives every replica the whole.

  Returns:
    `fn`'s output, every leaf stacked over the replicas (R, ...).

  Raises:
    ReplicaError: when a kind is none of "stacked", "rows", "shared".
  """
  specs = {"stacked": P(AXIS), "rows": P(AXIS), "shared": P()}
  if set(kinds) - set(specs):
    raise ReplicaError(f"argument kinds are {sorted(specs)}, not {sorted(set(kinds) - set(specs))}")

  def local(*parts):
    parts = [jax.tree.map(lambda x: x[0], p) if k == "stacked" else p for p, k in zip(parts, kinds)]
    return jax.tree.map(lambda y: jnp.asarray(y)[None], fn(*parts))

  return jax.shard_map(local, in_specs=tuple(specs[k] for k in kinds), out_specs=P(AXIS), axis_names={AXIS},
                       check_vma=False)(*args)


def ring_matrix(r: int) -> np.ndarray:
  """The ring's mixing matrix: each replica keeps 1/3 and takes 1/3 from each neighbour.

  For R = 2 both neighbours are the other replica: W = [[1/3, 2/3], [2/3, 1/3]]; R = 1: W = [[1]]. Doubly stochastic
  and symmetric.

  Args:
    r: R, the replicas.

  Returns:
    W, (R, R) float64.
  """
  w = np.zeros((r, r))
  for i in range(r):
    for j in (i - 1, i, i + 1):
      w[i, j % r] += 1 / 3
  return w


def check_mixing(w: ArrayLike, r: int) -> np.ndarray:
  """W as an (R, R) float64 array, checked doubly stochastic: the condition under which gossip keeps the replicas' mean.

  Args:
    w: the mixing matrix.
    r: R, the replicas (the mesh's `data` size).

  Returns:
    `w` as float64.

  Raises:
    ReplicaError: when `w` is not (R, R), or not doubly stochastic (non-negative, rows and columns summing to 1
      within 1e-6).
  """
  w = np.asarray(w, np.float64)
  if w.shape != (r, r):
    raise ReplicaError(f"the mixing matrix is {w.shape}, the mesh has {r} replicas (data={r}): it must be ({r}, {r})")
  if (w < 0).any() or not np.allclose(w.sum(0), 1, atol=1e-6) or not np.allclose(w.sum(1), 1, atol=1e-6):
    raise ReplicaError(f"the mixing matrix must be doubly stochastic (non-negative, every row and column summing to "
                       f"1); its row sums are {np.round(w.sum(1), 6).tolist()}, column sums "
                       f"{np.round(w.sum(0), 6).tolist()}")
  return w


def ring_mix(stacked: PyTree) -> PyTree:
  """Gossip on the ring: x_i <- (x_{i-1} + x_i + x_{i+1}) / 3 for every stacked leaf (R, ...).

  Two `ppermute`s of each replica's copy to its neighbours, in a shard_map manual over `data` (one when R = 2, where
  both neighbours are the same replica). Equals `mix(stacked, ring_matrix(R))`.

  Args:
    stacked: the replicas' copies, leaves (R, ...) split over `data`.

  Returns:
    The mixed copies, laid out as `stacked`.

  References:
    Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms? A Case Study for Decentralized
      Parallel Stochastic Gradient Descent", NeurIPS 2017 (D-PSGD).
  """
  r = jax.tree.leaves(stacked)[0].shape[0]
  if r == 1:
    return stacked
  fwd, bwd = [(i, (i + 1) % r) for i in range(r)], [(i, (i - 1) % r) for i in range(r)]

  def local(x):
    prev = jax.lax.ppermute(x, AXIS, fwd)  # replica i receives x_{i-1}
    nxt = prev if r == 2 else jax.lax.ppermute(x, AXIS, bwd)
    return ((x.astype(jnp.float32) + prev + nxt) / 3).astype(x.dtype)

  ring = jax.shard_map(local, in_specs=P(AXIS), out_specs=P(AXIS), axis_names={AXIS})
  return jax.tree.map(ring, stacked)


def mix(stacked: PyTree, w: ArrayLike) -> PyTree:
  """Gossip with any mixing matrix: x_i <- sum_j W_ij x_j for every stacked leaf (R, ...).

  An einsum over the replica axis, computed in float32; GSPMD gathers the replicas' copies (an all-gather over
  `data`).

  Args:
    stacked: the replicas' copies, leaves (R, ...) split over `data`.
    w: W, (R, R) doubly stochastic (`check_mixing`).

  Returns:
    The mixed copies, in each leaf's dtype, split over `data` (`on_replicas`).

  References:
    Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms? A Case Study for Decentralized
      Parallel Stochastic Gradient Descent", NeurIPS 2017 (D-PSGD).
  """
  w = jnp.asarray(w, jnp.float32)
  return jax.tree.map(lambda x: on_replicas(jnp.einsum("ij,j...->i...", w, x.astype(jnp.float32)).astype(x.dtype)),
                      stacked)


def on_replicas(y: jax.Array) -> jax.Array:
  """Y (R, ...) with its leading axis split over `data` (each replica's copy on its slice), the rest left to GSPMD.

  Inside jit, what a stacked result of arithmetic over the replica axis is pinned to.

  Args:
    y: a stacked array (R, ...).

  Returns:
    `y` under that sharding constraint.
  """
  return jax.lax.with_sharding_constraint(y, P(AXIS, *[P.UNCONSTRAINED] * (y.ndim - 1)))


def mean(stacked: PyTree) -> PyTree:
  """The replicas' mean of every stacked leaf (R, ...) -> (...): one all-reduce over `data`.

  Args:
    stacked: the replicas' copies, leaves (R, ...).

  Returns:
    The mean copy, computed in float32, in each leaf's dtype.
  """
  return jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype), stacked)


def consensus_distance(stacked: PyTree) -> jax.Array:
  """How far the replicas have drifted apart: sqrt((1/R) sum_i ||x_i - x_bar||^2) over all leaves.

  Args:
    stacked: the replicas' copies, leaves (R, ...).

  Returns:
    The float32 scalar; 0 when the copies are equal.
  """
  sq = [jnp.sum(jnp.mean(jnp.square(x.astype(jnp.float32) - jnp.mean(x.astype(jnp.float32), axis=0)), axis=0))
        for x in jax.tree.leaves(stacked)]
  return jnp.sqrt(sum(sq))


def outer_step(outer_tx: optax.GradientTransformation, params: PyTree, outer_state: optax.OptState,
               stacked: PyTree) -> tuple[PyTree, optax.OptState, PyTree]:
  """DiLoCo's outer step: params' = params + outer_tx(Δ), and every replica restarts from params'.

  The outer gradient Δ = params - mean_i(x_i) is the replicas' mean change since they last started from `params`,
  sign as a gradient. Outer SGD with lr 1 and no momentum makes params' the replicas' mean.

  Args:
    outer_tx: the outer optimizer (Nesterov SGD in the paper).
    params: the parameters the replicas last started from.
    outer_state: `outer_tx`'s state.
    stacked: the replicas' copies after their inner steps, leaves (R, ...).

  Returns:
    (params', outer_state', stacked'), stacked' R copies of params' split over `data`.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.
  """
  avg = mean(stacked)
  delta = jax.tree.map(lambda p, a: p.astype(jnp.float32) - a.astype(jnp.float32), params, avg)
  updates, outer_state = outer_tx.update(delta, outer_state, params)
  params = jax.tree.map(lambda p, u: (p.astype(jnp.float32) + u).astype(p.dtype), params, updates)
  r = jax.tree.leaves(stacked)[0].shape[0]
  return params, outer_state, jax.tree.map(lambda p: on_replicas(jnp.broadcast_to(p, (r,) + p.shape)), params)


def delays(key: jax.Array, step: jax.Array, r: int, tau: int, random: bool) -> jax.Array:
  """How many steps old the parameters are at which each replica takes its gradient at `step` (0-based).

  Tau for everyone, or with `random` each replica's own draw from {0, ..., tau} (a function of the key and the step,
  so a resumed run draws the same); never older than the first step's.

  Args:
    key: the PRNG key of the draws.
    step: the step (0-based).
    r: R, the replicas.
    tau: the largest delay.
    random: draw each replica's delay instead of giving everyone tau.

  Returns:
    (R,) int32, each at most `step`.

  References:
    Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NeurIPS 2013.
  """
  d = jax.random.randint(jax.random.fold_in(key, step), (r,), 0, tau + 1) if random else jnp.full((r,), tau)
  return jnp.minimum(d, step).astype(jnp.int32)


def stale_params(history: PyTree, step: jax.Array, delay: jax.Array) -> PyTree:
  """The parameters of `delay` steps before `step`, from a history of the last tau + 1 parameter versions.

  Args:
    history: leaves (tau + 1, ...), version s at slot s mod (tau + 1) (`record`).
    step: the step.
    delay: how many steps old (`delays`), at most tau.

  Returns:
    The parameters of version `step - delay`.
  """
  slots = jax.tree.leaves(history)[0].shape[0]
  slot = (step - delay) % slots
  return jax.tree.map(lambda h: jax.lax.dynamic_index_in_dim(h, slot, keepdims=False), history)


def record(history: PyTree, step: jax.Array, params: PyTree) -> PyTree:
  """The history with `params` (the version after `step`) at slot (step + 1) mod (tau + 1).

  Args:
    history: leaves (tau + 1, ...), version s at slot s mod (tau + 1).
    step: the step that produced `params`.
    params: the new parameters.

  Returns:
    The updated history, in its dtypes.
  """
  slots = jax.tree.leaves(history)[0].shape[0]
  return jax.tree.map(lambda h, p: jax.lax.dynamic_update_index_in_dim(h, p.astype(h.dtype), (step + 1) % slots, 0),
                      history, params)


def cross_replica_bytes(audit: Audit, mesh: Mesh) -> float:
  """Wire bytes per device of a program's collectives (`sharding.collectives`) that cross replicas.

  Those whose groups (or permute pairs) hold devices of different `data` indices: what the replicas send each other,
  as opposed to the fsdp / tensor traffic inside a replica. `data` is the mesh's first axis, so device p of the
  program is on replica p // (devices / R).

  Args:
    audit: the program's collectives.
    mesh: the mesh the program was compiled for.

  Returns:
    The bytes one device sends per program execution, loop trip counts included.
  """
  per = mesh.size // replica_count(mesh)
  crosses = lambda group: len({d // per for d in group}) > 1
  return float(sum(op.wire_bytes * op.count for op in audit.ops if any(crosses(g) for g in op.groups)))


__all__ = ["AXIS", "ReplicaError", "check_mixing", "consensus_distance", "cross_replica_bytes", "delays",
           "map_replicas", "mean", "mix", "on_replicas", "outer_step", "record", "replica_count", "ring_matrix",
           "ring_mix", "stack", "stacked_sharding", "stale_params"]
