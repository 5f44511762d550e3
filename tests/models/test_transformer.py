"""The transformer against an independent float64 NumPy forward pass written from the equations."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import ConfigError, TransformerConfig, count_params, flops_per_token, preset


def np_forward(p: dict, c: TransformerConfig, tokens: np.ndarray) -> np.ndarray:
  """float64 reference: pre-norm blocks, RoPE (rotate-half), causal softmax attention with kv heads
  shared by groups of query heads, SwiGLU, final RMSNorm, tied or untied head."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  B, T = tokens.shape
  H, rep = c.hd, c.n_heads // c.kv_heads

  def norm(x, s):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.norm_eps) * s

  inv = c.rope_theta ** (-np.arange(0, H, 2) / H)
  ang = np.arange(T)[:, None] * inv[None]
  cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

  def rope(x):
    a, b = x[..., :H // 2], x[..., H // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

  x = p["embed_VD"][tokens]
  mask = np.tril(np.ones((T, T), bool))
  for l in range(c.n_layers):
    w = {k: v[l] for k, v in p["blocks"].items()}
    h = norm(x, w["attn_norm"])
    q = (h @ w["wq_DQ"]).reshape(B, T, c.n_heads, H)  # head n owns columns n*H .. (n+1)*H-1
    k = (h @ w["wk_DK"]).reshape(B, T, c.kv_heads, H)
    v = (h @ w["wv_DK"]).reshape(B, T, c.kv_heads, H)
    if c.qk_norm:
      q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)  # query head n uses kv head n // rep
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    s = np.where(mask, s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("bnqk,bknh->bqnh", a, v).reshape(B, T, -1) @ w["wo_QD"]
    h = norm(x, w["mlp_norm"])
    g, u = h @ w["w_gate_DF"], h @ w["w_up_DF"]
    x = x + (g / (1 + np.exp(-g)) * u) @ w["w_down_FD"]
  h = norm(x, p["final_norm"])
  return h @ (p["embed_VD"].T if c.tie_embeddings else p["head_DV"])


VARIANTS = {
    "tiny (GQA, QK-norm)": preset("tiny"),
    "MHA, untied": preset("tiny", n_kv_heads=None, qk_norm=False, tie_embeddings=False),
    "MQA, head_dim != d/n": preset("tiny", n_kv_heads=1, head_dim=24),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_numpy_reference(name):
  c = VARIANTS[name]
  model = models.Transformer(c, rngs=nnx.Rngs(1))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
  ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
  ref = np_forward(nnx.to_pure_dict(nnx.state(model)), c, tokens)
  np.testing.assert_allclose(ours, ref, rtol=2e-4, atol=2e-5)


def test_attention_is_causal():
  model = models.Transformer(preset("tiny"), rngs=nnx.Rngs(0))
  x = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
  x2 = x.copy()
  x2[:, 10:] = (x2[:, 10:] + 7) % 256
  a, b = np.asarray(model(x)), np.asarray(model(x2))
  np.testing.assert_array_equal(a[:, :10], b[:, :10])
  assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-3


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
def test_count_params_matches_the_model(name):
  for c in (preset(name), preset(name, tie_embeddings=False, qk_norm=True, n_kv_heads=2)):
    model = nnx.eval_shape(lambda: models.Transformer(c, rngs=nnx.Rngs(0)))
    assert count_params(c) == sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  assert 80e6 < count_params(preset("base")) < 90e6  # GPT-2 small's shape without its 38M-param vocabulary


def test_flops_per_token_matches_xla_matmul_count():
  """Our analytic 6N + attention vs the FLOPs XLA counts in the compiled train step (dots dominate;
  XLA also counts elementwise work, so it may only exceed ours, and by little). One layer, because
  cost_analysis counts a scan body once, not once per trip."""
  c, T, B = preset("small", n_layers=1), 128, 4
  model = models.Transformer(c, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)

  def loss(p, x):
    return models.cross_entropy(nnx.merge(graphdef, p)(x[:, :-1]), x[:, 1:])

  x = jnp.zeros((B, T + 1), jnp.int32)
  compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
  xla = compiled.cost_analysis()["flops"] / (B * T)
  ours = flops_per_token(c, T)
  assert ours <= xla <= 1.15 * ours, (ours, xla)


def test_bf16_compute_keeps_fp32_params_and_stays_close():
  c32 = preset("tiny")
  c16 = dataclasses.replace(c32, compute_dtype="bfloat16")
  tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
  m32, m16 = models.Transformer(c32, rngs=nnx.Rngs(0)), models.Transformer(c16, rngs=nnx.Rngs(0))
  assert {x.dtype for x in jax.tree.leaves(nnx.state(m16))} == {jnp.dtype("float32")}
  out16 = m16(tokens)
  assert out16.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out16), np.asarray(m32(tokens)), atol=0.1)


def test_every_parameter_names_its_logical_axes():
  model = nnx.eval_shape(lambda: models.Transformer(preset("tiny", tie_embeddings=False), rngs=nnx.Rngs(0)))
  for path, var in nnx.to_flat_state(nnx.state(model)):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == len(var.shape), (path, names)


@pytest.mark.parametrize("bad, message", [
    (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(d_model=66, n_heads=4), "not divisible by n_heads"),
    (dict(head_dim=15), "even for RoPE"),
    (dict(d_ff=0), "d_ff must be positive"),
])
def test_bad_configs_raise_clear_errors(bad, message):
  with pytest.raises(ConfigError, match=message):
    preset("tiny", **bad)
  with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
    preset("huge")


def test_cross_entropy_equals_float64_numpy_and_is_nan_for_a_target_outside_the_vocabulary():
  """The masked-sum pick (models/transformer.py) against log-softmax and indexing in float64 NumPy; negative ids
  count from the end; an id outside [-V, V) makes the loss NaN and leaves the other positions' gradient finite."""
  rng = np.random.default_rng(0)
  logits, targets = rng.normal(size=(3, 5, 11)) * 4, rng.integers(-11, 11, size=(3, 5))
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  expect = -np.mean(np.take_along_axis(logp, (targets % 11)[..., None], -1))
  got = models.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets))
  np.testing.assert_allclose(float(got), expect, rtol=1e-6)
  bad = jnp.asarray(targets).at[0, 0].set(11)
  assert np.isnan(float(models.cross_entropy(jnp.asarray(logits, jnp.float32), bad)))
  grad = jax.grad(models.cross_entropy)(jnp.asarray(logits, jnp.float32), bad)
  assert np.isfinite(np.asarray(grad)).all()


def test_cross_entropy_leaves_out_ignored_targets():
  """Targets equal to IGNORE_TARGET (the loader's padding, research.data.records.IGNORE) take no part: the mean is
  over the others (float64 NumPy), their logits get no gradient, and an all-ignored batch is 0, not NaN."""
  from research.data.records import IGNORE
  assert IGNORE == models.IGNORE_TARGET
  rng = np.random.default_rng(1)
  logits, targets = rng.normal(size=(2, 6, 7)) * 3, rng.integers(0, 7, size=(2, 6))
  mask = rng.random((2, 6)) < 0.4
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  ignored = jnp.asarray(np.where(mask, models.IGNORE_TARGET, targets), jnp.int32)
  x = jnp.asarray(logits, jnp.float32)
  np.testing.assert_allclose(float(models.cross_entropy(x, ignored)), nll[~mask].mean(), rtol=1e-6)
  grad = np.asarray(jax.grad(models.cross_entropy)(x, ignored))
  assert (grad[mask] == 0).all() and (np.abs(grad[~mask]).sum(-1) > 0).all()
  assert float(models.cross_entropy(x, jnp.full((2, 6), models.IGNORE_TARGET, jnp.int32))) == 0.0
