"""Choosing, per layer, which quantization algorithm to use: CALM's CKA-guided choice, and the same choice by MSE.

CALM: Zhang et al., arXiv 2512.16282 (shared/reference/methods.md §5); the choice by output MSE is its baseline.

  linear_cka(X, Y) = ‖Ycᵀ Xc‖²_F / (‖Xcᵀ Xc‖_F · ‖Ycᵀ Yc‖_F),  Xc, Yc column-centred (tokens × features)

(Kornblith et al. 2019). CKA is invariant to isotropic scaling and to orthogonal transforms of either argument: a
quantized layer whose output is the full-precision one times a constant scores a perfect 1, an error the choice by
MSE sees and CKA does not.

`choose(model, candidates, tokens, by="cka")` walks the layers in order. For layer l, every candidate spec quantizes
all of the layer's target projections (the layer is CALM's unit of choice), and the block's update (its output minus
its input: what the layer adds to the residual stream; the stream itself would put every score near 1) on the
calibration set is compared with the full-precision block's update on the same input. The best candidate (largest
CKA, or smallest MSE) is kept, and its quantized layer gives layer l+1 its input, as `quant.quantize` calibrates.
Returns the plan (for `quant.quantize`, or to save with `quant.write_plan`) and every layer's scores.

`one_layer_losses(model, candidates, tokens, batches)` measures what the selection scores stand in for: the mean
loss on `batches` with one layer quantized by one candidate and every other layer in full precision, for every
(layer, candidate) — the choice an oracle that sees the held-out loss would make, one layer at a time. The residual
stream at each layer's input is computed once and kept, so layer l's candidates run layers l…L−1 only.

References:
  Zhang, Zhang, Cheng, Sun, Yan, "CALM: A CKA-Guided Adaptive Layer-Wise Modularization Framework for LLM
  Quantization", arXiv 2512.16282, 2025 (no public code).
  Kornblith, Norouzi, Lee, Hinton, "Similarity of Neural Network Representations Revisited", ICML 2019.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import quant
from models.transformer import Transformer, cross_entropy, run_blocks


def linear_cka(x: jax.Array, y: jax.Array) -> jax.Array:
  """Linear CKA of two representations of the same tokens.

  linear_cka(X, Y) = ‖Ycᵀ Xc‖²_F / (‖Xcᵀ Xc‖_F · ‖Ycᵀ Yc‖_F), Xc, Yc column-centred; 1 when y is x up to an isotropic
  scale and an orthogonal transform.

  Args:
    x: (n, d1) (leading axes flattened into n).
    y: (n, d2), the same n tokens.

  Returns:
    The scalar CKA in [0, 1], float32.

  References:
    Kornblith, Norouzi, Lee, Hinton, "Similarity of Neural Network Representations Revisited", ICML 2019.
  """
  x = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
  y = jnp.asarray(y, jnp.float32).reshape(-1, y.shape[-1])
  x, y = x - x.mean(0), y - y.mean(0)
  fro = lambda a: jnp.sqrt(jnp.sum(jnp.square(a)))
  return jnp.sum(jnp.square(y.T @ x)) / (fro(x.T @ x) * fro(y.T @ y))


def mse(x: jax.Array, y: jax.Array) -> jax.Array:
  """The mean squared difference of two outputs of the same shape: the choice by MSE's score.

  Args:
    x: one output.
    y: the other.

  Returns:
    The scalar mean of (x − y)², float32.
  """
  return jnp.mean(jnp.square(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)))


SCORES = {"cka": (linear_cka, max), "mse": (mse, min)}


def pick(full: jax.Array, outputs: dict, by: str = "cka") -> tuple[str, dict[str, float]]:
  """The output closest to `full` by a score.

  Args:
    full: the full-precision output.
    outputs: {name: the output of one candidate}, each shaped like `full`.
    by: "cka" (default; largest wins) or "mse" (smallest wins).

  Returns:
    (the name in `outputs` closest to `full`, every output's score).

  Raises:
    quant.QuantError: when `by` is unknown.
  """
  if by not in SCORES:
    raise quant.QuantError(f"unknown selection score {by!r}; choose one of {', '.join(SCORES)}")
  score, best = SCORES[by]
  scores = {name: float(score(full, out)) for name, out in outputs.items()}
  return best(scores, key=scores.__getitem__), scores


def _layers(model: Transformer, candidates: dict[str, quant.Spec], pattern: str):
  """(target paths, their names in a block, the blocks' graphdef and layer-stacked state).

  Every candidate is checked first to apply to every target.
  """
  if not candidates:
    raise quant.QuantError("no candidate algorithms to choose from")
  paths = list(quant.targets(model, pattern))
  for spec in candidates.values():
    quant.check_plan(model, quant.uniform_plan(model, spec, pattern))
  return paths, [p[len("blocks/"):] for p in paths], *nnx.split(model.blocks)


def choose(model: Transformer, candidates: dict[str, quant.Spec], tokens_NT: jax.Array | np.ndarray, by: str = "cka",
           pattern: str = quant.DEFAULT_TARGETS) -> tuple[quant.Plan, list[dict[str, float]]]:
  """CALM's per-layer choice: the candidate whose block update best matches full precision.

  Layers are walked in order; each candidate quantizes all of layer l's target projections, the block's update
  (output minus input) on the calibration set is compared with the full-precision block's, and the chosen candidate's
  quantized layer gives layer l+1 its input. The model is not changed.

  Args:
    model: the full-precision transformer.
    candidates: {name: spec}, each applied to every target projection of a layer.
    tokens_NT: the calibration set, N sequences of T tokens.
    by: "cka" (default, CALM) or "mse".
    pattern: the target weights' regular expression (default `quant.DEFAULT_TARGETS`).

  Returns:
    (plan, scores): the plan for `quant.quantize`, and `scores[l][name]` for every layer and candidate.

  Raises:
    quant.QuantError: when `by` is unknown, there is no candidate, or a candidate does not fit a target.
  """
  if by not in SCORES:
    raise quant.QuantError(f"unknown selection score {by!r}; choose one of {', '.join(SCORES)}")
  paths, names, graphdef, state = _layers(model, candidates, pattern)
  n_layers = jax.tree.leaves(state)[0].shape[0]
  layer_state = lambda layer: jax.tree.map(lambda a: a[layer], state)
  x = model.embed(jnp.asarray(tokens_NT))
  chosen, table = [], []
  for layer in range(n_layers):
    full_update = nnx.merge(graphdef, layer_state(layer))(x)[0] - x
    outputs = {}
    for name, spec in candidates.items():
      block = nnx.merge(graphdef, layer_state(layer))
      quant.quantize_layer(block, {n: spec for n in names}, x)
      outputs[name] = block(x)[0]
    name, scores = pick(full_update, {n: y - x for n, y in outputs.items()}, by)
    chosen.append(name)
    table.append(scores)
    x = outputs[name]
  plan = {p: [candidates[c] for c in chosen] for p in paths}
  return plan, table


def one_layer_losses(model: Transformer, candidates: dict[str, quant.Spec], tokens_NT: jax.Array | np.ndarray,
                     batches: list, pattern: str = quant.DEFAULT_TARGETS) -> tuple[float, list[dict[str, float]]]:
  """The held-out loss with one layer quantized by one candidate, for every (layer, candidate): the oracle's table.

  Layer l's target projections are quantized by candidate `name` (calibrated on `tokens_NT` through the
  full-precision layers before it, as `quant.quantize` calibrates a plan that quantizes layer l alone) and every other
  layer stays in full precision. The model is not changed. The candidates are refused as `choose` refuses them
  (quant.QuantError).

  Args:
    model: the full-precision transformer.
    candidates: {name: spec}, each applied to every target projection of a layer.
    tokens_NT: the calibration set, N sequences of T tokens.
    batches: the held-out batches [(tokens_BT, targets_BT), ...].
    pattern: the target weights' regular expression (default `quant.DEFAULT_TARGETS`).

  Returns:
    (full-precision loss, `losses[l][name]`): mean cross entropies over `batches`.
  """
  _, names, graphdef, state = _layers(model, candidates, pattern)
  n_layers = jax.tree.leaves(state)[0].shape[0]
  layer_state = lambda layer: jax.tree.map(lambda a: a[layer], state)
  model_def, model_state = nnx.split(model)

  @jax.jit
  def tail_loss(model_state, tail, x_BTD, targets_BT):  # layers l+1…L−1 (tail's leading axis), head, loss
    x_BTD, _ = run_blocks(nnx.merge(graphdef, tail), x_BTD)
    return cross_entropy(nnx.merge(model_def, model_state).unembed(x_BTD), targets_BT)

  one_block = jax.jit(lambda block_def, block_state, x: nnx.merge(block_def, block_state)(x)[0], static_argnums=0)
  run = lambda block, x: one_block(*nnx.split(block), x)
  mean_loss = lambda tail, xs: (sum(float(tail_loss(model_state, tail, x, y)) for x, (_, y) in zip(xs, batches))
                                / len(xs))
  xs = [model.embed(jnp.asarray(t)) for t, _ in batches]  # the held-out residual stream at layer l's input
  calib = model.embed(jnp.asarray(tokens_NT))  # the calibration stream at layer l's input
  full = mean_loss(state, xs)
  table = []
  for layer in range(n_layers):
    here, tail = layer_state(layer), jax.tree.map(lambda a: a[layer + 1:], state)
    row = {}
    for name, spec in candidates.items():
      block = nnx.merge(graphdef, here)  # quantize_layer replaces the merged block's weights, not `here`
      quant.quantize_layer(block, {n: spec for n in names}, calib)
      row[name] = mean_loss(tail, [run(block, x) for x in xs])
    table.append(row)
    block = nnx.merge(graphdef, here)
    xs, calib = [run(block, x) for x in xs], block(calib)[0]
  return full, table
