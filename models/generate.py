"""Autoregressive sampling with a KV cache: one prefill of the prompt, then one token per step.

Shapes: B batch, P prompt length, S = P + new tokens (the cache length), L layers, K kv heads, H head_dim,
V vocab. The cache holds every layer's rotated keys and values, (L, B, S, K, H) each, in the compute dtype; step t
writes position t and attends to positions ≤ t through a mask, so each new token costs one token's forward pass
instead of a re-run of the whole prefix (`research/bench/sample.py` measures the ratio). The whole loop is one
jitted program (prefill + `lax.fori_loop`). Dense and MoE models; not the pipeline (`stage`) layout.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.transformer import Transformer, rms_norm


def _block_step(block, x_BTD, k_BSKH, v_BSKH, pos):
  """One block on T new tokens at positions pos..pos+T-1, their k, v written into the layer's cache."""
  c = block.c
  q, k, v = block.qkv(rms_norm(x_BTD, block.attn_norm[...], c.norm_eps), pos)
  k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k.astype(k_BSKH.dtype), pos, axis=1)
  v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v.astype(v_BSKH.dtype), pos, axis=1)
  T, S = x_BTD.shape[1], k_BSKH.shape[1]
  mask_TS = jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]  # causal, and nothing past what is written
  o = jax.nn.dot_product_attention(q, k_BSKH, v_BSKH, mask=mask_TS[None, None])
  x_BTD, _ = block.ffn(x_BTD + block.out_proj(o))
  return x_BTD, k_BSKH, v_BSKH


def forward_cached(model: Transformer, tokens_BT: jax.Array, cache: tuple[jax.Array, jax.Array],
                   pos: int | jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """Logits of T new tokens at positions pos.., given the KV cache.

  Args:
    model: the transformer (not the pipeline layout).
    tokens_BT: the new tokens.
    cache: (k_LBSKH, v_LBSKH), every layer's rotated keys and values (`init_cache`).
    pos: the first new token's position (may be traced).

  Returns:
    (logits_BTV, cache), the cache with the new tokens' keys and values written at pos..pos+T-1.
  """
  graphdef, stacked = nnx.split(model.blocks)

  def layer(x, xs):
    state, k, v = xs
    x, k, v = _block_step(nnx.merge(graphdef, state), x, k, v, pos)
    return x, (k, v)

  x_BTD, cache = jax.lax.scan(layer, model.embed(tokens_BT), (stacked, *cache))
  return model.unembed(x_BTD), cache


def init_cache(model: Transformer, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
  """An empty KV cache.

  Args:
    model: the transformer.
    batch: B, the sequences sampled at once.
    length: S, the positions the cache holds (prompt + new tokens).

  Returns:
    (k_LBSKH, v_LBSKH) zeros in the compute dtype.
  """
  c = model.c
  shape = (c.n_layers, batch, length, c.kv_heads, c.hd)
  return jnp.zeros(shape, c.compute_dtype), jnp.zeros(shape, c.compute_dtype)


def _pick(logits_BV, key, temperature: float, top_k: int | None):
  if temperature == 0.0:
    return jnp.argmax(logits_BV, -1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "temperature", "top_k"))
def _generate(graphdef, state, prompt_BP, seed, *, max_new_tokens, temperature, top_k):
  model = nnx.merge(graphdef, state)
  B, P = prompt_BP.shape
  key = jax.random.key(seed)
  logits, cache = forward_cached(model, prompt_BP, init_cache(model, B, P + max_new_tokens), 0)
  out = jnp.concatenate([prompt_BP, jnp.zeros((B, max_new_tokens), jnp.int32)], 1)
  out = out.at[:, P].set(_pick(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k))

  def step(t, carry):  # t: the position of the token fed in
    out, cache = carry
    logits, cache = forward_cached(model, jax.lax.dynamic_slice_in_dim(out, t, 1, 1), cache, t)
    nxt = _pick(logits[:, -1], jax.random.fold_in(key, t - P + 1), temperature, top_k)
    return jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], t + 1, 1), cache

  out, _ = jax.lax.fori_loop(P, P + max_new_tokens - 1, step, (out, cache))
  return out


def generate(model: Transformer, prompt_tokens: Any, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0) -> jax.Array:
  """The prompt followed by `max_new_tokens` sampled tokens (no stop token).

  Args:
    model: the transformer (dense or MoE; not the pipeline layout).
    prompt_tokens: (B, P) or (P,) token ids (an array or nested lists).
    max_new_tokens: the tokens to sample, at least 1; always all of them.
    temperature: 0 (default) is greedy (argmax); otherwise softmax(logits / temperature).
    top_k: sample among the `top_k` most likely tokens only; None: all.
    seed: the sampling key's seed (each step's key folds in the step).

  Returns:
    (B, P + max_new_tokens) int32 tokens (1-D for a 1-D prompt).

  Raises:
    ValueError: when max_new_tokens < 1, temperature < 0 or top_k lies outside [1, vocab].
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0 or (top_k is not None and not 1 <= top_k <= model.c.vocab_size):
    raise ValueError(f"need temperature >= 0 and 1 <= top_k <= vocab, got {temperature}, {top_k}")
  prompt = jnp.asarray(prompt_tokens, jnp.int32)
  squeeze = prompt.ndim == 1
  prompt = prompt[None] if squeeze else prompt
  graphdef, state = nnx.split(model)
  out = _generate(graphdef, state, prompt, seed, max_new_tokens=max_new_tokens, temperature=float(temperature),
                  top_k=top_k)
  return out[0] if squeeze else out
