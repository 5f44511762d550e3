"""The one causal attention the model calls, `attend`, with its implementations chosen by name.

- "xla": `jax.nn.dot_product_attention(implementation="xla")`, the reference: it forms the B·N·T·T scores.
- "flash": a blockwise pure-JAX kernel (Dao et al. 2022, arXiv 2205.14135): queries and keys in blocks of `block`
  positions, an online softmax over the key blocks, only the causal triangle computed, and a `custom_vjp` whose
  backward recomputes each block's scores from the saved log-sum-exp, so nothing T·T is ever held. The blocks run
  by diagonal: step d pairs every query block i >= d with key block i - d as one batched product (T/block steps, the
  triangle's T²/2 scores in all), and only step 0 needs the mask.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, the fused kernel on NVIDIA GPUs.
- "ring", "allgather": context parallelism over the mesh's `context` axis (sharding/context.py); on a mesh without
  one they are "flash", which they equal.
- "auto": "ring" on a mesh with context > 1, else "xla".
With context > 1 the sequence is in zig-zag order (sharding/context.py), which only the context-parallel ones read.

Shapes: q_BTNH, k_BTKH, v_BTKH (GQA: K divides N); out o_BTNH.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ATTENTION
from sharding.context import (ALGORITHMS as CONTEXT_ALGORITHMS, ContextError, acc_dtype, block_grads, block_stats,
                              causal_mask, check_context, context_attention, finish, head_major, merge, mesh_context,
                              row_dot, token_major)

IMPLEMENTATIONS = ATTENTION  # the names TransformerConfig.attention accepts
BLOCK = 512  # flash's block: large enough for the products to run at the matmul rate on CPU, small enough to cache


class AttentionError(ValueError):
  """An attention implementation that cannot run as asked."""


def check_implementation(impl: str, context: int = 1):
  """Raises AttentionError, naming the fix, unless `impl` exists and can run on a mesh with `context` devices per
  sequence."""
  if impl not in IMPLEMENTATIONS:
    raise AttentionError(f"unknown attention {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
  if context > 1 and impl not in ("auto",) + CONTEXT_ALGORITHMS:
    raise AttentionError(f"attention {impl!r} does not split the sequence, but the mesh has context={context}; "
                         f"use attention ring or allgather (or auto)")


def check_attention(impl: str, seq_len: int, context: int = 1, block: int = BLOCK):
  """Every check `attend` makes at trace time, ahead of it (for CLIs): `check_implementation`, the zig-zag split of
  `seq_len` over `context` devices, and flash's block (which the context-parallel ones run on one device)."""
  check_implementation(impl, context)
  try:
    check_context(seq_len, context)
  except ContextError as e:
    raise AttentionError(str(e)) from None
  if impl in ("flash",) + CONTEXT_ALGORITHMS and context == 1:
    flash_block(seq_len, block)


def attend(q_BTNH, k_BTKH, v_BTKH, *, impl: str = "auto", block: int = BLOCK):
  """Causal grouped-query attention by implementation `impl` (module docstring); every one gives the same output and
  gradients."""
  C = mesh_context()
  check_implementation(impl, C)
  if impl == "auto":
    impl = "ring" if C > 1 else "xla"
  if impl in CONTEXT_ALGORITHMS:
    return context_attention(q_BTNH, k_BTKH, v_BTKH, algorithm=impl) if C > 1 else flash(q_BTNH, k_BTKH, v_BTKH,
                                                                                          block=block)
  if impl == "flash":
    return flash(q_BTNH, k_BTKH, v_BTKH, block=block)
  if impl == "cudnn" and jax.default_backend() != "gpu":
    raise AttentionError(f"attention 'cudnn' needs an NVIDIA GPU, this backend is {jax.default_backend()}; "
                         f"use xla or flash")
  return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True, implementation=impl)


def flash_block(seq_len: int, block: int = BLOCK) -> int:
  """The block flash uses for `seq_len` positions: `block`, or the whole sequence when shorter; raises
  AttentionError when `block` does not divide a longer sequence."""
  if seq_len <= block:
    return seq_len
  if seq_len % block:
    raise AttentionError(f"flash attention splits T={seq_len} into blocks of {block}, which does not divide it; "
                         f"use a sequence length that is a multiple of {block}")
  return block


def flash(q_BTNH, k_BTKH, v_BTKH, *, block: int = BLOCK):
  """Blockwise causal attention (module docstring), equal to the reference."""
  q, k, v = head_major(q_BTNH, k_BTKH, v_BTKH)
  return token_major(_flash(q, k, v, flash_block(q_BTNH.shape[1], block)))


def _slice(x, i, blk, axis):
  return jax.lax.dynamic_slice_in_dim(x, i * blk, blk, axis=axis)


def _unstack(x, axis):
  """Per-block results stacked on a leading axis back into one sequence `axis`: (nb, ..., b, ...) -> (..., nb·b, ...)."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _diag_mask(b):
  r = np.arange(b)
  return causal_mask(r, r)


def _flash_fwd(q, k, v, blk):
  """(o_BKGTH, lse_BKGT): query block i (a `lax.map`) takes its diagonal block under the mask, then key blocks
  0..i-1 whole in a `fori_loop`; one block of scores exists at a time."""
  T = q.shape[3]
  scale = 1.0 / math.sqrt(q.shape[-1])

  def query_block(i):
    q_i = _slice(q, i, blk, 3)
    kv = lambda j: (_slice(k, j, blk, 2), _slice(v, j, blk, 2))
    diagonal = block_stats(q_i, *kv(i), _diag_mask(blk), scale=scale)
    return finish(jax.lax.fori_loop(0, i, lambda j, st: merge(st, block_stats(q_i, *kv(j), scale=scale)), diagonal),
                  q.dtype)

  o, lse = jax.lax.map(query_block, jnp.arange(T // blk))  # (nb, B, K, G, b, H), (nb, B, K, G, b)
  return _unstack(o, 3), _unstack(lse, 3)


def _flash_fwd_rule(q, k, v, blk):
  o, lse = _flash_fwd(q, k, v, blk)
  return o, (q, k, v, o, lse)


def _flash_bwd_rule(blk, res, do):
  """Key block j (a `lax.scan` carrying dq): its diagonal under the mask, then query blocks j+1.. whole in a
  `fori_loop` that adds into dq and the block's dk, dv."""
  q, k, v, o, lse = res
  T = q.shape[3]
  scale = 1.0 / math.sqrt(q.shape[-1])
  delta = row_dot(do, o)
  rows = lambda i: (_slice(q, i, blk, 3), _slice(do, i, blk, 3), _slice(lse, i, blk, 3), _slice(delta, i, blk, 3))

  def add_rows(dq, i, g):
    return jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i, blk, 3) + g, i * blk, axis=3)

  def key_block(dq, j):
    k_j, v_j = _slice(k, j, blk, 2), _slice(v, j, blk, 2)
    q_i, do_i, lse_i, d_i = rows(j)
    g_q, dk, dv = block_grads(q_i, k_j, v_j, do_i, lse_i, d_i, _diag_mask(blk), scale=scale)

    def later(i, carry):
      dq, dk, dv = carry
      q_i, do_i, lse_i, d_i = rows(i)
      g_q, g_k, g_v = block_grads(q_i, k_j, v_j, do_i, lse_i, d_i, scale=scale)
      return add_rows(dq, i, g_q), dk + g_k, dv + g_v

    dq, dk, dv = jax.lax.fori_loop(j + 1, T // blk, later, (add_rows(dq, j, g_q), dk, dv))
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, acc_dtype(q)), jnp.arange(T // blk))
  dk, dv = _unstack(dk, 2), _unstack(dv, 2)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_flash = jax.custom_vjp(lambda q, k, v, blk: _flash_fwd(q, k, v, blk)[0], nondiff_argnums=(3,))
_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)
