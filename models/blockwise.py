"""Backprop that stops at one layer: the loss as a function of layer b's weights alone (BAdam's active block).

Its gradient so computes no other layer's weight gradient and no activation gradient below layer b.

The blocks are stacked (leading axis L) and scanned; b is traced, so one compiled program serves every block (BAdam
switches blocks without recompiling). `active_layer_loss` runs the forward in three pieces:

  below   h_b = layers 0 .. b−1: a scan over all L layers whose step is `lax.cond(l < b, layer, identity)`, its input
          and weights under stop_gradient (nothing below b is differentiated; the scan is never transposed);
  active  h_{b+1} = layer(w, h_b), w the variable differentiated (its gradient is layer b's weight gradient);
  above   h_L = the scan again with `lax.cond(l > b, layer, identity)`, the stacked weights constants: its backward
          carries the activation gradient down to layer b and computes no weight gradient.

At run time the conds take one branch, so each layer's forward runs once, each layer above b runs one activation
backward (~1× its forward FLOPs instead of 2× with weight gradients) and the layers below b none. Per step, in units of
one layer's forward F (the embedding/head work aside): forward L·F, backward 2F (layer b) + (L − 1 − b)·F, against
L·F + 2L·F for full backprop; averaged over a cycle of the L blocks: L·F + 2F + (L − 1)F/2 ≈ 1.5·L·F vs 3·L·F, i.e.
≈ 0.5× (+ the head's share). XLA's static cost analysis counts both branches of each cond, so measure this at run
time (or compile a step per block with the split made static, `static_split=True`, which gives the exact per-block
cost analysis).

The MoE aux losses of every layer are kept (their router statistics above b depend on w through h), so the loss and
gradient equal full backprop's restricted to layer b. Not for the pipeline (`stage`) or context-parallel layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.params import layer_checkpoint
from sharding.context import mesh_context
from sharding.pipeline import mesh_stages

if TYPE_CHECKING:
  from models.transformer import Transformer


class BlockwiseError(ValueError):
  """A model layout the active-layer backward does not run on."""


def _at(stacked, l):
  """Layer l's slice of a stacked tree (l may be traced)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, l, 0, keepdims=False), stacked)


def _layers(model, remat: bool):
  """(the stacked block state, layer(x, state) -> (x, aux) applying one layer's state).

  The layer is rematerialised in the backward when `remat`.
  """
  graphdef, stacked = nnx.split(model.blocks)

  def layer(x, state):
    return nnx.merge(graphdef, state)(x)

  return stacked, layer_checkpoint(layer, stacked, model.c.compute_dtype, remat)


def layer_weights(model: Transformer, b: int | jax.Array) -> nnx.State:
  """Layer b's slice of the stacked block state.

  Args:
    model: the transformer.
    b: the layer index (may be traced).

  Returns:
    An nnx State of one layer (the stack's leading axis L indexed away).
  """
  return _at(nnx.split(model.blocks)[1], b)


def active_layer_forward(model: Transformer, tokens_BT: jax.Array, w: nnx.State, b: int | jax.Array, *,
                         static_split: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The forward of `model` with layer b's weights replaced by `w`, differentiable w.r.t. `w` only (module docstring).

  Args:
    model: the transformer (not under a pipeline or context-parallel mesh).
    tokens_BT: the input tokens.
    w: layer b's weights, a `layer_weights` slice.
    b: the active layer (traced, unless `static_split`).
    static_split: b is a Python int and the stack is sliced statically (one program per block, whose cost analysis is
      exact); default False: one program for every b.

  Returns:
    (logits_BTV, aux), aux stacked over the L layers as `Transformer.forward`'s.

  Raises:
    BlockwiseError: when the mesh has a pipeline (`stage`) or context-parallel axis.

  References:
    Luo, Yu, Li, "BAdam: A Memory Efficient Full Parameter Optimization Method for Large Language Models", 2024,
    arXiv 2404.02827; Ledzy/BAdam.
  """
  if mesh_stages() > 1 or mesh_context() > 1:
    raise BlockwiseError("the active-layer backward (BAdam's truncated backprop) runs without a pipeline (stage) "
                         "or context-parallel mesh axis")
  remat = model.c.remat
  stacked, layer = _layers(model, remat)
  frozen = jax.lax.stop_gradient(stacked)
  x_BTD = jax.lax.stop_gradient(model.embed(tokens_BT))
  aux_shape = jax.eval_shape(lambda x, s: layer(x, s)[1], x_BTD, w)
  L = jax.tree.leaves(stacked)[0].shape[0]
  if static_split:
    x_BTD, aux_below = jax.lax.scan(layer, x_BTD, jax.tree.map(lambda a: a[:b], frozen))
    x_BTD = jax.lax.stop_gradient(x_BTD)
    x_BTD, aux_b = layer(x_BTD, w)
    x_BTD, aux_above = jax.lax.scan(layer, x_BTD, jax.tree.map(lambda a: a[b + 1:], frozen))
    aux = jax.tree.map(lambda lo, mid, hi: jnp.concatenate([lo, mid[None], hi]), aux_below, aux_b, aux_above)
    return model.unembed(x_BTD), aux

  def masked(run, layer_of):  # a scan step applying layer l where run(l), else passing x on with zero aux
    def step(x, inputs):
      state, l = layer_of(inputs)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
      return jax.lax.cond(run(l), lambda: layer(x, state), lambda: (x, zeros))
    return step

  def scan(run, x):
    # The stack is the scan's constant, sliced in a checkpointed step that keeps neither the slice nor its casts:
    # scanning the stack as an input instead, a layer's weights handed to the cond come out of it as residuals, which
    # the scan stacks: a copy of the model (docs/benchmarks.md, "A 3B model on this 24 GiB machine"), and without
    # remat their float32 casts beside it. With remat the step is recomputed whole (the scan keeps x and l per
    # layer); without, the products' outputs are kept and the rest recomputed (`layer_checkpoint`'s policy).
    step = masked(run, lambda l: (_at(frozen, l), l))
    policy = None if remat else jax.checkpoint_policies.dots_saveable
    return jax.lax.scan(jax.checkpoint(step, prevent_cse=False, policy=policy), x, ls)

  ls = jnp.arange(L)
  x_BTD, aux_below = scan(lambda l: l < b, x_BTD)
  x_BTD, aux_b = layer(jax.lax.stop_gradient(x_BTD), w)
  x_BTD, aux_above = scan(lambda l: l > b, x_BTD)
  here = (ls == b)
  aux = jax.tree.map(lambda lo, mid, hi: jax.lax.stop_gradient(lo) + hi +
                     jnp.where(here.reshape((L,) + (1,) * mid.ndim), mid[None], jnp.zeros_like(mid)[None]),
                     aux_below, aux_b, aux_above)
  return model.unembed(x_BTD), aux


def backprop_to_layer(model: Transformer, tokens_BT: jax.Array, w: nnx.State, b: int | jax.Array,
                      head_loss: Callable[[jax.Array, Any], tuple[jax.Array, Any]],
                      visit: Callable[[jax.Array, Any, Any, Any], tuple[Any, Any]], extra: Any) -> tuple:
  """The loss and its gradient w.r.t. layer b's weights `w`, by a backward pass written out layer by layer.

  The backward runs from the top down to b and hands each deeper layer l > b its weight gradient as it goes:
  `(new_l, extra) = visit(l, weights_l, grads_l, extra)` (BREAD's inactive blocks in reach, updated in the same
  pass), the layer's weights in the stack replaced by `new_l` in place. No gradient of a layer below b and no
  activation gradient below b is computed; no stack-sized gradient ever exists.

  Forward: one scan over the L layers (layer b with `w`), keeping each layer's input (L activations: what --remat
  keeps); `head_loss(logits_BTV, aux) -> (loss, out)` on top. Backward: a loop l = L−1 .. b+1 recomputing layer l from
  its input and pulling the cotangent through it (its vjp: activation and weight gradients), then layer b's vjp for
  ∂loss/∂w. FLOPs per step in units of one layer's forward F: L·F + 3F·(L − b) (each layer at or above b recomputed,
  then differentiated), against 3·L·F + L·F for remat'd full backprop.

  Dense and MoE layers alike (the aux outputs' cotangents come from `head_loss`); not for the pipeline (`stage`) or
  context-parallel layouts.

  Args:
    model: the transformer.
    tokens_BT: the input tokens.
    w: layer b's weights, a `layer_weights` slice.
    b: the active layer (traced).
    head_loss: `head_loss(logits_BTV, aux) -> (loss, out)`, the loss on top of the blocks and any auxiliary output.
    visit: `visit(l, weights_l, grads_l, extra) -> (new_l, extra)`, called for each layer l > b from the top down
      with its weights and weight gradient; `new_l` replaces the layer's weights in the stack.
    extra: the state `visit` threads through the layers.

  Returns:
    (loss, out, ∂loss/∂w, the stacked block weights after the visits as a pure dict, extra).

  Raises:
    BlockwiseError: when the mesh has a pipeline (`stage`) or context-parallel axis.

  References:
    Luo, Shen, Peng, Li, Li, "Accelerating Block Coordinate Descent for LLM Finetuning via Landscape Expansion"
    (BREAD), NeurIPS 2025 (OpenReview DBybUx7ARy).
  """
  if mesh_stages() > 1 or mesh_context() > 1:
    raise BlockwiseError("the layer-by-layer backward (BREAD's blockwise step) runs without a pipeline (stage) or "
                         "context-parallel mesh axis")
  stacked, layer = _layers(model, remat=False)
  stacked = jax.lax.stop_gradient(stacked)
  L = jax.tree.leaves(stacked)[0].shape[0]

  def forward(x, l):
    y, aux = jax.lax.cond(l == b, lambda: layer(x, w), lambda: layer(x, _at(stacked, l)))
    return y, (x, aux)

  x0 = jax.lax.stop_gradient(model.embed(tokens_BT))
  h, (inputs, aux) = jax.lax.scan(forward, x0, jnp.arange(L))
  loss, pull, out = jax.vjp(lambda h, aux: head_loss(model.unembed(h), aux), h, aux, has_aux=True)
  ct_h, ct_aux = pull(jnp.ones_like(loss))

  def down(i, carry):
    ct, stack, extra = carry
    l = L - 1 - i
    weights = _at(stack, l)
    _, back = jax.vjp(layer, _at(inputs, l), weights)
    ct_x, g = back((ct, _at(ct_aux, l)))
    new, extra = visit(l, weights, g, extra)
    stack = jax.tree.map(lambda s, n: jax.lax.dynamic_update_index_in_dim(s, n.astype(s.dtype), l, 0), stack, new)
    return ct_x, stack, extra

  ct_b, stack, extra = jax.lax.fori_loop(0, L - 1 - b, down, (ct_h, stacked, extra))
  _, back = jax.vjp(lambda m: layer(_at(inputs, b), m), w)
  g_w, = back((ct_b, _at(ct_aux, b)))
  return loss, out, g_w, nnx.to_pure_dict(stack), extra


def frozen_below_forward(model: Transformer, tokens_BT: jax.Array, upper: nnx.State,
                         n: int) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The forward of `model` with layers 0..n−1 frozen (--freeze-layers).

  The frozen layers run from the model's own stack under stop_gradient (as does the embedding below them), layers
  n..L−1 from `upper`. The backward therefore stops at layer n: no weight gradient and no activation gradient below
  it. Dense and MoE alike; not for the pipeline (`stage`) or context-parallel layouts.

  Args:
    model: the transformer.
    tokens_BT: the input tokens.
    upper: a State of the stack's layers n.. (`upper_layers`), the differentiable part.
    n: the number of frozen layers; static (one program).

  Returns:
    (logits_BTV, aux), aux stacked over the L layers.

  Raises:
    BlockwiseError: when the mesh has a pipeline (`stage`) or context-parallel axis.
  """
  if mesh_stages() > 1 or mesh_context() > 1:
    raise BlockwiseError("--freeze-layers runs without a pipeline (stage) or context-parallel mesh axis")
  stacked, layer = _layers(model, model.c.remat)
  x_BTD = jax.lax.stop_gradient(model.embed(tokens_BT))
  x_BTD, aux_below = jax.lax.scan(layer, x_BTD, jax.lax.stop_gradient(jax.tree.map(lambda a: a[:n], stacked)))
  x_BTD, aux_above = jax.lax.scan(layer, jax.lax.stop_gradient(x_BTD), upper)
  aux = jax.tree.map(lambda lo, hi: jnp.concatenate([jax.lax.stop_gradient(lo), hi]), aux_below, aux_above)
  return model.unembed(x_BTD), aux


def upper_layers(model: Transformer, n: int, weights: dict) -> nnx.State:
  """The stack's layers n.. as a State, for `frozen_below_forward`.

  Args:
    model: the transformer whose stack gives the State's structure.
    n: the number of frozen layers below.
    weights: the layers' values, a pure dict shaped like the stack's layers n...

  Returns:
    A State of layers n..L−1 holding `weights`.
  """
  upper = jax.tree.map(lambda a: a[n:], nnx.split(model.blocks)[1])
  nnx.replace_by_pure_dict(upper, weights)
  return upper
