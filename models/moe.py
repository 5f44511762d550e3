"""Mixture-of-Experts FFN: a token-choice top-k router over E SwiGLU experts, optional shared experts.

Shapes: B batch, T sequence, D d_model, E experts, K top-k, F expert width, G = B·T tokens.
Expert weights are stacks of (fan_in, fan_out) matrices, (E, D, F) and (E, F, D), with logical axes
("expert", "embed", "mlp") / ("expert", "mlp", "embed"), so Muon orthogonalizes each expert on its own.

Router (per token x: scores s = softmax(x·W_r) or sigmoid(x·W_r); b the aux-free balancing bias, or 0):
  selected = TopK_k(s + b)       b chooses experts only (DeepSeek-V3 §2.1.2, arXiv 2412.19437)
  g_e = s_e for e in selected    renormalised Σ_k g = 1 for sigmoid (DeepSeek-V3) or `normalize_top_k`
  y = Σ_{e∈selected} g_e·SwiGLU_e(x) + σ(x·w_s)·SwiGLU_shared(x)   (σ(x·w_s) = 1 unless `shared_gate`: Qwen2-MoE)
Auxiliary losses (per layer, over the G tokens of the global batch; `lb_loss`, `aux_loss`):
  load balancing  L_lb = E · Σ_e f_e·P_e, f_e = (assignments to e)/(G·K), P_e = mean_t p_te with p the
                  scores normalised to sum 1 (Switch Transformer, arXiv 2101.03961, eq. 4; Megatron's
                  top-k form); = 1 under uniform routing.
  router z-loss   L_z = mean_t (logsumexp_e logits_te)² (ST-MoE, arXiv 2202.08906, eq. 5).
Aux-loss-free balancing (Wang et al., arXiv 2408.15664): after each optimizer step
  b_e ← b_e + u·sign(mean_e' load_e' − load_e)
with b a `RouterBias` variable (not an nnx.Param: the optimizer never sees it), see `update_router_bias`.
PAD-Net (`moe.pad`, models/padnet.py): each expert stack is mixed with a static matrix shared by the experts,
W_e = λ_d·M_e⊙W_e + λ_s·(1 − M_e)⊙W^static, before the dispatch.
Dispatch (capacity-factor with dropping, or dropless sort + `jax.lax.ragged_dot`) and expert
parallelism live in `sharding/experts.py`; this module supplies the expert math.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import padnet
from models.config import TransformerConfig
from models.params import matmul, param
from sharding import experts
from sharding.rules import constrain

# Per-layer aux: every entry a mean over tokens, so the mean over equal microbatches (pipeline, gradient
# accumulation) is the whole batch's value; the load-balancing loss, a product, is formed from them (`lb_loss`).
AUX_KEYS = ("load", "prob", "z_loss", "dropped", "entropy")


class RouterBias(nnx.Variable):
  """Aux-loss-free selection bias, one per expert: state beside the params, outside the optimizer."""


def route(logits_GE: jax.Array, bias_E: jax.Array | None, *, router: str, top_k: int,
          normalize: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Token-choice top-k routing: top-k of scores + bias (selection only), gates from the scores.

  Args:
    logits_GE: the router logits x·W_r per token (computed in at least float32).
    bias_E: the aux-loss-free selection bias (no gradient), or None.
    router: "softmax" or "sigmoid", the scores from the logits.
    top_k: K, the experts per token.
    normalize: renormalise the K selected gates to sum 1 (always done for sigmoid).

  Returns:
    (idx_GK, gate_GK, scores_GE): the selected experts, their gates and every expert's score.

  References:
    DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, arXiv 2412.19437, §2.1.2 (the bias in selection only).
  """
  logits_GE = logits_GE.astype(jnp.promote_types(jnp.float32, logits_GE.dtype))
  scores = jax.nn.softmax(logits_GE, -1) if router == "softmax" else jax.nn.sigmoid(logits_GE)
  select = scores if bias_E is None else scores + jax.lax.stop_gradient(bias_E.astype(scores.dtype))
  _, idx_GK = jax.lax.top_k(select, top_k)
  gate_GK = jnp.take_along_axis(scores, idx_GK, axis=-1)
  if router == "sigmoid" or normalize:
    gate_GK = gate_GK / jnp.sum(gate_GK, -1, keepdims=True)
  return idx_GK, gate_GK, scores


def router_stats(logits_GE: jax.Array, scores_GE: jax.Array, idx_GK: jax.Array,
                 keep_GK: jax.Array) -> dict[str, jax.Array]:
  """Per-layer float32 router statistics, each a mean over the tokens (module docstring).

  Args:
    logits_GE: the router logits.
    scores_GE: the router scores (softmax or sigmoid of the logits).
    idx_GK: the selected experts.
    keep_GK: whether each assignment was kept (not dropped over capacity).

  Returns:
    {"load": f_E, the fraction of the G·K assignments per expert, before dropping; "prob": P_E, the mean normalised
    router probability; "z_loss"; "dropped": the dropped fraction; "entropy": the router entropy in nats}.
  """
  E = logits_GE.shape[-1]
  p_GE = scores_GE / jnp.sum(scores_GE, -1, keepdims=True)
  load_E = jnp.mean(jnp.sum(jax.nn.one_hot(idx_GK, E, dtype=p_GE.dtype), 1), 0) / idx_GK.shape[-1]
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_GE, -1)))
  entropy = -jnp.mean(jnp.sum(p_GE * jnp.log(jnp.maximum(p_GE, 1e-30)), -1))
  dropped = 1.0 - jnp.mean(keep_GK.astype(p_GE.dtype))
  stats = {"load": load_E, "prob": jnp.mean(p_GE, 0), "z_loss": z, "dropped": dropped, "entropy": entropy}
  return {k: v.astype(jnp.float32) for k, v in stats.items()}


def swiglu_grouped(x_MD: jax.Array, sizes_E: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
  """SwiGLU_e on each group of rows of x sorted by expert (`ragged_dot`).

  Args:
    x_MD: the rows, sorted by expert.
    sizes_E: the number of rows of each expert.
    w: the expert stacks {"gate": (E, D, F), "up": (E, D, F), "down": (E, F, D)}.

  Returns:
    y_MD, in x's dtype.
  """
  dt = x_MD.dtype
  g = jax.lax.ragged_dot(x_MD, w["gate"].astype(dt), sizes_E)
  u = jax.lax.ragged_dot(x_MD, w["up"].astype(dt), sizes_E)
  return jax.lax.ragged_dot(jax.nn.silu(g) * u, w["down"].astype(dt), sizes_E)


def swiglu_dense(x_ECD: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
  """SwiGLU_e on slot buffer e, C slots per expert (einsum).

  Args:
    x_ECD: each expert's slot buffer.
    w: the expert stacks {"gate": (E, D, F), "up": (E, D, F), "down": (E, F, D)}.

  Returns:
    y_ECD, in x's dtype.
  """
  dt = x_ECD.dtype
  g = jnp.einsum("ecd,edf->ecf", x_ECD, w["gate"].astype(dt))
  u = jnp.einsum("ecd,edf->ecf", x_ECD, w["up"].astype(dt))
  return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, w["down"].astype(dt))


class MoE(nnx.Module):
  """h_BTD -> (y_BTD, aux): router, top-k dispatch to E SwiGLU experts, optional shared experts.

  Args:
    c: the model configuration; `c.moe` must be set.
    rngs: the random streams the weights are drawn from.
  """

  def __init__(self, c: TransformerConfig, *, rngs: nnx.Rngs):
    m, pd = c.moe, c.param_dtype
    assert m is not None, "MoE needs c.moe"  # Block builds one only for an MoE config
    D, E, F = c.d_model, m.num_experts, m.d_expert or c.d_ff
    out_std = c.init_std / (2 * c.n_layers) ** 0.5
    self.c = c
    self.router_DE = param(rngs, (D, E), ("embed", None), c.init_std, pd)
    self.w_gate_EDF = param(rngs, (E, D, F), ("expert", "embed", "mlp"), c.init_std, pd)
    self.w_up_EDF = param(rngs, (E, D, F), ("expert", "embed", "mlp"), c.init_std, pd)
    self.w_down_EFD = param(rngs, (E, F, D), ("expert", "mlp", "embed"), out_std, pd)
    if m.num_shared:
      S = m.d_shared or m.num_shared * F
      self.shared_gate_DS = param(rngs, (D, S), ("embed", "mlp"), c.init_std, pd)
      self.shared_up_DS = param(rngs, (D, S), ("embed", "mlp"), c.init_std, pd)
      self.shared_down_SD = param(rngs, (S, D), ("mlp", "embed"), out_std, pd)
      if m.shared_gate:
        self.shared_router_D1 = param(rngs, (D, 1), ("embed", None), c.init_std, pd)
    if m.bias_rate > 0:
      self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,), eager_sharding=False)
    if m.pad:  # static weights, all-dynamic masks, φ = 0: the plain MoE until a partition (models/padnet.py)
      padnet.add_parameters(self, rngs, D, E, F, c.init_std, out_std, pd)

  def __call__(self, h_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routes each token to its top-k experts and adds the shared experts' output.

    Args:
      h_BTD: the normalised residual stream.

    Returns:
      (y_BTD in h's dtype, aux): aux the `router_stats` of this layer.
    """
    c, m = self.c, self.c.moe
    assert m is not None
    dt = jnp.dtype(c.compute_dtype)
    B, T, D = h_BTD.shape
    rdt = jnp.promote_types(jnp.float32, dt)  # the router in at least fp32 (ST-MoE's selective precision)
    logits_BTE = jnp.einsum("btd,de->bte", h_BTD.astype(rdt), self.router_DE[...].astype(rdt))
    bias = self.router_bias[...] if m.bias_rate > 0 else None
    idx, gate, scores = route(logits_BTE.reshape(B * T, -1), bias, router=m.router, top_k=m.top_k,
                              normalize=m.normalize_top_k)
    K = m.top_k
    w = (padnet.expert_weights(self) if m.pad else
         {"gate": self.w_gate_EDF[...], "up": self.w_up_EDF[...], "down": self.w_down_EFD[...]})
    names = {"gate": ("expert", None, "mlp"), "up": ("expert", None, "mlp"), "down": ("expert", "mlp", None)}
    y_BTD, keep = experts.dispatch(h_BTD.astype(dt), idx.reshape(B, T, K), gate.reshape(B, T, K), w, names,
                                   num_experts=m.num_experts, grouped=swiglu_grouped, dense=swiglu_dense,
                                   capacity_factor=m.capacity_factor, ragged=m.ragged_a2a)
    if m.num_shared:
      # a weight with a product of its own (an adapter's factorized one, a quantized weight's) computes it
      g, u = matmul(h_BTD.astype(dt), self.shared_gate_DS, dt), matmul(h_BTD.astype(dt), self.shared_up_DS, dt)
      a_BTS = constrain(jax.nn.silu(g) * u, ("batch", "seq", "act_mlp"))
      shared_BTD = matmul(a_BTS, self.shared_down_SD, dt)
      if m.shared_gate:
        shared_BTD = jax.nn.sigmoid(matmul(h_BTD.astype(dt), self.shared_router_D1, dt)) * shared_BTD
      y_BTD = y_BTD + shared_BTD
    return y_BTD.astype(h_BTD.dtype), router_stats(logits_BTE.reshape(B * T, -1), scores, idx, keep.reshape(B * T, K))


def lb_loss(aux: dict) -> jax.Array:
  """Switch load-balancing loss per layer, E·Σ_e f_e·P_e, from the aux statistics (f carries no gradient).

  Args:
    aux: the router statistics ("load", "prob"), stacked over layers or not.

  Returns:
    L_lb per layer (a scalar for one layer's aux); 1 under uniform routing.

  References:
    Fedus, Zoph, Shazeer, "Switch Transformers", 2021, arXiv 2101.03961, eq. 4.
  """
  E = aux["load"].shape[-1]
  return E * jnp.sum(jax.lax.stop_gradient(aux["load"]) * aux["prob"], -1)


def aux_loss(aux: dict, c: TransformerConfig) -> jax.Array:
  """The weighted auxiliary loss lb_weight·Σ_layers L_lb + z_weight·Σ_layers L_z (0 for a dense model).

  Args:
    aux: the model's aux, stacked over layers (`Transformer.forward`).
    c: the model configuration, whose `moe` gives the weights.

  Returns:
    The scalar float32 loss to add to the train loss.

  References:
    Fedus, Zoph, Shazeer, "Switch Transformers", 2021, arXiv 2101.03961, eq. 4 (L_lb); Zoph et al., "ST-MoE", 2022,
    arXiv 2202.08906, eq. 5 (L_z).
  """
  if c.moe is None or not aux:
    return jnp.zeros((), jnp.float32)
  return c.moe.lb_weight * jnp.sum(lb_loss(aux)) + c.moe.z_weight * jnp.sum(aux["z_loss"])


def update_router_bias(buffers: Any, aux: dict, rate: float) -> Any:
  """Aux-loss-free balancing: b ← b + rate·sign(mean(load) − load) on every `router_bias` leaf of `buffers`.

  Args:
    buffers: the model's non-Param variables, a pytree whose `router_bias` leaves are stacked like the blocks,
      e.g. (L, E).
    aux: the aux of the same step; its "load" (L, E) matches the bias leaves.
    rate: the step u (`moe.bias_rate`).

  Returns:
    `buffers` with every `router_bias` leaf updated; other leaves unchanged (all of them without "load" in `aux`).

  References:
    Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", 2024, arXiv 2408.15664;
    DeepSeek-V3, arXiv 2412.19437, §2.1.2.
  """
  if not aux or "load" not in aux:
    return buffers
  load = aux["load"]

  def step(path, b):
    if getattr(path[-1], "key", None) != "router_bias":
      return b
    return b + rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load).reshape(b.shape).astype(b.dtype)

  return jax.tree_util.tree_map_with_path(step, buffers)


def summarize(aux: dict) -> dict:
  """Router metrics for logging from one step's stacked aux (layers first).

  Args:
    aux: the model's aux, stacked over layers; {} for a dense model.

  Returns:
    {"moe/...": value}: means over layers, and the load balance as max/min of the per-expert load (averaged over
    layers, times E) and its coefficient of variation; {} for a dense model.
  """
  if not aux:
    return {}
  load_LE = aux["load"].reshape(-1, aux["load"].shape[-1])
  mean_E = jnp.mean(load_LE, 0)
  return {"moe/lb_loss": jnp.mean(lb_loss(aux)), "moe/z_loss": jnp.mean(aux["z_loss"]),
          "moe/dropped": jnp.mean(aux["dropped"]), "moe/entropy": jnp.mean(aux["entropy"]),
          "moe/load_max": jnp.max(mean_E) * mean_E.shape[0], "moe/load_min": jnp.min(mean_E) * mean_E.shape[0],
          "moe/load_cv": jnp.mean(jnp.std(load_LE, -1) / jnp.mean(load_LE, -1)), "moe/load": mean_E}
