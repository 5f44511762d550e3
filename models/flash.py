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


def head_major(q_BTNH, k_BTKH, v_BTKH):
  """(q_BKGTH, k_BKTH, v_BKTH): the layout the kernel's products run in without transposes."""
  B, T, N, H = q_BTNH.shape
  K = k_BTKH.shape[2]
  q = q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  return q, k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3)


def token_major(o_BKGTH):
  """o_BTNH from the kernel's head-major output."""
  B, K, G, T, H = o_BKGTH.shape
  return o_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def acc_dtype(x):
  """The dtype scores and statistics accumulate in for inputs like `x`: at least float32."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _scores(q, k, scale):
  return jnp.einsum("bkgqh,bksh->bkgqs", q, k, preferred_element_type=acc_dtype(q)) * scale


def block_stats(q, k, v, mask=None, *, scale):
  """(acc, m, l) of q attending to one key block: the running statistics of a block alone. `mask` (Q, S) bool or
  None (all visible); a row with no visible key has m = -inf, l = 0, acc = 0."""
  s = _scores(q, k, scale)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - _finite(m)[..., None])
  acc = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v, preferred_element_type=acc_dtype(v))
  return acc, m, jnp.sum(p, axis=-1)


def merge(a, b):
  """The statistics of the union of two key sets from each one's (acc, m, l)."""
  (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
  m = jnp.maximum(m_a, m_b)
  wa, wb = jnp.exp(m_a - _finite(m)), jnp.exp(m_b - _finite(m))
  return acc_a * wa[..., None] + acc_b * wb[..., None], m, l_a * wa + l_b * wb


def finish(stats, dtype):
  """(o_BKGQH in `dtype`, lse_BKGQ in the accumulation dtype) from the statistics over all keys (every row sees at
  least one)."""
  acc, m, l = stats
  return (acc / l[..., None]).astype(dtype), m + jnp.log(l)


def block_grads(q, k, v, do, lse, delta, mask=None, *, scale):
  """(dq, dk, dv) of one key block's share, given the final log-sum-exp `lse` and delta = rowsum(do · o) (both
  B, K, G, Q; accumulation dtype): the flash-attention backward, scores recomputed."""
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


def row_dot(do, o):
  """delta_BKGQ = Σ_h do·o per query, in the accumulation dtype: the backward's softmax correction."""
  dt = acc_dtype(o)
  return jnp.sum(do.astype(dt) * o.astype(dt), axis=-1)


def _finite(m):
  return jnp.where(jnp.isfinite(m), m, 0.0)


def causal_mask(q_pos, k_pos):
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
  """The tile size for `n` positions: all of them when n <= block, else `block`, which must divide n (FlashError)."""
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


def pair_stats(q, k, v, *, causal: bool, scale, block: int = BLOCK):
  """(acc, m, l) of q (Q positions) on k, v (S positions) tile by tile: a `lax.map` over query tiles, each a
  `fori_loop` over the key tiles it sees. `causal`: Q == S, aligned (query i sees keys <= i: the diagonal tile under
  the mask, the earlier ones whole, the later ones skipped); else every key is visible."""
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


def pair_grads(q, k, v, do, lse, delta, *, causal: bool, scale, block: int = BLOCK):
  """(dq, dk, dv) of `pair_stats`'s pairs, in the accumulation dtype, tile by tile: a `lax.scan` over key tiles
  carrying dq, each a `fori_loop` over the query tiles that see it."""
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
