"""BREAD's backward passes for the blockwise step (research/train/steps/blockstep.py):
`models.blockwise.backprop_to_layer` with a visit that updates each layer above the active one as the pass reaches it —
by SGD (`stepped_backward`) or through its rank-r factors (`lowrank_backward`) — on top of
`research.train.steps.step.head_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.blockwise import backprop_to_layer, layer_weights
from optim import factor_delta, factor_grads
from optim.trees import path_name
from research.train.steps.step import head_loss


def stepped_backward(model, params, master, b, x, y, step, sign: bool):
  """BREAD-SGD's backward (`models.blockwise.backprop_to_layer`): ((total, (ce, aux)), ∂total/∂master, params with
  every layer above b stepped by `step`·g (or `step`·sign(g)) as the pass reaches it, in place. A layer whose
  gradient is not finite keeps its weights (the step's finite check then leaves the rest unchanged; layers above a
  non-finite one have already moved)."""
  w = layer_weights(model, b)
  nnx.replace_by_pure_dict(w, master)

  def visit(l, weights, grads, extra):
    fine = _finite(grads)
    new = jax.tree.map(lambda p, g: jnp.where(fine, p + jnp.asarray(step, g.dtype) * (jnp.sign(g) if sign else g),
                                              p).astype(p.dtype), weights, grads)
    return new, extra

  total, out, g_w, blocks, _ = backprop_to_layer(model, x, w, b, head_loss(model, y), visit, ())
  return (total, out), nnx.to_pure_dict(g_w), {**params, "blocks": blocks}


def _finite(tree) -> jax.Array:
  """Whether every entry of a layer's gradient tree is finite (a layer that is not keeps its weights)."""
  return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]))


def _block_names(blocks) -> list[str]:
  """The parameter-tree path names ("blocks/attn/wq_DQ", as optim.bread keys its factors) of a layer tree's leaves."""
  return ["blocks/" + path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(blocks)[0]]


def lowrank_backward(model, params, master, b, x, y, factors, fstate, inner, step, scale):
  """BREAD's low-rank step inside its backward (`models.blockwise.backprop_to_layer`): as the pass reaches a layer
  l above b with W's gradient G, the layer's factors take their gradients s·G Bᴴ, s·Aᴴ G (`optim.bread.factor_grads`)
  and their AdamW step on layer l's slice of the factors' state, (A', B') = (A, B) + `step`·update, and W moves by
  s·(A'B' − AB) (`optim.bread.factor_delta`), in place. Returns ((total, (ce, aux)), ∂total/∂master, params,
  factors, factors' state).

  Per layer is the optax transform's update (optim.bread over the whole factor tree) because AdamW is elementwise:
  within a block period the layers in reach are the same every step and the state restarts at each switch, so the
  moments of the layers out of reach are zeros the transform decays to zeros. The state's scalars (the count) step
  once per update, as the transform's do. A layer whose gradient is not finite keeps its weights, factors and
  moments (BREAD-SGD's rule); layers above it have moved. A step found non-finite only afterwards (its loss, or the
  active layer's update) keeps what the pass already moved, those layers' moments one update ahead of the count it
  keeps (the transform would keep everything: a difference in a step that is being discarded anyway). Merging after
  the pass instead, in a second loop over the stored stack, made XLA:CPU fuse the read of layer l into the write and
  copy the stack (caught by tests/research/test_memory.py)."""
  w = layer_weights(model, b)
  nnx.replace_by_pure_dict(w, master)
  sliced = lambda tree, l: jax.tree.map(lambda z: jax.lax.dynamic_index_in_dim(z, l - 1, 0, keepdims=False)
                                        if z.ndim else z, tree)
  put = lambda tree, new, l: jax.tree.map(lambda z, n: jax.lax.dynamic_update_index_in_dim(z, n, l - 1, 0)
                                          if z.ndim else z, tree, new)

  def visit(l, weights, grads, carry):
    fs, st = carry
    pure = nnx.to_pure_dict(grads)
    g_of = dict(zip(_block_names(pure), jax.tree.leaves(pure)))
    fine = _finite(pure)
    f_l = sliced(fs, l)
    g_l = {name: factor_grads(g_of[name].astype(f["a_IR"].dtype), f["a_IR"], f["b_RO"], scale)
           for name, f in f_l.items()}
    u_l, st_l = inner.update(g_l, sliced(st, l), f_l)
    d_l = jax.tree.map(lambda u: jnp.where(fine, jnp.asarray(step, u.dtype) * u, 0), u_l)
    new_f = jax.tree.map(jnp.add, f_l, d_l)
    dw = {name: factor_delta(d_l[name]["a_IR"], d_l[name]["b_RO"], new_f[name]["a_IR"], f_l[name]["b_RO"], scale)
          for name in f_l}
    w_pure = nnx.to_pure_dict(weights)
    names = _block_names(w_pure)
    new_w = [(x + dw[n].astype(x.dtype)) if n in dw else x for n, x in zip(names, jax.tree.leaves(w_pure))]
    keep = lambda new, old: jax.tree.map(lambda a, o: jnp.where(fine, a, o), new, old)
    nnx.replace_by_pure_dict(weights, jax.tree.unflatten(jax.tree.structure(w_pure), new_w))  # `_at`'s own slice
    return weights, (put(fs, new_f, l), put(st, keep(st_l, sliced(st, l)), l))

  total, out, g_w, blocks, (factors, new_state) = backprop_to_layer(model, x, w, b, head_loss(model, y), visit,
                                                                    (factors, fstate))
  # the scalars (AdamW's count) as the transform steps them, whatever the number of layers in reach
  probe = inner.update(jax.tree.map(jnp.zeros_like, sliced(factors, 1)), sliced(fstate, 1), sliced(factors, 1))[1]
  new_state = jax.tree.map(lambda z, p: z if z.ndim else p, new_state, probe)
  return (total, out), nnx.to_pure_dict(g_w), {**params, "blocks": blocks}, factors, new_state
