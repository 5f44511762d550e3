"""Post-training quantization of the transformer's projections on qwix's quantizer: weights at 2, 3, 4, 8 or 16 bits
(per output channel or per group of inputs, symmetric or not) and, for W8A8, activations at 8 bits.

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

Written here, not taken from qwix.contrib: GPTQ (qwix's unrolls a Python loop over columns: ~100 s for one 32×256
matrix on this CPU, eager or jitted; this one runs a `lax.fori_loop` per batch, the same arithmetic, and is checked
against qwix's on a small matrix) and AWQ's search (qwix scores a scale by the activation-weighted weight error, the
paper by the output error on the calibration set, which is what this does). Calibration is sequential: layer l is
calibrated on the inputs the already-quantized layers 0..l−1 give it (within a layer, every projection sees the
full-precision layer's inputs). Algorithms other than rtn need the projection's inputs, recorded on dense blocks'
attention and MLP projections; MoE experts take rtn only.
Shapes: ... leading axes of one layer's weight (experts), I fan_in, O fan_out, G groups (I / group, or 1).
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from qwix._src.core import qarray
from qwix.contrib import smooth_quant

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
  """How one layer of one projection is quantized."""
  algorithm: str = "rtn"
  bits: int = 4
  group: int = 0  # inputs per scale; 0: one scale per output channel
  symmetric: bool = True
  act_bits: int = 0  # 0: activations in full precision; 8: W8A8-style per-token int8
  alpha: float = 0.5  # SmoothQuant's migration strength

  def check(self, where: str = "") -> "Spec":
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


def qtype(bits: int):
  """qwix's logical type for a width: int4/int8 dtypes, its emulated 'int2'/'int3'."""
  return {2: "int2", 3: "int3", 4: jnp.int4, 8: jnp.int8}[bits]


def how(spec: Spec, ndim: int = 2) -> qarray.HowToQuantize:
  """qwix's recipe for a weight (..., I, O): one scale per output channel (and per leading index) or per group."""
  return qarray.HowToQuantize(qtype=qtype(spec.bits), channelwise_axes=tuple(a for a in range(ndim) if a != ndim - 2),
                              tiled_axes={ndim - 2: spec.group} if spec.group else {},
                              calibration_method="absmax" if spec.symmetric else "minmax")


# ---- one layer's weight ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Piece:
  """One layer of a quantized projection: codes (..., I, O) (integers, or bfloat16 weights at 16 bits), scale
  (..., G, O), zero (..., G, O) or None, smooth (..., I): w ≈ (codes − zero) · scale / smooth."""
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
  def of(x) -> "Stats":
    x = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    return Stats(x.T @ x, jnp.mean(jnp.abs(x), 0), jnp.max(jnp.abs(x), 0))


def rtn(w, spec: Spec) -> tuple:
  """(codes, scale, zero | None) of qwix's round-to-nearest."""
  q = qarray.quantize(jnp.asarray(w, jnp.float32), how(spec, w.ndim))
  zero = None if q.zero_point is None else q.zero_point.astype(jnp.float32)
  return q.qvalue.astype(jnp.float32), q.scale, zero


def dequantize(codes, scale, zero=None):
  """(codes − zero) · scale with scale (and zero) (..., G, O) repeated over the I / G inputs of each group."""
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
  scales, zeros, codes = [], [], []
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


def gptq(w_IO, gram_II, spec: Spec) -> tuple:
  """(codes (I, O), scale (G, O), zero | None) of GPTQ on one (I, O) weight with the inputs' Gram XᵀX."""
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


def awq_scale(w_IO, stats: Stats, spec: Spec):
  """AWQ's per-input scale s (I,) and the calibration output error of each α on the grid."""
  return _awq_jit(jnp.asarray(w_IO, jnp.float32), stats.gram, stats.mean_abs, spec)


def smoothquant_scale(w_IO, stats: Stats, spec: Spec):
  """SmoothQuant's per-input scale s_j = max|X_j|^α / max_o|W_jo|^(1−α) (qwix's formula)."""
  return smooth_quant.compute_scales_ratio(stats.max_abs, jnp.max(jnp.abs(w_IO), -1), spec.alpha)


def quantize_weight(w, spec: Spec, stats: Stats | None = None) -> Piece:
  """One layer's weight (..., I, O) quantized by `spec` (`stats` of its inputs for every algorithm but rtn)."""
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
    smooth = awq_scale(w, stats, spec)[0]
  elif spec.algorithm == "smoothquant":
    smooth = smoothquant_scale(w, stats, spec)
  if spec.algorithm == "gptq":
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


def fake_quant_tokens(x, bits: int = 8):
  """x quantized and dequantized per token (every axis but the last), symmetric: qwix's dynamic activation recipe."""
  h = qarray.HowToQuantize(qtype=qtype(bits), channelwise_axes=tuple(range(x.ndim - 1)))
  return qarray.dequantize(qarray.quantize(x, h))


class Quantized(nnx.Module):
  """A quantized weight stacked over layers: codes (L, ..., I, O), scale/zero (L, ..., G, O), smooth (L, ..., I),
  act (L,); `bits` (per layer) and `specs` are static. `[...]` is the dequantized weight, `matmul(x, dt)` the
  projection with its input smoothed and, where act > 0, quantized per token."""

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
    return variable_names(self.codes)

  def dequantized(self):
    """deq(codes): the smoothed weight diag(s)·W, as the codes hold it."""
    return dequantize(self.codes[...], self.scale[...], None if self.zero is None else self.zero[...])

  def weight(self):
    return self.dequantized() / self.smooth[...][..., None]

  def __getitem__(self, index):
    return self.weight()[index]

  def matmul(self, x, dt):
    x = x.astype(jnp.float32) / self.smooth[...]
    x = jnp.where(self.act[...] > 0, fake_quant_tokens(x), x)
    return x.astype(dt) @ self.dequantized().astype(dt)


# ---- plans ------------------------------------------------------------------------------------------------------


def path_name(path) -> str:
  """A graph or state path as the plans name it: "blocks/wq_DQ"."""
  return "/".join(str(k) for k in path)


def by_path(state) -> dict[str, nnx.Variable]:
  """{path name: Variable} of an `nnx.State` (e.g. `nnx.state(model, nnx.Param)`, or gradients)."""
  return {path_name(k): v for k, v in nnx.to_flat_state(state)}


def targets(model: nnx.Module, pattern: str = DEFAULT_TARGETS) -> dict[str, nnx.Param]:
  """{path: Param} of the layer-stacked weights (3+ dimensions under `blocks`) whose path `pattern` searches."""
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
  """Every target projection, every layer, quantized by `spec`."""
  spec.check()
  return {p: [spec] * v.shape[0] for p, v in targets(model, pattern).items()}


def plan_to_json(plan: Plan) -> dict:
  return {"format": PLAN_FORMAT,
          "layers": {p: [dataclasses.asdict(s) for s in specs] for p, specs in plan.items()}}


def plan_from_json(data: dict) -> Plan:
  if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT or not isinstance(data.get("layers"), dict):
    raise QuantError(f"not a quantization plan (expected {{'format': {PLAN_FORMAT!r}, 'layers': {{...}}}})")
  fields = {f.name for f in dataclasses.fields(Spec)}
  plan = {}
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
  with open(path, "w") as f:
    json.dump(plan_to_json(plan), f, indent=1)
    f.write("\n")


def read_plan(path: str) -> Plan:
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise QuantError(f"{path}: no such plan file") from None
  except ValueError as e:
    raise QuantError(f"{path}: not valid JSON ({e})") from None
  return plan_from_json(data)


def check_plan(model: nnx.Module, plan: Plan):
  """Every planned path is a target weight of `model` with one spec per layer, each spec fits it."""
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
  """Stands in for a weight during calibration: records the input of each product, then computes it."""

  def __init__(self, w, sink: list):
    self.w, self.sink = w, sink

  def matmul(self, x, dt):
    self.sink.append(x)
    return x @ self.w.astype(dt)

  def __getitem__(self, index):
    return self.w[index]


def record_inputs(block: nnx.Module, x_BTD, names) -> dict[str, Stats]:
  """Stats of the inputs each of `names` (attributes of one layer's block) sees when the block runs on x."""
  sinks = {n: [] for n in names}
  saved = {n: getattr(block, n) for n in names}
  try:
    for n in names:
      setattr(block, n, _Recorder(saved[n][...], sinks[n]))
    block(x_BTD)
  finally:
    for n in names:
      setattr(block, n, saved[n])
  return {n: Stats.of(sinks[n][0]) for n in names}


def quantize(model: nnx.Module, plan: Plan, tokens_NT) -> nnx.Module:
  """Quantizes `model` in place by `plan` (and returns it), calibrating on `tokens_NT` (N sequences of T tokens),
  layer by layer: layer l's inputs come through the already-quantized layers before it."""
  check_plan(model, plan)
  names = {p: p[len("blocks/"):] for p in plan}
  graphdef, state = nnx.split(model.blocks)  # layer l alone: nnx.merge(graphdef, state[l])
  n_layers = jax.tree.leaves(state)[0].shape[0]
  x = model.embed(jnp.asarray(tokens_NT))
  pieces = {p: [] for p in plan}
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


def quantize_layer(block: nnx.Module, specs: dict[str, Spec], x_BTD) -> dict[str, Piece]:
  """Quantizes one layer's block (merged alone, no layer axis) in place: each weight `specs` names (relative to the
  block: "wq_DQ", "moe/w_up_EDF") by its spec, calibrated on the block's input `x_BTD`. Returns the pieces."""
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


def owner(root, name: str):
  """(module, attribute) of a path relative to `root`: "wq_DQ" or "moe/w_up_EDF" in a block, "blocks/wq_DQ" in a
  model."""
  *mods, attr = name.split("/")
  for m in mods:
    root = getattr(root, m)
  return root, attr


class _LayerQuantized(Quantized):
  """One layer's quantized weight (no layer axis), for the calibration forward of later layers."""

  def __init__(self, piece: Piece, spec: Spec):
    super().__init__([piece], tuple([None] * (piece.codes.ndim + 1)), [spec])
    for v in (self.codes, self.scale, self.smooth, self.act) + (() if self.zero is None else (self.zero,)):
      v.set_value(v.get_value()[0])


def quantized(model: nnx.Module) -> list[tuple[str, Quantized]]:
  return [(path_name(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, Quantized) and p]
