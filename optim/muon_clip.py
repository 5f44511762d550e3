"""MuonClip: Muon, then QK-clip (Kimi K2, arXiv 2507.20534 §2.1), against attention-logit blow-ups.

After the update, every attention head h whose largest logit S_h = max q·k/√d in this step's forward pass exceeded τ
has its query and key projections scaled down so the same inputs would give exactly τ:
  η_h = min(1, τ / S_h);   W_q^h ← η_h^α · W_q^h,   W_k^h ← η_h^(1−α) · W_k^h      (α = 0.5)
Heads at or below τ are untouched. Grouped-query attention (K kv heads shared by N/K query heads; Kimi K2's MLA has
per-head keys, and pytorch_optimizer's MuonClip assumes them): the shared key of group g is scaled by
s_g = min_{h∈g} η_h^(1−α), and each query head of the group by η_h / s_g, so every head's logits are multiplied by
exactly η_h: offending heads end at τ, the others keep their logits (their queries grow by 1/s_g to make up for
the shared key). RoPE is linear, so the logits scale as the weights do; q/k biases (Qwen2) are scaled with their
weights. A model with QK-norm is refused: the norm undoes any scale on W_q and W_k.

The per-head maxima come from the model (`TransformerConfig(logit_stats=True)`: aux["max_logit"], (L, N) stacked
like the blocks) and reach `update` as the extra argument `max_logits`; without it the step is plain Muon.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optim.hparams import Beta, Fraction, NonNegative, NonNegativeInt
from optim.muon import ShapeScale, muon
from optim.needs import Needs
from optim.registry import register
from optim.trees import leaf_name

QUERY, KEY = ("wq", "q_bias"), ("wk", "k_bias")
PyTree = Any


class QKClipError(ValueError):
  """A parameter tree or statistic QK-clip cannot use."""


def _role(path) -> str | None:
  name = leaf_name(path).lower()
  if name.startswith(("q_norm", "k_norm")):
    return "norm"
  for role, names in (("q", QUERY), ("k", KEY)):
    if any(name == n or name.startswith(n + "_") for n in names):
      return role
  return None


def head_scales(max_logits: jax.typing.ArrayLike, threshold: float | jax.Array, alpha: float | jax.Array,
                kv_heads: int, dtype: jax.typing.DTypeLike = jnp.float32) -> tuple[jax.Array, jax.Array]:
  """(s_q (..., N), s_k (..., K)): the query and key scales of the module docstring from max_logits (..., N).

  In `dtype` (at least float32; the parameters' dtype in `qk_clip`, so float64 parameters get float64 scales).

  Args:
    max_logits: S, each head's largest logit (..., N).
    threshold: τ.
    alpha: α, the query's share of the scale (the key's is 1 − α).
    kv_heads: K, the key/value heads; N / K query heads share each.
    dtype: the scales' dtype, promoted to at least float32 (default float32).

  Returns:
    (s_q, s_k): the query heads' scales (..., N) and the key heads' (..., K).

  References:
    Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025, arXiv 2507.20534, §2.1 (MuonClip / QK-clip).
  """
  S = jnp.asarray(max_logits, jnp.promote_types(jnp.float32, dtype))
  N = S.shape[-1]
  eta = jnp.where(S > threshold, threshold / jnp.where(S > 0, S, 1.0), 1.0)  # min(1, τ/S); S ≤ τ: 1
  eta_g = eta.reshape(S.shape[:-1] + (kv_heads, N // kv_heads))
  s_k = jnp.min(eta_g ** (1.0 - alpha), axis=-1)
  s_q = (eta_g / s_k[..., None]).reshape(S.shape)
  return s_q, s_k


def qk_clip(threshold: float = 100.0, alpha: float = 0.5) -> optax.GradientTransformationExtraArgs:
  """QK-clip as an update transformation, last in a chain.

  With `update(..., params, max_logits=(..., N))` it turns each query/key update u (leaves named wq*/q_bias*,
  wk*/k_bias*, stacked like `max_logits`) into s⊙(p+u) − p, so the new parameters are the clipped ones; every other
  leaf, and every step without max_logits, passes through.

  Args:
    threshold: τ, the largest logit a head keeps (default 100, Kimi K2's).
    alpha: α, the query's share of the scale (default 0.5, Kimi K2's).

  Returns:
    A stateless transformation with extra-argument support. Its update raises `QKClipError` when given
    `max_logits` without the params, on a model with QK-norm, without exactly one layer-stacked wq* and wk*, or with
    `max_logits` that do not fit the query projection.

  References:
    Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025, arXiv 2507.20534, §2.1 (MuonClip / QK-clip).
  """

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None, *, max_logits=None, **extra):
    del extra
    if max_logits is None:
      return updates, state
    if params is None:
      raise QKClipError("QK-clip needs the parameters: call update(updates, state, params, max_logits=...)")
    roles = jax.tree_util.tree_map_with_path(lambda p, _: _role(p), params)
    if "norm" in jax.tree.leaves(roles):
      raise QKClipError("QK-clip rescales W_q and W_k, which QK-norm undoes: this model has q_norm/k_norm")
    S = jnp.asarray(max_logits)
    N = S.shape[-1]
    flat = {r: [p for p, x in jax.tree_util.tree_leaves_with_path(params) if _role(p) == r] for r in "qk"}
    if not flat["q"] or not flat["k"]:
      raise QKClipError("QK-clip found no query/key projections (leaves named wq*, wk*)")
    stacks = {r: [x for p, x in jax.tree_util.tree_leaves_with_path(params) if leaf_name(p).lower().startswith(r)]
              for r in ("wq", "wk")}
    if len(stacks["wq"]) != 1 or len(stacks["wk"]) != 1:
      raise QKClipError(f"QK-clip expects one layer-stacked query and key projection (wq*, wk*), found "
                        f"{len(stacks['wq'])} and {len(stacks['wk'])}")
    wq, wk = stacks["wq"][0], stacks["wk"][0]
    if wq.shape[-1] % N or wq.shape[:-2] != S.shape[:-1]:
      raise QKClipError(f"max_logits {S.shape} does not fit the query projection {wq.shape}: expected "
                        f"{wq.shape[:-2]} + (heads,) with heads dividing {wq.shape[-1]}")
    H = wq.shape[-1] // N
    dt = jnp.promote_types(jnp.float32, wq.dtype)  # the clip's arithmetic: float32, or the parameters' if wider
    s_q, s_k = head_scales(S, threshold, alpha, wk.shape[-1] // H, dt)

    def clip(role, u, p):
      if role not in ("q", "k"):
        return u
      s = jnp.repeat(s_q if role == "q" else s_k, H, axis=-1)  # (..., heads·H), per column
      if p.ndim == S.ndim + 1:  # a weight (..., D, heads·H): one scale per column
        s = s[..., None, :]
      # s⊙(p+u) − p written as u + (s−1)⊙(p+u): a head with s = 1 keeps its update bit for bit
      return (u + (s - 1.0) * (p.astype(dt) + u.astype(dt))).astype(u.dtype)

    return jax.tree.map(clip, roles, updates, params, is_leaf=lambda r: r is None or isinstance(r, str)), state

  return optax.GradientTransformationExtraArgs(init, update)


@register("muonclip", needs=Needs(update_args=frozenset({"max_logits"}), model_refuses=(
    ("qk_norm", "clips W_q and W_k, which QK-norm undoes"),)))
def muonclip(learning_rate: optax.ScalarOrSchedule, *, clip_threshold: NonNegative = 100.0,
             clip_alpha: Fraction = 0.5, beta: Beta = 0.95, weight_decay: NonNegative = 0.1, nesterov: bool = True,
             ns_steps: NonNegativeInt = 5, eps: NonNegative = 1e-7, scale: ShapeScale = "moonlight",
             adam_b1: Beta = 0.9, adam_b2: Beta = 0.95,
             labels: PyTree | Callable[[PyTree], PyTree] | None = None,
             distributed: bool = False) -> optax.GradientTransformationExtraArgs:
  """Muon (`optim.muon`, Moonlight scale: Kimi K2's) followed by `qk_clip(clip_threshold τ, clip_alpha α)`.

  Kimi K2 uses τ = 100 and α = 0.5. The train CLI switches the model's `logit_stats` on and passes the step's
  max_logits, as its registry entry declares (`optim.needs.Needs`).

  Args:
    learning_rate: the learning rate or schedule (both of Muon's groups).
    clip_threshold: τ (default 100).
    clip_alpha: α (default 0.5).
    beta: Muon's momentum (default 0.95).
    weight_decay: decoupled weight decay (default 0.1).
    nesterov: Nesterov momentum (default True).
    ns_steps: Newton–Schulz iterations (static; default 5).
    eps: added to the Frobenius norm before Newton–Schulz (default 1e-7).
    scale: Muon's shape scale (default "moonlight").
    adam_b1: the AdamW group's β1 (default 0.9).
    adam_b2: the AdamW group's β2 (default 0.95).
    labels: "muon" / "adam" per leaf (a tree, a prefix, or a function of the params); None: `optim.muon_labels`.
    distributed: orthogonalize each matrix once across the mesh's devices (`optim.distributed`).

  Returns:
    `optax.chain(muon(...), qk_clip(clip_threshold, clip_alpha))`, taking `max_logits` as an extra argument.

  References:
    Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025, arXiv 2507.20534, §2.1 (MuonClip / QK-clip).
  """
  base = muon(learning_rate, beta=beta, weight_decay=weight_decay, nesterov=nesterov, ns_steps=ns_steps, eps=eps,
              scale=scale, adam_b1=adam_b1, adam_b2=adam_b2, labels=labels, distributed=distributed)
  return optax.chain(base, qk_clip(clip_threshold, clip_alpha))
