"""Loss-aware mixed precision: a bit-width per (layer, projection) from {2, 3, 4, 8, 16} under a size budget.

After Cheng & Chen, arXiv 2207.10083, "… Lower Loss" (shared/reference/methods.md §6).

Quantizing weight W_p (a projection of one layer, y = x W_p) to b bits moves its output by x ΔW_p(b): noise on the
input of what follows. To first order the loss moves by

  ΔL_p(b) ≈ ⟨∂L/∂y_p, x ΔW_p(b)⟩ = ⟨∂L/∂W_p, ΔW_p(b)⟩,   ΔW_p(b) = RTN_b(W_p) − W_p,

summed over the calibration tokens. The term has a sign: a layout whose terms add up below zero is predicted to have a
*lower* loss than full precision (the paper's claim, which `research/experiments/quantization.py` tests on held-out
data). The baseline is HAWQ-style (Dong et al. 2019/2020): ½ · Tr(H_p)/n_p · ‖ΔW_p(b)‖², Tr(H_p) the trace of the
loss Hessian's diagonal block of W_p by Hutchinson's estimator (E[vᵀHv], v Rademacher; one Hessian-vector product per
sample gives every block's estimate, the cross terms averaging to zero).

Their sum ("first_plus_hessian") is the second-order Taylor expansion with HAWQ's isotropic curvature per block.

The search: minimise Σ_p cost_p(b_p) subject to Σ_p bytes_p(b_p) ≤ budget, a multiple-choice knapsack. `exact` solves
it by dynamic programming over the budget in units of the greatest common divisor of the choices' sizes (exact, and
cheap here: every projection's size is a multiple of a few shapes); `greedy` starts every projection at its fewest
bits and upgrades, while the budget allows, the step of largest cost decrease per byte. bytes_p(b) = ⌈n_p·b/8⌉ plus a
float32 scale per output channel (or group) for b < 16: what `models/quant_store.py` writes.

References:
  Cheng, Chen, "Mixed-Precision Inference Quantization: Radically Towards Faster inference speed, Lower Storage
  requirement, and Lower Loss", arXiv 2207.10083, 2022 (no public code).
  Dong et al., "HAWQ: Hessian AWare Quantization of Neural Networks with Mixed-Precision", ICCV 2019, and
  "HAWQ-V2: Hessian Aware trace-Weighted Quantization of Neural Networks", NeurIPS 2020.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import quant
from models.transformer import cross_entropy

BITS = (2, 3, 4, 8, 16)
SENSITIVITIES = ("first_order", "hessian", "first_plus_hessian")


@dataclasses.dataclass
class Sensitivity:
  """Per unit (a projection path and a layer): its size and each bit-width's predicted loss change."""
  units: list[tuple[str, int]]  # (path, layer)
  bits: tuple[int, ...]
  bytes: np.ndarray  # (units, bits)
  first_order: np.ndarray  # (units, bits): ⟨∂L/∂W, ΔW(b)⟩
  hessian: np.ndarray | None = None  # (units, bits): ½ Tr(H)/n ‖ΔW(b)‖², once `add_hessian` ran
  traces: np.ndarray | None = None  # (units,): Hutchinson's Tr(H_p)
  trace_se: np.ndarray | None = None  # (units,): its standard error over the probes

  def cost(self, by: str) -> np.ndarray:
    """Each unit's predicted loss change per width.

    Args:
      by: "first_order", "hessian", or "first_plus_hessian" (their sum: the second-order Taylor term with HAWQ's
        isotropic curvature).

    Returns:
      (units, bits).

    Raises:
      quant.QuantError: when `by` is unknown, or asks for the Hessian term before `add_hessian` ran.
    """
    if by not in SENSITIVITIES:
      raise quant.QuantError(f"unknown sensitivity {by!r}; choose one of {', '.join(SENSITIVITIES)}")
    if by == "first_order":
      return self.first_order
    if self.hessian is None:
      raise quant.QuantError("no Hessian traces: run add_hessian first")
    return self.hessian if by == "hessian" else self.first_order + self.hessian


def unit_bytes(shape: tuple[int, ...], groups: int, bits: int) -> int:
  """Bytes one layer's weight takes in `models/quant_store.py`'s file.

  Codes packed at `bits`, and float32 scales (G, O) and smoothing (I,) for every leading index (written at 16 bits
  too).

  Args:
    shape: the layer's weight shape (..., I, O).
    groups: G, the scale rows (I / group, or 1 per output channel).
    bits: the codes' width.

  Returns:
    ⌈n·bits/8⌉ + 4·(leading size)·(G·O + I), n the weight's entries.
  """
  *lead, i, o = shape
  n, m = int(np.prod(shape)), int(np.prod(lead or [1]))
  return math.ceil(n * bits / 8) + 4 * m * (groups * o + i)


def _loss(model, x, y):
  return cross_entropy(model(x), y)


def _weights(model, paths):
  flat = quant.by_path(nnx.state(model, nnx.Param))
  return {p: flat[p] for p in paths}


def _delta(w, bits: int, group: int):
  """ΔW = RTN_b(W) − W for one layer's weight (16 bits: bfloat16 rounding)."""
  if bits == 16:
    return w.astype(jnp.bfloat16).astype(jnp.float32) - w
  codes, scale, zero = quant.rtn(w, quant.Spec("rtn", bits, group))
  return quant.dequantize(codes, scale, zero) - w


def sensitivity(model: nnx.Module, x_BT: jax.Array | np.ndarray, y_BT: jax.Array | np.ndarray,
                pattern: str = quant.DEFAULT_TARGETS, bits: tuple[int, ...] = BITS, group: int = 0) -> Sensitivity:
  """First-order loss changes of every (projection, layer) at every width, from the gradient on (x, y).

  ΔL_p(b) ≈ ⟨∂L/∂W_p, RTN_b(W_p) − W_p⟩, the cross-entropy's gradient taken once on the calibration batch.

  Args:
    model: the full-precision transformer (not changed).
    x_BT: the calibration tokens.
    y_BT: their targets.
    pattern: the target weights' regular expression (default `quant.DEFAULT_TARGETS`).
    bits: the widths to score (default `BITS`: 2, 3, 4, 8, 16).
    group: inputs per scale of the RTN rounding; 0 (default): per output channel.

  Returns:
    The `Sensitivity` with its units, their sizes and first-order costs (no Hessian term yet).
  """
  paths = list(quant.targets(model, pattern))
  grads = nnx.jit(nnx.grad(_loss))(model, jnp.asarray(x_BT), jnp.asarray(y_BT))
  flat_g = quant.by_path(grads)
  weights = _weights(model, paths)
  units, sizes, first = [], [], []
  for p in paths:
    w_all = jnp.asarray(weights[p].get_value(), jnp.float32)
    g_all = jnp.asarray(flat_g[p].get_value(), jnp.float32)
    for layer in range(w_all.shape[0]):
      w, g = w_all[layer], g_all[layer]
      groups = (w.shape[-2] // group) if group else 1
      units.append((p, layer))
      sizes.append([unit_bytes(w.shape, groups, b) for b in bits])
      first.append([float(jnp.sum(g * _delta(w, b, group))) for b in bits])
  return Sensitivity(units, tuple(bits), np.array(sizes, np.int64), np.array(first))


def add_hessian(sens: Sensitivity, model: nnx.Module, x_BT: jax.Array | np.ndarray, y_BT: jax.Array | np.ndarray,
                group: int = 0, samples: int = 8, seed: int = 0) -> Sensitivity:
  """Adds HAWQ's second-order term ½ Tr(H_p)/n_p ‖ΔW_p(b)‖² to `sens`, in place.

  Tr(H_p) is Hutchinson's estimate over `samples` probes (Rademacher on the target weights, zero elsewhere: the
  estimate of a block is v_pᵀ(Hv)_p, unbiased), one Hessian-vector product per probe, a few probes per batch.

  Args:
    sens: what `sensitivity` returned; its `hessian`, `traces` and `trace_se` are filled.
    model: the same full-precision transformer (not changed).
    x_BT: the calibration tokens.
    y_BT: their targets.
    group: inputs per scale of the RTN rounding; 0 (default): per output channel.
    samples: the Hutchinson probes (default 8).
    seed: the probes' seed (default 0).

  Returns:
    `sens`, with each unit's trace estimate and its standard error over the probes (inf with one probe).
  """
  paths = sorted({p for p, _ in sens.units})
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # flax: variadic tuple of states

  def loss(params, x, y):
    return _loss(nnx.merge(graphdef, params, rest), x, y)

  def probe(params, key):
    def one(path, x):
      name = "/".join(str(k.key) for k in path if hasattr(k, "key"))  # DictKeys; the last is the Variable's value
      if name not in paths:
        return jnp.zeros_like(x)
      return jax.random.rademacher(jax.random.fold_in(key, paths.index(name)), x.shape, x.dtype)
    return jax.tree_util.tree_map_with_path(one, params)

  flat = lambda tree: {k: v.get_value() for k, v in quant.by_path(tree).items()}

  @jax.jit
  def estimates(params, x, y, keys):  # {path: (probes, layers)}: v_pᵀ(Hv)_p per probe and layer
    v = jax.vmap(lambda k: probe(params, k))(keys)
    hvp = lambda vi: jax.jvp(lambda p: jax.grad(loss)(p, x, y), (params,), (vi,))[1]
    hv, vf = flat(jax.vmap(hvp)(v)), flat(v)
    return {p: jnp.sum(vf[p] * hv[p], axis=tuple(range(2, vf[p].ndim))) for p in paths}

  n_params = sum(x.size for x in jax.tree.leaves(params))
  chunk = max(1, min(samples, 2 ** 26 // n_params))  # probes per batch: a few copies of the model at most
  keys = jax.random.split(jax.random.key(seed), samples)
  x, y = jnp.asarray(x_BT), jnp.asarray(y_BT)  # arguments, not constants XLA would fold into the program
  parts = [estimates(params, x, y, keys[i:i + chunk]) for i in range(0, samples, chunk)]
  per_sample = {p: np.concatenate([np.asarray(part[p]) for part in parts]) for p in paths}
  weights = _weights(model, paths)
  rows, traces, ses = [], [], []
  for p, layer in sens.units:
    w = jnp.asarray(weights[p].get_value()[layer], jnp.float32)
    est = per_sample[p][:, layer]
    traces.append(float(est.mean()))
    ses.append(float(est.std(ddof=1) / np.sqrt(samples)) if samples > 1 else float("inf"))
    rows.append([0.5 * traces[-1] / w.size * float(jnp.sum(jnp.square(_delta(w, b, group)))) for b in sens.bits])
  sens.hessian, sens.traces, sens.trace_se = np.array(rows), np.array(traces), np.array(ses)
  return sens


def exact(cost: np.ndarray, sizes: np.ndarray, budget: int) -> np.ndarray:
  """The least-cost choice with Σ size ≤ budget, exactly: the multiple-choice knapsack by dynamic programming.

  The programme runs over the bytes above every unit's smallest choice, in units of their gcd.

  Args:
    cost: (units, bits), e.g. `Sensitivity.cost`.
    sizes: (units, bits) bytes, e.g. `Sensitivity.bytes`.
    budget: the bytes allowed.

  Returns:
    An index into the bit-widths per unit (units,).

  Raises:
    quant.QuantError: when even the smallest choices exceed the budget.
  """
  floor = int(sizes.min(1).sum())
  if floor > budget:
    raise quant.QuantError(f"a budget of {budget} bytes is below the smallest layout ({floor})")
  extra = sizes - sizes.min(1, keepdims=True)
  unit = int(np.gcd.reduce(extra[extra > 0])) if np.any(extra > 0) else 1
  cap = (budget - floor) // unit
  steps = extra // unit
  n = len(cost)
  best = np.full(cap + 1, np.inf)
  best[0] = 0.0
  pick = np.zeros((n, cap + 1), np.int8)
  for i in range(n):
    new = np.full(cap + 1, np.inf)
    for k in range(cost.shape[1]):
      s = steps[i, k]
      if s <= cap:
        cand = np.full(cap + 1, np.inf)
        cand[s:] = best[:cap + 1 - s] + cost[i, k]
        better = cand < new
        new[better], pick[i, better] = cand[better], k
    best = new
  c = int(np.argmin(best))
  choice = np.zeros(n, np.int64)
  for i in range(n - 1, -1, -1):
    choice[i] = pick[i, c]
    c -= steps[i, choice[i]]
  return choice


def greedy(cost: np.ndarray, sizes: np.ndarray, budget: int) -> np.ndarray:
  """A greedy choice with Σ size ≤ budget: the knapsack's heuristic next to `exact`.

  Every unit starts at its smallest choice; then, while the budget allows, the upgrade with the largest cost decrease
  per extra byte is taken (ties: the cheaper upgrade).

  Args:
    cost: (units, bits), e.g. `Sensitivity.cost`.
    sizes: (units, bits) bytes, e.g. `Sensitivity.bytes`.
    budget: the bytes allowed.

  Returns:
    An index into the bit-widths per unit (units,).

  Raises:
    quant.QuantError: when even the smallest choices exceed the budget.
  """
  choice = np.argmin(sizes, 1)
  if sizes[np.arange(len(cost)), choice].sum() > budget:
    raise quant.QuantError(f"a budget of {budget} bytes is below the smallest layout ({int(sizes.min(1).sum())})")
  used = int(sizes[np.arange(len(cost)), choice].sum())
  while True:
    best, best_gain = None, 0.0
    for i in range(len(cost)):
      for k in range(cost.shape[1]):
        extra = sizes[i, k] - sizes[i, choice[i]]
        gain = cost[i, choice[i]] - cost[i, k]
        if extra > 0 and used + extra <= budget and gain > 0 and gain / extra > best_gain:
          best, best_gain = (i, k), gain / extra
    if best is None:
      return choice
    i, k = best
    used += int(sizes[i, k] - sizes[i, choice[i]])
    choice[i] = k


def plan_of(sens: Sensitivity, choice: np.ndarray, group: int = 0) -> quant.Plan:
  """The RTN plan of a choice.

  Args:
    sens: the sensitivities the choice was made on (their units and widths).
    choice: one bit-width index per unit.
    group: inputs per scale; 0 (default): per output channel.

  Returns:
    {path: [Spec per layer]}, for `quant.quantize`.
  """
  plan: quant.Plan = {}
  for (p, layer), k in zip(sens.units, choice):
    plan.setdefault(p, {})[layer] = quant.Spec("rtn", sens.bits[k], group)
  return {p: [specs[layer] for layer in sorted(specs)] for p, specs in plan.items()}


def predicted(sens: Sensitivity, choice: np.ndarray, by: str = "first_order") -> float:
  """The predicted loss change of a choice: the sum of its units' costs.

  Args:
    sens: the sensitivities.
    choice: one bit-width index per unit.
    by: the cost (see `Sensitivity.cost`; default "first_order").

  Returns:
    Σ_p cost_p(b_p).
  """
  return float(sens.cost(by)[np.arange(len(choice)), choice].sum())


def layout_bytes(sens: Sensitivity, choice: np.ndarray) -> int:
  """The bytes of a choice's weights in `models/quant_store.py`'s file.

  Args:
    sens: the sensitivities (their sizes).
    choice: one bit-width index per unit.

  Returns:
    Σ_p bytes_p(b_p).
  """
  return int(sens.bytes[np.arange(len(choice)), choice].sum())
