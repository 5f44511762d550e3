"""Parameter-efficient fine-tuning: low-rank adapters and weight conditioning on the transformer's stacked weights.

`apply(model, method, ...)` replaces each target weight W0 (a `Param` of shape (..., fan_in, fan_out): leading axes
are the layer stack and, for MoE experts, the expert axis) by an adapter module whose `[...]` is the effective weight
and whose `matmul(x, dt)` is the product by it in factorized form (below), so the model's own forward (`matmul(x, w,
dt)`, or `w[...]` for MoE experts) runs unchanged, under `lax.scan` over layers and on any mesh. Every other
parameter becomes `Frozen` (not an `nnx.Param`): `nnx.state(model, nnx.Param)` is the adapters alone, so a train step
that differentiates Params keeps no gradient and no optimizer state for the base. `merge(model)` folds the adapters
back into plain `Param`s.

Methods, in this file's (fan_in, fan_out) layout (a Hugging Face / PEFT weight is the transpose, (out, in)); A is
(fan_in, r), B is (r, fan_out), s = alpha / r, every adapter is the identity at initialisation:
  lora            W = W0 + s·A B                                  A ~ U(±1/√fan_in) (PEFT's kaiming-uniform, a=√5),
                                                                  B = 0
  dora            W = (W0 + s·A B) · diag(m / ‖W0 + s·A B‖_col)   m (fan_out,) = ‖W0‖_col at init; the column norm
                                                                  (PEFT's per-output-row norm) is treated as a
                                                                  constant in the backward pass, as PEFT and the
                                                                  DoRA paper (§4.3) do
  prediag         W = W0 · diag(d) + s·A B                        d (fan_out,) = 1 (Pre-Diag, "calibrating": the
                                                                  diagonal before the update; shared/reference §7)
  sora            W = W' (I + S),  W' = prediag's,                C, D (fan_out, r_p): C ~ U(±1/√fan_out), D = C, so
                  S = s_p (C Dᵀ − D Cᵀ) (skew-symmetric),          S = 0 at init; y(I + S) is the reference forward
                  s_p = min(s0 / (‖C‖_F + ‖D‖_F + 1e-6), 1)       (`SoraLinear`), computed as W' + s_p((W'C)Dᵀ −
                                                                  (W'D)Cᵀ); the merge uses the same formula (the
                                                                  reference's merge omits the identity, §7's caveat)
  sparse_adapter  W = W0 + s·(A ⊙ M_A)(B ⊙ M_B)                    a LoRA of rank r/(1 − sparsity) ("Large-Sparse":
                                                                  the same surviving budget as rank r), pruned at
                                                                  init by SNIP (`snip_prune`, SparseAdapter's best
                                                                  criterion): keep the weights of largest |θ·∂L/∂θ|
                                                                  over all adapters; masks are `Mask`s, not trained
Only the projections' weights are adapted; a target with a bias (Qwen2's q/k/v) keeps its bias as it is, which is
PEFT's LoRA and DoRA. The reference Pre-Diag/SORA scale and rotate the bias with the output, so `prediag` and `sora`
refuse a biased target (`PEFTError`) rather than compute something else.

Factorized products. A dense projection calls `matmul(x, w, dt)` (models/transformer.py; MoE shared experts likewise),
which an adapter answers with `matmul(x, dt)` in factorized form: y = x W is computed without forming W, so neither W
nor dL/dW (I, O) exists in a train step (the gradient reaches A, B through the rank-r products). For a row x (I,):
  lora, sparse_adapter  y = x W0 + s·(x A') B'                   A' = A ⊙ M_A, B' = B ⊙ M_B (M = 1 for lora)
  dora                  y = (x W0 + s·(x A) B) ⊙ m / n,          n² = ‖W0‖²_col + 2s·diag((W0ᵀA) B) + s²·diag(Bᵀ(AᵀA) B)
                        (colsum(W0 ⊙ AB) = diag((W0ᵀA)B), ‖AB‖²_col = diag(Bᵀ(AᵀA)B); n is a constant of the backward,
                        as in the merged form. ‖W0‖_col is recomputed each step, not cached: I·O flops, 1/N of x W0's,
                        and no cache to go stale when w0 is cast (`base_dtype`) or set again)
  prediag               y' = (x W0) ⊙ d + s·(x A) B
  sora                  y = y' + s_p·((y' C) Dᵀ − (y' D) Cᵀ) = y'(I + S)
FLOPs (a multiply-add is 2) of one projection in a train step of N rows: forward, the input's gradient and the
adapters' gradients (the frozen W0 gets none); per row, then per step (independent of N):
  full fine-tuning      6IO                                       (x W, G Wᵀ, dL/dW = Xᵀ G)
  merged adapters       6IO;  + 6IOr per step                     (the same three, and W = W0 + sAB, dA = s dW Bᵀ,
                                                                  dB = s Aᵀ dW: two (I, O) arrays per matrix)
  lora, sparse_adapter  4IO + 6r(I + O)                           (x W0, G W0ᵀ; xA, (xA)B, GBᵀ, (GBᵀ)Aᵀ, Xᵀ(GBᵀ),
                                                                  (XA)ᵀG)
  dora                  4IO + 6r(I + O);  + 2IO(r + 1) + 2r²(I + O) per step   (the norm n: W0ᵀA, an (R, O) result,
                                                                  ‖W0‖²_col, AᵀA, (AᵀA)B; no backward)
  prediag               4IO + 6r(I + O)
  sora                  4IO + 6r(I + O) + 24·O·r_p;  + 4O·r_p per step (s_p)
each plus a few O of elementwise work per row. Against the merged form a row saves 2IO − 6r(I + O) (a third of the
dense products' flops when r ≪ I, O) and a step 6IOr more. `weight()` (`[...]`) still forms W: `merge`, the PEFT
export and the tests read it, and so do the MoE experts, whose dispatch (sharding/experts.py) takes whole expert
stacks: adapters on routed experts run merged (their W formed, dL/dW projected), as before.
Shapes: ... leading axes (layers, experts), N rows of x (any leading shape), I fan_in, O fan_out, R rank, P r_p.

References:
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, arXiv 2106.09685.
  Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", ICML 2024, arXiv 2402.09353 (code NVlabs/DoRA).
  Chang, Xue, Li, Liu, Xu, Zhang, "Calibrating and Rotating: A Unified Framework for Weight Conditioning in PEFT",
  AAAI 2026, arXiv 2511.00051 (Pre-Diag and SORA; code MaeChd/SORA, `SoraLinear`).
  He, Ding, Dong, Zhang, Tao, "SparseAdapter: An Easy Approach for Improving the Parameter-Efficiency of Adapters",
  Findings of EMNLP 2022, arXiv 2210.04284 (code Shwai-He/SparseAdapter).
  Lee, Ajanthan, Torr, "SNIP: Single-shot Network Pruning based on Connection Sensitivity", ICLR 2019,
  arXiv 1810.02340.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharding.state import variable_names as _names

# the attention projections and the (dense, expert, shared-expert) MLP projections; never the router or embeddings
DEFAULT_TARGETS = r"blocks/(wq_DQ|wk_DK|wv_DK|wo_QD|w_gate_DF|w_up_DF|w_down_FD|moe/(w_gate_EDF|w_up_EDF|w_down_EFD|" \
                  r"shared_gate_DS|shared_up_DS|shared_down_SD))$"
ADAPTER_AXIS = "adapter"  # the logical name of a rank axis (sharding/rules.py: never sharded)
BIASES = {"wq_DQ": "q_bias_Q", "wk_DK": "k_bias_K", "wv_DK": "v_bias_K"}


class PEFTError(ValueError):
  """A PEFT setting that cannot be applied; the message names it."""


class Frozen(nnx.Variable):
  """A base parameter that does not train: no gradient, no optimizer state (it is not an `nnx.Param`)."""


class Mask(nnx.Variable):
  """A fixed 0/1 mask of a sparse adapter's factor."""


def _var(cls, value, names):
  """A variable of `cls` carrying logical axis `names` (sharded by whoever places it, as models/transformer.py does)."""
  return cls(value, out_sharding=tuple(names), eager_sharding=False)


def _uniform(key, shape, bound, dtype):
  return jax.random.uniform(key, shape, dtype, -bound, bound)


ADAPTERS: dict[str, type[Adapter]] = {}  # method -> its class, in registration order (`register`)


def register(method: str) -> Callable[[type[Adapter]], type[Adapter]]:
  """A class decorator: makes an `Adapter` subclass the PEFT method `method` (`apply(model, method)`, `--peft`).

  What the method needs is declared on the class (`Adapter`'s class attributes), never tested by name elsewhere.

  Args:
    method: the method's name.

  Returns:
    The decorator, which registers the class and returns it.
  """
  def add(cls: type[Adapter]) -> type[Adapter]:
    cls.METHOD = method
    ADAPTERS[method] = cls
    return cls
  return add


class Adapter(nnx.Module):
  """A frozen weight `w0` (..., I, O) and a low-rank update s·A B; `[...]` reads the effective weight.

  A ~ U(±1/√fan_in) (PEFT's kaiming-uniform, a=√5), B = 0: the identity at initialisation.

  A method declares what it needs on its class: `OPTIONS` (its own `apply` options: {name: (default, what it sets)}),
  `BIAS` (False: it cannot adapt a projection with a bias), `HF` (PEFT's adapter_config fields when PEFT's adapter
  format holds it, else None: export merged weights), `CALIBRATES` (it needs one batch before the first step,
  `calibrate`), and overrides `check`, `width`, `calibrate` and `hf_tensors` where it differs.

  Args:
    w0: the weight it adapts (..., I, O), kept as a `Frozen` variable; A and B inherit its logical axis names, the
      rank axis named `ADAPTER_AXIS`.
    rank: r.
    alpha: α; the update's scale is s = α / r.
    key: A's PRNG key.
    dtype: A's and B's dtype.
  """

  METHOD: ClassVar[str] = ""  # set by `register`
  OPTIONS: ClassVar[dict[str, tuple[Any, str]]] = {}
  BIAS: ClassVar[bool] = True
  HF: ClassVar[dict | None] = None
  CALIBRATES: ClassVar[bool] = False

  @classmethod
  def check(cls, rank: int, **options: Any) -> None:
    """Refuses settings the method cannot use.

    Args:
      rank: r.
      **options: its `OPTIONS`, resolved.

    Raises:
      PEFTError: naming the setting.
    """
    if rank < 1:
      raise PEFTError(f"rank must be >= 1, got rank={rank}")

  @classmethod
  def width(cls, rank: int, **options: Any) -> int:
    """The adapter's rank for the budget `rank` (the budget itself, but for a method that prunes).

    Args:
      rank: r.
      **options: its `OPTIONS`, resolved.

    Returns:
      The factors' inner dimension.
    """
    return rank

  @classmethod
  def calibrate(cls, model: nnx.Module, loss_fn: Callable[[nnx.Module], jax.Array], *, seed: int = 0,
                **options: Any) -> nnx.Module:
    """What a `CALIBRATES` method does on one batch before the first step (nothing for the others).

    Args:
      model: the adapted model (changed in place).
      loss_fn: the model's loss on one batch.
      seed: the calibration's seed.
      **options: its `OPTIONS`, resolved.

    Returns:
      The model.
    """
    return model

  def hf_tensors(self, layer: int) -> dict[str, np.ndarray]:
    """Tensors beyond A and B that PEFT's adapter format keeps for one layer ({suffix: array}); none by default.

    Args:
      layer: the layer index.

    Returns:
      {name suffix after the module's name: array}.
    """
    return {}

  def __init__(self, w0: nnx.Variable, rank: int, alpha: float, key: jax.Array, dtype: jax.typing.DTypeLike):
    *lead, fan_in, fan_out = w0.shape
    names = _names(w0)
    self.w0 = _var(Frozen, w0.get_value(), names)
    self.scale = alpha / rank
    self.a_IR = _var(nnx.Param, _uniform(key, (*lead, fan_in, rank), 1 / math.sqrt(fan_in), dtype),
                     (*names[:-1], ADAPTER_AXIS))
    self.b_RO = _var(nnx.Param, jnp.zeros((*lead, rank, fan_out), dtype), (*names[:-2], ADAPTER_AXIS, names[-1]))

  @property
  def names(self) -> tuple:
    """The logical axis names of the adapted weight (those of w0)."""
    return _names(self.w0)

  def factors(self) -> tuple[jax.Array, jax.Array]:
    """The factors as the products use them.

    Returns:
      (A (..., I, R), B (..., R, O)).
    """
    return self.a_IR[...], self.b_RO[...]

  def delta(self) -> jax.Array:
    """The update s·A B, formed.

    Returns:
      (..., I, O).
    """
    a, b = self.factors()
    return self.scale * jnp.einsum("...ir,...ro->...io", a, b)

  def base(self) -> jax.Array:
    """The frozen weight W0 in the adapters' dtype.

    Returns:
      (..., I, O).
    """
    return self.w0[...].astype(self.a_IR.dtype)

  def weight(self) -> jax.Array:
    """The effective weight W0 + s·A B, formed (what `[...]` reads, and `merge` keeps).

    Returns:
      (..., I, O).
    """
    return self.base() + self.delta()

  def __getitem__(self, index):
    return self.weight()[index]

  def matmul(self, x_NI: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """X @ weight() in compute dtype `dt`, factorized: x W0 + s·(x A) B.

    Args:
      x_NI: the input rows (N, I); with leading axes, x_NI has them too.
      dt: the compute dtype.

    Returns:
      (N, O) in `dt`.
    """
    return self.base_matmul(x_NI, dt) + self.low_rank(x_NI, dt)

  def base_matmul(self, x_NI: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """X W0, the frozen weight read as `base()` does (adapter dtype), then in `dt`.

    Args:
      x_NI: the input rows (N, I).
      dt: the compute dtype.

    Returns:
      (N, O) in `dt`.
    """
    return x_NI @ self.base().astype(dt)

  def low_rank(self, x_NI: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """s·(x A) B: two rank-R products, never A B.

    Args:
      x_NI: the input rows (N, I).
      dt: the compute dtype.

    Returns:
      (N, O) in `dt`.
    """
    a_IR, b_RO = self.factors()
    return self.scale * ((x_NI @ a_IR.astype(dt)) @ b_RO.astype(dt))


@register("lora")
class LoRA(Adapter):
  """LoRA: W = W0 + s·A B (the `Adapter` itself), its product x W0 + s·(x A) B.

  References:
    Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, arXiv 2106.09685.
  """

  HF = {"use_dora": False}


@register("dora")
class DoRA(Adapter):
  """DoRA: W = (W0 + s·A B) · diag(m / ‖W0 + s·A B‖_col), m (..., O) = ‖W0‖_col at init.

  The column norm (PEFT's per-output-row norm) is a constant of the backward pass, as PEFT and the DoRA paper (§4.3)
  treat it.

  Args:
    w0: the weight it adapts (..., I, O).
    rank: r.
    alpha: α (s = α / r).
    key: A's PRNG key.
    dtype: the adapter's dtype.

  References:
    Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", ICML 2024, arXiv 2402.09353, §4.3 (code NVlabs/DoRA;
    PEFT's `tuners/lora/dora.py`).
  """

  HF = {"use_dora": True}

  def __init__(self, w0: nnx.Variable, rank: int, alpha: float, key: jax.Array, dtype: jax.typing.DTypeLike):
    super().__init__(w0, rank, alpha, key, dtype)
    names = self.names
    self.m_O = _var(nnx.Param, jnp.linalg.norm(self.base(), axis=-2), (*names[:-2], names[-1]))

  def hf_tensors(self, layer: int) -> dict[str, np.ndarray]:
    """PEFT's `lora_magnitude_vector` of one layer.

    Args:
      layer: the layer index.

    Returns:
      {"lora_magnitude_vector": m (O,)}.
    """
    return {"lora_magnitude_vector": np.asarray(jax.device_get(self.m_O[...]), np.float32)[layer]}

  def weight(self) -> jax.Array:
    """The effective weight (W0 + s·A B) · diag(m / ‖W0 + s·A B‖_col), the norm a constant of the backward.

    Returns:
      (..., I, O).
    """
    v = self.base() + self.delta()
    norm = jax.lax.stop_gradient(jnp.linalg.norm(v, axis=-2, keepdims=True))
    return v * (self.m_O[...][..., None, :] / norm)

  def column_norm(self) -> jax.Array:
    """‖W0 + s·A B‖_col without forming A B, a constant of the backward.

    n² = ‖W0‖²_col + 2s·diag((W0ᵀA) B) + s²·diag(Bᵀ(AᵀA) B).

    Returns:
      n (..., O), ≥ 0.
    """
    w0_IO = self.base()
    a_IR, b_RO = (jax.lax.stop_gradient(f) for f in self.factors())
    cross_O = jnp.sum(jnp.einsum("...io,...ir->...ro", w0_IO, a_IR) * b_RO, axis=-2)  # (W0ᵀA)ᵀ: (R, O), not AB
    gram_RR = jnp.einsum("...ir,...is->...rs", a_IR, a_IR)
    square_O = jnp.sum((gram_RR @ b_RO) * b_RO, axis=-2)
    n2_O = jnp.sum(jnp.square(w0_IO), axis=-2) + 2 * self.scale * cross_O + self.scale ** 2 * square_O
    return jax.lax.stop_gradient(jnp.sqrt(jnp.maximum(n2_O, 0.0)))  # ≥ 0 up to rounding

  def matmul(self, x_NI: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """(x W0 + s·(x A) B) ⊙ m / n, n the `column_norm`.

    Args:
      x_NI: the input rows (N, I).
      dt: the compute dtype.

    Returns:
      (N, O) in `dt`.
    """
    return super().matmul(x_NI, dt) * (self.m_O[...] / self.column_norm())[..., None, :].astype(dt)


@register("prediag")
class PreDiag(Adapter):
  """Pre-Diag ("calibrating"): W = W0 · diag(d) + s·A B, d (..., O) = 1 at init: the diagonal before the update.

  Args:
    w0: the weight it adapts (..., I, O).
    rank: r.
    alpha: α (s = α / r).
    key: A's PRNG key.
    dtype: the adapter's dtype.

  References:
    Chang et al., "Calibrating and Rotating: A Unified Framework for Weight Conditioning in PEFT", AAAI 2026,
    arXiv 2511.00051 (code MaeChd/SORA; shared/reference/methods.md §7).
  """

  BIAS = False  # the reference scales (and SORA rotates) the bias with the output: not supported

  def __init__(self, w0: nnx.Variable, rank: int, alpha: float, key: jax.Array, dtype: jax.typing.DTypeLike):
    super().__init__(w0, rank, alpha, key, dtype)
    names = self.names
    self.d_O = _var(nnx.Param, jnp.ones(w0.shape[:-2] + w0.shape[-1:], dtype), (*names[:-2], names[-1]))

  def weight(self) -> jax.Array:
    """The effective weight W0 · diag(d) + s·A B.

    Returns:
      (..., I, O).
    """
    return self.base() * self.d_O[...][..., None, :] + self.delta()

  def matmul(self, x_NI: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """(x W0) ⊙ d + s·(x A) B.

    Args:
      x_NI: the input rows (N, I).
      dt: the compute dtype.

    Returns:
      (N, O) in `dt`.
    """
    return self.base_matmul(x_NI, dt) * self.d_O[...][..., None, :].astype(dt) + self.low_rank(x_NI, dt)


@register("sora")
class SORA(PreDiag):
  """SORA: W = W'(I + S), W' Pre-Diag's, S = s_p (C Dᵀ − D Cᵀ) skew-symmetric (an output-side rotation).

  s_p = min(s0 / (‖C‖_F + ‖D‖_F + 1e-6), 1); C, D (..., O, r_p): C ~ U(±1/√fan_out), D = C, so S = 0 at init.
  y(I + S) is the reference forward (`SoraLinear`); the merge uses the same formula (the reference's merge omits the
  identity, shared/reference/methods.md §7's caveat).

  Args:
    w0: the weight it adapts (..., I, O).
    rank: r.
    alpha: α (s = α / r).
    key: split into A's and C's PRNG keys (D = C).
    dtype: the adapter's dtype.
    r_p: the rotation's rank (default 4).
    s0: the reference's initial_s_p (default 1.0).

  References:
    Chang et al., "Calibrating and Rotating: A Unified Framework for Weight Conditioning in PEFT", AAAI 2026,
    arXiv 2511.00051 (code MaeChd/SORA, `peft/tuners/sora/layer.py`).
  """

  OPTIONS = {"r_p": (4, "the rank of the output rotation's factors C, D."),
             "s0": (1.0, "the bound s0 of the rotation scale s_p = min(s0 / (|C|_F + |D|_F), 1).")}

  @classmethod
  def check(cls, rank: int, **options: Any) -> None:
    """Refuses a rank or rotation rank r_p below 1.

    Args:
      rank: r.
      **options: r_p, s0.

    Raises:
      PEFTError: naming the setting.
    """
    super().check(rank)
    if options["r_p"] < 1:
      raise PEFTError(f"r_p must be >= 1, got r_p={options['r_p']}")

  def __init__(self, w0: nnx.Variable, rank: int, alpha: float, key: jax.Array, dtype: jax.typing.DTypeLike,
               r_p: int = 4, s0: float = 1.0):
    k1, k2 = jax.random.split(key)
    super().__init__(w0, rank, alpha, k1, dtype)
    names, fan_out = self.names, w0.shape[-1]
    c = _uniform(k2, w0.shape[:-2] + (fan_out, r_p), 1 / math.sqrt(fan_out), dtype)
    self.s0 = s0
    self.c_OP = _var(nnx.Param, c, (*names[:-2], names[-1], ADAPTER_AXIS))
    self.d_OP = _var(nnx.Param, jnp.copy(c), (*names[:-2], names[-1], ADAPTER_AXIS))  # equal, not the same buffer

  def s_p(self) -> jax.Array:
    """The rotation's scale per matrix, min(s0 / (‖C‖_F + ‖D‖_F + 1e-6), 1).

    Returns:
      (...,).
    """
    fro = lambda x: jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1)))
    return jnp.minimum(self.s0 / (fro(self.c_OP[...]) + fro(self.d_OP[...]) + 1e-6), 1.0)

  def weight(self) -> jax.Array:
    """The effective weight W'(I + S) = W' + s_p((W'C)Dᵀ − (W'D)Cᵀ).

    Returns:
      (..., I, O).
    """
    w = super().weight()
    c, d = self.c_OP[...], self.d_OP[...]
    ws = jnp.einsum("...io,...op,...qp->...iq", w, c, d) - jnp.einsum("...io,...op,...qp->...iq", w, d, c)
    return w + self.s_p()[..., None, None] * ws

  def matmul(self, x_NI: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """Y' + s_p·((y' C) Dᵀ − (y' D) Cᵀ) = y'(I + S), y' Pre-Diag's x W'.

    The two terms are formed apart (not as (y'[C D]) [D −C]ᵀ, the same flops) so that they cancel exactly while
    C = D: the identity at init is exact.

    Args:
      x_NI: the input rows (N, I).
      dt: the compute dtype.

    Returns:
      (N, O) in `dt`.
    """
    y_NO = super().matmul(x_NI, dt)
    c_OP, d_OP = self.c_OP[...].astype(dt), self.d_OP[...].astype(dt)
    t = lambda m: jnp.swapaxes(m, -1, -2)
    rotated_NO = (y_NO @ c_OP) @ t(d_OP) - (y_NO @ d_OP) @ t(c_OP)
    return y_NO + self.s_p()[..., None, None].astype(dt) * rotated_NO


@register("sparse_adapter")
class SparseAdapter(Adapter):
  """A LoRA whose factors are masked: W = W0 + s·(A ⊙ M_A)(B ⊙ M_B), the masks `Mask`s (all ones until `snip_prune`).

  `apply` gives it rank r/(1 − sparsity) ("Large-Sparse": the same surviving budget as rank r).

  Args:
    w0: the weight it adapts (..., I, O).
    rank: its rank before pruning.
    alpha: α (s = α / rank).
    key: A's PRNG key.
    dtype: the adapter's dtype (and the masks').

  References:
    He, Ding, Dong, Zhang, Tao, "SparseAdapter: An Easy Approach for Improving the Parameter-Efficiency of Adapters",
    Findings of EMNLP 2022, arXiv 2210.04284 (code Shwai-He/SparseAdapter).
  """

  OPTIONS = {"sparsity": (0.5, "the share of the wide adapter pruned at initialisation (SNIP).")}
  CALIBRATES = True

  @classmethod
  def check(cls, rank: int, **options: Any) -> None:
    """Refuses a rank below 1 or a sparsity outside [0, 1).

    Args:
      rank: r, the budget.
      **options: sparsity.

    Raises:
      PEFTError: naming the setting.
    """
    super().check(rank)
    if not 0.0 <= options["sparsity"] < 1.0:
      raise PEFTError(f"sparsity must lie in [0, 1), got {options['sparsity']}")

  @classmethod
  def width(cls, rank: int, **options: Any) -> int:
    """Rank r / (1 − sparsity) before pruning ("Large-Sparse": r·(I + O) weights survive on average).

    Args:
      rank: r, the budget.
      **options: sparsity.

    Returns:
      The wide adapter's rank.
    """
    return max(1, round(rank / (1.0 - options["sparsity"])))

  @classmethod
  def calibrate(cls, model: nnx.Module, loss_fn: Callable[[nnx.Module], jax.Array], *, seed: int = 0,
                **options: Any) -> nnx.Module:
    """SNIP pruning on one batch (`snip_prune`).

    Args:
      model: the adapted model (changed in place).
      loss_fn: its loss on one batch.
      seed: B's probe draw's seed.
      **options: sparsity.

    Returns:
      The model, its masks set.
    """
    return snip_prune(model, loss_fn, options["sparsity"], seed=seed)

  def __init__(self, w0: nnx.Variable, rank: int, alpha: float, key: jax.Array, dtype: jax.typing.DTypeLike):
    super().__init__(w0, rank, alpha, key, dtype)
    self.mask_a = _var(Mask, jnp.ones(self.a_IR.shape, dtype), _names(self.a_IR))
    self.mask_b = _var(Mask, jnp.ones(self.b_RO.shape, dtype), _names(self.b_RO))

  def factors(self) -> tuple[jax.Array, jax.Array]:
    """The masked factors, as the products use them.

    Returns:
      (A ⊙ M_A, B ⊙ M_B).
    """
    return self.a_IR[...] * self.mask_a[...], self.b_RO[...] * self.mask_b[...]


def _path(path) -> str:
  return "/".join(str(k) for k in path)


def _param_slots(model: nnx.Module):
  """(module, attribute name, path string, Param) for every Param attribute of every module."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      for name, value in list(vars(node).items()):
        if isinstance(value, nnx.Param):
          yield node, name, _path((*path, name)), value


def apply(model: nnx.Module, method: str, targets: str = DEFAULT_TARGETS, rank: int = 8, alpha: float = 16.0, *,
          seed: int = 0, base_dtype: jax.typing.DTypeLike | None = None, **options: Any) -> nnx.Module:
  """Adapts `model` in place: target weights become adapters, every other parameter `Frozen`.

  Every check runs before the model changes.

  Args:
    model: the model (changed in place).
    method: a registered method (`ADAPTERS`: lora, dora, prediag, sora, sparse_adapter, and any `register`ed since).
    targets: a regular expression searched in each parameter's path (`blocks/wq_DQ`, `blocks/moe/w_up_EDF`, ...);
      it must match at least one weight of two or more dimensions (default `DEFAULT_TARGETS`).
    rank: r (default 8): the budget; a method's `width` may widen it (sparse_adapter: round(r / (1 − sparsity))
      before pruning, so r·(I + O) weights survive it on average).
    alpha: α (default 16.0); the update's scale is α/r.
    seed: the adapters' initialisation seed (default 0).
    base_dtype: the frozen weights' dtype (e.g. jnp.bfloat16); default unchanged. Adapters keep the parameter dtype.
    **options: any registered method's `OPTIONS` (SORA's r_p, default 4, and s0, default 1.0; sparse_adapter's
      sparsity, default 0.5); the method reads its own, the others are ignored.

  Returns:
    The model.

  Raises:
    PEFTError: when the method is unknown, an option is no registered method's, the method's `check` refuses its
      settings (rank < 1, ...), `targets` is not a regular expression or matches no weight matrix, the model already
      has adapters, or a method that cannot adapt a bias (`BIAS`) targets a projection with one.
  """
  if method not in ADAPTERS:
    raise PEFTError(f"unknown PEFT method {method!r}; choose one of {', '.join(ADAPTERS)}")
  cls = ADAPTERS[method]
  known = {k for c in ADAPTERS.values() for k in c.OPTIONS}
  if set(options) - known:
    raise PEFTError(f"unknown PEFT option(s) {', '.join(sorted(set(options) - known))}; the methods' options are "
                    f"{', '.join(sorted(known))}")
  resolved = lambda c: {k: options.get(k, default) for k, (default, _) in c.OPTIONS.items()}
  own = resolved(cls)
  cls.check(rank, **own)
  for other in ADAPTERS.values():  # an option given for another method still holds to that method's rules
    if other is not cls and set(other.OPTIONS) & set(options):
      other.check(rank, **resolved(other))
  try:
    pattern = re.compile(targets)
  except re.error as e:
    raise PEFTError(f"--peft.targets {targets!r} is not a regular expression ({e})") from None
  if any(isinstance(n, Adapter) for _, n in nnx.iter_graph(model)):
    raise PEFTError("the model already has adapters; merge(model) first")
  slots = list(_param_slots(model))
  chosen = [s for s in slots if pattern.search(s[2]) and s[3].ndim >= 2]
  if not chosen:
    raise PEFTError(f"targets {targets!r} match no weight matrix (paths look like {slots[0][2]!r})")
  width = cls.width(rank, **own)
  keys = jax.random.split(jax.random.key(seed), len(chosen))
  chosen_ids = {id(s[3]) for s in chosen}
  for module, name, path, _ in chosen:  # every check before the model changes
    if not cls.BIAS and getattr(module, BIASES.get(name, ""), None) is not None:
      raise PEFTError(f"{method} on {path}: the projection has a bias, which the reference scales and rotates with "
                      "the output; not supported (use lora or dora, or targets without q/k/v)")
  takes = inspect.signature(cls.__init__).parameters  # the options its constructor reads (not width's or check's)
  extra = {k: v for k, v in own.items() if k in takes}
  for (module, name, _, param), key in zip(chosen, keys):
    adapter = cls(param, width, alpha, key, param.dtype, **extra)
    if base_dtype is not None:
      adapter.w0.set_value(adapter.w0.get_value().astype(base_dtype))
    setattr(module, name, adapter)
  for module, name, _, param in slots:
    if id(param) not in chosen_ids:
      value = param.get_value()
      setattr(module, name, _var(Frozen, value if base_dtype is None else value.astype(base_dtype), _names(param)))
  return model


def adapters(model: nnx.Module) -> list[tuple[str, Adapter]]:
  """The adapters of a model.

  Args:
    model: a model `apply` adapted.

  Returns:
    [(path, Adapter)] in graph order.
  """
  return [(_path(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, Adapter)]


def merge(model: nnx.Module) -> nnx.Module:
  """Folds every adapter into a plain `Param` and makes `Frozen` parameters `Param`s again, in place.

  The merged model computes what the adapted one did. Merged weights take the model's parameter dtype
  (`model.c.param_dtype`, the adapters' own: a bfloat16 base plus a float32 update is not rounded to bfloat16), and
  so do frozen ones (exactly: a widening cast). A model without a config keeps the stored dtypes.

  Args:
    model: an adapted model (changed in place).

  Returns:
    The model, its adapters folded into their effective weights.
  """
  config = getattr(model, "c", None)
  for _, node in list(nnx.iter_graph(model)):
    if isinstance(node, nnx.Module) and not isinstance(node, Adapter):
      for name, value in list(vars(node).items()):
        if isinstance(value, Adapter):
          dtype = config.param_dtype if config is not None else value.w0.dtype
          setattr(node, name, _var(nnx.Param, value.weight().astype(dtype), value.names))
        elif isinstance(value, Frozen):
          v = value.get_value()
          setattr(node, name, _var(nnx.Param, v if config is None else v.astype(config.param_dtype), _names(value)))
  return model


def trainable_count(model: nnx.Module) -> int:
  """Adapter weights that can change: every Param entry, less the pruned ones of sparse adapters.

  Args:
    model: an adapted model (or one under `jax.eval_shape`: then the count before pruning).

  Returns:
    The number of trainable entries.
  """
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  for _, a in adapters(model):
    if isinstance(a, SparseAdapter):
      pruned = a.mask_a.size - jnp.sum(a.mask_a[...]) + a.mask_b.size - jnp.sum(a.mask_b[...])
      if not isinstance(pruned, jax.core.Tracer):  # traced (shapes only, jax.eval_shape): the count before pruning
        total -= int(pruned)
  return total


def snip_prune(model: nnx.Module, loss_fn: Callable[[nnx.Module], jax.Array], sparsity: float, *,
               seed: int = 0) -> nnx.Module:
  """Prunes the sparse adapters of `model` at initialisation by SNIP (SparseAdapter's criterion), in place.

  The connection sensitivity |θ · ∂L/∂θ| of every adapter weight is taken on `loss_fn(model)` (one batch), and the
  `sparsity` share with the smallest scores masked out over all adapters together (global, as SNIP ranks). B is zero
  at init, which gives every weight a zero score, so the scores are taken with B at a probe draw (A's distribution,
  U(±1/√r)) and B is zeroed again afterwards: the model stays the identity and pruned entries never train (their
  mask is 0).

  Args:
    model: a model adapted with method="sparse_adapter" (changed in place).
    loss_fn: the loss of the model on one batch.
    sparsity: the pruned share, in [0, 1).
    seed: the seed of B's probe draw (default 0).

  Returns:
    The model, its masks set.

  Raises:
    PEFTError: when the model has no sparse adapter, or sparsity lies outside [0, 1).

  References:
    Lee, Ajanthan, Torr, "SNIP: Single-shot Network Pruning based on Connection Sensitivity", ICLR 2019,
    arXiv 1810.02340.
  """
  sparse = [(p, a) for p, a in nnx.iter_graph(model) if isinstance(a, SparseAdapter)]
  if not sparse:
    raise PEFTError("snip_prune needs a model adapted with method='sparse_adapter'")
  if not 0.0 <= sparsity < 1.0:
    raise PEFTError(f"sparsity must lie in [0, 1), got {sparsity}")
  for (_, a), key in zip(sparse, jax.random.split(jax.random.key(seed), len(sparse))):
    a.b_RO.set_value(_uniform(key, a.b_RO.shape, 1 / math.sqrt(a.b_RO.shape[-2]), a.b_RO.dtype))
  grads = nnx.to_pure_dict(nnx.jit(nnx.grad(loss_fn))(model))  # one compiled backward, not op-by-op

  def grad_of(path, name):
    g = grads
    for k in (*path, name):
      g = g[k]
    return g

  scores = [(var, mask, jnp.abs(var[...] * grad_of(path, name)))
            for path, a in sparse for var, mask, name in ((a.a_IR, a.mask_a, "a_IR"), (a.b_RO, a.mask_b, "b_RO"))]
  flat = jnp.sort(jnp.concatenate([sc.ravel() for _, _, sc in scores]))
  keep = flat.size - int(round(sparsity * flat.size))
  threshold = flat[flat.size - keep] if keep > 0 else jnp.inf  # the keep-th largest score
  for _, mask, sc in scores:
    mask.set_value((sc >= threshold).astype(mask.dtype))
  for _, a in sparse:
    a.b_RO.set_value(jnp.zeros_like(a.b_RO[...]))
  return model
