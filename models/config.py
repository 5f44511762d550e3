"""Transformer configuration, size presets, and analytic parameter / FLOP counts.

Each field is a `models.schema.setting`: its help, its kind (what the model is, how it is computed, how it is laid
out) and its choices are declared here once, and the command lines and resume checks are derived from them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from models.schema import COMPUTE, LAYOUT, setting

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
COMPUTE_DTYPES = ("float32", "bfloat16")  # the matmul dtypes a training run offers (the loss stays float32)
ATTENTION = ("auto", "xla", "flash", "cudnn", "ring", "allgather")  # models/attention.py
ROUTERS = ("softmax", "sigmoid")  # models/moe.py


class ConfigError(ValueError):
  """A model configuration that cannot be built."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A token-choice top-k mixture of SwiGLU experts as every block's FFN (see models/moe.py).

  `num_experts=0` means no MoE (a dense FFN): TransformerConfig turns such a config into `moe=None`.
  """

  num_experts: int = setting(8, "Routed experts per block (0: a dense FFN).")
  top_k: int = setting(2, "Experts each token is sent to.", kind=COMPUTE)
  d_expert: int | None = setting(None, "Each expert's SwiGLU hidden width (unset: --d-ff).")
  num_shared: int = setting(0, "Always-on shared experts (DeepSeekMoE), fused into one SwiGLU.")
  d_shared: int | None = setting(None, "The fused shared SwiGLU's width (unset: num_shared x d_expert; Qwen2-MoE "
                                       "sets its own).")
  shared_gate: bool = setting(False, "Scale the shared output by a per-token sigmoid gate (Qwen2-MoE).")
  router: str = setting("softmax", "Router scores: softmax, or sigmoid (always renormalised over the top-k).",
                        kind=COMPUTE, choices=ROUTERS)
  normalize_top_k: bool = setting(False, "Softmax router: renormalise the k selected probabilities to sum 1 "
                                         "(Mixtral).", kind=COMPUTE)
  capacity_factor: float | None = setting(None, "Slots per expert = ceil(cf x tokens x k / E) per batch shard, the "
                                                "rest dropped (unset: dropless, sort + ragged_dot).", kind=COMPUTE)
  lb_weight: float = setting(1e-2, "Load-balancing loss weight (Switch).", kind=COMPUTE)
  z_weight: float = setting(1e-3, "Router z-loss weight (ST-MoE).", kind=COMPUTE)
  # a positive rate keeps a selection bias in the state
  bias_rate: float = setting(0.0, "Aux-loss-free balancing step (DeepSeek-V3: 1e-3; 0: none).", kind=COMPUTE,
                             state=lambda rate: rate > 0)
  ragged_a2a: bool = setting(False, "Expert parallelism with ragged_all_to_all (GPU/TPU only).", kind=LAYOUT)
  # PAD-Net (models/padnet.py): experts = λ_d·M⊙W_e + λ_s·(1−M)⊙W_static, one static matrix per stack, masks as buffers
  pad: bool = setting(False, "PAD-Net form: experts mixed with one static matrix per stack by masks and two scales "
                             "(models/padnet.py), all dynamic until --moe.pad-ratio partitions them.")

  def __post_init__(self):
    if self.num_experts < 0:
      raise ConfigError(f"moe.num_experts must be >= 0 (0 = dense), got {self.num_experts}")
    if self.num_experts and not 1 <= self.top_k <= self.num_experts:
      raise ConfigError(f"moe.top_k={self.top_k} must lie in [1, num_experts={self.num_experts}]")
    if self.router not in ROUTERS:
      raise ConfigError(f"moe.router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
    if self.capacity_factor is not None and self.capacity_factor <= 0:
      raise ConfigError(f"moe.capacity_factor must be positive (or None for dropless), got {self.capacity_factor}")
    for f in ("d_expert", "d_shared"):
      if getattr(self, f) is not None and getattr(self, f) <= 0:
        raise ConfigError(f"moe.{f} must be positive, got {getattr(self, f)}")
    if (self.d_shared or self.shared_gate) and not self.num_shared:
      raise ConfigError("moe.d_shared and moe.shared_gate need a shared expert (moe.num_shared >= 1)")
    for f in ("num_shared", "lb_weight", "z_weight", "bias_rate"):
      if getattr(self, f) < 0:
        raise ConfigError(f"moe.{f} must be >= 0, got {getattr(self, f)}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only LM. `n_kv_heads < n_heads` gives grouped-query attention."""

  NESTED: ClassVar[dict] = {"moe": MoEConfig}  # the nested configs models/schema.py reads by their own schema

  vocab_size: int = 256
  d_model: int = setting(256, "Model width (residual stream).")
  n_layers: int = setting(4, "Transformer blocks.")
  n_heads: int = setting(4, "Query heads.")
  n_kv_heads: int | None = setting(None, "Key/value heads; fewer than query heads = grouped-query attention.")
  head_dim: int | None = None  # None: d_model // n_heads
  d_ff: int = setting(768, "SwiGLU hidden width.")
  qk_norm: bool = setting(False, "RMSNorm on queries and keys (Qwen3).")
  qkv_bias: bool = setting(False, "Biases on the q, k, v projections (Qwen2).")
  tie_embeddings: bool = setting(True, "Share the input embedding and the output head.")
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  param_dtype: str = setting("float32", choices=FLOAT_DTYPES)
  compute_dtype: str = setting("float32", "Matmul dtype (the loss stays float32).", kind=COMPUTE,
                               choices=COMPUTE_DTYPES)
  remat: bool = setting(False, "Recompute each block in the backward pass (less memory, ~1/3 more compute).",
                        kind=LAYOUT)
  microbatches: int | None = setting(None, "Pipeline microbatches when the mesh has stage > 1 (unset: one per "
                                           "stage); the GPipe bubble is (S-1)/(M+S-1).", kind=LAYOUT)
  attention: str = setting("auto", "Attention implementation (models/attention.py); with a `context` mesh axis, "
                                   "ring or allgather. auto: ring on a context mesh, cudnn on NVIDIA in "
                                   "bfloat16/float16, flash past one 512-tile, else xla.", kind=COMPUTE,
                           choices=ATTENTION)
  logit_stats: bool = setting(False, "Log each step's largest attention logit (attn/max_logit, "
                                     "attn/max_logit_layer); on for an optimizer that declares the update argument "
                                     "max_logits.", kind=COMPUTE)
  moe: MoEConfig | None = None  # a mixture of experts instead of the dense SwiGLU in every block (--moe.*)

  def __post_init__(self):
    if isinstance(self.moe, dict):  # from a saved config.json
      object.__setattr__(self, "moe", MoEConfig(**self.moe))
    if self.moe is not None and self.moe.num_experts == 0:
      object.__setattr__(self, "moe", None)
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
      if getattr(self, f) <= 0:
        raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")
    for f in ("n_kv_heads", "head_dim"):
      if getattr(self, f) is not None and getattr(self, f) <= 0:
        raise ConfigError(f"{f} must be positive (or None), got {getattr(self, f)}")
    kv, hd = self.kv_heads, self.hd
    if self.n_heads % kv:
      raise ConfigError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim")
    if hd % 2:
      raise ConfigError(f"head_dim={hd} must be even for RoPE")
    if not (math.isfinite(self.norm_eps) and self.norm_eps > 0 and math.isfinite(self.rope_theta) and
            self.rope_theta > 0):
      raise ConfigError(f"norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) must be positive and finite")
    for f in ("param_dtype", "compute_dtype"):
      if getattr(self, f) not in FLOAT_DTYPES:
        raise ConfigError(f"{f} must be one of {', '.join(FLOAT_DTYPES)}, got {getattr(self, f)!r}")
    if self.attention not in ATTENTION:
      raise ConfigError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
    if self.microbatches is not None and self.microbatches <= 0:
      raise ConfigError(f"microbatches must be positive (or None: one per pipeline stage), got {self.microbatches}")

  @property
  def kv_heads(self) -> int:
    """The number of key/value heads: `n_kv_heads`, or `n_heads` when None."""
    return self.n_kv_heads or self.n_heads

  @property
  def hd(self) -> int:
    """The head dimension: `head_dim`, or `d_model // n_heads` when None."""
    return self.head_dim or self.d_model // self.n_heads


PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, qk_norm=True),
    "small": TransformerConfig(d_model=256, n_layers=4, n_heads=4, d_ff=768),
    # GPT-2 small's shape (768 wide, 12 layers, 12 heads); SwiGLU 2048 matches its 4*768 MLP in params.
    "base": TransformerConfig(d_model=768, n_layers=12, n_heads=12, d_ff=2048),
    # tiny with 8 SwiGLU experts of width 32, top-2: active FFN width 64, total 256
    "moe_tiny": TransformerConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, qk_norm=True,
                                  moe=MoEConfig(num_experts=8, top_k=2, d_expert=32)),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
  """A size preset of `PRESETS`, with some fields replaced.

  Args:
    name: a key of `PRESETS` ("tiny", "small", "base", "moe_tiny").
    **overrides: `TransformerConfig` fields to replace.

  Returns:
    The preset's config with `overrides` applied (checked again by `TransformerConfig`).

  Raises:
    ConfigError: when `name` is not a preset.
  """
  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)


def _ffn_params(c: TransformerConfig, active: bool = False) -> int:
  """SwiGLU weights of one block's FFN.

  For MoE: the router, all E experts (or, `active`, the k a token uses) and the shared experts.
  """
  if c.moe is None:
    return 3 * c.d_model * c.d_ff
  m = c.moe
  F = m.d_expert or c.d_ff
  shared = 3 * c.d_model * (m.d_shared or m.num_shared * F) + (c.d_model if m.shared_gate else 0)
  pad = 3 * c.d_model * F + 1 if m.pad and not active else 0  # PAD-Net's static matrices and φ (mixed per step)
  return c.d_model * m.num_experts + 3 * c.d_model * F * (m.top_k if active else m.num_experts) + shared + pad


def _vector_params(c: TransformerConfig) -> int:
  """One block's norm scales and biases (no matmul FLOPs)."""
  return 2 * c.d_model + (2 * c.hd if c.qk_norm else 0) + (c.hd * (c.n_heads + 2 * c.kv_heads) if c.qkv_bias else 0)


def _block_params(c: TransformerConfig, active: bool = False) -> int:
  attn = c.d_model * c.hd * (2 * c.n_heads + 2 * c.kv_heads)  # wq, wo, wk, wv
  return attn + _ffn_params(c, active) + _vector_params(c)


def count_params(c: TransformerConfig) -> int:
  """Total trainable parameters (the tied table counted once).

  Args:
    c: the model configuration.

  Returns:
    The parameter count, every expert included (PAD-Net's static matrices and φ too).
  """
  embed = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
  return embed + c.n_layers * _block_params(c) + c.d_model


def flops_per_token(c: TransformerConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 x (matmul parameters) + attention scores and values.

  Matmul parameters are the block weights plus the output head (d_model x vocab, tied or not);
  the embedding lookup costs nothing; an MoE block counts its router, its k routed and its shared
  experts. Attention adds 12·L·n_heads·head_dim·T (PaLM, App. B: forward QK^T and AV at 2·2·T·d_attn
  each, times 3 for the backward; no causal halving).

  Args:
    c: the model configuration.
    seq_len: T, the training sequence length.

  Returns:
    FLOPs per token of one training step (forward and backward).

  References:
    Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022, Appendix B.
  """
  matmul = c.n_layers * (_block_params(c, active=True) - _vector_params(c))
  matmul += c.d_model * c.vocab_size
  return 6.0 * matmul + 12.0 * c.n_layers * c.n_heads * c.hd * seq_len
