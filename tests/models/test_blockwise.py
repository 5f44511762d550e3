"""The active-layer backward (models/blockwise.py): its loss and layer-b gradient equal full backprop's, for every b
(traced, one program) and with the split made static; in the compiled program no weight gradient is computed inside
a loop (only the active layer's, once) — full backprop computes them in its scan's backward loop."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Transformer, cross_entropy, preset, transformer
from models.blockwise import active_layer_forward, layer_weights
from models.moe import aux_loss

B, T = 2, 24


def model_and_batch(name):
  config = dataclasses.replace(preset(name), n_layers=3)
  model = Transformer(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  x, y = (jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32) for _ in range(2))
  return model, x, y


def full_loss(model, x, y):
  logits, aux = model.forward(x)
  return cross_entropy(logits, y) + aux_loss(aux, model.c)


def active_loss(w, graphdef, params, rest, x, y, b, static=False):
  model = nnx.merge(graphdef, params, rest)
  logits, aux = active_layer_forward(model, x, w, b, static_split=static)
  return cross_entropy(logits, y) + aux_loss(aux, model.c)


@pytest.mark.parametrize("name", ["tiny", "moe_tiny"])
def test_the_active_layer_gradient_is_full_backprops(name):
  model, x, y = model_and_batch(name)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss, full = jax.value_and_grad(lambda p: full_loss(nnx.merge(graphdef, p, rest), x, y))(params)
  full = nnx.to_pure_dict(full)["blocks"]
  traced = jax.jit(jax.value_and_grad(active_loss))  # one program for every b
  per_block = jax.jit(jax.value_and_grad(active_loss), static_argnums=(6, 7))
  for b in range(3):
    for static in ((False, True) if b == 1 else (False,)):  # the static split compiles per block: one is enough
      w = layer_weights(model, b)
      run = per_block if static else traced
      value, g = run(w, graphdef, params, rest, x, y, b if static else jnp.int32(b), *((True,) if static else ()))
      np.testing.assert_allclose(value, loss, rtol=1e-6)
      got = nnx.to_pure_dict(g)
      for path, want in jax.tree_util.tree_leaves_with_path(full):
        here = got
        for k in path:
          here = here[k.key]
        np.testing.assert_allclose(here, want[b], rtol=2e-4, atol=2e-7,
                                   err_msg=f"b={b} static={static} {jax.tree_util.keystr(path)}")


def computations(hlo: str) -> dict[str, str]:
  """{name: body text} of every computation of an HLO module's text."""
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m and not line.startswith(" "):
      name, lines = m.group(1), []
    elif line.startswith("}") and name:
      out[name] = "\n".join(lines)
      name = None
    elif name:
      lines.append(line)
  return out


def loop_computations(hlo: str) -> set[str]:
  """The computations that run inside a while loop: each while's body and condition and everything they call."""
  comps = computations(hlo)
  called = lambda text: set(re.findall(r"(?:body|condition|calls|to_apply|branch_computations=\{|true_computation|"
                                       r"false_computation)=?%?([\w.\-]+)", text)) | \
      {c for group in re.findall(r"branch_computations=\{([^}]*)\}", text) for c in re.findall(r"%?([\w.\-]+)", group)}
  todo = {c for text in comps.values() for c in re.findall(r"while\(.*?body=%?([\w.\-]+)", text)}
  todo |= {c for text in comps.values() for c in re.findall(r"while\(.*?condition=%?([\w.\-]+)", text)}
  seen = set()
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    todo |= called(comps[c])
  return seen


def weight_grad_dots(hlo: str, shape: tuple[int, ...], inside: set[str]) -> int:
  comps = computations(hlo)
  pattern = rf"= f32\[{','.join(map(str, shape))}\][^ ]* dot\("
  return sum(len(re.findall(pattern, comps[c])) for c in inside if c in comps)


def test_no_weight_gradient_is_computed_in_a_loop(monkeypatch):
  """tiny: D = 64, its w_up is (64, 128). Full backprop computes (64, 128) weight gradients in its scan's backward
  loop; the active-layer program computes the one of layer b outside any loop, and none inside. (The control keeps
  the layer scan a loop: the CPU unrolls a model this small, `models.transformer.scan_unroll`.)"""
  model, x, y = model_and_batch("tiny")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  monkeypatch.setattr(transformer, "UNROLL_BYTES", -1)
  full = jax.jit(jax.grad(lambda p: full_loss(nnx.merge(graphdef, p, rest), x, y))).lower(params).compile().as_text()
  w = layer_weights(model, 1)
  active = jax.jit(jax.grad(active_loss)).lower(w, graphdef, params, rest, x, y, jnp.int32(1)).compile().as_text()
  assert weight_grad_dots(full, (64, 128), loop_computations(full)) > 0
  in_loops = loop_computations(active)
  assert any(" dot(" in computations(active)[c] for c in in_loops)  # the layers' own products run in the loops
  assert weight_grad_dots(active, (64, 128), in_loops) == 0
  assert weight_grad_dots(active, (64, 128), set(computations(active))) > 0  # layer b's, once
