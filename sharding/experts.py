"""Token dispatch to experts: on one device, and expert-parallel with `shard_map` over a mesh.

Given each token's top-k experts `idx` and gate weights `gate`, the dispatch gathers tokens per
expert, runs the experts, and returns Σ_k gate·expert(x). The expert math is the caller's: two
callbacks on stacked weights `w` (leading axis E, or the E/P local experts of a shard),
  grouped(x_MD, sizes_E, w) -> y_MD   rows sorted by expert, sizes_E rows each (`jax.lax.ragged_dot`)
  dense(x_ECD, w) -> y_ECD            C capacity slots per expert (einsum)
each linear in the hidden width F, so a shard holding an F slice (tensor parallelism) returns a
partial sum that the dispatch `psum`s over `tensor`.

Paths, chosen by the mesh alone (`dispatch`):
- no mesh, or one device: the plain dispatch on the whole batch.
- a mesh: `shard_map` over every non-stage axis. Each device dispatches its own tokens (its batch
  shard: a GShard "group"); with an `expert` axis of size P > 1 the experts are split P ways and
  tokens travel by all-to-all, then come back:
    capacity:  the (E, C, D) slot buffer viewed as (P, E/P·C, D), one `all_to_all` each way;
    dropless:  a fixed-capacity `all_to_all` whose buffer holds all G·K local assignments for every
               destination (never drops, P× the bytes needed: what runs on XLA:CPU), or
               `ragged_all_to_all` (`ragged=True`, GPU/TPU; XLA:CPU cannot run it) sending exact sizes.
  Weights enter with the rules table's layout minus FSDP (gathered once before use): experts over
  `expert`, F over `tensor` (column-parallel gate/up, row-parallel down).

Capacity (GShard/Switch): C = ceil(capacity_factor · G·K / E) slots per expert for the G tokens of a
group; all first choices are placed before second choices, each in token order, and assignments past
C are dropped (they contribute 0; the residual carries the token). Shapes: G tokens, K top-k, E
experts, D model width, A = G·K assignments, P expert shards, C capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.mesh import STAGE
from sharding.rules import ShardingError, logical_to_spec

Grouped = Callable[[jax.Array, jax.Array, dict], jax.Array]
Dense = Callable[[jax.Array, dict], jax.Array]


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  """Slots per expert: ceil(capacity_factor · tokens · k / E).

  Args:
    num_tokens: G, the tokens of one group (a device's batch shard).
    top_k: K, experts per token.
    num_experts: E.
    capacity_factor: slots per expert over the even share G·K/E; 1.0 fits a perfectly balanced router.

  Returns:
    C, at least 1.

  References:
    Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding", 2020.
    Fedus, Zoph, Shazeer, "Switch Transformers", 2021, arXiv 2101.03961 (capacity factor); NVIDIA/Megatron-LM
      `get_capacity` (moe_utils.py), the same formula.
  """
  return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def expert_slots(idx_GK: jax.Array, num_experts: int, cap: int) -> tuple[jax.Array, jax.Array]:
  """Each assignment's slot in the (E·C) buffer of expert slots.

  Priority is k-major (every token's first choice before any second choice), then token order.

  Args:
    idx_GK: each token's top-k expert ids (G, K).
    num_experts: E.
    cap: C, slots per expert (`capacity`).

  Returns:
    (slot_GK, keep_GK): slot e·C + position in its expert's buffer, or E·C (dropped); keep False where dropped.
  """
  G, K = idx_GK.shape
  e_A = idx_GK.T.reshape(-1)
  order_A = jnp.argsort(e_A, stable=True)
  sizes_E = jnp.bincount(e_A, length=num_experts)
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  rank_A = jnp.arange(G * K) - starts_E[e_A[order_A]]
  pos_GK = jnp.zeros(G * K, jnp.int32).at[order_A].set(rank_A.astype(jnp.int32)).reshape(K, G).T
  keep_GK = pos_GK < cap
  return jnp.where(keep_GK, idx_GK * cap + pos_GK, num_experts * cap), keep_GK


def _inverse(order):
  return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _gather_rows(x_MD, rows):
  """x_MD[rows] with row M (one past the end) reading zeros."""
  return jnp.concatenate([x_MD, jnp.zeros((1, x_MD.shape[1]), x_MD.dtype)])[rows]


def _combine(y_AD, gate_GK):
  G, K = gate_GK.shape
  return jnp.einsum("gkd,gk->gd", y_AD.reshape(G, K, -1), gate_GK.astype(y_AD.dtype))


def dropless_local(x_GD: jax.Array, idx_GK: jax.Array, gate_GK: jax.Array, w: dict, grouped: Grouped,
                   num_experts: int, reduce: Callable[[jax.Array], jax.Array] = lambda y: y
                   ) -> tuple[jax.Array, jax.Array]:
  """Sort the G·K assignments by expert, run `grouped`, unsort, combine. Nothing is dropped.

  Args:
    x_GD: the tokens (G, D).
    idx_GK: their top-k expert ids (G, K).
    gate_GK: their gate weights (G, K).
    w: the stacked expert weights (leading axis E).
    grouped: the expert math on rows sorted by expert (module docstring).
    num_experts: E.
    reduce: applied to the experts' output rows (the `psum` over `tensor` of partial sums); default the identity.

  Returns:
    (y_GD, keep_GK): Σ_k gate·expert_k(x) per token, and keep all True.
  """
  G, K = idx_GK.shape
  e_A = idx_GK.reshape(-1)
  order_A = jnp.argsort(e_A, stable=True)
  y_AD = reduce(grouped(x_GD[order_A // K], jnp.bincount(e_A, length=num_experts), w))
  return _combine(y_AD[_inverse(order_A)], gate_GK), jnp.ones_like(idx_GK, bool)


def capacity_local(x_GD: jax.Array, idx_GK: jax.Array, gate_GK: jax.Array, w: dict, dense: Dense, num_experts: int,
                   cap: int, reduce: Callable[[jax.Array], jax.Array] = lambda y: y) -> tuple[jax.Array, jax.Array]:
  """Scatter tokens into (E, C, D) slots, run `dense`, gather back; assignments past C drop.

  Args:
    x_GD: the tokens (G, D).
    idx_GK: their top-k expert ids (G, K).
    gate_GK: their gate weights (G, K).
    w: the stacked expert weights (leading axis E).
    dense: the expert math on (E, C, D) slots (module docstring).
    num_experts: E.
    cap: C, slots per expert (`capacity`).
    reduce: applied to the experts' output slots (the `psum` over `tensor` of partial sums); default the identity.

  Returns:
    (y_GD, keep_GK): Σ_k gate·expert_k(x) over the kept assignments, and keep False where one was dropped.
  """
  G, K = idx_GK.shape
  E, D = num_experts, x_GD.shape[1]
  slot_GK, keep_GK = expert_slots(idx_GK, E, cap)
  token_S = jnp.full(E * cap, G, jnp.int32).at[slot_GK.reshape(-1)].set(
      jnp.repeat(jnp.arange(G, dtype=jnp.int32), K), mode="drop")
  y_ECD = reduce(dense(_gather_rows(x_GD, token_S).reshape(E, cap, D), w))
  return _combine(_gather_rows(y_ECD.reshape(E * cap, D), slot_GK.reshape(-1)), gate_GK), keep_GK


def _capacity_ep(x_GD, idx_GK, gate_GK, w, dense, E, cap, ep, reduce):
  """Capacity dispatch with the experts split over `ep` devices: (E, C, D) = (P, E/P·C, D) slot rows."""
  G, K = idx_GK.shape
  D, Pn = x_GD.shape[1], jax.lax.axis_size(ep)
  El = E // Pn
  slot_GK, keep_GK = expert_slots(idx_GK, E, cap)
  token_S = jnp.full(E * cap, G, jnp.int32).at[slot_GK.reshape(-1)].set(
      jnp.repeat(jnp.arange(G, dtype=jnp.int32), K), mode="drop")
  send = _gather_rows(x_GD, token_S).reshape(Pn, El * cap, D)
  recv = jax.lax.all_to_all(send, ep, 0, 0, tiled=True)  # recv[p]: source p's slots of my experts
  x_ECD = recv.reshape(Pn, El, cap, D).transpose(1, 0, 2, 3).reshape(El, Pn * cap, D)
  y = reduce(dense(x_ECD, w)).reshape(El, Pn, cap, D).transpose(1, 0, 2, 3).reshape(Pn, El * cap, D)
  back = jax.lax.all_to_all(y, ep, 0, 0, tiled=True).reshape(E * cap, D)
  return _combine(_gather_rows(back, slot_GK.reshape(-1)), gate_GK), keep_GK


def _local_grouped(x_MD, e_M, valid_M, w, grouped, El, reduce):
  """Received rows (any order, local expert ids e_M, some invalid) through the local experts."""
  order = jnp.argsort(jnp.where(valid_M, e_M, El), stable=True)  # invalid rows last: no group holds them
  sizes = jnp.bincount(jnp.where(valid_M, e_M, El), length=El)
  y = reduce(grouped(x_MD[order], sizes, w))[_inverse(order)]
  return jnp.where(valid_M[:, None], y, 0)


def _dropless_ep(x_GD, idx_GK, gate_GK, w, grouped, E, ep, reduce):
  """Dropless dispatch over `ep` devices with a fixed-capacity all_to_all.

  Every destination gets a buffer of A = G·K rows (enough if all local assignments pick its experts).
  """
  G, K = idx_GK.shape
  D, Pn, A = x_GD.shape[1], jax.lax.axis_size(ep), G * K
  El = E // Pn
  e_A = idx_GK.reshape(-1)
  order_A = jnp.argsort(e_A, stable=True)
  e_sorted = e_A[order_A]
  n_P = jnp.bincount(e_A, length=E).reshape(Pn, El).sum(1)
  start_P = jnp.cumsum(n_P) - n_P
  j = jnp.arange(A)
  row_PA = jnp.where(j[None] < n_P[:, None], start_P[:, None] + j[None], A)  # sorted row in slot (p, j)
  send_x = _gather_rows(x_GD[order_A // K], row_PA.reshape(-1)).reshape(Pn, A, D)
  send_e = jnp.concatenate([e_sorted % El, jnp.array([-1], e_sorted.dtype)])[row_PA]
  recv_x = jax.lax.all_to_all(send_x, ep, 0, 0, tiled=True).reshape(Pn * A, D)
  recv_e = jax.lax.all_to_all(send_e, ep, 0, 0, tiled=True).reshape(Pn * A)
  y = _local_grouped(recv_x, recv_e, recv_e >= 0, w, grouped, El, reduce)
  back_PAD = jax.lax.all_to_all(y.reshape(Pn, A, D), ep, 0, 0, tiled=True)
  dest_A = e_sorted // El
  y_sorted = back_PAD[dest_A, j - start_P[dest_A]]
  return _combine(y_sorted[_inverse(order_A)], gate_GK), jnp.ones_like(idx_GK, bool)


def _dropless_ep_ragged(x_GD, idx_GK, gate_GK, w, grouped, E, ep, reduce):
  """Dropless dispatch over `ep` devices with `ragged_all_to_all`: each source sends exactly its rows per destination.

  Receivers learn the sizes from an all_gather of every source's expert counts.
  """
  G, K = idx_GK.shape
  D, Pn, A = x_GD.shape[1], jax.lax.axis_size(ep), G * K
  El = E // Pn
  me = jax.lax.axis_index(ep)
  e_A = idx_GK.reshape(-1)
  order_A = jnp.argsort(e_A, stable=True)
  sizes_PE = jax.lax.all_gather(jnp.bincount(e_A, length=E).astype(jnp.int32), ep)  # [source, expert]
  counts_PP = sizes_PE.reshape(Pn, Pn, El).sum(-1)  # [source, destination]
  send_start = jnp.cumsum(counts_PP, 1) - counts_PP  # a source's offset of each destination's rows
  recv_start = jnp.cumsum(counts_PP, 0) - counts_PP  # a destination's offset of each source's rows
  buf = jnp.zeros((Pn * A, D), x_GD.dtype)
  recv_x = jax.lax.ragged_all_to_all(x_GD[order_A // K], buf, send_start[me], counts_PP[me], recv_start[me],
                                     counts_PP[:, me], axis_name=ep)
  # received: source-major chunks, each sorted by expert, with sizes_PE[p, me·El:(me+1)·El] rows per expert
  mine_PL = jax.lax.dynamic_slice_in_dim(sizes_PE, me * El, El, axis=1)
  e_M = jnp.repeat(jnp.tile(jnp.arange(El), Pn), mine_PL.reshape(-1), total_repeat_length=Pn * A)
  valid_M = jnp.arange(Pn * A) < mine_PL.sum()
  y = _local_grouped(recv_x, e_M, valid_M, w, grouped, El, reduce)
  y_sorted = jax.lax.ragged_all_to_all(y, jnp.zeros((A, D), y.dtype), recv_start[:, me], counts_PP[:, me],
                                       send_start[:, me], counts_PP[me], axis_name=ep)
  return _combine(y_sorted[_inverse(order_A)], gate_GK), jnp.ones_like(idx_GK, bool)


def dispatch(x_BTD: jax.Array, idx_BTK: jax.Array, gate_BTK: jax.Array, w: dict, names: dict, *, num_experts: int,
             grouped: Grouped, dense: Dense, capacity_factor: float | None = None, ragged: bool = False
             ) -> tuple[jax.Array, jax.Array]:
  """Σ_k gate·expert_k(x) for every token, on the layout the current mesh implies.

  The path (one device, a shard_map over the mesh, expert parallelism by all-to-all) is chosen by the mesh alone;
  the module docstring describes each.

  Args:
    x_BTD: the tokens (B, T, D).
    idx_BTK: their top-k expert ids (B, T, K).
    gate_BTK: their gate weights (B, T, K).
    w: stacked expert weights (leading axis E).
    names: the logical axis names of `w`'s leaves *as used in compute* (an FSDP-split axis named None, so it is
      gathered before the shard_map).
    num_experts: E.
    grouped: the expert math on rows sorted by expert, for the dropless paths (module docstring).
    dense: the expert math on (E, C, D) capacity slots (module docstring).
    capacity_factor: C = ceil(capacity_factor · G·K / E) slots per expert (`capacity`); default None, dropless.
    ragged: expert parallelism through `ragged_all_to_all` (GPU/TPU) instead of a fixed-capacity all_to_all (which
      XLA:CPU runs); default False.

  Returns:
    (y_BTD, keep_BTK), keep False where an assignment was dropped.

  Raises:
    ShardingError: when the rules split the weights' expert axis over mesh axes that do not split the batch, or
      their F axis over one that does.

  References:
    Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding", 2020 (groups
      and capacity). MaxText's `RoutedMoE` (AI-Hypercomputer/maxtext, layers/moe.py: `ragged_all_to_all`).
  """
  D, K = x_BTD.shape[-1], idx_BTK.shape[-1]
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  # every axis of size > 1 but `stage` (the pipeline's) and those already manual (an enclosing shard_map)
  axes = [] if mesh.empty else [a for a in mesh.axis_names if mesh.shape[a] > 1 and a != STAGE and a not in manual]

  def local(x, idx, gate, w, *, ep=(), tp=()):
    G = x.shape[0] * x.shape[1]
    x_GD, idx_GK, gate_GK = x.reshape(G, D), idx.reshape(G, K), gate.reshape(G, K)
    # the partial sums over F slices, added in fp32 (XLA:CPU fails on a bf16 all-reduce here; fp32 is also exact-er)
    reduce = (lambda y: jax.lax.psum(y.astype(jnp.float32), tp).astype(y.dtype)) if tp else (lambda y: y)
    if capacity_factor is not None:
      cap = capacity(G, K, num_experts, capacity_factor)
      if ep:
        y, keep = _capacity_ep(x_GD, idx_GK, gate_GK, w, dense, num_experts, cap, ep, reduce)
      else:
        y, keep = capacity_local(x_GD, idx_GK, gate_GK, w, dense, num_experts, cap, reduce)
    elif ep:
      fn = _dropless_ep_ragged if ragged else _dropless_ep
      y, keep = fn(x_GD, idx_GK, gate_GK, w, grouped, num_experts, ep, reduce)
    else:
      y, keep = dropless_local(x_GD, idx_GK, gate_GK, w, grouped, num_experts, reduce)
    return y.reshape(x.shape), keep.reshape(idx.shape)

  if not axes:
    return local(x_BTD, idx_BTK, gate_BTK, w)

  x_spec = _restrict(logical_to_spec(("batch", "seq", "act_embed"), mesh, x_BTD.shape), axes)
  w_specs = {k: _restrict(logical_to_spec(names[k], mesh, v.shape), axes) for k, v in w.items()}
  ep: str | tuple[str, ...] = _entry(next(iter(w_specs.values())), 0)  # the expert (leading) axis of the weights
  tp = tuple(dict.fromkeys(a for s in w_specs.values() for i in range(1, len(s)) for a in _entry(s, i)))
  batch = _entry(x_spec, 0)
  if not set(ep) <= set(batch) or set(tp) & set(batch):
    raise ShardingError(f"expert dispatch needs the expert axes {ep} to split the batch and the tensor axes {tp} "
                        f"not to (batch is split over {batch}); fix the 'batch'/'expert'/'mlp' rules")
  ep = ep[0] if len(ep) == 1 else ep
  fn = jax.shard_map(lambda *a: local(*a, ep=ep, tp=tp), in_specs=(x_spec, x_spec, x_spec, w_specs),
                     out_specs=(x_spec, x_spec), axis_names=set(axes))
  return fn(x_BTD, idx_BTK, gate_BTK, w)


def _entry(spec: P, dim: int) -> tuple[str, ...]:
  """The mesh axes that split dimension `dim` of `spec`."""
  e = spec[dim] if dim < len(spec) else None
  return () if e is None else (e,) if isinstance(e, str) else tuple(e)


def _restrict(spec: P, axes) -> P:
  """`spec` without mesh axes outside `axes` (those stay automatic, e.g. `stage`)."""
  out = []
  for i in range(len(spec)):
    kept = tuple(a for a in _entry(spec, i) if a in axes)
    out.append(kept[0] if len(kept) == 1 else (kept or None))
  return P(*out)
