"""Model surgery: dense → MoE upcycling (the split partitions the neurons, all experts with uniform gates reproduce
the dense logits, the balanced k-means recovers a planted partition) and the inserted zero-output block (logits
unchanged bit for bit, which weights get gradient, the W_down gradient against a float64 NumPy a^T·γ)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import ConfigError, TransformerConfig
from models.surgery import SurgeryError, balanced_kmeans, insert_block, split_neurons, upcycle
from models.transformer import run_blocks

CFG = TransformerConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
E = 8
TOKENS = np.random.default_rng(0).integers(0, 32, (2, 9)).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, x):
  return nnx.merge(graphdef, state)(x)


def logits(model, x=TOKENS[:, :-1]):
  return np.asarray(_forward(*nnx.split(model), jnp.asarray(x)))


@pytest.fixture(scope="module")
def dense():
  """CFG's model with weights drawn on the host (no initializer to compile): matrices N(0, 0.1²), norm scales
  1 + N(0, 0.1²)."""
  model = nnx.eval_shape(lambda: models.Transformer(CFG, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  state = nnx.state(model)
  draw = lambda path, a: jnp.asarray((path[-1].key.endswith("norm")) + 0.1 * rng.standard_normal(a.shape), a.dtype)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
  nnx.update(model, state)
  return model


def params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def with_dtype(model, config):
  """`model`'s weights cast into a model built (abstractly, no initializer) from `config`."""
  new = nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0)))
  dt = jnp.dtype(config.param_dtype)
  nnx.update(new, jax.tree.map(lambda a: jnp.asarray(a, dt), nnx.state(model)))
  return new


@pytest.mark.parametrize("split", ["random", "clustered"])
def test_all_experts_with_uniform_gates_equal_the_dense_model(dense, split):
  """k = E and a zero router (every gate 1/E): Σ_e (1/E)·s·Expert_e = (s/E)·FFN; the default s = E gives the dense
  logits, s = 1 those of the dense model with W_down / E."""
  smaller = nnx.clone(dense)
  smaller.blocks.w_down_FD[...] = smaller.blocks.w_down_FD[...] / E
  for scale, target in ((None, logits(dense)), (1.0, logits(smaller))):
    moe = upcycle(dense, E, E, split, scale=scale)
    moe.blocks.moe.router_DE[...] = jnp.zeros_like(moe.blocks.moe.router_DE[...])
    np.testing.assert_allclose(logits(moe), target, rtol=1e-5, atol=1e-6)
  assert np.abs(logits(smaller) - logits(dense)).max() > 1e-3  # the two targets really differ


@pytest.mark.parametrize("split", ["random", "clustered"])
def test_split_partitions_the_neurons_with_gate_up_down_sliced_alike(dense, split):
  """Every dense neuron (its W_gate column, W_up column, W_down row) is in exactly one expert, d_ff/E per expert."""
  moe = upcycle(dense, E, 2, split)
  p, q = params(dense)["blocks"], params(moe)["blocks"]
  f = CFG.d_ff // E
  assert q["moe"]["w_gate_EDF"].shape == (CFG.n_layers, E, CFG.d_model, f)
  for l in range(CFG.n_layers):
    neurons = np.concatenate([p["w_gate_DF"][l].T, p["w_up_DF"][l].T, p["w_down_FD"][l]], 1)  # (F, 3D)
    m = q["moe"]
    pieces = np.concatenate([m["w_gate_EDF"][l].transpose(0, 2, 1), m["w_up_EDF"][l].transpose(0, 2, 1),
                             m["w_down_EFD"][l] / E], 2).reshape(CFG.d_ff, -1)  # (E·f, 3D); /E is exact
    key = lambda a: a[np.lexsort(a.T[::-1])]
    np.testing.assert_array_equal(key(pieces), key(neurons))
  for name in ("wq_DQ", "wo_QD", "attn_norm", "mlp_norm"):
    np.testing.assert_array_equal(q[name], p[name])
  np.testing.assert_array_equal(params(moe)["embed_VD"], params(dense)["embed_VD"])
  assert moe.c.moe.num_experts == E and moe.c.moe.top_k == 2 and moe.c.moe.d_expert == f
  assert np.isfinite(logits(moe)).all()


def test_clustered_split_recovers_a_planted_partition_and_random_does_not():
  """Neurons drawn around E directions (shuffled): balanced k-means on their normalised W_up columns finds the
  groups exactly; the random split is balanced but mixes them; both are deterministic in the seed."""
  rng = np.random.default_rng(1)
  D, F = 16, 64
  centers = rng.standard_normal((E, D)) * 3
  truth = rng.permutation(np.repeat(np.arange(E), F // E))
  w_up_DF = (centers[truth] + 0.3 * rng.standard_normal((F, D))).T * rng.uniform(0.5, 2.0, F)  # any column norm
  same_partition = lambda a, b: {frozenset(np.flatnonzero(a == e)) for e in range(E)} == {
      frozenset(np.flatnonzero(b == e)) for e in range(E)}
  clustered = split_neurons(w_up_DF, E, "clustered", seed=0)
  random = split_neurons(w_up_DF, E, "random", seed=0)
  for labels in (clustered, random):
    np.testing.assert_array_equal(np.bincount(labels, minlength=E), F // E)
  assert same_partition(clustered, truth)
  assert not same_partition(random, truth)
  np.testing.assert_array_equal(split_neurons(w_up_DF, E, "random", seed=0), random)
  assert not np.array_equal(split_neurons(w_up_DF, E, "random", seed=1), random)


def test_balanced_kmeans_beats_random_balanced_splits_on_the_k_means_objective(dense):
  """On a real (unstructured) layer the clustered split has a lower within-cluster sum of squares than random
  balanced splits, and differs from the random split."""
  w = params(dense)["blocks"]["w_up_DF"][0]
  u = w.T / np.linalg.norm(w.T, axis=1, keepdims=True)
  sse = lambda lab: sum(((u[lab == e] - u[lab == e].mean(0)) ** 2).sum() for e in range(E))
  clustered = balanced_kmeans(u, E, seed=0)
  randoms = [split_neurons(w, E, "random", seed=s) for s in range(20)]
  assert sse(clustered) < min(sse(r) for r in randoms)
  assert not np.array_equal(clustered, randoms[0])
  np.testing.assert_array_equal(clustered, split_neurons(w, E, "clustered", seed=0))


@pytest.mark.parametrize("index", [0, 1, 2])
def test_inserted_block_leaves_the_logits_unchanged_exactly(dense, index):
  deeper = insert_block(dense, index, seed=3)
  assert deeper.c.n_layers == CFG.n_layers + 1
  np.testing.assert_array_equal(logits(deeper), logits(dense))
  old, new = params(dense)["blocks"], params(deeper)["blocks"]
  keep = [i for i in range(CFG.n_layers + 1) if i != index]
  for name in old:
    np.testing.assert_array_equal(new[name][keep], old[name])
  assert not new["wo_QD"][index].any() and not new["w_down_FD"][index].any()
  assert np.abs(new["wq_DQ"][index]).max() > 0 and np.abs(new["w_up_DF"][index]).max() > 0


def test_block_inserted_into_an_moe_model_is_the_identity_too(dense):
  moe = upcycle(dense, E, 2, "random")
  deeper = insert_block(moe, 1)
  np.testing.assert_array_equal(logits(deeper), logits(moe))
  assert not params(deeper)["blocks"]["moe"]["w_down_EFD"][1].any()
  assert deeper.c.moe == moe.c.moe


def test_inserted_block_gradients_only_its_zeroed_out_projections_and_w_down_equals_a_gamma(dense):
  """At insertion ∂L/∂W_o ≠ 0 and ∂L/∂W_down = Σ_tokens a^T·γ (NumPy: a the new block's SwiGLU activation of the
  RMS-normed residual x_m, γ = ∂L/∂x_m of the OLD model at the insertion point); W_q, W_k, W_v, W_gate, W_up and
  the norms get exactly zero; a small step along −∂L/∂(new block) lowers the loss (first-order descent).
  Weights and matmuls in float64 (the model's RMSNorm and RoPE run in fp32 inside, hence the tolerance)."""
  index = 1
  with jax.enable_x64(True):
    old = with_dtype(dense, dataclasses.replace(CFG, param_dtype="float64", compute_dtype="float64"))
    new = insert_block(old, index, seed=5)
    x, y = jnp.asarray(TOKENS[:, :-1]), jnp.asarray(TOKENS[:, 1:])
    graphdef, state = nnx.split(new, nnx.Param)
    p = nnx.to_pure_dict(state)
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p: models.cross_entropy(nnx.merge(graphdef, p)(x), y)))
    loss, grads = loss_and_grad(p)
    g = {k: np.asarray(v[index]) for k, v in grads["blocks"].items()}
    for name in ("wo_QD", "w_down_FD"):
      assert np.abs(g[name]).max() > 1e-4, name
    for name in ("wq_DQ", "wk_DK", "wv_DK", "w_gate_DF", "w_up_DF", "attn_norm", "mlp_norm"):
      assert not g[name].any(), name

    @jax.jit
    def residual_and_gamma(x):
      """x_m after the old model's first `index` blocks, and ∂L/∂x_m through its remaining blocks."""
      bdef, stacked = nnx.split(old.blocks)
      part = lambda lo, hi: nnx.merge(bdef, jax.tree.map(lambda a: a[lo:hi], stacked))
      x_m = run_blocks(part(0, index), old.embed(x))[0]
      rest = lambda h: models.cross_entropy(old.unembed(run_blocks(part(index, CFG.n_layers), h)[0]), y)
      return x_m, jax.grad(rest)(x_m)

    x_m, gamma = (np.asarray(v).reshape(-1, CFG.d_model) for v in residual_and_gamma(x))
    nb = {k: np.asarray(v[index]) for k, v in p["blocks"].items()}
    h = x_m / np.sqrt(np.mean(x_m * x_m, -1, keepdims=True) + CFG.norm_eps) * nb["mlp_norm"]
    gate, up = h @ nb["w_gate_DF"], h @ nb["w_up_DF"]
    ref = (gate / (1 + np.exp(-gate)) * up).T @ gamma
    np.testing.assert_allclose(g["w_down_FD"], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    only_new = lambda d: d * (np.arange(d.shape[0]) == index).reshape((-1,) + (1,) * (d.ndim - 1))
    step = {**p, "blocks": jax.tree.map(lambda w, d: w - 1e-2 * only_new(d), p["blocks"], grads["blocks"])}
    assert float(loss_and_grad(step)[0]) < float(loss) - 1e-6


@pytest.mark.parametrize("call, message", [
    (lambda d: upcycle(d, 5, 2), "does not split into num_experts=5"),
    (lambda d: upcycle(d, E, 2, "kmeans"), "split must be one of"),
    (lambda d: upcycle(d, E, 2, d_expert=16), "sets moe.d_expert itself"),
    (lambda d: upcycle(d, E, 2, num_shared=1), "num_shared must be 0"),
    (lambda d: upcycle(d, E, 2, capacity=1.0), "see models.MoEConfig"),
    (lambda d: upcycle(upcycle(d, E, 2), 4, 2), "already has moe"),
    (lambda d: upcycle(nnx.state(d), E, 2), r"nnx\.merge\(graphdef, params\)"),
    (lambda d: insert_block(d, 3), r"index must lie in \[0, n_layers=2\]"),
    (lambda d: insert_block(d, -1), r"index must lie in"),
])
def test_bad_input_raises_one_clear_error(dense, call, message):
  with pytest.raises(SurgeryError, match=message):
    call(dense)


def test_top_k_above_num_experts_is_a_config_error(dense):
  with pytest.raises(ConfigError, match=r"moe.top_k=9 must lie in \[1, num_experts=8\]"):
    upcycle(dense, E, 9)
