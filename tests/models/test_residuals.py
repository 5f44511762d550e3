"""What a backward pass keeps of a model stored in bfloat16 and computed in float32: the products' outputs, never a
float32 copy of a weight (models.params.layer_checkpoint, models.transformer.head_logits)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from models import Transformer, TransformerConfig, transformer
from models.blockwise import active_layer_forward, layer_weights
from models.transformer import head_logits


def saved_residuals(f, *args) -> list:
  """(aval-like, why) for each value the backward of `f` keeps, read from JAX's public `print_saved_residuals`."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(f, *args)
  kept = []
  for line in out.getvalue().splitlines():
    m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
    assert m, line
    shape = tuple(int(d) for d in m[2].split(",") if d)
    kept.append((jax.ShapeDtypeStruct(shape, {"f32": jnp.float32, "bf16": jnp.bfloat16}.get(m[1], jnp.int32)), m[3]))
  return kept


TINY = dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128)


def _weight_shaped(residuals, shapes) -> list:
  """The float32 residuals shaped like a weight (or a stack of them) in `shapes`."""
  return [(a.shape, why) for a, why in residuals if a.dtype == jnp.float32 and
          (tuple(a.shape) in shapes or tuple(a.shape[1:]) in shapes)]


def _shapes(tree) -> set:
  return {tuple(a.shape[1:]) for a in jax.tree.leaves(tree)} | {tuple(a.shape) for a in jax.tree.leaves(tree)}


def test_full_backprop_keeps_no_float32_weight_of_a_bfloat16_model(monkeypatch):
  model = Transformer(TransformerConfig(**TINY, param_dtype="bfloat16"), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  x = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 256
  loss = lambda p: nnx.merge(graphdef, p)(x)[0].astype(jnp.float32).mean()
  weights = {s for s in _shapes(params.blocks) if len(s) == 2}
  assert weights and not _weight_shaped(saved_residuals(loss, params), weights)
  g = jax.grad(loss)(params)
  # the backward that keeps everything (the float32 casts with it) computes the same gradients
  monkeypatch.setattr(transformer, "layer_checkpoint", lambda layer, *_: layer)
  assert _weight_shaped(saved_residuals(loss, params), weights)  # the check above can fail
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(jax.grad(loss)(params))):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-9)


def test_the_active_layer_backward_keeps_no_weight_of_the_frozen_stack():
  """BAdam's step without --remat: the layers above the active one keep activations, not their (cast) weights."""
  model = Transformer(TransformerConfig(**TINY, param_dtype="bfloat16"), rngs=nnx.Rngs(0))
  x = jnp.zeros((1, 8), jnp.int32)
  master = jax.tree.map(lambda a: a.astype(jnp.float32), nnx.to_pure_dict(layer_weights(model, 1)))

  def loss(m):
    w = layer_weights(model, 1)
    nnx.replace_by_pure_dict(w, m)
    return active_layer_forward(model, x, w, jnp.int32(1))[0].sum()

  stacked = nnx.split(model.blocks)[1]
  weights = {s for s in _shapes(stacked) if len(s) == 2}
  kept = [(a, why) for a, why in saved_residuals(loss, master)  # the stack itself (a constant, stop_gradient: no copy)
          if not any(w in why for w in ("argument", "constant", "stop_gradient"))]
  assert not _weight_shaped(kept, weights), kept
  assert not [a for a, _ in kept if a.ndim == 3 and tuple(a.shape[1:]) in weights]  # nor the bfloat16 stack


def test_a_narrow_head_is_widened_in_slices_with_the_same_logits_and_gradients(monkeypatch):
  D, V = 64, 4096
  monkeypatch.setattr(transformer, "HEAD_CHUNK_BYTES", D * 4 * V // 4)  # four slices of the float32 head
  k1, k2 = jax.random.split(jax.random.key(0))
  h = jax.random.normal(k1, (2, 3, D), jnp.float32)
  w = (jax.random.normal(k2, (D, V), jnp.float32) * 0.02).astype(jnp.bfloat16)
  whole = lambda h, w: jnp.einsum("btd,dv->btv", h, w.astype(jnp.float32))
  np.testing.assert_allclose(head_logits(h, w, 1, jnp.float32), whole(h, w), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(head_logits(h, w.T, 0, jnp.float32), whole(h, w), rtol=1e-6, atol=1e-6)
  ct = jax.random.normal(k1, (2, 3, V))
  gh, gw = jax.grad(lambda h, w: (head_logits(h, w, 1, jnp.float32) * ct).sum(), (0, 1))(h, w)
  rh, rw = jax.grad(lambda h, w: (whole(h, w) * ct).sum(), (0, 1))(h, w)
  np.testing.assert_allclose(gh, rh, rtol=1e-5, atol=1e-6 * np.abs(rh).max())  # sums over V in another order
  np.testing.assert_allclose(np.asarray(gw, np.float32), np.asarray(rw, np.float32), rtol=1e-2, atol=1e-3)
  kept = saved_residuals(lambda h: head_logits(h, w, 1, jnp.float32).sum(), h)
  assert not [a for a, _ in kept if a.dtype == jnp.float32 and a.size >= D * V // 4], kept  # no widened slice
