"""The MoE layer against an independent float64 NumPy reference written from the equations (router, top-k,
capacity dropping, SwiGLU experts, shared expert, aux losses and statistics), its gradients against central
differences of that reference, aux-loss-free balancing over several steps, Muon per expert (optax's
Newton–Schulz as the oracle), and the config/params plumbing."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from optax import contrib as optax_contrib

import models
import optim
import sharding
from models import ConfigError, MoEConfig, TransformerConfig, count_params
from models.moe import MoE, RouterBias

D, G = 16, 24  # model width, tokens (B=2 x T=12)


def run(f, *args):
  """f(*args) compiled once with LLVM at -O0 (a third less compile time; the numbers are IEEE all the same)."""
  return jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)


def cfg(**moe) -> TransformerConfig:
  m = dict(num_experts=4, top_k=2, d_expert=8)
  m.update(moe)
  return TransformerConfig(vocab_size=32, d_model=D, n_layers=1, n_heads=2, d_ff=8, param_dtype="float64",
                           compute_dtype="float64", moe=MoEConfig(**m))


def np_moe(h, p, m: MoEConfig, bias=None):
  """float64 reference. h (G, D); p the layer's weights. Returns (y, stats)."""
  E, K = m.num_experts, m.top_k
  logits = h @ p["router_DE"]
  if m.router == "softmax":
    s = np.exp(logits - logits.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
  else:
    s = 1 / (1 + np.exp(-logits))
  sel = s + (0 if bias is None else bias)
  idx = np.argsort(-sel, axis=-1, kind="stable")[:, :K]  # best first
  gate = np.take_along_axis(s, idx, -1)
  if m.router == "sigmoid" or m.normalize_top_k:
    gate = gate / gate.sum(-1, keepdims=True)
  keep = np.ones_like(idx, bool)
  if m.capacity_factor is not None:  # slots per expert; first choices of all tokens before second choices
    cap, used = math.ceil(m.capacity_factor * len(h) * K / E), np.zeros(E, int)
    for j in range(K):
      for g in range(len(h)):
        keep[g, j] = used[idx[g, j]] < cap
        used[idx[g, j]] += 1

  def swiglu(x, wg, wu, wd):
    a, b = x @ wg, x @ wu
    return (a / (1 + np.exp(-a)) * b) @ wd

  y = np.zeros_like(h)
  for g in range(len(h)):
    for j in range(K):
      e = idx[g, j]
      if keep[g, j]:
        y[g] += gate[g, j] * swiglu(h[g], p["w_gate_EDF"][e], p["w_up_EDF"][e], p["w_down_EFD"][e])
  if m.num_shared:
    y += swiglu(h, p["shared_gate_DS"], p["shared_up_DS"], p["shared_down_SD"])
  pn = s / s.sum(-1, keepdims=True)
  load = np.bincount(idx.ravel(), minlength=E) / idx.size
  lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
  stats = {"load": load, "prob": pn.mean(0), "z_loss": np.mean(lse ** 2), "dropped": 1 - keep.mean(),
           "entropy": -np.mean(np.sum(pn * np.log(pn), -1)), "lb_loss": E * np.sum(load * pn.mean(0))}
  return y, stats


def layer_and_input(c: TransformerConfig, seed=0):
  layer = MoE(c, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  layer.router_DE[...] = jnp.asarray(rng.standard_normal((D, c.moe.num_experts)))  # spread the scores
  h = rng.standard_normal((2, G // 2, D))
  return layer, h


def weights(layer):
  return {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}


VARIANTS = {
    "softmax, dropless": dict(),
    "softmax renormalised, 2 shared experts": dict(normalize_top_k=True, num_shared=2),
    "sigmoid with selection bias, top-3": dict(router="sigmoid", top_k=3, bias_rate=1e-3),
    "softmax, capacity 1.0 (drops)": dict(capacity_factor=1.0),
    "softmax, capacity 2.0, top-1": dict(capacity_factor=2.0, top_k=1),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_layer_matches_numpy_reference(name):
  with jax.enable_x64(True):
    c = cfg(**VARIANTS[name])
    layer, h = layer_and_input(c)
    bias = None
    if c.moe.bias_rate:  # a bias big enough to change the selection of some tokens
      layer.router_bias[...] = jnp.array([0.3, -0.2, 0.0, 0.1], jnp.float32)  # an fp32 buffer
      bias = np.asarray(layer.router_bias[...], np.float64)
    y, aux = run(lambda x: layer(x), jnp.asarray(h))
    ref_y, ref = np_moe(h.reshape(G, D), weights(layer), c.moe, bias)
    np.testing.assert_allclose(np.asarray(y).reshape(G, D), ref_y, rtol=1e-10, atol=1e-12)
    assert {k: v.dtype for k, v in aux.items()} == dict.fromkeys(models.moe.AUX_KEYS, jnp.float32)
    for k in models.moe.AUX_KEYS:
      np.testing.assert_allclose(np.asarray(aux[k], np.float64), ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(float(models.moe.lb_loss(aux)), ref["lb_loss"], rtol=1e-6)
    if c.moe.capacity_factor == 1.0:
      assert ref["dropped"] > 0.05  # the capacity path really drops here
    if bias is not None:  # and the bias really moved some choices
      unbiased = np_moe(h.reshape(G, D), weights(layer), c.moe)[1]["load"]
      assert not np.allclose(unbiased, ref["load"])


def test_aux_of_microbatches_averages_to_the_whole_batch():
  """Every aux entry is a mean over tokens, so the mean over equal microbatches (a pipeline, gradient
  accumulation) equals the whole batch's; the product-form lb_loss is formed afterwards and matches too."""
  with jax.enable_x64(True):
    layer, h = layer_and_input(cfg(router="sigmoid"))
    f = lambda x: layer(x)[1]
    whole, halves = run(f, jnp.asarray(h)), [jax.jit(f)(jnp.asarray(h[i:i + 1])) for i in range(2)]
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *halves)
    for k in models.moe.AUX_KEYS:
      np.testing.assert_allclose(np.asarray(mean[k]), np.asarray(whole[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(float(models.moe.lb_loss(mean)), float(models.moe.lb_loss(whole)), rtol=1e-6)


def test_gradients_match_central_differences_of_the_reference():
  """d/dθ [Σ y·r + lb_loss + z_loss] for the router and one expert's weights, f64, against the reference."""
  with jax.enable_x64(True):
    c = cfg(num_shared=1, normalize_top_k=True)
    layer, h = layer_and_input(c, seed=1)
    graphdef, params = nnx.split(layer)
    r = np.random.default_rng(5).standard_normal((G, D))

    def loss(p):
      y, aux = nnx.merge(graphdef, p)(jnp.asarray(h))
      return jnp.sum(y.reshape(G, D) * r) + (models.moe.lb_loss(aux) + aux["z_loss"]).astype(jnp.float64)

    grads = nnx.to_pure_dict(run(jax.grad(loss), params))
    w = weights(layer)

    def ref_loss(w):
      y, st = np_moe(h.reshape(G, D), w, c.moe)
      return np.sum(y * r) + st["lb_loss"] + st["z_loss"]

    rng = np.random.default_rng(0)
    for name in ("router_DE", "w_gate_EDF", "w_down_EFD", "shared_up_DS"):
      for _ in range(3):
        at = tuple(rng.integers(0, n) for n in w[name].shape)
        plus, minus = dict(w), dict(w)
        plus[name], minus[name] = w[name].copy(), w[name].copy()
        plus[name][at] += 1e-6
        minus[name][at] -= 1e-6
        fd = (ref_loss(plus) - ref_loss(minus)) / 2e-6
        np.testing.assert_allclose(float(grads[name][at]), fd, rtol=1e-5, atol=1e-7, err_msg=f"{name}{at}")


def test_aux_free_bias_follows_the_reference_over_steps_and_stays_out_of_the_params():
  """b ← b + u·sign(mean(load) − load) for 6 steps on changing inputs; the selection uses the updated b each
  step, so a wrong update (sign, or one computed from the biased scores' probabilities) shows up as drift."""
  with jax.enable_x64(True):
    c = cfg(router="sigmoid", bias_rate=0.05)
    layer, _ = layer_and_input(c)
    assert isinstance(layer.router_bias, RouterBias) and not isinstance(layer.router_bias, nnx.Param)
    assert "router_bias" not in nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    graphdef, params, buffers = nnx.split(layer, nnx.Param, ...)
    buffers = nnx.to_pure_dict(buffers)
    w, ref_b = weights(layer), np.zeros(4)
    rng = np.random.default_rng(3)

    @jax.jit
    def step(buffers, h):
      _, aux = nnx.merge(graphdef, params, buffers)(h)
      return models.update_router_bias(buffers, aux, c.moe.bias_rate)

    for _ in range(6):
      h = rng.standard_normal((2, G // 2, D)) + 0.5  # a shifted input: unbalanced loads
      buffers = step(buffers, jnp.asarray(h))
      load = np_moe(h.reshape(G, D), w, c.moe, ref_b)[1]["load"]
      ref_b = ref_b + 0.05 * np.sign(load.mean() - load)
      np.testing.assert_allclose(np.asarray(buffers["router_bias"]), ref_b, atol=1e-6)  # an fp32 buffer
    assert np.abs(ref_b).max() > 0.1  # it moved


def test_model_stacks_aux_over_layers_and_weights_the_losses():
  c = dataclasses.replace(models.preset("moe_tiny"), n_layers=3)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.Transformer(c, rngs=nnx.Rngs(0))))
  logits, aux = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s).forward(t), state,
                               jax.ShapeDtypeStruct((2, 8), jnp.int32))
  assert logits.shape == (2, 8, 256)
  assert {k: (v.shape, v.dtype) for k, v in aux.items()} == {
      "load": ((3, 8), jnp.float32), "prob": ((3, 8), jnp.float32), "z_loss": ((3,), jnp.float32),
      "dropped": ((3,), jnp.float32), "entropy": ((3,), jnp.float32)}
  load = jnp.array([[0.5, 0.5] + [0.0] * 6, [0.25] * 4 + [0.0] * 4, [0.125] * 8])  # lb = 8·Σ f·P
  prob = jnp.array([[0.5, 0.5] + [0.0] * 6, [0.125] * 8, [0.125] * 8])
  aux = {"load": load, "prob": prob, "z_loss": jnp.array([10.0, 20.0, 30.0])}
  np.testing.assert_allclose(np.asarray(models.moe.lb_loss(aux)), [4.0, 1.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(float(models.aux_loss(aux, c)), 1e-2 * 6 + 1e-3 * 60, rtol=1e-6)
  assert float(models.aux_loss({}, models.preset("tiny"))) == 0.0


@pytest.mark.parametrize("moe", [dict(num_experts=8, top_k=2, d_expert=32),
                                 dict(num_experts=4, top_k=1, num_shared=2, bias_rate=1e-3)])
def test_count_params_counts_the_experts(moe):
  c = models.preset("tiny", moe=MoEConfig(**moe))
  model = nnx.eval_shape(lambda: models.Transformer(c, rngs=nnx.Rngs(0)))
  assert count_params(c) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  for path, var in nnx.to_flat_state(nnx.state(model)):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == len(var.shape), (path, names)
  dense_active = models.preset("tiny", d_ff=(moe.get("d_expert") or 128) * (moe["top_k"] + moe.get("num_shared", 0)))
  router = 6 * 2 * 64 * moe["num_experts"]  # 6 x (D x E) per layer, 2 layers
  assert models.flops_per_token(c, 64) == models.flops_per_token(dense_active, 64) + router


def test_the_bias_is_a_buffer_beside_the_params():
  """logical_names/init_params see Params only; init_buffers holds the (L, E) bias (init_train_state puts it in
  state["buffers"]: checked with the train CLI in tests/sharding/test_expert_parallel.py)."""
  c = models.preset("moe_tiny", moe=MoEConfig(num_experts=4, top_k=2, d_expert=16, bias_rate=1e-3))
  model_fn = lambda: models.Transformer(c, rngs=nnx.Rngs(0))
  _, abstract, names = sharding.logical_names(model_fn)
  assert "router_bias" not in abstract["blocks"]["moe"] and "router_DE" in names["blocks"]["moe"]
  buffers = sharding.init_buffers(model_fn, sharding.make_mesh("data=1", devices=jax.devices()[:1]))
  np.testing.assert_array_equal(np.asarray(buffers["blocks"]["moe"]["router_bias"]), np.zeros((2, 4)))
  assert sharding.init_buffers(lambda: models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0)),
                               sharding.make_mesh("data=1", devices=jax.devices()[:1])) == {}


def test_muon_orthogonalizes_each_expert_separately():
  """The registered `muon` on the MoE model's expert parameters routes the expert stacks (L, E, fan_in, fan_out) to its
  Muon group, and its update of each expert equals optax's Muon run on that expert as its own 2-D parameter (keller
  factor √max(1, out/in) from the per-expert shape); flattening the experts into one (E·fan_in, fan_out) matrix
  gives a different update. float64, first step (optax's bias correction only rescales g then)."""
  with jax.enable_x64(True):
    c = TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, param_dtype="float64",
                          moe=MoEConfig(num_experts=4, top_k=2, d_expert=32))
    abstract = nnx.state(nnx.eval_shape(lambda: models.Transformer(c, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    moe = nnx.to_pure_dict(abstract)["blocks"]["moe"]  # router and experts, under their model path
    params = {"blocks": {"moe": jax.tree.map(lambda v: jnp.asarray(rng.standard_normal(v.shape)), moe)}}
    grads = jax.tree.map(lambda v: jnp.asarray(rng.standard_normal(v.shape)), params)
    experts = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
    assert {optim.muon_labels(params)["blocks"]["moe"][k] for k in experts} == {"muon"}
    tx = optim.muon(1.0, weight_decay=0.0, scale="keller", eps=1e-8)
    flat_tx = optim.scale_by_muon(0.95, scale="keller", eps=1e-8)
    oracle = optax_contrib.muon(1.0, beta=0.95)  # every 2-D leaf is a Muon matrix; no decay

    def updates(params, grads):
      ours = tx.update(grads, tx.init(params), params)[0]["blocks"]["moe"]
      g = {k: grads["blocks"]["moe"][k] for k in experts}
      per = {f"{k}/{l}/{e}": v[l, e] for k, v in g.items() for l in range(1) for e in range(4)}
      theirs = oracle.update(per, oracle.init(per), jax.tree.map(jnp.zeros_like, per))[0]
      flat = {k: v.reshape(1, 4 * v.shape[2], v.shape[3]) for k, v in g.items()}  # one (E·fan_in, fan_out) per layer
      flat = {k: -v.reshape(g[k].shape) for k, v in flat_tx.update(flat, flat_tx.init(flat))[0].items()}
      return ours, theirs, flat

    ours, theirs, flat = run(updates, params, grads)
    for key, o in theirs.items():
      k, l, e = key.split("/")
      np.testing.assert_allclose(np.asarray(ours[k][int(l), int(e)]), np.asarray(o), atol=1e-7, rtol=0, err_msg=key)
    for k in experts:
      gap = jnp.linalg.norm(flat[k] - ours[k]) / jnp.linalg.norm(ours[k])
      assert gap > 0.3, (k, float(gap))


@pytest.mark.parametrize("bad, message", [
    (dict(top_k=5), "top_k=5 must lie in"),
    (dict(router="relu"), "router must be"),
    (dict(capacity_factor=0.0), "capacity_factor must be positive"),
    (dict(num_experts=-1), "num_experts must be >= 0"),
    (dict(bias_rate=-1.0), "bias_rate must be >= 0"),
])
def test_bad_moe_configs_raise_clear_errors(bad, message):
  with pytest.raises(ConfigError, match=message):
    MoEConfig(**{"num_experts": 4, **bad})


def test_zero_experts_means_dense():
  assert models.preset("tiny", moe=MoEConfig(num_experts=0)).moe is None
  assert TransformerConfig(moe={"num_experts": 4, "top_k": 1}).moe == MoEConfig(num_experts=4, top_k=1)
