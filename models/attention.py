"""The one causal attention the model calls, `attend`, with its implementations chosen by name.

- "xla": `jax.nn.dot_product_attention(implementation="xla")`, the reference: it forms the B·N·T·T scores.
- "flash": a blockwise pure-JAX kernel (Dao et al. 2022, arXiv 2205.14135; models/flash.py's `pair_stats` and
  `pair_grads`): queries and keys in tiles of `block` positions, a `lax.map` over query tiles, each an online softmax
  over the key tiles at or before it (a `fori_loop`; only the causal triangle is computed, only the diagonal tile
  masked), and a `custom_vjp` whose backward (a `scan` over key tiles) recomputes each tile's scores from the saved
  log-sum-exp: one tile of scores exists at a time, nothing T·T is ever held.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, the fused kernel on NVIDIA GPUs.
- "ring", "allgather": context parallelism over the mesh's `context` axis (sharding/context.py); on a mesh without
  one they are "flash", which they equal.
- "auto" (`resolve`): the fastest exact kernel for the platform, dtype and length: "ring" on a mesh with context > 1;
  "cudnn" on an NVIDIA GPU for bfloat16/float16 with a head dim cuDNN's fused kernel takes (≤ 128, a multiple of 8);
  else "flash" when the sequence spans several of its tiles (T > `block`, a multiple of it: faster than xla on the
  CPU and with a fraction of its temporaries, see research/results/bench_attention.md; on a GPU in float32 it keeps
  no T·T scores, which xla holds for the backward); else "xla" (one tile: the same work, xla's is fused).
  Kernel libraries: tokamax (Pallas flash attention for GPU/TPU) was evaluated and is not used: tokamax 0.0.12 pins
  typeguard==2.13.3 and does not import with typeguard 4, which tyro (the command lines) requires.
With context > 1 the sequence is in zig-zag order (sharding/context.py), which only the context-parallel ones read.

Shapes: q_BTNH, k_BTKH, v_BTKH (GQA: K divides N); out o_BTNH.
"""

from __future__ import annotations

import math
from typing import Literal, cast

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from models.config import ATTENTION
from models.flash import BLOCK, FlashError, finish, head_major, pair_grads, pair_stats, row_dot, sub_block, token_major

# the module, not its names: sharding/context.py imports models.flash, so importing it first runs this file while it
# is half loaded; its names are read at call time, when it is whole
from sharding import context as cx

IMPLEMENTATIONS = ATTENTION  # the names TransformerConfig.attention accepts


class AttentionError(ValueError):
  """An attention implementation that cannot run as asked."""


def check_implementation(impl: str, context: int = 1) -> None:
  """Checks that attention `impl` exists and can run on a mesh with `context` devices per sequence.

  Args:
    impl: an implementation name of `IMPLEMENTATIONS`.
    context: devices per sequence (the mesh's `context` axis); 1: no context parallelism.

  Raises:
    AttentionError: naming the fix, when `impl` is unknown, or does not split the sequence while `context` > 1.
  """
  if impl not in IMPLEMENTATIONS:
    raise AttentionError(f"unknown attention {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
  if context > 1 and impl not in ("auto",) + cx.ALGORITHMS:
    raise AttentionError(f"attention {impl!r} does not split the sequence, but the mesh has context={context}; "
                         f"use attention ring or allgather (or auto)")


def check_attention(impl: str, seq_len: int, context: int = 1, block: int = BLOCK) -> None:
  """Every check `attend` makes at trace time, ahead of it (for CLIs).

  They are `check_implementation`, the zig-zag split of `seq_len` over `context` devices, and flash's block (which the
  context-parallel ones run on one device).

  Args:
    impl: an implementation name of `IMPLEMENTATIONS`.
    seq_len: T, the sequence length.
    context: devices per sequence (the mesh's `context` axis).
    block: flash's tile size in positions (default models/flash.py's `BLOCK`).

  Raises:
    AttentionError: when any of the checks fails.
  """
  check_implementation(impl, context)
  try:
    cx.check_context(seq_len, context, block)
  except cx.ContextError as e:
    raise AttentionError(str(e)) from None
  if impl in ("flash",) + cx.ALGORITHMS and context == 1:
    flash_block(seq_len, block)


def attend(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, impl: str = "auto",
           block: int = BLOCK) -> jax.Array:
  """Causal grouped-query attention by implementation `impl` (module docstring).

  Every implementation gives the same output and gradients.

  Args:
    q_BTNH: queries (B, T, N, H).
    k_BTKH: keys (B, T, K, H), K dividing N.
    v_BTKH: values (B, T, K, H).
    impl: an implementation name of `IMPLEMENTATIONS`; "auto" (default) chooses by `resolve`.
    block: flash's tile size in positions.

  Returns:
    The attention output o_BTNH.

  Raises:
    AttentionError: when `impl` is unknown or cannot run on this mesh (`check_implementation`), or is "cudnn" on a
      backend other than an NVIDIA GPU.
  """
  C = cx.mesh_context()
  check_implementation(impl, C)
  if impl == "auto":
    device = jax.devices()[0]
    kind, capability = getattr(device, "device_kind", ""), getattr(device, "compute_capability", None)
    impl = resolve(impl, q_BTNH.dtype, q_BTNH.shape[1], q_BTNH.shape[-1], C, kind, block, capability)
    if impl == "cudnn":  # cuDNN's own checks (its version, no cuDNN found) may still refuse: then flash or xla
      try:
        return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True, implementation="cudnn")
      except (NotImplementedError, RuntimeError):
        impl = resolve("auto", q_BTNH.dtype, q_BTNH.shape[1], q_BTNH.shape[-1], C, "", block)
  if impl in cx.ALGORITHMS:
    if C > 1:
      return cx.context_attention(q_BTNH, k_BTKH, v_BTKH, algorithm=impl, block=block)
    return flash(q_BTNH, k_BTKH, v_BTKH, block=block)
  if impl == "flash":
    return flash(q_BTNH, k_BTKH, v_BTKH, block=block)
  if impl == "cudnn" and jax.default_backend() != "gpu":
    raise AttentionError(f"attention 'cudnn' needs an NVIDIA GPU, this backend is {jax.default_backend()}; "
                         f"use xla or flash")
  # every other name has returned above: impl is "xla" or "cudnn" here
  return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True,
                                      implementation=cast(Literal["xla", "cudnn"], impl))


def resolve(impl: str, dtype: DTypeLike, seq_len: int, head_dim: int, context: int = 1, device_kind: str = "",
            block: int = BLOCK, capability: str | None = None) -> str:
  """The implementation `impl` runs as: itself, or for "auto" the choice the module docstring gives.

  Args:
    impl: an implementation name of `IMPLEMENTATIONS`.
    dtype: the dtype of q, k and v.
    seq_len: T, the sequence length.
    head_dim: H, the head dimension.
    context: devices per sequence (the mesh's `context` axis).
    device_kind: jax's device kind, e.g. "NVIDIA H100 80GB HBM3" or "cpu".
    block: flash's tile size in positions.
    capability: the GPU's compute capability, e.g. "9.0" (cuDNN's fused attention needs 8.0, Ampere, or newer);
      None: unknown, taken as new enough.

  Returns:
    The name of a concrete implementation ("xla", "flash", "cudnn" or a context-parallel one).
  """
  if impl != "auto":
    return impl
  if context > 1:
    return "ring"
  if (device_kind.startswith("NVIDIA") and (capability is None or float(capability) >= 8.0)
      and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 128 and head_dim % 8 == 0):
    return "cudnn"
  if seq_len > block and seq_len % block == 0:
    return "flash"
  return "xla"


def flash_block(seq_len: int, block: int = BLOCK) -> int:
  """The block flash uses for `seq_len` positions: `block`, or the whole sequence when shorter.

  The tiles are those of models/flash.py's `sub_block`.

  Args:
    seq_len: T, the sequence length.
    block: the requested tile size in positions.

  Returns:
    The tile size flash runs with.

  Raises:
    AttentionError: when `block` does not divide a longer sequence.
  """
  try:
    return sub_block(seq_len, block)
  except FlashError as e:
    raise AttentionError(f"flash attention: {e}") from None


def flash(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, block: int = BLOCK) -> jax.Array:
  """Blockwise causal attention (module docstring), equal to the reference.

  Args:
    q_BTNH: queries (B, T, N, H).
    k_BTKH: keys (B, T, K, H), K dividing N.
    v_BTKH: values (B, T, K, H).
    block: the tile size in positions (`flash_block` adapts it to T).

  Returns:
    The attention output o_BTNH, in q's dtype.

  References:
    Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", 2022, arXiv 2205.14135.
  """
  q, k, v = head_major(q_BTNH, k_BTKH, v_BTKH)
  return token_major(_flash(q, k, v, flash_block(q_BTNH.shape[1], block)))


def _flash_fwd(q, k, v, blk):
  o, lse = finish(pair_stats(q, k, v, causal=True, scale=1.0 / math.sqrt(q.shape[-1]), block=blk), q.dtype)
  return o, (q, k, v, o, lse)


def _flash_bwd(blk, res, do):
  q, k, v, o, lse = res
  grads = pair_grads(q, k, v, do, lse, row_dot(do, o), causal=True, scale=1.0 / math.sqrt(q.shape[-1]), block=blk)
  return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_flash = jax.custom_vjp(lambda q, k, v, blk: _flash_fwd(q, k, v, blk)[0], nondiff_argnums=(3,))
_flash.defvjp(_flash_fwd, _flash_bwd)
