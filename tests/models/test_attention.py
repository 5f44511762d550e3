"""The attention entry point (models/attention.py): every implementation gives the reference's output and gradients,
the dense and MoE models on context-parallel meshes equal one device, and bad choices are one-line errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import sharding
from models import ConfigError, MoEConfig, Transformer, cross_entropy, preset
from models.attention import AttentionError, attend, check_attention, flash

B, N, K, H = 2, 4, 2, 16


def qkv(T, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(k, (B, T, n, H), dtype) for k, n in zip(keys, (N, K, K)))


def reference(q, k, v):
  """The causal softmax written out in float64 NumPy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k, v = (np.repeat(x, N // K, axis=2) for x in (k, v))
  s = np.einsum("bqnh,bsnh->bnqs", q, k) / np.sqrt(H)
  T = q.shape[1]
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bnqs,bsnh->bqnh", p / p.sum(-1, keepdims=True), v)


def objective(attn):
  return lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v)) * jnp.arange(1, H + 1))


@pytest.mark.parametrize("impl, block, T", [
    ("xla", None, 64), ("flash", 16, 64), ("flash", 8, 64), ("flash", 64, 64), ("flash", 512, 48),
    ("ring", 16, 64), ("allgather", 32, 64), ("auto", None, 64)])
def test_every_implementation_gives_the_reference_output_and_gradients(impl, block, T):
  kw = {} if block is None else {"block": block}
  attn = lambda q, k, v: attend(q, k, v, impl=impl, **kw)
  x = qkv(T)
  np.testing.assert_allclose(jax.jit(attn)(*x), reference(*x), atol=2e-6)
  grads = jax.jit(jax.grad(objective(attn), argnums=(0, 1, 2)))(*x)
  xla = jax.grad(objective(lambda *a: attend(*a, impl="xla")), argnums=(0, 1, 2))(*x)
  for g, r in zip(grads, xla):
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5)


def test_flash_gradients_match_finite_differences_in_float64():
  with jax.enable_x64():
    x = qkv(32, jnp.float64, seed=3)
    f = lambda q, k, v: objective(lambda *a: flash(*a, block=8))(q, k, v)
    check_grads(f, x, order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(flash(*x, block=8), reference(*x), atol=1e-12)


def test_flash_in_bfloat16_stays_near_the_reference():
  x = qkv(128, jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(flash(*x, block=32), np.float32), reference(*x), atol=3e-2)


def test_bad_choices_are_one_line_errors():
  x = qkv(64)
  with pytest.raises(AttentionError, match="unknown attention 'sdpa'; choose one of auto, xla, flash, cudnn, ring"):
    attend(*x, impl="sdpa")
  with pytest.raises(AttentionError, match="flash attention: 64 positions do not split into attention tiles of 48; use "
                                           "a length that is a multiple of 48"):
    flash(*x, block=48)
  if jax.default_backend() != "gpu":
    with pytest.raises(AttentionError, match="attention 'cudnn' needs an NVIDIA GPU, this backend is cpu"):
      attend(*x, impl="cudnn")
  with pytest.raises(ConfigError, match="attention must be one of auto, xla, flash, cudnn, ring, allgather"):
    dataclasses.replace(preset("tiny"), attention="sdpa")
  with jax.set_mesh(sharding.make_mesh("context=8")), pytest.raises(
      AttentionError, match="attention 'flash' does not split the sequence, but the mesh has context=8"):
    attend(*x, impl="flash")
  with pytest.raises(AttentionError, match="seq_len=60 does not split into the 2\\*context=8 zig-zag chunks"):
    check_attention("ring", 60, 4)
  check_attention("ring", 56, 1, block=8)


# --- the models on context-parallel meshes -------------------------------------------------------------------------

DENSE = dataclasses.replace(preset("tiny"), n_layers=2, logit_stats=True)
MOE = dataclasses.replace(DENSE, moe=MoEConfig(num_experts=4, top_k=2))
TOKENS = np.random.default_rng(0).integers(0, 256, (8, 33))


def loss_and_grads(cfg, mesh):
  """Loss, aux and gradients of `cfg`'s model (seed 0) on TOKENS, on `mesh`; host arrays."""
  with jax.set_mesh(mesh):
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def loss(state):
      logits, aux = nnx.merge(graphdef, state).forward(TOKENS[:, :-1])
      return cross_entropy(logits, TOKENS[:, 1:]), aux
    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return jax.device_get((value, aux, grads))


@pytest.fixture(scope="module")
def one_device():
  mesh = sharding.make_mesh("data=1", devices=jax.devices()[:1])
  return {"dense": loss_and_grads(DENSE, mesh), "moe": loss_and_grads(MOE, mesh)}


@pytest.mark.parametrize("model, spec, algorithm", [  # the dense model on every layout, the MoE where experts split
    ("dense", "context=8", "ring"), ("dense", "context=2,tensor=2,data=2", "allgather"),
    ("dense", "context=2,expert=2,fsdp=2", "ring"), ("dense", "context=2,stage=2,data=2", "allgather"),
    ("moe", "context=2,expert=2,fsdp=2", "allgather"), ("moe", "context=2,stage=2,data=2", "ring")])
def test_models_on_context_meshes_equal_one_device(one_device, model, spec, algorithm):
  cfg = dataclasses.replace(DENSE if model == "dense" else MOE, attention=algorithm)
  value, aux, grads = loss_and_grads(cfg, sharding.make_mesh(spec))
  ref_value, ref_aux, ref_grads = one_device[model]
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
  # per-layer aux: router statistics are means over tokens, max_logit a maximum over the causal pairs
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), aux, ref_aux)


def test_the_sequence_is_split_over_context_inside_the_model():
  """Per device the residual stream holds its T/C positions of its B/D rows, never a whole sequence (the `seq` rule)."""
  with jax.set_mesh(sharding.make_mesh("context=4,data=2")):
    model = Transformer(DENSE, rngs=nnx.Rngs(0))
    hlo = jax.jit(lambda t: model(t)).lower(TOKENS[:, :32]).compile().as_text()
  assert "f32[4,8,64]" in hlo and "f32[4,32,64]" not in hlo  # (B/2, T/4, D) per device; (B/2, T, D) nowhere


@pytest.mark.parametrize("dtype, T, head_dim, context, kind, want", [
    ("float32", 2048, 64, 1, "cpu", "flash"),  # several tiles: flash is faster and smaller on the CPU
    ("float32", 512, 64, 1, "cpu", "xla"),  # one tile: the same work
    ("float32", 1000, 64, 1, "cpu", "xla"),  # not a multiple of the tile
    ("bfloat16", 2048, 64, 4, "cpu", "ring"),  # context parallel
    ("bfloat16", 2048, 64, 1, "NVIDIA H100 80GB HBM3", "cudnn"),
    ("float16", 256, 128, 1, "NVIDIA A100-SXM4-80GB", "cudnn"),
    ("bfloat16", 2048, 256, 1, "NVIDIA H100 80GB HBM3", "flash"),  # a head dim cuDNN's kernel may not take
    ("float32", 2048, 64, 1, "NVIDIA H100 80GB HBM3", "flash"),  # no fused float32 kernel: no T·T scores kept
    ("bfloat16", 2048, 64, 1, "AMD Instinct MI300X", "flash"),
    ("bfloat16", 2048, 64, 1, "TPU v5 lite", "flash"),
    ("bfloat16", 2048, 64, 1, "NVIDIA Tesla V100-SXM2-16GB:7.0", "flash"),  # before Ampere: no fused kernel
    ("bfloat16", 2048, 64, 1, "NVIDIA A100-SXM4-80GB:8.0", "cudnn"),
])
def test_auto_picks_the_kernel_for_the_platform_dtype_and_length(dtype, T, head_dim, context, kind, want):
  from models.attention import resolve
  kind, _, capability = kind.partition(":")
  assert resolve("auto", dtype, T, head_dim, context, kind, capability=capability or None) == want
  assert resolve("xla", dtype, T, head_dim, context, kind) == "xla"  # a named one is run as named


def test_auto_on_the_cpu_is_flash_past_one_tile_and_equals_the_reference():
  q, k, v = qkv(1024)
  got = attend(q, k, v, impl="auto", block=256)
  np.testing.assert_array_equal(got, flash(q, k, v, block=256))
  np.testing.assert_allclose(got, reference(q, k, v), atol=2e-5)
  short = qkv(128)
  np.testing.assert_array_equal(attend(*short, impl="auto"), attend(*short, impl="xla"))


def test_auto_falls_back_when_cudnn_refuses(monkeypatch):
  """On an NVIDIA GPU in bfloat16 auto asks cuDNN first; if cuDNN refuses at trace time (not installed, its version),
  the run goes on with flash past one tile (else xla), and the outputs are the reference's."""
  import types

  import models.attention as attention
  monkeypatch.setattr(attention.jax, "devices", lambda: [types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3",
                                                                               compute_capability="9.0")])
  real, asked = jax.nn.dot_product_attention, []

  def refusing(*args, implementation=None, **kwargs):
    asked.append(implementation)
    if implementation == "cudnn":
      raise RuntimeError("cuDNN is not detected.")
    return real(*args, implementation=implementation, **kwargs)
  monkeypatch.setattr(attention.jax.nn, "dot_product_attention", refusing)
  q, k, v = (x.astype(jnp.bfloat16) for x in qkv(1024))
  got = attend(q, k, v, impl="auto", block=256)
  assert asked == ["cudnn"]  # then flash (1024 = four tiles of 256), which calls no jax.nn attention
  np.testing.assert_allclose(np.asarray(got, np.float32), reference(q, k, v), atol=3e-2)
