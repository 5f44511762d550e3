"""Transformer configuration, size presets, and analytic parameter / FLOP counts."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal


class ConfigError(ValueError):
  """A model configuration that cannot be built."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A token-choice top-k mixture of SwiGLU experts as every block's FFN (see models/moe.py).

  `num_experts=0` means no MoE (a dense FFN): TransformerConfig turns such a config into `moe=None`.
  """

  num_experts: int = 8
  top_k: int = 2
  d_expert: int | None = None  # each expert's SwiGLU hidden width; None: d_ff
  num_shared: int = 0  # always-on shared experts (DeepSeekMoE), fused into one SwiGLU of num_shared*d_expert
  d_shared: int | None = None  # the fused shared SwiGLU's width; None: num_shared*d_expert (Qwen2-MoE sets its own)
  shared_gate: bool = False  # scale the shared output by sigmoid(x·w), one gate per token (Qwen2-MoE)
  router: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid always renormalises the top-k weights
  normalize_top_k: bool = False  # softmax: renormalise the k selected probabilities to sum 1 (Mixtral)
  # None: dropless (sort + ragged_dot); else ceil(cf*tokens*k/E) slots per expert and batch shard, the rest dropped
  capacity_factor: float | None = None
  lb_weight: float = 1e-2  # Switch load-balancing loss weight in the train loss
  z_weight: float = 1e-3  # router z-loss weight (ST-MoE)
  bias_rate: float = 0.0  # aux-loss-free balancing step u (DeepSeek-V3: 1e-3); 0: no selection bias
  ragged_a2a: bool = False  # expert parallelism with ragged_all_to_all (GPU/TPU; XLA:CPU cannot run it)
  # PAD-Net (models/padnet.py): experts = λ_d·M⊙W_e + λ_s·(1−M)⊙W_static, one static matrix per stack, masks as buffers
  pad: bool = False

  def __post_init__(self):
    if self.num_experts < 0:
      raise ConfigError(f"moe.num_experts must be >= 0 (0 = dense), got {self.num_experts}")
    if self.num_experts and not 1 <= self.top_k <= self.num_experts:
      raise ConfigError(f"moe.top_k={self.top_k} must lie in [1, num_experts={self.num_experts}]")
    if self.router not in ("softmax", "sigmoid"):
      raise ConfigError(f"moe.router must be 'softmax' or 'sigmoid', got {self.router!r}")
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


FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
ATTENTION = ("auto", "xla", "flash", "cudnn", "ring", "allgather")  # models/attention.py


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only LM. `n_kv_heads < n_heads` gives grouped-query attention."""

  vocab_size: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int | None = None  # None: = n_heads
  head_dim: int | None = None  # None: d_model // n_heads
  d_ff: int = 768  # SwiGLU hidden width
  qk_norm: bool = False
  qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
  tie_embeddings: bool = True
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"  # "bfloat16" for bf16 matmuls (the loss stays fp32)
  remat: bool = False  # recompute each block in the backward pass
  microbatches: int | None = None  # pipeline microbatches when the mesh has stage > 1 (None: one per stage)
  attention: str = "auto"  # models/attention.py: auto, xla, flash, cudnn, ring, allgather (context parallelism)
  logit_stats: bool = False  # aux["max_logit"] (L, N): each head's largest attention logit per batch (MuonClip)
  moe: MoEConfig | None = None  # a mixture of experts instead of the dense SwiGLU in every block

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
