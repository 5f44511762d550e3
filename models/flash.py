"""Flash attention's kernel: the block-wise online softmax of one device's queries over its keys, forward and backward.

Shapes: B batch, T sequence, N query heads, K kv heads, G = N/K query heads per kv head, H head_dim, Q query and S key
positions of one block.

The kernel runs head-major (`head_major`: q_BKGQH, the queries grouped by kv head; k_BKSH, v_BKSH), the layout its
products take without transposes. Per query it keeps the online softmax's statistics (Dao et al. 2022, arXiv
2205.14135): acc_BKGQH the unnormalized output, m_BKGQ the running maximum of the scores, l_BKGQ the sum of their
exponentials, in the accumulation dtype (`acc_dtype`: float32, or float64 for float64 inputs).
- `block_stats`, `merge`, `finish`: the statistics of one key block, of the union of two key sets, and from them the
  output and its log-sum-exp.
- `block_grads`, `row_dot`: one key block's share of the gradients given the final log-sum-exp, its scores recomputed.
- `pair_stats`, `pair_grads`: both over Q queries and S keys one tile of `BLOCK` positions at a time (`sub_block`), so
  that no more than one (BLOCK x BLOCK) tile of scores per head exists whatever Q and S are.
models/attention.py's single-device `flash` runs `pair_stats` / `pair_grads` on the whole causal sequence;
sharding/context.py's ring and all-gather attention run them on each device's zig-zag chunks against every key block
of the `context` mesh axis. This file knows nothing of meshes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# attention tiles: large enough for their products to run near the matmul rate on CPU, small enough to stay in cache
BLOCK = 512


class FlashError(ValueError):
  """A length that the attention's tiles cannot split."""


def head_major(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The kernel's head-major layout, in which its products run without transposes.

  Args:
    q_BTNH: the queries (B, T, N, H).
    k_BTKH: the keys (B, T, K, H).
    v_BTKH: the values (B, T, K, H).

  Returns:
    (q_BKGTH, k_BKTH, v_BKTH): the queries grouped by kv head (G = N/K), the keys and values head-major.
  """
  B, T, N, H = q_BTNH.shape
  K = k_BTKH.shape[2]
  q = q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  return q, k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3)


def token_major(o_BKGTH: jax.Array) -> jax.Array:
  """The kernel's head-major output back in the model's token-major layout.

  Args:
    o_BKGTH: the attention output (B, K, G, T, H), as the kernel computes it.

  Returns:
    o_BTNH, N = K·G.
  """
  B, K, G, T, H = o_BKGTH.shape
  return o_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def acc_dtype(x: jax.Array) -> np.dtype:
  """The dtype scores and statistics accumulate in for inputs like `x`: at least float32.

  Args:
    x: an input of the kernel (only its dtype is read).

  Returns:
    float32, or x's dtype where it is wider (float64).
  """
  return jnp.promote_types(x.dtype, jnp.float32)


def _scores(q, k, scale):
  return jnp.einsum("bkgqh,bksh->bkgqs", q, k, preferred_element_type=acc_dtype(q)) * scale


def block_stats(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | np.ndarray | None = None, *,
                scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(acc, m, l) of q attending to one key block: the running statistics of a block alone.

  Args:
    q: the queries q_BKGQH.
    k: the block's keys k_BKSH.
    v: the block's values v_BKSH.
    mask: (Q, S) bool, True where a query sees a key; None (default): every key visible.
    scale: the scores' factor (1/√H).

  Returns:
    (acc_BKGQH, m_BKGQ, l_BKGQ) in the accumulation dtype; a row with no visible key has m = -inf, l = 0, acc = 0.
  """
  s = _scores(q, k, scale)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - _finite(m)[..., None])
  acc = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v, preferred_element_type=acc_dtype(v))
  return acc, m, jnp.sum(p, axis=-1)


def merge(a: tuple[jax.Array, jax.Array, jax.Array],
          b: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The statistics of the union of two key sets from each one's (acc, m, l).

  Args:
    a: (acc, m, l) of the same queries over one key set.
    b: (acc, m, l) over another.

  Returns:
    (acc, m, l) over both: each side rescaled to the larger running maximum.
  """
  (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
  m = jnp.maximum(m_a, m_b)
  wa, wb = jnp.exp(m_a - _finite(m)), jnp.exp(m_b - _finite(m))
  return acc_a * wa[..., None] + acc_b * wb[..., None], m, l_a * wa + l_b * wb


def finish(stats: tuple[jax.Array, jax.Array, jax.Array], dtype: jax.typing.DTypeLike) -> tuple[jax.Array, jax.Array]:
  """The output and its log-sum-exp from the statistics over all keys.

  Args:
    stats: (acc, m, l) over all keys (every row sees at least one).
    dtype: the output's dtype.

  Returns:
    (o_BKGQH in `dtype`, lse_BKGQ in the accumulation dtype).
  """
  acc, m, l = stats
  return (acc / l[..., None]).astype(dtype), m + jnp.log(l)


def block_grads(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array,
                mask: jax.Array | np.ndarray | None = None, *,
                scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One key block's share of the gradients: the flash-attention backward, scores recomputed.

  Args:
    q: the queries q_BKGQH.
    k: the block's keys k_BKSH.
    v: the block's values v_BKSH.
    do: the output's gradient (B, K, G, Q, H).
    lse: the final log-sum-exp (B, K, G, Q; accumulation dtype), from `finish`.
    delta: rowsum(do · o) (B, K, G, Q; accumulation dtype), from `row_dot`.
    mask: (Q, S) bool, True where a query sees a key; None (default): every key visible.
    scale: the scores' factor (1/√H).

  Returns:
    (dq, dk, dv) of this block, in the accumulation dtype.
  """
  p = jnp.exp(_scores(q, k, scale) - lse[..., None])
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dt = acc_dtype(q)
  dv = jnp.einsum("bkgqs,bkgqh->bksh", p, do, preferred_element_type=dt)
  dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v, preferred_element_type=dt)
  ds = p * (dp - delta[..., None]) * scale
  dq = jnp.einsum("bkgqs,bksh->bkgqh", ds, k, preferred_element_type=dt)
  dk = jnp.einsum("bkgqs,bkgqh->bksh", ds, q, preferred_element_type=dt)
  return dq, dk, dv


def row_dot(do: jax.Array, o: jax.Array) -> jax.Array:
  """delta_BKGQ = Σ_h do·o per query, in the accumulation dtype: the backward's softmax correction.

  Args:
    do: the output's gradient (B, K, G, Q, H).
    o: the output (B, K, G, Q, H).

  Returns:
    delta_BKGQ.
  """
  dt = acc_dtype(o)
  return jnp.sum(do.astype(dt) * o.astype(dt), axis=-1)


def _finite(m):
  return jnp.where(jnp.isfinite(m), m, 0.0)


def causal_mask(q_pos: jax.Array | np.ndarray, k_pos: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
  """The (Q, S) bool mask of which keys each query sees under causality.

  Args:
    q_pos: (Q,) the queries' positions.
    k_pos: (S,) the keys' positions.

  Returns:
    mask[i, j] = k_pos[j] <= q_pos[i].
  """
  return k_pos[None, :] <= q_pos[:, None]


def _diag(n):
  r = np.arange(n)
  return causal_mask(r, r)


# --- blockwise: the same statistics and gradients, one (block x block) tile of scores at a time ---------------------


def sub_block(n: int, block: int = BLOCK) -> int:
  """The tile size for `n` positions: all of them when n <= block, else `block`, which must divide n.

  Args:
    n: the number of positions (queries or keys).
    block: the tile size (default `BLOCK`).

  Returns:
    n when n <= block, else block.

  Raises:
    FlashError: when n > block and block does not divide n.
  """
  if n <= block:
    return n
  if n % block:
    raise FlashError(f"{n} positions do not split into attention tiles of {block}; use a length that is a multiple "
                     f"of {block} (or at most {block})")
  return block


def _tile(x, i, b, axis):
  return jax.lax.dynamic_slice_in_dim(x, i * b, b, axis=axis)


def _unstack(x, axis):
  """Per-tile results stacked on a leading axis back into one sequence `axis`: (n, ..., b, ...) -> (..., n·b, ...)."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def pair_stats(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float,
               block: int = BLOCK) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(acc, m, l) of q (Q positions) on k, v (S positions), tile by tile.

  A `lax.map` over query tiles, each a `fori_loop` over the key tiles it sees; at most one (block x block) tile of
  scores per head exists at a time.

  Args:
    q: the queries q_BKGQH.
    k: the keys k_BKSH.
    v: the values v_BKSH.
    causal: Q == S, aligned (query i sees keys <= i: the diagonal tile under the mask, the earlier ones whole, the
      later ones skipped); False: every key is visible.
    scale: the scores' factor (1/√H).
    block: the tile size (default `BLOCK`; see `sub_block`).

  Returns:
    (acc_BKGQH, m_BKGQ, l_BKGQ), as `block_stats` computes them over all of k, v.
  """
  Q, S = q.shape[3], k.shape[2]
  bq, bk = sub_block(Q, block), sub_block(S, block)
  if bq == Q and bk == S:
    return block_stats(q, k, v, _diag(Q) if causal else None, scale=scale)

  def query_tile(i):
    q_i = _tile(q, i, bq, 3)
    kv = lambda j: (_tile(k, j, bk, 2), _tile(v, j, bk, 2))
    first = block_stats(q_i, *kv(i if causal else 0), _diag(bq) if causal else None, scale=scale)
    later = lambda j, st: merge(st, block_stats(q_i, *kv(j), scale=scale))
    return jax.lax.fori_loop(0 if causal else 1, i if causal else S // bk, later, first)

  acc, m, l = jax.lax.map(query_tile, jnp.arange(Q // bq))
  return _unstack(acc, 3), _unstack(m, 3), _unstack(l, 3)


def pair_grads(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
               causal: bool, scale: float, block: int = BLOCK) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv) of `pair_stats`'s pairs, in the accumulation dtype, tile by tile.

  A `lax.scan` over key tiles carrying dq, each a `fori_loop` over the query tiles that see it.

  Args:
    q: the queries q_BKGQH.
    k: the keys k_BKSH.
    v: the values v_BKSH.
    do: the output's gradient (B, K, G, Q, H).
    lse: the final log-sum-exp (B, K, G, Q), from `finish`.
    delta: rowsum(do · o) (B, K, G, Q), from `row_dot`.
    causal: Q == S, aligned (query i sees keys <= i), as in `pair_stats`; False: every key is visible.
    scale: the scores' factor (1/√H).
    block: the tile size (default `BLOCK`; see `sub_block`).

  Returns:
    (dq, dk, dv), in the accumulation dtype.
  """
  Q, S = q.shape[3], k.shape[2]
  bq, bk = sub_block(Q, block), sub_block(S, block)
  if bq == Q and bk == S:
    return block_grads(q, k, v, do, lse, delta, _diag(Q) if causal else None, scale=scale)
  dt = acc_dtype(q)
  rows = lambda i: (_tile(q, i, bq, 3), _tile(do, i, bq, 3), _tile(lse, i, bq, 3), _tile(delta, i, bq, 3))
  add_rows = lambda dq, i, g: jax.lax.dynamic_update_slice_in_dim(dq, _tile(dq, i, bq, 3) + g, i * bq, axis=3)

  def key_tile(dq, j):
    k_j, v_j = _tile(k, j, bk, 2), _tile(v, j, bk, 2)

    def later(i, carry):
      dq, dk, dv = carry
      q_i, do_i, lse_i, d_i = rows(i)
      g_q, g_k, g_v = block_grads(q_i, k_j, v_j, do_i, lse_i, d_i, scale=scale)
      return add_rows(dq, i, g_q), dk + g_k, dv + g_v

    if causal:
      q_j, do_j, lse_j, d_j = rows(j)
      g_q, dk, dv = block_grads(q_j, k_j, v_j, do_j, lse_j, d_j, _diag(bq), scale=scale)
      carry, lo = (add_rows(dq, j, g_q), dk, dv), j + 1
    else:
      carry, lo = (dq, jnp.zeros(k_j.shape, dt), jnp.zeros(v_j.shape, dt)), 0
    dq, dk, dv = jax.lax.fori_loop(lo, Q // bq, later, carry)
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(key_tile, jnp.zeros(q.shape, dt), jnp.arange(S // bk))
  return dq, _unstack(dk, 2), _unstack(dv, 2)
