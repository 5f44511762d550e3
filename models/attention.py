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
from sharding.context import (ALGORITHMS as CONTEXT_ALGORITHMS, ContextError, block_grads, block_stats, causal_mask,
                              check_context, context_attention, finish, merge, mesh_context)

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
  B, T, N, H = q_BTNH.shape
  K = k_BTKH.shape[2]
  o = _flash(q_BTNH.reshape(B, T, K, N // K, H), k_BTKH, v_BTKH, flash_block(T, block))
  return o.reshape(B, T, N, H)


def _blocks(x, nb):
  """(B, T, ...) -> (B, nb, T/nb, ...)."""
  return x.reshape(x.shape[0], nb, x.shape[1] // nb, *x.shape[2:])


def _fold(x):
  """(B, n, b, ...) -> (B·n, b, ...): a run of blocks as a batch of independent sequences."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _unfold(x, B):
  return x.reshape(B, x.shape[0] // B, *x.shape[1:])


def _diag_mask(b):
  r = np.arange(b)
  return causal_mask(r, r)


def _flash_fwd(q, k, v, blk):
  B, T = q.shape[:2]
  nb, scale = T // blk, 1.0 / math.sqrt(q.shape[-1])
  qb, kb, vb = (_blocks(x, nb) for x in (q, k, v))
  # statistics per query block: acc (B, nb, b, K, G, H); m, l (B, nb, K, G, b)
  stats = None
  for d in range(nb):  # query blocks d.. against key blocks ..nb-d: the d-th diagonal of the block triangle
    st = block_stats(_fold(qb[:, d:]), _fold(kb[:, :nb - d]), _fold(vb[:, :nb - d]),
                     _diag_mask(blk) if d == 0 else None, scale=scale)
    if stats is None:
      stats = tuple(_unfold(x, B) for x in st)
    else:
      head = merge(tuple(_fold(x[:, d:]) for x in stats), st)
      stats = tuple(x.at[:, d:].set(_unfold(y, B)) for x, y in zip(stats, head))
  o, lse = finish(tuple(_fold(x) for x in stats), q.dtype)
  return _unfold(o, B).reshape(q.shape), _unfold(lse, B)


def _flash_fwd_rule(q, k, v, blk):
  o, lse = _flash_fwd(q, k, v, blk)
  return o, (q, k, v, o, lse)


def _flash_bwd_rule(blk, res, do):
  q, k, v, o, lse = res  # lse (B, nb, K, G, b)
  B, T = q.shape[:2]
  nb, scale = T // blk, 1.0 / math.sqrt(q.shape[-1])
  delta = jnp.moveaxis(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1), 1, -1)  # (B, K, G, T)
  delta = jnp.moveaxis(delta.reshape(*delta.shape[:3], nb, blk), 3, 1)  # (B, nb, K, G, b)
  qb, kb, vb, dob = (_blocks(x, nb) for x in (q, k, v, do))
  dq, dk, dv = (jnp.zeros(x.shape, jnp.float32) for x in (qb, kb, vb))
  for d in range(nb):
    g = block_grads(_fold(qb[:, d:]), _fold(kb[:, :nb - d]), _fold(vb[:, :nb - d]), _fold(dob[:, d:]),
                    _fold(lse[:, d:]), _fold(delta[:, d:]), _diag_mask(blk) if d == 0 else None, scale=scale)
    gq, gk, gv = (_unfold(x, B) for x in g)
    dq = dq.at[:, d:].add(gq)
    dk, dv = dk.at[:, :nb - d].add(gk), dv.at[:, :nb - d].add(gv)
  return tuple(x.reshape(y.shape).astype(y.dtype) for x, y in ((dq, q), (dk, k), (dv, v)))


_flash = jax.custom_vjp(lambda q, k, v, blk: _flash_fwd(q, k, v, blk)[0], nondiff_argnums=(3,))
_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)
