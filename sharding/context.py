"""Context parallelism over the `context` mesh axis: the sequence split across devices, zig-zag balanced.

Attention runs as a ring or an all-gather of K/V (`algorithm`, below).

Shapes: B batch, T sequence, C context devices, h = T/(2C) positions per chunk, N query heads, K kv heads, G = N/K
query heads per kv head, H head_dim.

Layout (zig-zag, as Megatron-LM's context parallelism and ring-flash-attention): the sequence is cut into 2C chunks of
h positions and device c holds chunks c and 2C-1-c, so under the causal mask every device has the same work: an early
chunk that sees little and a late chunk that sees much (`balance` counts it). The model runs in this order: the
transformer permutes the tokens once on the way in (`to_zigzag`) and the hidden states back once before the head
(`from_zigzag`); every block in between is position-wise except attention, which reads each slot's global position
(`zigzag_positions`: RoPE and the causal mask use those).

Attention (`context_attention`, inside a `shard_map` manual over `context` only, so data / fsdp / tensor / expert and
an enclosing pipeline stage stay as they are): device c computes its queries against every device's K/V block, one
block per step, merging by online softmax (running max, sum and unnormalized output per query):
- step 0, its own block, as three (h x h) products: early queries on early keys and late on late under the causal
  mask, late on early whole;
- step s = 1..C-1, the block of device j = (c - s) mod C. Exactly half of it is needed, and it is computed as two
  (h x h) products with no mask: the late queries on j's early keys (always visible), and either the early queries on
  j's early keys (j < c) or the late queries on j's late keys (j > c); the other two pairs are masked out entirely.
  The choice is a `jnp.where` on the device index, so every device runs the same program.
Two ways to get block j (`algorithm`):
- "ring" (Liu et al. 2023, arXiv 2310.01889): the K/V blocks travel around the ring with `ppermute`, C-1 hops forward;
  the backward pass re-runs the ring, the K/V gradients travelling with their blocks (C hops) back to their owners. No
  device holds more than two K/V blocks.
- "allgather" (Llama 3, arXiv 2407.21783 §3.3.2): one all-gather of K and V, then the same steps on slices; its
  backward all-gathers again and reduce-scatters the K/V gradients. Simpler, each device holds all of K/V for a layer.
Both are `jax.custom_vjp`s whose residuals are the local q, k, v, the output and its log-sum-exp: the backward
recomputes each block's scores, as flash attention does. Their steps are unrolled in Python, so the schedule puts no
collective inside a `while` body (XLA:CPU can deadlock there); in the model the layer `scan` around it is one, as it
is for every per-layer collective of tensor and expert parallelism, and the tests train through it on XLA:CPU.

Each pair of chunks runs flash attention's kernel, models/flash.py's `pair_stats` / `pair_grads` (tiles of `BLOCK`
positions, one tile of scores at a time), so no device forms more than one (BLOCK x BLOCK) tile of scores per head
whatever T/C is; models/attention.py's single-device `flash` is the same kernel on the whole causal sequence.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# the flash kernels are model math (models/flash.py); this file adds only their schedule over the `context` axis
from models.flash import BLOCK, acc_dtype, finish, head_major, merge, pair_grads, pair_stats, row_dot, token_major
from sharding.mesh import CONTEXT

AXIS = CONTEXT
ALGORITHMS = ("ring", "allgather")


class ContextError(ValueError):
  """A sequence or mesh that the context-parallel layout cannot split."""


def mesh_context() -> int:
  """Size of the `context` axis of the current mesh (`jax.set_mesh`).

  Returns:
    The axis size; 1 outside a mesh or on a mesh without the axis.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.shape.get(AXIS, 1)


def check_context(seq_len: int, context: int, block: int = BLOCK) -> None:
  """Check that a `seq_len`-token sequence splits into 2·`context` zig-zag chunks that the attention's tiles fit.

  Args:
    seq_len: T, tokens per sequence.
    context: C, devices on the `context` axis; 1 passes any length.
    block: the attention's tile of positions; default models/flash.py's `BLOCK`.

  Raises:
    ContextError: naming the fix, when T is not a multiple of 2C, or its chunks of h = T/(2C) positions are larger
      than `block` and not a multiple of it.
  """
  if context > 1 and seq_len % (2 * context):
    raise ContextError(f"seq_len={seq_len} does not split into the 2*context={2 * context} zig-zag chunks of "
                       f"context={context}; use a seq_len that is a multiple of {2 * context}")
  h = seq_len // (2 * context)
  if context > 1 and h > block and h % block:
    raise ContextError(f"seq_len={seq_len} gives zig-zag chunks of {h} positions, which the attention's tiles of "
                       f"{block} do not divide; use a seq_len that is a multiple of {2 * context * block} (or at most "
                       f"{2 * context * block})")


def zigzag_positions(seq_len: int, context: int) -> np.ndarray:
  """The global position held in each slot of the zig-zag layout (device c: chunks c, 2C-1-c).

  A sequence the layout cannot split raises ContextError (`check_context`).

  Args:
    seq_len: T, tokens per sequence.
    context: C, devices on the `context` axis.

  Returns:
    (T,) int: slot i holds position out[i]; `np.arange(T)` when C = 1.
  """
  check_context(seq_len, context)
  if context == 1:
    return np.arange(seq_len)
  h = seq_len // (2 * context)
  chunks = np.stack([np.arange(context), 2 * context - 1 - np.arange(context)], axis=1).reshape(-1)
  return (chunks[:, None] * h + np.arange(h)).reshape(-1)


def to_zigzag(x: jax.Array, context: int, axis: int = 1) -> jax.Array:
  """`x` with its sequence axis reordered into the zig-zag layout.

  Args:
    x: an array with a sequence axis of T positions, T a multiple of 2C.
    context: C, devices on the `context` axis; 1 returns `x` unchanged.
    axis: the sequence axis; default 1, as in (B, T, ...).

  Returns:
    out[..., i, ...] = x[..., positions[i], ...], positions = `zigzag_positions(T, C)`.
  """
  if context == 1:
    return x
  x = jnp.moveaxis(x, axis, 0)
  halves = x.reshape(2, context, x.shape[0] // (2 * context), *x.shape[1:])
  y = jnp.stack([halves[0], jnp.flip(halves[1], axis=0)], axis=1)  # (C, 2, h, ...)
  return jnp.moveaxis(y.reshape(x.shape), 0, axis)


def from_zigzag(x: jax.Array, context: int, axis: int = 1) -> jax.Array:
  """The inverse of `to_zigzag`: the sequence axis back in position order.

  Args:
    x: an array whose sequence axis is in the zig-zag layout.
    context: C, devices on the `context` axis; 1 returns `x` unchanged.
    axis: the sequence axis; default 1, as in (B, T, ...).

  Returns:
    `x` with out[..., positions[i], ...] = x[..., i, ...].
  """
  if context == 1:
    return x
  x = jnp.moveaxis(x, axis, 0)
  y = x.reshape(context, 2, x.shape[0] // (2 * context), *x.shape[1:])
  halves = jnp.stack([y[:, 0], jnp.flip(y[:, 1], axis=0)])  # (2, C, h, ...)
  return jnp.moveaxis(halves.reshape(x.shape), 0, axis)


def balance(seq_len: int, context: int) -> dict:
  """Causal work per device: the (query, key) pairs under the mask each device owns.

  For the contiguous split (device c: positions [cT/C, (c+1)T/C)) and for zig-zag, and what the zig-zag kernel
  computes (three of its own block's four half-chunk pairs, then two per step). max/mean = 1 is perfect balance.

  Args:
    seq_len: T, tokens per sequence.
    context: C, devices on the `context` axis.

  Returns:
    {"contiguous", "zigzag", "zigzag_computed": per-device pair counts (lists of C ints),
    "contiguous_max_over_mean", "zigzag_max_over_mean": max/mean of the first two}.
  """
  T, C = seq_len, context
  causal = lambda pos: int(np.sum(pos + 1))  # query p sees keys 0..p
  contiguous = [causal(np.arange(c * T // C, (c + 1) * T // C)) for c in range(C)]
  zz = zigzag_positions(T, C).reshape(C, -1)
  zigzag = [causal(zz[c]) for c in range(C)]
  h = T // (2 * C)
  computed = [3 * h * h + (C - 1) * 2 * h * h] * C
  ratio = lambda w: max(w) / (sum(w) / len(w))
  return {"contiguous": contiguous, "zigzag": zigzag, "zigzag_computed": computed,
          "contiguous_max_over_mean": ratio(contiguous), "zigzag_max_over_mean": ratio(zigzag)}


# --- context-parallel attention ------------------------------------------------------------------------------------


def context_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, algorithm: str = "ring",
                      block: int = BLOCK) -> jax.Array:
  """Causal attention of sequences laid out in zig-zag order over the mesh's `context` axis (T split C ways).

  Equals `jax.nn.dot_product_attention(..., is_causal=True)` on the sequences in position order. GQA: K divides N.
  The schedule (step 0 on the own block, then C-1 steps of two unmasked half-chunk products) and both algorithms are
  the module docstring's. A sequence the layout cannot split raises ContextError (`check_context`).

  Args:
    q_BTNH: queries (B, T, N, H), T in zig-zag order and split over `context`.
    k_BTKH: keys (B, T, K, H), laid out as the queries.
    v_BTKH: values (B, T, K, H), laid out as the queries.
    algorithm: "ring" (K/V blocks passed around the ring by `ppermute`) or "allgather" (one all-gather of K and V);
      default "ring".
    block: the flash kernel's tile of positions; default models/flash.py's `BLOCK`.

  Returns:
    The attention output (B, T, N, H), in the queries' layout.

  Raises:
    ContextError: when `algorithm` is not one of ALGORITHMS.

  References:
    Liu et al., "Ring Attention with Blockwise Transformers for Near-Infinite Context", 2023, arXiv 2310.01889
      ("ring").
    Llama Team, "The Llama 3 Herd of Models", 2024, arXiv 2407.21783, §3.3.2 ("allgather").
    The zig-zag layout: Megatron-LM's context parallelism (NVIDIA/Megatron-LM) and ring-flash-attention.
  """
  if algorithm not in ALGORITHMS:
    raise ContextError(f"unknown context-parallel attention {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
  C = mesh_context()
  check_context(q_BTNH.shape[1], C, block)
  fn = _ring if algorithm == "ring" else _allgather
  spec = P(None, AXIS)

  def local(q, k, v):
    return token_major(fn(*head_major(q, k, v), (C, block)))

  # check_vma=False: as sharding/pipeline.py's run_stages, for a shard_map nested in the pipeline's
  return jax.shard_map(local, in_specs=(spec, spec, spec), out_specs=spec, axis_names={AXIS},
                       check_vma=False)(q_BTNH, k_BTKH, v_BTKH)


# Inside the shard_map: q_BKGQH, k_BKSH, v_BKSH hold this device's 2h slots, its early chunk then its late one.

def _q_halves(x, h):
  return x[..., :h, :], x[..., h:, :]


def _kv_halves(x, h):
  return x[:, :, :h], x[:, :, h:]


def _stat_halves(st, h):
  acc, m, l = st
  return (acc[..., :h, :], m[..., :h], l[..., :h]), (acc[..., h:, :], m[..., h:], l[..., h:])


def _where(pred, a, b):
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _chunk_tile(h: int, block: int) -> int:
  """The tile of a chunk of h positions: `block`; a chunk that fits in one is still cut in two (from 128 positions).

  Cutting it lets every pair run in a loop whose body scopes its score tiles; unrolled, XLA:CPU keeps the tiles of
  all the ring's steps alive together.
  """
  return block if h > block else h // 2 if h >= 128 and h % 2 == 0 else h


def _forward(q, k, v, C, block, block_of):
  """(o, lse) of the local queries against every device's block; `block_of(s)` -> (j, k_j, v_j) at step s >= 1."""
  h, scale = q.shape[3] // 2, 1.0 / math.sqrt(q.shape[-1])
  block = _chunk_tile(h, block)
  c = jax.lax.axis_index(AXIS)
  (q_e, q_l), (k_e, k_l), (v_e, v_l) = _q_halves(q, h), _kv_halves(k, h), _kv_halves(v, h)
  pair = lambda q_, k_, v_, causal=False: pair_stats(q_, k_, v_, causal=causal, scale=scale, block=block)
  # step 0, the own block: early on early and late on late under the causal mask, late on early whole
  early = pair(q_e, k_e, v_e, causal=True)
  late = merge(pair(q_l, k_e, v_e), pair(q_l, k_l, v_l, causal=True))
  for s in range(1, C):
    j, k_j, v_j = block_of(s)
    (k_e, k_l), (v_e, v_l) = _kv_halves(k_j, h), _kv_halves(v_j, h)
    late = merge(late, pair(q_l, k_e, v_e))
    before = j < c  # j's early keys for the early queries, else j's late keys for the late queries
    b = pair(jnp.where(before, q_e, q_l), jnp.where(before, k_e, k_l), jnp.where(before, v_e, v_l))
    early, late = _where(before, merge(early, b), early), _where(before, late, merge(late, b))
  (o_e, lse_e), (o_l, lse_l) = finish(early, q.dtype), finish(late, q.dtype)
  return jnp.concatenate([o_e, o_l], axis=3), jnp.concatenate([lse_e, lse_l], axis=-1)


def _backward(q, k, v, o, lse, do, C, block, block_of, k_grads):
  """dq, and through `k_grads(s, j, dk_j, dv_j)` each step's (2h) K/V gradient block for device j (s = 0: own)."""
  h, scale = q.shape[3] // 2, 1.0 / math.sqrt(q.shape[-1])
  block = _chunk_tile(h, block)
  c = jax.lax.axis_index(AXIS)
  delta = row_dot(do, o)
  (q_e, q_l), (do_e, do_l) = _q_halves(q, h), _q_halves(do, h)
  (lse_e, lse_l), (d_e, d_l) = (lse[..., :h], lse[..., h:]), (delta[..., :h], delta[..., h:])
  early, late = (q_e, do_e, lse_e, d_e), (q_l, do_l, lse_l, d_l)
  grads = lambda qs, k_, v_, causal=False: pair_grads(qs[0], k_, v_, *qs[1:], causal=causal, scale=scale,
                                                      block=block)
  (k_e, k_l), (v_e, v_l) = _kv_halves(k, h), _kv_halves(v, h)
  dq_ee, dk_ee, dv_ee = grads(early, k_e, v_e, causal=True)
  dq_le, dk_le, dv_le = grads(late, k_e, v_e)
  dq_ll, dk_ll, dv_ll = grads(late, k_l, v_l, causal=True)
  dq_e, dq_l = dq_ee, dq_le + dq_ll
  k_grads(0, c, jnp.concatenate([dk_ee + dk_le, dk_ll], axis=2), jnp.concatenate([dv_ee + dv_le, dv_ll], axis=2))
  for s in range(1, C):
    j, k_j, v_j = block_of(s)
    (k_e, k_l), (v_e, v_l) = _kv_halves(k_j, h), _kv_halves(v_j, h)
    dq_a, dk_a, dv_a = grads(late, k_e, v_e)
    before = j < c
    sel = lambda e, l: jnp.where(before, e, l)
    dq_b, dk_b, dv_b = grads(jax.tree.map(sel, early, late), sel(k_e, k_l), sel(v_e, v_l))
    dq_e, dq_l = dq_e + sel(dq_b, 0.0), dq_l + dq_a + sel(0.0, dq_b)
    k_grads(s, j, jnp.concatenate([dk_a + sel(dk_b, 0.0), sel(0.0, dk_b)], axis=2),
            jnp.concatenate([dv_a + sel(dv_b, 0.0), sel(0.0, dv_b)], axis=2))
  return jnp.concatenate([dq_e, dq_l], axis=3).astype(q.dtype)


def _shift(x, C):
  """Every device's block to the next device on the ring (c -> c+1)."""
  return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % C) for i in range(C)])


def _ring_blocks(k, v, C):
  """block_of for the ring: step s holds the block of device c - s, one hop more than step s - 1."""
  c = jax.lax.axis_index(AXIS)
  held = {0: (k, v)}

  def block_of(s):
    if s not in held:
      held[s] = _shift(held[s - 1], C)
    return (c - s) % C, *held[s]
  return block_of


def _ring_fwd(q, k, v, layout):
  C, block = layout  # context size, tile
  o, lse = _forward(q, k, v, C, block, _ring_blocks(k, v, C))
  return o, (q, k, v, o, lse)


def _ring_bwd(layout, res, do):
  C, block = layout
  q, k, v, o, lse = res
  carried = {}  # the K/V gradient of the block held at the latest step, travelling with it

  def k_grads(s, j, dk_j, dv_j):
    if s == 0:
      carried["g"] = (dk_j, dv_j)
    else:
      g = _shift(carried["g"], C)  # the gradient block of device c - s, from device c - 1
      carried["g"] = (g[0] + dk_j, g[1] + dv_j)

  dq = _backward(q, k, v, o, lse, do, C, block, _ring_blocks(k, v, C), k_grads)
  dk, dv = _shift(carried["g"], C)  # the C-th hop: each block's gradient home
  return dq, dk.astype(k.dtype), dv.astype(v.dtype)


_ring = jax.custom_vjp(lambda q, k, v, layout: _ring_fwd(q, k, v, layout)[0], nondiff_argnums=(3,))
_ring.defvjp(_ring_fwd, _ring_bwd)


def _gathered_blocks(k, v, C):
  """block_of for all-gather: every device's block sliced from one all-gather of K and V."""
  c = jax.lax.axis_index(AXIS)
  k_all, v_all = (jax.lax.all_gather(x, AXIS, axis=2, tiled=True) for x in (k, v))
  n = k.shape[2]

  def block_of(s):
    j = (c - s) % C
    return j, *(jax.lax.dynamic_slice_in_dim(x, j * n, n, axis=2) for x in (k_all, v_all))
  return block_of


def _allgather_fwd(q, k, v, layout):
  C, block = layout
  o, lse = _forward(q, k, v, C, block, _gathered_blocks(k, v, C))
  return o, (q, k, v, o, lse)


def _allgather_bwd(layout, res, do):
  C, block = layout
  q, k, v, o, lse = res
  n = k.shape[2]
  grads = {"k": jnp.zeros(k.shape[:2] + (n * C,) + k.shape[3:], acc_dtype(k))}
  grads["v"] = grads["k"]

  def k_grads(s, j, dk_j, dv_j):
    for name, g in (("k", dk_j), ("v", dv_j)):
      cur = jax.lax.dynamic_slice_in_dim(grads[name], j * n, n, axis=2)
      grads[name] = jax.lax.dynamic_update_slice_in_dim(grads[name], cur + g, j * n, axis=2)

  dq = _backward(q, k, v, o, lse, do, C, block, _gathered_blocks(k, v, C), k_grads)
  dk, dv = (jax.lax.psum_scatter(grads[x], AXIS, scatter_dimension=2, tiled=True) for x in ("k", "v"))
  return dq, dk.astype(k.dtype), dv.astype(v.dtype)


_allgather = jax.custom_vjp(lambda q, k, v, layout: _allgather_fwd(q, k, v, layout)[0], nondiff_argnums=(3,))
_allgather.defvjp(_allgather_fwd, _allgather_bwd)
