"""ExFusion (models/exfusion.py): the expanded model is the dense one (bit for bit without noise), the fused model's
logits equal those of a dense model built from the rule W̄ = Σ softmax(a)_e W_e computed in float64 NumPy, the
experts' gradients are α_e ∂L/∂W̄, and bad uses are refused in one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import MoEConfig, TransformerConfig, exfusion

CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=48, tie_embeddings=False)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 9)).astype(np.int32))
MATRICES = ("w_gate_DF", "w_up_DF", "w_down_FD")


def logits(model):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, TOKENS))


def loss_and_grads(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    out = nnx.merge(graphdef, p, rest)(TOKENS[:, :-1])
    return models.cross_entropy(out, TOKENS[:, 1:])

  return jax.jit(jax.value_and_grad(loss))(params)


def test_expansion_keeps_the_dense_model():
  dense = models.Transformer(CFG, rngs=nnx.Rngs(0))
  want = logits(dense)
  exact = exfusion.expand(models.Transformer(CFG, rngs=nnx.Rngs(0)), 4, noise=0.0)
  np.testing.assert_array_equal(logits(exact), want)  # four equal copies at α = 1/4: W exactly
  noisy = exfusion.expand(models.Transformer(CFG, rngs=nnx.Rngs(0)), 4, noise=0.05, seed=1)
  w = noisy.blocks.w_up_DF.experts_EIO[...]
  assert w.shape == (2, 4, 32, 48) and float(jnp.std(w[:, 0] - w[:, 1])) > 1e-3  # the experts differ
  np.testing.assert_allclose(logits(noisy), want, rtol=1e-5, atol=1e-5)  # Σ_e ε_e = 0
  alphas = exfusion.fusion_weights(noisy)
  assert sorted(alphas) == [f"blocks/{m}" for m in sorted(MATRICES)]
  np.testing.assert_allclose(np.asarray(alphas["blocks/w_up_DF"]), 0.25)


def test_the_fused_model_is_the_rule_in_float64():
  with jax.enable_x64(True):
    c = dataclasses.replace(CFG, param_dtype="float64", compute_dtype="float64")
    model = exfusion.expand(models.Transformer(c, rngs=nnx.Rngs(0)), 3, noise=0.1, seed=2)
    rng = np.random.default_rng(5)
    reference = {}
    for name in MATRICES:
      fused = getattr(model.blocks, name)
      a = rng.standard_normal(fused.logits_E.shape)  # trained-looking logits
      fused.logits_E[...] = jnp.asarray(a)
      experts = np.asarray(fused.experts_EIO[...], np.float64)
      alpha = np.exp(a - a.max(-1, keepdims=True))
      alpha /= alpha.sum(-1, keepdims=True)
      reference[name] = np.einsum("le,leio->lio", alpha, experts)  # W̄ per layer, float64 NumPy
    trained = logits(model)
    exfusion.fuse(model)
    for name in MATRICES:
      assert isinstance(getattr(model.blocks, name), nnx.Param)
      np.testing.assert_allclose(np.asarray(getattr(model.blocks, name)[...]), reference[name], rtol=1e-12, atol=1e-16)
    dense = models.Transformer(c, rngs=nnx.Rngs(7))  # a plain dense model holding the reference weights
    nnx.update(dense, nnx.state(model))
    for name in MATRICES:
      getattr(dense.blocks, name)[...] = jnp.asarray(reference[name])
    np.testing.assert_allclose(logits(model), logits(dense), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(trained, logits(dense), rtol=1e-11, atol=1e-11)


def test_each_expert_gets_its_share_of_the_fused_gradient():
  # ∂L/∂W_e = α_e ∂L/∂W̄ for the expanded model, ∂L/∂W̄ read off the fused one
  expanded = exfusion.expand(models.Transformer(CFG, rngs=nnx.Rngs(0)), 4, noise=0.05)
  a = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4)), jnp.float32)
  expanded.blocks.w_down_FD.logits_E[...] = a
  _, g_exp = loss_and_grads(expanded)
  _, g_fused = loss_and_grads(exfusion.fuse(expanded))
  want = jax.nn.softmax(a, -1)[:, :, None, None] * g_fused["blocks"]["w_down_FD"][...][:, None]
  np.testing.assert_allclose(np.asarray(g_exp["blocks"]["w_down_FD"]["experts_EIO"][...]), np.asarray(want),
                             rtol=1e-4, atol=1e-8)
  assert float(jnp.abs(g_exp["blocks"]["w_down_FD"]["logits_E"][...]).max()) > 0  # the fusion weights train too


@pytest.mark.parametrize("call, message", [
    (lambda: exfusion.expand(models.Transformer(CFG, rngs=nnx.Rngs(0)), 0), "experts must be >= 1"),
    (lambda: exfusion.expand(exfusion.expand(models.Transformer(CFG, rngs=nnx.Rngs(0)))), "already expanded"),
    (lambda: exfusion.fuse(models.Transformer(CFG, rngs=nnx.Rngs(0))), "no ExFusion experts"),
    (lambda: exfusion.expand(models.Transformer(models.preset("tiny", moe=MoEConfig(num_experts=4)),
                                                rngs=nnx.Rngs(0))), "an MoE model"),
])
def test_bad_uses_are_refused_in_one_line(call, message):
  with pytest.raises(exfusion.ExFusionError, match=message) as e:
    call()
  assert "\n" not in str(e.value)
