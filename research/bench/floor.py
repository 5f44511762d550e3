"""The JAX floor: the same model's train step written as plainly as JAX allows, the bar optlab's step is held to.

No Flax module, no sharding, no scan: the parameters are a dict of arrays (each layer its own), the layers a Python
loop, every projection one 2-D matmul on the [B·T, D] view of the activations (on XLA's CPU backend a weight gradient
that contracts two batch axes of a 3-D activation costs ~40% more: issue 50), attention a plain einsum under a causal
mask, the loss a log-softmax cross entropy. What it shares with optlab's step, so that the comparison is fair: the
initial weights (the trainer's own `Transformer(mcfg, rngs=nnx.Rngs(seed))`), the shapes and compute dtype, the
optimizer (the trainer's `make_optimizer`: clipping, AdamW, its schedule and decay mask), the XLA compiler options
(`research/train/runtime/xla.py`) and donated state; its loss
before the first update equals optlab's (`research.bench peer` prints both). What it leaves out is what a real run
needs and the floor does not: the non-finite guard, gradient-norm and router metrics, sharding constraints, the MoE
and pipeline paths.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import Transformer, TransformerConfig
from models.transformer import rms_norm, rope


def floor_params(mcfg: TransformerConfig, seed: int) -> dict[str, Any]:
  """The trainer's initial weights as plain arrays: embedding, final norm, and one dict per layer.

  Args:
    mcfg: a dense model's configuration (no MoE, QK-norm or QKV bias: the floor writes the Llama block only).
    seed: the trainer's seed (`--seed`).

  Returns:
    {"embed_VD", "final_norm", "head_DV" (untied only), "layers": [per-layer dict of the block's weights]}.

  Raises:
    ValueError: for a model the floor does not write (MoE, QK-norm, QKV bias).
  """
  if mcfg.moe is not None or mcfg.qk_norm or mcfg.qkv_bias:
    raise ValueError("the JAX floor writes the dense Llama block only (no MoE, QK-norm or QKV bias)")
  pure = nnx.to_pure_dict(nnx.state(Transformer(mcfg, rngs=nnx.Rngs(seed)), nnx.Param))
  blocks = pure.pop("blocks")
  layers = [{name: w[i] for name, w in blocks.items()} for i in range(mcfg.n_layers)]
  return {**pure, "layers": layers}


def floor_loss(params: dict[str, Any], x_BT: jax.Array, y_BT: jax.Array, mcfg: TransformerConfig) -> jax.Array:
  """Mean next-token cross entropy of the plain forward.

  Args:
    params: `floor_params`' tree.
    x_BT: input token ids.
    y_BT: target token ids.
    mcfg: the model's configuration.

  Returns:
    The float32 scalar loss.
  """
  c, dt = mcfg, jnp.dtype(mcfg.compute_dtype)
  B, T = x_BT.shape
  D, N, K, H = c.d_model, c.n_heads, c.kv_heads, c.hd
  causal_TS = jnp.tril(jnp.ones((T, T), bool))
  h = jnp.take(params["embed_VD"], x_BT, axis=0).astype(dt).reshape(B * T, D)
  for p in params["layers"]:
    a = rms_norm(h, p["attn_norm"], c.norm_eps)
    q = rope((a @ p["wq_DQ"].astype(dt)).reshape(B, T, N, H), c.rope_theta)  # head n reads kv head n // (N/K)
    k = rope((a @ p["wk_DK"].astype(dt)).reshape(B, T, K, H), c.rope_theta)
    v = (a @ p["wv_DK"].astype(dt)).reshape(B, T, K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k,
                   preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(H))
    w = jax.nn.softmax(jnp.where(causal_TS, s, -jnp.inf), axis=-1).astype(dt)
    o = jnp.einsum("bkgts,bskh->btkgh", w, v).reshape(B * T, N * H)
    h = h + o @ p["wo_QD"].astype(dt)
    m = rms_norm(h, p["mlp_norm"], c.norm_eps)
    h = h + (jax.nn.silu(m @ p["w_gate_DF"].astype(dt)) * (m @ p["w_up_DF"].astype(dt))) @ p["w_down_FD"].astype(dt)
  f = rms_norm(h, params["final_norm"], c.norm_eps)
  head = params["embed_VD"].T if c.tie_embeddings else params["head_DV"]
  logp = jax.nn.log_softmax((f @ head.astype(dt)).astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, y_BT.reshape(B * T, 1), axis=-1))


def floor_step(mcfg: TransformerConfig, tx: Any, compiler_options: dict[str, str] | None = None) -> Any:
  """The jitted step (params, opt_state, x, y) -> (params, opt_state, loss), its state donated.

  Args:
    mcfg: the model's configuration.
    tx: the optimizer (the trainer's `make_optimizer`'s).
    compiler_options: XLA options (the bench passes the trainer's, so that a flag is never what the ratio measures).

  Returns:
    The jitted step.
  """
  def step(params, opt_state, x_BT, y_BT):
    loss, grads = jax.value_and_grad(floor_loss)(params, x_BT, y_BT, mcfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1), compiler_options=compiler_options)
