"""Post-training quantization of the transformer's projections on qwix's quantizer.

Weights at 2, 3, 4, 8 or 16 bits (per output channel or per group of inputs, symmetric or not) and, for W8A8,
activations at 8 bits.

A plan says, for every layer of every target projection, how it is quantized: a `Spec` (algorithm, bits, group,
symmetric, act_bits, alpha). `quantize(model, plan, tokens)` replaces each target weight, a layer-stacked Param
(L, ..., I, O), by a `Quantized` module holding the integer codes, their scales (and zero points), a per-input
smoothing vector and the activation width; the model's own forward then runs unchanged, under `lax.scan` over layers
and on any mesh: a projection calls `matmul(x, w)` (models/transformer.py), which a `Quantized` answers with
(Q_act(x / s)) · deq(codes), and `w[...]` (MoE experts) reads the dequantized weight deq(codes) / s.

Algorithms, for y = x W with W (I, O) and X (tokens × I) the projection's inputs on the calibration set:
  rtn          round to nearest: qwix's quantize (absmax, or min/max when not symmetric, per output channel or per
               group of `group` inputs)
  gptq         GPTQ (Frantar et al. 2023): inputs quantized in order, each one's rounding error fed back to those not
               yet quantized through the upper Cholesky factor U of H⁻¹, H = XᵀX + λI (λ = 1% of H's mean diagonal),
               in lazy batches of 128 columns; a group's scale is taken when the batch holding its first column starts
               (the authors' code and qwix do the same)
  awq          AWQ (Lin et al. 2024): W' = diag(s) W, x' = x / s, s = mean|x|^α / √(max·min) for α in {0, 1/20, ...,
               19/20}, the α whose ‖X W − (X / s) Q(W')‖² on the calibration set is least (through the Gram XᵀX);
               no weight clipping search
  smoothquant  SmoothQuant (Xiao et al. 2023): s_j = max|X_j|^α / max_o|W_jo|^(1−α) (α = 0.5; qwix's formula), W' RTN;
               with act_bits = 8 the activations x / s are quantized per token (int8, symmetric, dynamic)
A 16-bit layer is not quantized: its weight is rounded to bfloat16 (scale 1); a 32-bit one is left as it is (float32),
so a plan can quantize some layers of a projection and not others. Embeddings, the head, norms, biases and
MoE routers stay in full precision (as GPTQ, AWQ and SmoothQuant leave them).

Written here, not taken from qwix.contrib: GPTQ (qwix's unrolls a Python loop over columns, slow whether eager or
jitted: see docs/quantization.md; this one runs a `lax.fori_loop` per batch, the same arithmetic,
and is checked against qwix's on a small matrix) and AWQ's search (qwix scores a scale by the activation-weighted
weight error, the paper by the output error on the calibration set, which is what this does). Calibration is
sequential: layer l is calibrated on the inputs the already-quantized layers 0..l−1 give it (within a layer, every
projection sees the full-precision layer's inputs). Algorithms other than rtn need the projection's inputs, recorded
on dense blocks' attention and MLP projections; MoE experts take rtn only.
Shapes: ... leading axes of one layer's weight (experts), I fan_in, O fan_out, G groups (I / group, or 1).

References:
  Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
  Transformers", ICLR 2023, arXiv 2210.17323 (code IST-DASLab/gptq).
  Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration", MLSys 2024,
  arXiv 2306.00978 (code mit-han-lab/llm-awq).
  Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language Models", ICML 2023,
  arXiv 2211.10438 (code mit-han-lab/smoothquant).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from qwix._src.core import qarray
from qwix.contrib import smooth_quant

from models.transformer import Transformer
from sharding.state import variable_names

ALGORITHMS = ("rtn", "gptq", "awq", "smoothquant")
BITS = (2, 3, 4, 8, 16, 32)  # 16: the weight rounded to bfloat16; 32: left in float32 (a layer a plan skips)
ACT_BITS = (0, 8)
# the projections a forward reaches through `matmul` (their inputs can be recorded and quantized) and the expert
# weights (read whole): never embeddings, head, norms, biases or routers
DEFAULT_TARGETS = r"blocks/(wq_DQ|wk_DK|wv_DK|wo_QD|w_gate_DF|w_up_DF|w_down_FD|moe/(w_gate_EDF|w_up_EDF|w_down_EFD|" \
                  r"shared_gate_DS|shared_up_DS|shared_down_SD))$"
RECORDED = ("wq_DQ", "wk_DK", "wv_DK", "wo_QD", "w_gate_DF", "w_up_DF", "w_down_FD")
PLAN_FORMAT = "optlab.quant-plan.v1"
GPTQ_BLOCK = 128
AWQ_GRID = 20


class QuantError(ValueError):
  """A quantization setting or plan that cannot be applied; the message names it."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """How one layer of one projection is quantized.

  Attributes:
    algorithm: one of `ALGORITHMS` (default "rtn").
    bits: the weight's width, one of `BITS` (default 4; 16: rounded to bfloat16, 32: left in float32).
    group: inputs per scale; 0 (default): one scale per output channel.
    symmetric: absmax scales (default), else min/max with zero points (4 or 8 bits).
    act_bits: 0 (default): activations in full precision; 8: W8A8-style per-token int8.
    alpha: SmoothQuant's migration strength, in [0, 1] (default 0.5).
  """
  algorithm: str = "rtn"
  bits: int = 4
  group: int = 0  # inputs per scale; 0: one scale per output channel
  symmetric: bool = True
  act_bits: int = 0  # 0: activations in full precision; 8: W8A8-style per-token int8
  alpha: float = 0.5  # SmoothQuant's migration strength

  def check(self, where: str = "") -> Spec:
    """Refuses a spec that cannot be applied.

    Args:
      where: what the spec is for (e.g. "blocks/wq_DQ layer 3"), to name it in the message; default none.

    Returns:
      The spec itself.

    Raises:
      QuantError: when the algorithm, bits or act_bits is unknown, an asymmetric spec is not at 4 or 8 bits, the
        group is negative or alpha lies outside [0, 1].
    """
    at = f"{where}: " if where else ""
    if self.algorithm not in ALGORITHMS:
      raise QuantError(f"{at}unknown algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if self.bits not in BITS:
      raise QuantError(f"{at}bits must be one of {BITS}, got {self.bits}")
    if self.act_bits not in ACT_BITS:
      raise QuantError(f"{at}act_bits must be 0 (none) or 8, got {self.act_bits}")
    if not self.symmetric and self.bits not in (4, 8):
      raise QuantError(f"{at}asymmetric quantization needs 4 or 8 bits (qwix's zero points), got {self.bits}")
    if self.group < 0:
      raise QuantError(f"{at}group must be >= 0 (0: per channel), got {self.group}")
    if not 0.0 <= self.alpha <= 1.0:
      raise QuantError(f"{at}alpha must lie in [0, 1], got {self.alpha}")
    return self


Plan = dict  # projection path (e.g. "blocks/wq_DQ") -> [Spec per layer]


def qtype(bits: int) -> Any:
  """Qwix's logical type for a width.

  Args:
    bits: 2, 3, 4 or 8.

  Returns:
    jnp.int4 / jnp.int8, or qwix's emulated "int2" / "int3".
  """
  return {2: "int2", 3: "int3", 4: jnp.int4, 8: jnp.int8}[bits]


def how(spec: Spec, ndim: int = 2) -> qarray.HowToQuantize:
  """Qwix's recipe for a weight (..., I, O): one scale per output channel (and per leading index) or per group.

  Args:
    spec: the layer's spec (its bits, group and symmetric are read).
    ndim: the weight's number of dimensions (default 2: (I, O)).

  Returns:
    The `qarray.HowToQuantize`: absmax calibration when symmetric, else min/max.
  """
  return qarray.HowToQuantize(qtype=qtype(spec.bits), channelwise_axes=tuple(a for a in range(ndim) if a != ndim - 2),
                              tiled_axes={ndim - 2: spec.group} if spec.group else {},
                              calibration_method="absmax" if spec.symmetric else "minmax")


# ---- one layer's weight ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Piece:
  """One layer of a quantized projection: w ≈ (codes − zero) · scale / smooth.

  Attributes:
    codes: (..., I, O), integers (bfloat16 weights at 16 bits).
    scale: (..., G, O).
    zero: (..., G, O), or None (symmetric).
    smooth: (..., I), the per-input smoothing (ones for rtn and gptq).
    bits: the weight's width.
    act_bits: the activations' width (0: full precision).
  """
  codes: jax.Array
  scale: jax.Array
  zero: jax.Array | None
  smooth: jax.Array
  bits: int
  act_bits: int


@dataclasses.dataclass
class Stats:
  """A projection's calibration inputs X (tokens × I), reduced: the Gram XᵀX, mean|x| and max|x| per input."""
  gram: jax.Array
  mean_abs: jax.Array
  max_abs: jax.Array

  @staticmethod
  def of(x: jax.Array) -> Stats:
    """The statistics of a projection's recorded inputs.

    Args:
      x: the inputs (..., I) (every leading axis a token), any float dtype.

    Returns:
      Their `Stats`, in float32.
    """
    x = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    return Stats(x.T @ x, jnp.mean(jnp.abs(x), 0), jnp.max(jnp.abs(x), 0))


def rtn(w: jax.Array, spec: Spec) -> tuple:
  """Qwix's round-to-nearest of one layer's weight.

  Args:
    w: the weight (..., I, O).
    spec: its spec (bits, group, symmetric).

  Returns:
    (codes (..., I, O), scale (..., G, O), zero (..., G, O) or None), codes and zero in float32.
  """
  q = qarray.quantize(jnp.asarray(w, jnp.float32), how(spec, w.ndim))
  zero = None if q.zero_point is None else q.zero_point.astype(jnp.float32)
  return q.qvalue.astype(jnp.float32), q.scale, zero


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array | None = None) -> jax.Array:
  """(codes − zero) · scale with scale (and zero) (..., G, O) repeated over the I / G inputs of each group.

  Args:
    codes: (..., I, O).
    scale: (..., G, O).
    zero: (..., G, O), or None (default: symmetric, no zero point).

  Returns:
    The dequantized weight (..., I, O) in float32.
  """
  codes = codes.astype(jnp.float32)
  rep = codes.shape[-2] // scale.shape[-2]
  if zero is not None:
    codes = codes - jnp.repeat(zero, rep, axis=-2)
  return codes * jnp.repeat(scale, rep, axis=-2)


def _gptq(w_IO, gram_II, *, bits: int, group: int, symmetric: bool, percdamp: float = 0.01):
  W = w_IO.T.astype(jnp.float32)  # (O, I): rows the outputs, columns the inputs (the paper's layout)
  O, I = W.shape
  g = group or I
  find = qarray.HowToQuantize(qtype=qtype(bits), channelwise_axes=(0,),
                              calibration_method="absmax" if symmetric else "minmax")
  diag = jnp.diag(gram_II)
  dead = diag == 0
  H = jnp.where(dead & jnp.eye(I, dtype=bool), 1.0, gram_II)
  W = jnp.where(dead[None, :], 0.0, W)
  H = H + percdamp * jnp.mean(diag) * jnp.eye(I)
  L = jnp.linalg.cholesky(H)
  U = jnp.linalg.cholesky(jax.scipy.linalg.cho_solve((L, True), jnp.eye(I)), upper=True)  # upper factor of H⁻¹
  scales, codes = [], []
  zeros: list[Any] = []  # None per group when symmetric, and then never stacked
  for i1 in range(0, I, GPTQ_BLOCK):
    i2 = min(i1 + GPTQ_BLOCK, I)
    for c in range(i1, i2):
      if c % g == 0:  # a group's scale from W as it stands when its batch starts
        s, z = qarray.compute_scale_zero_point(qarray.calibrate(W[:, c:c + g], find), find.qtype)
        scales.append(s[:, 0])
        zeros.append(None if z is None else z[:, 0].astype(jnp.float32))
    col = np.arange(i1, i2) // g
    S = jnp.stack(scales, 1)[:, col]
    Z = None if zeros[0] is None else jnp.stack(zeros, 1)[:, col]
    U1 = U[i1:i2, i1:i2]

    def column(i, carry):
      W1, Q1, E1 = carry
      w = W1[:, i]
      s, z = S[:, i][:, None], (None if Z is None else Z[:, i][:, None].astype(find.qtype))  # 4 or 8 bits
      q = qarray.quantize_with_scale_zero_point(w[:, None], find.qtype, s, z)
      dq = qarray.dequantize(q)[:, 0]
      err = (w - dq) / U1[i, i]
      W1 = W1 - jnp.outer(err, U1[i])  # U1 is upper triangular: the columns before i stay as they are
      return W1, Q1.at[:, i].set(q.qvalue[:, 0].astype(jnp.float32)), E1.at[:, i].set(err)

    n = i2 - i1
    _, Q1, E1 = jax.lax.fori_loop(0, n, column, (W[:, i1:i2], jnp.zeros((O, n)), jnp.zeros((O, n))))
    codes.append(Q1)
    W = W.at[:, i2:].add(-E1 @ U[i1:i2, i2:])
  zero = None if zeros[0] is None else jnp.stack(zeros, 1).T
  return jnp.concatenate(codes, 1).T, jnp.stack(scales, 1).T, zero


_gptq_jit = jax.jit(_gptq, static_argnames=("bits", "group", "symmetric", "percdamp"))


def gptq(w_IO: jax.Array, gram_II: jax.Array, spec: Spec) -> tuple:
  """GPTQ on one (I, O) weight with the inputs' Gram XᵀX.

  Inputs are quantized in order, each one's rounding error fed back to those not yet quantized through the upper
  Cholesky factor U of H⁻¹, H = XᵀX + λI (λ = 1% of H's mean diagonal; an input never seen keeps H's diagonal 1 and
  a zero weight), in lazy batches of `GPTQ_BLOCK` columns; a group's scale is taken when the batch holding its first
  column starts.

  Args:
    w_IO: the weight (I, O).
    gram_II: the Gram XᵀX of its calibration inputs (I, I).
    spec: its spec (bits, group, symmetric).

  Returns:
    (codes (I, O), scale (G, O), zero (G, O) or None).

  References:
    Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
    Transformers", ICLR 2023, arXiv 2210.17323 (code IST-DASLab/gptq).
  """
  return _gptq_jit(w_IO, gram_II, bits=spec.bits, group=spec.group, symmetric=spec.symmetric)


def _awq_scale(w_IO, gram_II, mean_abs_I, spec: Spec):
  a = jnp.maximum(mean_abs_I, 1e-8)

  def loss_and_scale(alpha):
    s = jnp.maximum(a ** alpha, 1e-4)
    s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
    codes, scale, zero = rtn(w_IO * s[:, None], spec)
    delta = dequantize(codes, scale, zero) / s[:, None] - w_IO
    return jnp.sum(delta * (gram_II @ delta)), s

  losses, scales = jax.vmap(loss_and_scale)(jnp.arange(AWQ_GRID, dtype=jnp.float32) / AWQ_GRID)
  return scales[jnp.argmin(losses)], losses


_awq_jit = jax.jit(_awq_scale, static_argnames=("spec",))


def awq_scale(w_IO: jax.Array, stats: Stats, spec: Spec) -> tuple[jax.Array, jax.Array]:
  """AWQ's per-input scale, searched on a grid of α by the calibration output error.

  s = mean|x|^α / √(max·min) for α in {0, 1/20, ..., 19/20}; the α whose ‖X W − (X / s) Q(diag(s) W)‖² (computed
  through the Gram XᵀX) is least wins. No weight clipping search.

  Args:
    w_IO: the weight (I, O).
    stats: its inputs' statistics (the Gram and mean|x| are read).
    spec: its spec (the rounding of Q).

  Returns:
    (s (I,), the output error of each α on the grid (`AWQ_GRID`,)).

  References:
    Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration", MLSys 2024,
    arXiv 2306.00978 (code mit-han-lab/llm-awq).
  """
  return _awq_jit(jnp.asarray(w_IO, jnp.float32), stats.gram, stats.mean_abs, spec)


def smoothquant_scale(w_IO: jax.Array, stats: Stats, spec: Spec) -> jax.Array:
  """SmoothQuant's per-input scale s_j = max|X_j|^α / max_o|W_jo|^(1−α) (qwix's formula).

  Args:
    w_IO: the weight (I, O).
    stats: its inputs' statistics (max|x| is read).
    spec: its spec (alpha is read).

  Returns:
    s (I,).

  References:
    Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language Models",
    ICML 2023, arXiv 2211.10438 (code mit-han-lab/smoothquant).
  """
  return smooth_quant.compute_scales_ratio(stats.max_abs, jnp.max(jnp.abs(w_IO), -1), spec.alpha)


def quantize_weight(w: jax.Array, spec: Spec, stats: Stats | None = None) -> Piece:
  """One layer's weight quantized by `spec`.

  Args:
    w: the weight (..., I, O).
    spec: how it is quantized.
    stats: its inputs' statistics, needed by every algorithm but rtn (a weight with leading axes, MoE experts, takes
      rtn only); default None.

  Returns:
    The `Piece`; at 16 or 32 bits the weight itself (bfloat16 or float32) with scale 1.

  Raises:
    QuantError: when the group does not divide the inputs, or a calibrated algorithm has no `stats` or a weight with
      leading axes.
  """
  w = jnp.asarray(w, jnp.float32)
  I, O = w.shape[-2:]
  lead = w.shape[:-2]
  ones = jnp.ones((*lead, I), jnp.float32)
  if spec.bits >= 16:
    return Piece(w.astype(jnp.bfloat16 if spec.bits == 16 else jnp.float32), jnp.ones((*lead, 1, O), jnp.float32),
                 None, ones, spec.bits, spec.act_bits)
  if spec.group and I % spec.group:
    raise QuantError(f"group {spec.group} does not divide the {I} inputs")
  if spec.algorithm != "rtn" and (stats is None or lead):
    raise QuantError(f"{spec.algorithm} needs the projection's recorded inputs (dense attention/MLP projections "
                     "only; MoE experts take rtn)")
  smooth = ones
  if spec.algorithm == "awq":
    assert stats is not None  # refused above
    smooth = awq_scale(w, stats, spec)[0]
  elif spec.algorithm == "smoothquant":
    assert stats is not None
    smooth = smoothquant_scale(w, stats, spec)
  if spec.algorithm == "gptq":
    assert stats is not None
    codes, scale, zero = gptq(w, stats.gram, spec)
  else:
    codes, scale, zero = rtn(w * smooth[..., :, None], spec)
  return Piece(codes, scale, zero, smooth, spec.bits, spec.act_bits)


# ---- the quantized weight in the model -----------------------------------------------------------------------------


class QuantCodes(nnx.Variable):
  """A quantized weight's integer codes (int8 container; bfloat16 or float32 where a layer is kept at 16 or 32 bits)."""


class QuantParam(nnx.Variable):
  """A quantized weight's fixed numbers: scales, zero points, smoothing, activation width."""


def _var(cls, value, names):
  return cls(value, out_sharding=tuple(names), eager_sharding=False)


def fake_quant_tokens(x: jax.Array, bits: int = 8) -> jax.Array:
  """X quantized and dequantized per token (every axis but the last), symmetric: qwix's dynamic activation recipe.

  Args:
    x: the activations (..., I).
    bits: the width (default 8).

  Returns:
    x with each token rounded to `bits` (absmax scale per token), dequantized.
  """
  h = qarray.HowToQuantize(qtype=qtype(bits), channelwise_axes=tuple(range(x.ndim - 1)))
  return qarray.dequantize(qarray.quantize(x, h))


class Quantized(nnx.Module):
  """A quantized weight stacked over layers, standing in for the layer-stacked Param it replaces.

  It holds codes (L, ..., I, O), scale/zero (L, ..., G, O), smooth (L, ..., I), act (L,); `bits` (per layer) and
  `specs` are static. `[...]` is the dequantized weight, `matmul(x, dt)` the projection with its input smoothed and,
  where act > 0, quantized per token. The codes' container is int8, or bfloat16 (float32) where a layer is kept at 16
  (32) bits.

  Args:
    pieces: one `Piece` per layer.
    names: the weight's logical axis names (L, ..., I, O), which the codes, scales and smoothing inherit.
    specs: one `Spec` per layer.
  """

  def __init__(self, pieces: list[Piece], names: tuple, specs: list[Spec]):
    G = max(p.scale.shape[-2] for p in pieces)
    widest = max(p.bits for p in pieces)
    container = jnp.float32 if widest == 32 else jnp.bfloat16 if widest == 16 else jnp.int8
    lead, (in_name, out_name) = tuple(names[:-2]), tuple(names[-2:])
    grow = lambda x: jnp.repeat(x, G // x.shape[-2], axis=-2)  # a 16/32-bit layer's single scale row to G rows
    self.codes = _var(QuantCodes, jnp.stack([p.codes for p in pieces]).astype(container), names)
    self.scale = _var(QuantParam, jnp.stack([grow(p.scale) for p in pieces]), (*lead, None, out_name))
    asym = any(p.zero is not None for p in pieces)
    zeros = [grow(p.zero) if p.zero is not None else jnp.zeros_like(grow(p.scale)) for p in pieces]
    self.zero = _var(QuantParam, jnp.stack(zeros), (*lead, None, out_name)) if asym else None
    self.smooth = _var(QuantParam, jnp.stack([p.smooth for p in pieces]), (*lead, in_name))
    self.act = _var(QuantParam, jnp.array([p.act_bits for p in pieces], jnp.int32), lead[:1])
    self.bits = tuple(p.bits for p in pieces)
    self.specs = tuple(specs)

  @property
  def names(self) -> tuple:
    """The logical axis names of the weight (those of its codes)."""
    return variable_names(self.codes)

  def dequantized(self) -> jax.Array:
    """deq(codes): the smoothed weight diag(s)·W, as the codes hold it.

    Returns:
      (L, ..., I, O) in float32.
    """
    return dequantize(self.codes[...], self.scale[...], None if self.zero is None else self.zero[...])

  def weight(self) -> jax.Array:
    """The dequantized weight W = deq(codes) / s, what `[...]` reads.

    Returns:
      (L, ..., I, O) in float32.
    """
    return self.dequantized() / self.smooth[...][..., None]

  def __getitem__(self, index):
    return self.weight()[index]

  def matmul(self, x: jax.Array, dt: jax.typing.DTypeLike) -> jax.Array:
    """The projection (Q_act(x / s)) · deq(codes), without forming W.

    Args:
      x: the input (..., I).
      dt: the compute dtype of the product.

    Returns:
      (..., O) in `dt`; the input is quantized per token (int8) where the layer's act > 0.
    """
    x = x.astype(jnp.float32) / self.smooth[...]
    x = jnp.where(self.act[...] > 0, fake_quant_tokens(x), x)
    return x.astype(dt) @ self.dequantized().astype(dt)


# ---- plans ------------------------------------------------------------------------------------------------------


def path_name(path: tuple) -> str:
  """A graph or state path as the plans name it.

  Args:
    path: the path's keys, e.g. ("blocks", "wq_DQ").

  Returns:
    The keys joined by "/": "blocks/wq_DQ".
  """
  return "/".join(str(k) for k in path)


def by_path(state: nnx.State) -> dict[str, nnx.Variable]:
  """The leaves of an `nnx.State` by path name.

  Args:
    state: e.g. `nnx.state(model, nnx.Param)`, or gradients.

  Returns:
    {path name ("blocks/wq_DQ"): Variable}.
  """
  return {path_name(k): v for k, v in nnx.to_flat_state(state)}


def targets(model: nnx.Module, pattern: str = DEFAULT_TARGETS) -> dict[str, nnx.Param]:
  """The layer-stacked weights (3+ dimensions under `blocks`) whose path `pattern` searches.

  Args:
    model: the transformer.
    pattern: a regular expression searched in each path (default `DEFAULT_TARGETS`: the projections and expert
      weights, never embeddings, head, norms, biases or routers).

  Returns:
    {path: Param}.

  Raises:
    QuantError: when `pattern` is not a regular expression or matches no layer-stacked weight.
  """
  try:
    rx = re.compile(pattern)
  except re.error as e:
    raise QuantError(f"targets {pattern!r} is not a regular expression ({e})") from None
  found = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      for name, value in vars(node).items():
        p = path_name((*path, name))
        if isinstance(value, nnx.Param) and value.ndim >= 3 and p.startswith("blocks/") and rx.search(p):
          found[p] = value
  if not found:
    raise QuantError(f"targets {pattern!r} match no layer-stacked weight")
  return found


def uniform_plan(model: nnx.Module, spec: Spec, pattern: str = DEFAULT_TARGETS) -> Plan:
  """Every target projection, every layer, quantized by `spec`.

  Args:
    model: the transformer.
    spec: the spec of every layer (checked).
    pattern: the targets' regular expression (default `DEFAULT_TARGETS`; see `targets`).

  Returns:
    The plan: {path: [spec] * layers}.
  """
  spec.check()
  return {p: [spec] * v.shape[0] for p, v in targets(model, pattern).items()}


def plan_to_json(plan: Plan) -> dict:
  """A plan as JSON-able data, tagged with `PLAN_FORMAT`.

  Args:
    plan: {path: [Spec per layer]}.

  Returns:
    {"format": PLAN_FORMAT, "layers": {path: [spec as a dict per layer]}}.
  """
  return {"format": PLAN_FORMAT,
          "layers": {p: [dataclasses.asdict(s) for s in specs] for p, specs in plan.items()}}


def plan_from_json(data: dict) -> Plan:
  """The plan that `plan_to_json` wrote, every spec checked.

  Args:
    data: the JSON data.

  Returns:
    {path: [Spec per layer]}.

  Raises:
    QuantError: when `data` is not a plan of this format, a path does not list its specs, or a spec has unknown
      keys or values.
  """
  if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT or not isinstance(data.get("layers"), dict):
    raise QuantError(f"not a quantization plan (expected {{'format': {PLAN_FORMAT!r}, 'layers': {{...}}}})")
  fields = {f.name for f in dataclasses.fields(Spec)}
  plan: Plan = {}
  for p, specs in data["layers"].items():
    if not isinstance(specs, list):
      raise QuantError(f"plan: {p} must list one spec per layer")
    plan[p] = []
    for i, s in enumerate(specs):
      if not isinstance(s, dict) or set(s) - fields:
        raise QuantError(f"plan: {p} layer {i}: a spec has the keys {sorted(fields)}, got {s!r}")
      plan[p].append(Spec(**s).check(f"{p} layer {i}"))
  return plan


def write_plan(plan: Plan, path: str):
  """Writes a plan as JSON (`plan_to_json`) to the file `path`.

  Args:
    plan: {path: [Spec per layer]}.
    path: the file to write.
  """
  with open(path, "w") as f:
    json.dump(plan_to_json(plan), f, indent=1)
    f.write("\n")


def read_plan(path: str) -> Plan:
  """Reads a plan that `write_plan` wrote.

  Args:
    path: the JSON file.

  Returns:
    {path: [Spec per layer]}, every spec checked.

  Raises:
    QuantError: when the file is missing or not valid JSON (and as `plan_from_json` does).
  """
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise QuantError(f"{path}: no such plan file") from None
  except ValueError as e:
    raise QuantError(f"{path}: not valid JSON ({e})") from None
  return plan_from_json(data)


def check_plan(model: nnx.Module, plan: Plan):
  """Refuses a plan that does not fit `model`.

  Every planned path must be a layer-stacked weight of `model` with one spec per layer, and each spec must fit it.

  Args:
    model: the transformer.
    plan: {path: [Spec per layer]}.

  Raises:
    QuantError: when a path is not a layer-stacked weight of the model, the number of specs is not the number of
      layers, a projection mixes group sizes, a spec is invalid or its group does not divide the inputs, or a
      projection whose inputs are not recorded (MoE experts) gets more than rtn weights.
  """
  weights = targets(model, ".")
  for p, specs in plan.items():
    if p not in weights:
      raise QuantError(f"plan: {p} is not a layer-stacked weight of this model (it has {', '.join(weights)})")
    w = weights[p]
    if len(specs) != w.shape[0]:
      raise QuantError(f"plan: {p} has {len(specs)} specs for {w.shape[0]} layers")
    name = p.rsplit("/", 1)[-1]
    I = w.shape[-2]
    groups = {s.group for s in specs if s.bits < 16}
    if len(groups) > 1:
      raise QuantError(f"plan: {p} mixes group sizes {sorted(groups)} across layers (one per projection)")
    for i, s in enumerate(specs):
      s.check(f"{p} layer {i}")
      if s.group and I % s.group:
        raise QuantError(f"plan: {p} layer {i}: group {s.group} does not divide its {I} inputs")
      if name not in RECORDED and (s.algorithm != "rtn" or s.act_bits):
        raise QuantError(f"plan: {p} layer {i}: {s.algorithm} with act_bits {s.act_bits}: only rtn weights for "
                         f"this projection (its inputs are not recorded: MoE experts)")


# ---- calibration and quantization --------------------------------------------------------------------------------


class _Recorder(nnx.Module):
  """Stands in for a weight during calibration: records the input of each product, then computes it.

  Args:
    w: the weight it stands in for (I, O).
    sink: the list each product's input is appended to.
  """

  def __init__(self, w: jax.Array, sink: list):
    self.w, self.sink = w, sink

  def matmul(self, x, dt):
    self.sink.append(x)
    return x @ self.w.astype(dt)

  def __getitem__(self, index):
    return self.w[index]


def record_inputs(block: nnx.Module, x_BTD: jax.Array, names: list[str]) -> dict[str, Stats]:
  """Stats of the inputs each of `names` sees when the block runs on x.

  Args:
    block: one layer's block (merged alone, no layer axis); its weights are restored afterwards.
    x_BTD: the block's input.
    names: attributes of the block (its dense projections, e.g. "wq_DQ").

  Returns:
    {name: Stats of the input of its first product}.
  """
  sinks: dict[str, list[jax.Array]] = {n: [] for n in names}
  saved = {n: getattr(block, n) for n in names}
  try:
    for n in names:
      setattr(block, n, _Recorder(saved[n][...], sinks[n]))
    block(x_BTD)
  finally:
    for n in names:
      setattr(block, n, saved[n])
  return {n: Stats.of(sinks[n][0]) for n in names}


def quantize(model: Transformer, plan: Plan, tokens_NT: jax.Array | np.ndarray) -> nnx.Module:
  """Quantizes `model` in place by `plan`, calibrating layer by layer.

  Layer l's inputs come through the already-quantized layers before it; each target weight becomes a `Quantized`.

  Args:
    model: the transformer (changed in place).
    plan: {path: [Spec per layer]} (checked against the model first: `check_plan`).
    tokens_NT: the calibration set, N sequences of T tokens.

  Returns:
    The model.
  """
  check_plan(model, plan)
  names = {p: p[len("blocks/"):] for p in plan}
  graphdef, state = nnx.split(model.blocks)  # layer l alone: nnx.merge(graphdef, state[l])
  n_layers = jax.tree.leaves(state)[0].shape[0]
  x = model.embed(jnp.asarray(tokens_NT))
  pieces: dict[str, list[Piece]] = {p: [] for p in plan}
  for layer in range(n_layers):
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state))
    done = quantize_layer(block, {names[p]: plan[p][layer] for p in plan}, x)
    for p in plan:
      pieces[p].append(done[names[p]])
    if layer + 1 < n_layers:
      x, _ = block(x)
  for p, weight in targets(model, ".").items():
    if p in plan:
      module, attr = owner(model, p)
      setattr(module, attr, Quantized(pieces[p], variable_names(weight), plan[p]))
  return model


def quantize_layer(block: nnx.Module, specs: dict[str, Spec], x_BTD: jax.Array) -> dict[str, Piece]:
  """Quantizes one layer's block (merged alone, no layer axis) in place.

  Args:
    block: the block; each weight `specs` names becomes a one-layer `Quantized`.
    specs: {weight path relative to the block ("wq_DQ", "moe/w_up_EDF"): its spec}.
    x_BTD: the block's input, on which the calibrated algorithms record their projections' inputs.

  Returns:
    {weight path: its `Piece`}.

  Raises:
    QuantError: when a calibrated algorithm (not rtn, under 16 bits) is asked of a weight below the block's top level
      (MoE experts).
  """
  wanted = [n for n, s in specs.items() if s.algorithm != "rtn" and s.bits < 16]  # 16, 32: nothing to calibrate
  if any("/" in n for n in wanted):
    raise QuantError(f"calibrated algorithms reach dense blocks' projections only, not {wanted}")
  stats = record_inputs(block, x_BTD, wanted) if wanted else {}
  pieces = {}
  for n, spec in specs.items():
    module, attr = owner(block, n)
    pieces[n] = quantize_weight(getattr(module, attr)[...], spec, stats.get(n))
    setattr(module, attr, _LayerQuantized(pieces[n], spec))
  return pieces


def owner(root: nnx.Module, name: str) -> tuple[nnx.Module, str]:
  """The module and attribute a path relative to `root` names.

  Args:
    root: a model or a block.
    name: the path: "wq_DQ" or "moe/w_up_EDF" in a block, "blocks/wq_DQ" in a model.

  Returns:
    (module, attribute name).
  """
  *mods, attr = name.split("/")
  for m in mods:
    root = getattr(root, m)
  return root, attr


class _LayerQuantized(Quantized):
  """One layer's quantized weight (no layer axis), for the calibration forward of later layers.

  Args:
    piece: the layer's quantized weight.
    spec: its spec.
  """

  def __init__(self, piece: Piece, spec: Spec):
    super().__init__([piece], tuple([None] * (piece.codes.ndim + 1)), [spec])
    for v in (self.codes, self.scale, self.smooth, self.act) + (() if self.zero is None else (self.zero,)):
      v.set_value(v.get_value()[0])


def quantized(model: nnx.Module) -> list[tuple[str, Quantized]]:
  """The quantized weights of a model.

  Args:
    model: a model `quantize` quantized (or `models.quant_store.load` read).

  Returns:
    [(path, Quantized)] in graph order.
  """
  return [(path_name(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, Quantized) and p]
