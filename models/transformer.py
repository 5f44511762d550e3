"""Decoder-only transformer in Flax NNX.

RoPE, pre-norm RMSNorm, causal GQA attention with optional QK-norm and q/k/v biases, SwiGLU MLP, tied or untied head;
blocks stacked on a leading `layers` axis and run with `lax.scan` (one compiled block, whatever the depth).

Shapes: B batch, T sequence, D d_model, N query heads, K kv heads, H head_dim, F d_ff,
V vocab, L layers. Every parameter carries logical axis names (see sharding/rules.py), and every
weight is a matrix (fan_in, fan_out) behind leading stack axes, so matrix optimizers such as Muon
need no per-layer shape rules: attention projections are stored as (D, N*H) and (N*H, D).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from models.attention import attend
from models.config import TransformerConfig
from models.moe import MoE
from models.params import context_size, layer_checkpoint, matmul, narrow_weights, param, whole_weights

# the module, not its names: sharding/context.py imports models.flash, so importing it first runs this file while it
# is half loaded; its names are read at call time, when it is whole
from sharding import context as cx
from sharding.pipeline import mesh_stages, pipeline
from sharding.rules import constrain


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32: x / sqrt(mean(x²) + eps) · scale.

  Args:
    x: the activations (..., D).
    scale: the norm's scale (D,).
    eps: added to the mean square.

  Returns:
    The normalised x, in x's dtype.
  """
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x_BTNH: jax.Array, theta: float, offset: int | jax.Array = 0, positions: Any = None) -> jax.Array:
  """Rotary position embedding, rotate-half form.

  Args:
    x_BTNH: queries or keys (B, T, N, H), H even.
    theta: the base of the rotation frequencies (`rope_theta`).
    offset: the first position: positions offset..offset+T-1 (may be traced).
    positions: the (T,) positions instead (the context-parallel layout's); None: from `offset`.

  Returns:
    x_BTNH rotated, in its dtype.

  References:
    Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
  """
  T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
  freq = theta ** (-jnp.arange(0, H, 2, dtype=jnp.float32) / H)
  pos_T = offset + jnp.arange(T, dtype=jnp.float32) if positions is None else jnp.asarray(positions, jnp.float32)
  angle_TH = pos_T[:, None] * freq[None, :]
  cos, sin = jnp.cos(angle_TH)[None, :, None, :], jnp.sin(angle_TH)[None, :, None, :]
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


class Block(nnx.Module):
  """x + Attn(Norm(x)); then x + FFN(Norm(x)), the FFN a SwiGLU MLP or a mixture of SwiGLU experts.

  Args:
    c: the model configuration.
    rngs: the random streams the weights are drawn from.
  """

  def __init__(self, c: TransformerConfig, *, rngs: nnx.Rngs):
    D, N, K, H, F, pd = c.d_model, c.n_heads, c.kv_heads, c.hd, c.d_ff, c.param_dtype
    out_std = c.init_std / (2 * c.n_layers) ** 0.5  # GPT-2: residual projections scaled by depth
    self.c = c
    self.attn_norm = param(rngs, (D,), ("norm",), 0, pd)
    self.wq_DQ = param(rngs, (D, N * H), ("embed", "heads"), c.init_std, pd)
    self.wk_DK = param(rngs, (D, K * H), ("embed", "kv_heads"), c.init_std, pd)
    self.wv_DK = param(rngs, (D, K * H), ("embed", "kv_heads"), c.init_std, pd)
    self.wo_QD = param(rngs, (N * H, D), ("heads", "embed"), out_std, pd)
    if c.qkv_bias:
      self.q_bias_Q = param(rngs, (N * H,), ("heads",), None, pd)
      self.k_bias_K = param(rngs, (K * H,), ("kv_heads",), None, pd)
      self.v_bias_K = param(rngs, (K * H,), ("kv_heads",), None, pd)
    if c.qk_norm:
      self.q_norm = param(rngs, (H,), ("norm",), 0, pd)
      self.k_norm = param(rngs, (H,), ("norm",), 0, pd)
    self.mlp_norm = param(rngs, (D,), ("norm",), 0, pd)
    if c.moe is not None:
      self.moe = MoE(c, rngs=rngs)
    else:
      self.w_gate_DF = param(rngs, (D, F), ("embed", "mlp"), c.init_std, pd)
      self.w_up_DF = param(rngs, (D, F), ("embed", "mlp"), c.init_std, pd)
      self.w_down_FD = param(rngs, (F, D), ("mlp", "embed"), out_std, pd)

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Applies the block: x_BTD -> (x_BTD, aux).

    Args:
      x_BTD: the residual stream.

    Returns:
      (x_BTD, aux): aux holds float32 router statistics of an MoE block ({} for a dense one) and, with
      `logit_stats`, "max_logit" (N,): each query head's largest attention logit over the batch.
    """
    h_BTD = rms_norm(x_BTD, self.attn_norm[...], self.c.norm_eps)
    positions = cx.zigzag_positions(h_BTD.shape[1], cx.mesh_context())  # 0..T-1 without context parallelism
    q, k, v = self.qkv(h_BTD, positions=positions)
    stats = {"max_logit": max_logits(q, k, positions)} if self.c.logit_stats else {}
    x_BTD = x_BTD + self.out_proj(attend(q, k, v, impl=self.c.attention))
    x_BTD, aux = self.ffn(x_BTD)
    return x_BTD, {**aux, **stats}

  def ffn(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The residual FFN half: x + FFN(Norm(x)).

    Args:
      x_BTD: the residual stream after attention.

    Returns:
      (x_BTD, aux): the new residual stream and the MoE aux ({} for a dense block).
    """
    h = rms_norm(x_BTD, self.mlp_norm[...], self.c.norm_eps)
    if self.c.moe is not None:
      y_BTD, aux = self.moe(h)
    else:
      y_BTD, aux = self.mlp(h), {}
    return x_BTD + constrain(y_BTD, ("batch", "seq", "act_embed")), aux

  def qkv(self, h_BTD: jax.Array, offset: int | jax.Array = 0,
          positions: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries and keys, and values, for tokens at positions offset..offset+T-1 (or `positions`).

    Args:
      h_BTD: the normalised residual stream.
      offset: the first token's position (may be traced).
      positions: the (T,) positions instead; None: from `offset`.

    Returns:
      (q_BTNH, k_BTKH, v_BTKH), q and k rotated, in the compute dtype.
    """
    c, dt = self.c, jnp.dtype(self.c.compute_dtype)
    B, T, _ = h_BTD.shape
    heads = lambda y, n, names: constrain(y.reshape(B, T, n, c.hd), ("batch", "seq", names, "kv"))
    proj = lambda wt, b: matmul(h_BTD, wt, dt) + (b[...].astype(dt) if c.qkv_bias else 0)
    q = heads(proj(self.wq_DQ, getattr(self, "q_bias_Q", None)), c.n_heads, "act_heads")
    k = heads(proj(self.wk_DK, getattr(self, "k_bias_K", None)), c.kv_heads, "act_kv_heads")
    v = heads(proj(self.wv_DK, getattr(self, "v_bias_K", None)), c.kv_heads, "act_kv_heads")
    if c.qk_norm:
      q, k = rms_norm(q, self.q_norm[...], c.norm_eps), rms_norm(k, self.k_norm[...], c.norm_eps)
    return rope(q, c.rope_theta, offset, positions), rope(k, c.rope_theta, offset, positions), v

  def out_proj(self, o_BTNH: jax.Array) -> jax.Array:
    """The attention output projection W_o.

    Args:
      o_BTNH: the attention output.

    Returns:
      The projected o_BTD, in the compute dtype.
    """
    B, T = o_BTNH.shape[:2]
    o = constrain(o_BTNH, ("batch", "seq", "act_heads", "kv"))
    return constrain(matmul(o.reshape(B, T, -1), self.wo_QD, jnp.dtype(self.c.compute_dtype)),
                     ("batch", "seq", "act_embed"))

  def mlp(self, h_BTD: jax.Array) -> jax.Array:
    """The dense SwiGLU MLP: (silu(h·W_gate) ⊙ h·W_up)·W_down.

    Args:
      h_BTD: the normalised residual stream.

    Returns:
      The MLP output y_BTD, in the compute dtype.
    """
    dt = jnp.dtype(self.c.compute_dtype)
    gate, up = matmul(h_BTD, self.w_gate_DF, dt), matmul(h_BTD, self.w_up_DF, dt)
    a_BTF = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
    return matmul(a_BTF, self.w_down_FD, dt)


def max_logits(q_BTNH: jax.Array, k_BSKH: jax.Array, positions: Any = None) -> jax.Array:
  """Each query head's largest causal attention logit q·k/√H over the batch (no gradient).

  The statistic MuonClip's QK-clip reads. Forms the B·N·T² logits once more: a diagnostic switched on by
  `logit_stats`, not the attention itself.

  Args:
    q_BTNH: the rotated queries.
    k_BSKH: the rotated keys (GQA: K divides N).
    positions: (T,) each slot's position; None: 0..T-1.

  Returns:
    (N,) float32 maxima.

  References:
    Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025, arXiv 2507.20534 (MuonClip's QK-clip).
  """
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q = jax.lax.stop_gradient(q_BTNH).astype(jnp.float32).reshape(B, T, K, N // K, H)
  k = jax.lax.stop_gradient(k_BSKH).astype(jnp.float32)
  s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q, k) / jnp.sqrt(jnp.float32(H))
  pos = np.arange(T) if positions is None else np.asarray(positions)
  causal_TS = pos[None, :] <= pos[:, None]
  return jnp.max(jnp.where(causal_TS, s_BKGTS, -jnp.inf), axis=(0, 3, 4)).reshape(N)


def run_blocks(blocks: Block, x_BTD: jax.Array, *, remat: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Apply layer-stacked blocks (a vmapped `Block`, leading axis L) in order with `lax.scan`.

  The pipeline calls this on each stage's slice of the stack.

  Args:
    blocks: the stacked blocks.
    x_BTD: the residual stream in.
    remat: recompute each block in the backward pass (`jax.checkpoint`).

  Returns:
    (x_BTD, aux) with every aux leaf stacked over the L layers (leading axis L).
  """
  graphdef, stacked = nnx.split(blocks)

  def layer(x, block_state):
    return nnx.merge(graphdef, block_state)(x)

  layer = layer_checkpoint(layer, stacked, blocks.c.compute_dtype, remat)
  return jax.lax.scan(layer, x_BTD, stacked, unroll=scan_unroll(stacked))


UNROLL_BYTES = 256 * 2 ** 20  # the largest layer stack whose scan the CPU unrolls


def scan_unroll(stacked: Any) -> int | bool:
  """How far the layer scan is unrolled: whole for a small float32 stack on the CPU, not at all otherwise.

  On XLA's CPU backend a scanned layer stacks its residuals and runs each layer's kernels one at a time; a small
  model's layers unrolled ran the step ~15% faster (issue 50, against the JAX floor of research/bench/floor.py). That
  is the models the CPU trains in seconds (the tests, the notebooks, `make run`). The loop stays where it bounds
  memory or where unrolling measured no gain: a stack over `UNROLL_BYTES` (compute-bound; unrolled, compile time
  grows with depth and every layer's temporaries may be live at once), weights stored narrower than float32 (XLA:CPU
  multiplies bfloat16 in float32: unrolled, each layer's float32 copy of its weights is a live temporary, which the
  loop keeps to one layer), a `context` mesh axis (the ring attention's backward is written per scanned layer), and
  every platform but the CPU (the scan's one compiled body keeps compile time flat in depth).

  Args:
    stacked: the layer-stacked parameters (arrays or abstract values with a leading layers axis).

  Returns:
    `True` (unroll every layer) where the rule above allows, else 1.
  """
  leaves = [x for x in jax.tree.leaves(stacked) if hasattr(x, "dtype")]
  small = sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves) <= UNROLL_BYTES
  float32 = all(jnp.dtype(x.dtype) == jnp.float32 for x in leaves)
  return (jax.default_backend() == "cpu" and small and float32 and context_size() == 1) or 1


class Transformer(nnx.Module):
  """tokens_BT (int) -> logits_BTV (float32); `forward` also returns the per-layer aux (MoE router statistics).

  Args:
    c: the model configuration.
    rngs: the random streams the weights are drawn from (split over the layers).
  """

  def __init__(self, c: TransformerConfig, *, rngs: nnx.Rngs):
    self.c = c
    self.embed_VD = param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), c.init_std, c.param_dtype)

    @nnx.split_rngs(splits=c.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(r):
      return Block(c, rngs=r)

    self.blocks = make_blocks(rngs)
    self.final_norm = param(rngs, (c.d_model,), ("norm",), 0, c.param_dtype)
    if not c.tie_embeddings:
      self.head_DV = param(rngs, (c.d_model, c.vocab_size), ("embed", "vocab"), c.init_std, c.param_dtype)

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    """The logits of `forward`, without the aux.

    Args:
      tokens_BT: the input token ids.

    Returns:
      logits_BTV in float32.
    """
    return self.forward(tokens_BT)[0]

  def forward(self, tokens_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """tokens_BT -> (logits_BTV, aux).

    Args:
      tokens_BT: the input token ids.

    Returns:
      (logits_BTV float32, aux), aux the blocks' router statistics stacked over layers ({} if dense).
    """
    C = cx.mesh_context()
    cx.check_context(tokens_BT.shape[1], C)
    x_BTD = self.embed(cx.to_zigzag(tokens_BT, C))  # context > 1: the sequence in zig-zag order (sharding/context.py)
    if mesh_stages() > 1:  # a `stage` mesh axis: the blocks run as a GPipe pipeline of microbatches
      graphdef, stacked = nnx.split(self.blocks)
      stage = lambda stage_blocks, x: run_blocks(nnx.merge(graphdef, stage_blocks), x, remat=self.c.remat)
      x_BTD, aux = pipeline(stage, stacked, x_BTD, microbatches=self.c.microbatches or mesh_stages(),
                            names=("batch", "seq", "act_embed"))
    else:
      x_BTD, aux = run_blocks(self.blocks, x_BTD, remat=self.c.remat)
    return self.unembed(cx.from_zigzag(x_BTD, C)), aux

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    """The token embeddings.

    Args:
      tokens_BT: the input token ids.

    Returns:
      x_BTD in the compute dtype.
    """
    dt = jnp.dtype(self.c.compute_dtype)
    # Look up in a whole copy of the table: a gather from a vocab/embed-split table makes GSPMD
    # replicate the *output*; gathering the (V, D) table is what FSDP does for every weight anyway.
    table_VD = constrain(self.embed_VD[...], (None, None))
    return constrain(jnp.take(table_VD, tokens_BT, axis=0).astype(dt), ("batch", "seq", "act_embed"))

  def unembed(self, x_BTD: jax.Array) -> jax.Array:
    """The final norm and the output head (the embedding table when tied).

    Args:
      x_BTD: the residual stream after the last block.

    Returns:
      logits_BTV in float32.
    """
    c, dt = self.c, jnp.dtype(self.c.compute_dtype)
    h = rms_norm(x_BTD, self.final_norm[...], c.norm_eps)
    w, vocab_axis = (self.embed_VD[...], 0) if c.tie_embeddings else (self.head_DV[...], 1)
    return constrain(head_logits(h, w, vocab_axis, dt).astype(jnp.float32), ("batch", "seq", "act_vocab"))


HEAD_CHUNK_BYTES = 2 ** 28  # the largest slice of the head widened at once when it is stored narrower


def head_logits(h_BTD: jax.Array, w: jax.Array, vocab_axis: int, dt: DTypeLike) -> jax.Array:
  """The output head's logits `h @ w` in the compute dtype `dt`, `w` the head (D, V) or the tied table (V, D).

  A head stored in a narrower dtype than `dt` (a bfloat16 fine-tune computing in float32) is widened in vocabulary
  slices of at most `HEAD_CHUNK_BYTES`, each recomputed in the backward rather than kept: widened whole, Llama-3-8B's
  (4096, 128256) head is a 2 GiB temporary beside the model. Slices are used where the mesh leaves the head whole on
  each device (no `fsdp` or `tensor` axis above 1) and the vocabulary divides into them; elsewhere, and for a head in
  the compute dtype, one product as before.

  Args:
    h_BTD: the normed residual stream.
    w: the head's value.
    vocab_axis: the vocabulary's axis of `w` (0: the tied embedding table, 1: the head).
    dt: the compute dtype.

  Returns:
    logits_BTV in `dt`.
  """
  spec = "btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv"
  V, D = w.shape[vocab_axis], w.shape[1 - vocab_axis]
  n = next((n for n in range(1, 257) if V % n == 0 and V // n * D * jnp.dtype(dt).itemsize <= HEAD_CHUNK_BYTES), 1)
  if not narrow_weights(w, dt) or n == 1 or not whole_weights():
    return jnp.einsum(spec, h_BTD, w.astype(dt))
  size = V // n

  def chunk(logits, i):
    part = jnp.einsum(spec, h_BTD, jax.lax.dynamic_slice_in_dim(w, i * size, size, axis=vocab_axis).astype(dt))
    return jax.lax.dynamic_update_slice_in_dim(logits, part, i * size, axis=2), None

  body = jax.checkpoint(chunk, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
  zeros = jnp.zeros((*h_BTD.shape[:2], V), jnp.result_type(h_BTD.dtype, dt))
  return jax.lax.scan(body, zeros, jnp.arange(n))[0]


IGNORE_TARGET = -(2 ** 31)  # a target the loss leaves out (padding): int32's minimum, no vocabulary's id


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """Mean next-token cross entropy in nats over the targets that are not `IGNORE_TARGET` (padding; none left: 0).

  The target's log-probability is picked by a masked sum over the vocabulary (exact: one term is non-zero), not a
  gather: with the vocabulary split over `tensor` each device sums its own slice and GSPMD all-reduces (B, T)
  numbers, and XLA's partitioner aborts on the gather inside a shard_map manual over `data` with fsdp and tensor both
  split (sharding/replicas.py).

  Args:
    logits_BTV: the logits.
    targets_BT: the target ids; `IGNORE_TARGET` where left out, negative ids count from the vocabulary's end.

  Returns:
    The scalar float32 mean loss; NaN when a target lies outside the vocabulary (bad data is a bad step).
  """
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  V = logp_BTV.shape[-1]
  used_BT = targets_BT != IGNORE_TARGET
  t_BT = jnp.where(targets_BT < 0, targets_BT + V, targets_BT)  # negative ids count from the end, as in a gather
  picked_BT = jnp.sum(jnp.where(jnp.arange(V) == t_BT[..., None], logp_BTV, 0.0), axis=-1)
  # a target outside the vocabulary makes the loss NaN (as the gather's fill did): bad data is a bad step, not a 0
  nll_BT = jnp.where(used_BT, -jnp.where((t_BT >= 0) & (t_BT < V), picked_BT, jnp.nan), 0.0)
  return jnp.sum(nll_BT) / jnp.maximum(jnp.sum(used_BT), 1).astype(jnp.float32)
