"""PAD-Net (models/padnet.py, models/surgery.py to_padnet / to_moe): the layer against a float64 NumPy reference of
W_e = λ_d·M⊙W_e + λ_s·(1 − M)⊙W^static on the MoE reference of test_moe.py; an all-dynamic PAD-Net model equals the
MoE exactly (logits and gradients); the Iterative Mode Partition's shares follow its schedule and keep the entries
with the largest |∂L/∂M|, whose closed form is checked against autodiff; sharded == one device on the MoE meshes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_moe import D, G, cfg, layer_and_input, np_moe, run, weights

import models
import sharding
from models import MoEConfig, TransformerConfig, count_params, padnet, surgery

CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=32, tie_embeddings=False,
                        moe=MoEConfig(num_experts=8, top_k=2, d_expert=16, num_shared=1))
TOKENS = np.random.default_rng(0).integers(0, 64, (8, 9)).astype(np.int32)


def loss_fn(model, tokens):
  logits, aux = model.forward(tokens[:, :-1])
  return models.cross_entropy(logits, tokens[:, 1:]) + models.aux_loss(aux, model.c)


def loss_and_grads(model, tokens=TOKENS):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  f = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(nnx.merge(graphdef, p, rest), x)))
  return f(params, jnp.asarray(tokens))


def randomized(model, seed=1, share=0.4):
  """`model` (PAD-Net) with random masks of about `share` dynamic, φ ≠ 0 and static weights apart from the experts."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model)):
    name = str(path[-1])
    if name in padnet.MASKS.values():
      var.set_value(jnp.asarray(rng.random(var.shape) < share))
    elif name == "pad_phi":
      var.set_value(jnp.asarray(rng.uniform(-1, 1, var.shape), var.get_value().dtype))
    elif name in padnet.STATIC.values():
      var.set_value(jnp.asarray(0.1 * rng.standard_normal(var.shape), var.get_value().dtype))
  return model


def test_the_layer_matches_the_numpy_reference_of_its_formula():
  with jax.enable_x64(True):
    c = cfg(pad=True, num_shared=1)
    layer, h = layer_and_input(c)
    rng = np.random.default_rng(3)
    phi = 0.7
    layer.pad_phi[...] = jnp.asarray(phi)
    p = weights(layer)
    for key, name in padnet.MATRICES.items():
      mask = rng.random(p[name].shape) < 0.3
      getattr(layer, padnet.MASKS[key])[...] = jnp.asarray(mask)
      static = rng.standard_normal(p[padnet.STATIC[key]].shape) * 0.2
      getattr(layer, padnet.STATIC[key])[...] = jnp.asarray(static)
      lam_d = 2 / (1 + np.exp(-phi))
      p[name] = lam_d * mask * p[name] + (2 - lam_d) * (1 - mask) * static[None]  # the paper's W_e, in float64
    y, _ = run(lambda x: layer(x), jnp.asarray(h))
    ref_y, _ = np_moe(h.reshape(G, D), p, c.moe)
    np.testing.assert_allclose(np.asarray(y).reshape(G, D), ref_y, rtol=1e-10, atol=1e-12)


def test_an_all_dynamic_padnet_model_is_the_moe_exactly_and_folds_back():
  moe = models.Transformer(CFG, rngs=nnx.Rngs(0))
  pad = surgery.to_padnet(moe)
  assert pad.c.moe.pad and padnet.dynamic_share(pad) == 1.0
  assert padnet.counts(pad) == {"dynamic": 2 * 3 * 8 * 32 * 16, "masked": 0, "static": 2 * 3 * 32 * 16}
  np.testing.assert_allclose(np.asarray(pad.blocks.moe.static_up_DF[...]),
                             np.asarray(moe.blocks.moe.w_up_EDF[...], np.float64).mean(1), rtol=1e-6, atol=1e-9)
  (l_moe, g_moe), (l_pad, g_pad) = loss_and_grads(moe), loss_and_grads(pad)
  assert float(l_moe) == float(l_pad)
  g_pad = nnx.to_flat_state(g_pad)
  for path, g in nnx.to_flat_state(g_moe):  # every MoE parameter's gradient, bit for bit
    np.testing.assert_array_equal(np.asarray(g.get_value()), np.asarray(dict(g_pad)[path].get_value()), str(path))
  back = surgery.to_moe(pad)
  assert back.c == CFG and float(loss_and_grads(back)[0]) == float(l_moe)
  # a partitioned model folds into the MoE that computes the same function
  randomized(pad)
  np.testing.assert_allclose(float(loss_and_grads(surgery.to_moe(pad))[0]), float(loss_and_grads(pad)[0]),
                             rtol=1e-6)


def test_a_padnet_config_counts_its_static_weights_and_scales():
  c = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, pad=True))
  model = nnx.eval_shape(lambda: models.Transformer(c, rngs=nnx.Rngs(0)))
  assert count_params(c) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count_params(c) == count_params(CFG) + 2 * (3 * 32 * 16 + 1)
  assert models.flops_per_token(c, 8) == models.flops_per_token(CFG, 8)  # the mixing is per step, not per token
  masks = nnx.state(model, padnet.PadMask)  # buffers: never in the params (the optimizer's tree)
  assert len(jax.tree.leaves(masks)) == 3 and all(m.dtype == jnp.bool_ for m in jax.tree.leaves(masks))


def test_the_mask_gradient_has_its_closed_form():
  """∂L/∂M = (λ_d W − λ_s W^static) ⊙ ∂L/∂W_eff, ∂L/∂W_eff read off the folded MoE (whose experts are W_eff)."""
  pad = randomized(surgery.to_padnet(models.Transformer(CFG, rngs=nnx.Rngs(0))))
  graphdef, masks, rest = nnx.split(pad, padnet.PadMask, ...)
  as_float = jax.tree.map(lambda m: m.astype(jnp.float32), masks)
  g_mask = jax.jit(jax.grad(lambda m: loss_fn(nnx.merge(graphdef, m, rest), jnp.asarray(TOKENS))))(as_float)
  _, g_eff = loss_and_grads(surgery.to_moe(pad))
  moe = pad.blocks.moe
  lam_d = 2 * jax.nn.sigmoid(moe.pad_phi[...])[:, None, None, None]
  for key, name in padnet.MATRICES.items():
    w, s = getattr(moe, name)[...], getattr(moe, padnet.STATIC[key])[...][:, None]
    expect = (lam_d * w - (2 - lam_d) * s) * g_eff["blocks"]["moe"][name][...]
    got = g_mask["blocks"]["moe"][padnet.MASKS[key]][...]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expect), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("schedule, scope", [("exponential", "local"), ("linear", "global")])
def test_the_partition_follows_its_schedule_and_keeps_the_largest_scores(schedule, scope):
  rng = np.random.default_rng(0)
  shapes = [(2, 4, 6, 5), (2, 4, 5, 6)]
  masks = [np.ones(s, bool) for s in shapes]
  scores = [rng.standard_normal(s) for s in shapes]  # fixed |∂L/∂M| of ±: the magnitude ranks
  calls = []

  def grad_sum(masks_f):
    calls.append([np.asarray(m) for m in masks_f])
    return [jnp.asarray(s) for s in scores]

  new, shares = padnet.iterative_partition(masks, grad_sum, 0.3, rounds=4, schedule=schedule, scope=scope)
  target = [padnet.share_at(t, 4, 0.3, schedule) for t in (1, 2, 3, 4)]
  expect = [0.3 ** (t / 4) for t in (1, 2, 3, 4)] if schedule == "exponential" else [0.825, 0.65, 0.475, 0.3]
  np.testing.assert_allclose(target, expect, rtol=1e-12)
  np.testing.assert_allclose(shares, target, atol=1 / 30)  # each matrix rounds its count (30 entries)
  assert len(calls) == 4 and all(m.dtype == np.float32 for m in calls[1])  # round 2 scored the round-1 masks
  assert calls[1][0].mean() == pytest.approx(shares[0], abs=1 / 30)
  mags = [np.abs(s) for s in scores]
  if scope == "local":  # per expert matrix: exactly 30 − int(0.7·30) = 9 dynamic, the 9 largest magnitudes
    for m, a in zip(new, mags):
      flat_m, flat_a = m.reshape(-1, 30), a.reshape(-1, 30)
      assert (flat_m.sum(1) == 9).all()
      assert (np.sort(flat_a, 1)[:, -9] <= np.where(flat_m, flat_a, np.inf).min(1)).all()
  else:  # one ranking over both stacks
    everything = np.concatenate([a.ravel() for a in mags])
    keep = everything.size - int((1.0 - 0.3) * everything.size)  # the code's count (480 − 336)
    threshold = np.sort(everything)[-keep]
    for m, a in zip(new, mags):
      np.testing.assert_array_equal(m, a >= threshold)


def reference_kept(n, d):
  """The code's count (Shwai-He/PAD-Net pruners.py `_global_mask` / `_local_mask`): k = int((1 − d)·n) entries made
  static, the rest dynamic."""
  return n - int((1.0 - d) * n)


GRID = [(n, d) for n in (1, 2, 3, 7, 10, 11, 25, 100) for d in (0.05, 0.1, 0.3, 0.5, 0.6, 0.7, 0.72, 0.9, 0.99, 1.0)]


@pytest.mark.parametrize("scope", ["global", "local"])
def test_each_ranking_keeps_the_codes_count_not_the_rounded_share(scope):
  assert reference_kept(10, 0.72) == 8 and round(0.72 * 10) == 7  # (1 − 0.72)·10 = 2.8000000000000003
  differs = 0
  for n, d in GRID:
    rng = np.random.default_rng(n)
    # global: one ranking of n over two arrays; local: each (expert) row of one array its own ranking of n
    shapes = [(1, 1, n), (1, 1, n)] if scope == "local" else [(1, 1, n // 2 or 1), (1, 1, n - (n // 2 or 1))]
    shapes = [s for s in shapes if s[-1] > 0]
    scores = [rng.standard_normal(s) for s in shapes]
    new, _ = padnet.iterative_partition([np.ones(s, bool) for s in shapes], lambda _: scores, d, rounds=1, scope=scope)
    got = [int(m.sum()) for m in new] if scope == "local" else [sum(int(m.sum()) for m in new)]
    assert got == [reference_kept(n, d)] * len(got), (n, d, scope)
    assert padnet.kept(n, d) == reference_kept(n, d)
    differs += reference_kept(n, d) != round(d * n)
  assert differs >= 3  # the grid holds cases where the rule and round(d·n) part


def test_the_kept_count_holds_every_round_and_ties_keep_the_earlier_entry():
  n, ratio, rounds = 10, 0.3, 4
  for schedule in padnet.SCHEDULES:
    new, shares = padnet.iterative_partition([np.ones((1, 1, n), bool)], lambda _: [np.arange(n, dtype=float)],
                                             ratio, rounds=rounds, schedule=schedule)
    d = [ratio ** (t / rounds) if schedule == "exponential" else 1.0 - (1.0 - ratio) * (t / rounds)
         for t in range(1, rounds + 1)]
    assert [round(s * n) for s in shares] == [reference_kept(n, x) for x in d]
  tied = [np.array([[[1.0, 2.0, 2.0, 2.0, 0.5]]])]  # kept(5, 0.4) = 2 of three tied at the top: the first two
  new, _ = padnet.iterative_partition([np.ones((1, 1, 5), bool)], lambda _: tied, 0.4, rounds=1)
  np.testing.assert_array_equal(new[0][0, 0], [False, True, True, False, False])
  # a round that makes nothing static (int((1 − d)·n) = 0) leaves the masks as they are, as the code's `if not k < 1`
  start = np.array([[[True, False, True]]])
  new, _ = padnet.iterative_partition([start], lambda _: [np.ones((1, 1, 3))], 0.9, rounds=1)
  np.testing.assert_array_equal(new[0], start)


def test_partition_on_a_model_scores_with_the_loss_and_is_deterministic():
  def fresh():
    return surgery.to_padnet(models.Transformer(CFG, rngs=nnx.Rngs(0)))

  batches = [jnp.asarray(TOKENS[:4]), jnp.asarray(TOKENS[4:])]
  a, b = fresh(), fresh()
  shares = padnet.partition(a, loss_fn, batches, 0.5, rounds=2)
  padnet.partition(b, loss_fn, batches, 0.5, rounds=2)
  np.testing.assert_allclose(shares, [0.5 ** 0.5, 0.5], atol=1e-3)
  assert padnet.dynamic_share(a) == pytest.approx(0.5, abs=1e-3)
  for x, y in zip(jax.tree.leaves(nnx.state(a, padnet.PadMask)), jax.tree.leaves(nnx.state(b, padnet.PadMask))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # the first round's ranking is |∂L/∂M| at the all-dynamic model, summed over the batches
  c = fresh()
  graphdef, masks, rest = nnx.split(c, padnet.PadMask, ...)
  grads = [jax.grad(lambda m: loss_fn(nnx.merge(graphdef, m, rest), x))(
      jax.tree.map(lambda m: m.astype(jnp.float32), masks)) for x in batches]
  score = np.abs(np.asarray(grads[0]["blocks"]["moe"]["mask_up_EDF"][...]
                            + grads[1]["blocks"]["moe"]["mask_up_EDF"][...]))
  one = fresh()
  padnet.partition(one, loss_fn, batches, 0.5, rounds=1, scope="local")
  kept = np.asarray(one.blocks.moe.mask_up_EDF[...]).reshape(-1, 32 * 16)
  flat = score.reshape(-1, 32 * 16)
  assert (kept.sum(1) == 256).all()
  assert (np.where(kept, flat, np.inf).min(1) >= np.where(kept, -np.inf, flat).max(1)).all()


MESHES = {"fsdp=8": P(None, None, "fsdp"), "data=2,tensor=2,expert=2": P(None, "expert", None, "tensor"),
          "expert=8": P(None, "expert")}


@pytest.fixture(scope="module")
def pad_reference():
  pad = randomized(surgery.to_padnet(models.Transformer(CFG, rngs=nnx.Rngs(0))))
  graphdef, params, rest = nnx.split(pad, nnx.Param, ...)
  host = (jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, rest))
  return graphdef, host, loss_and_grads(pad)


@pytest.mark.parametrize("spec", list(MESHES))
def test_sharded_padnet_matches_one_device(spec, pad_reference):
  graphdef, (params, rest), (ref_loss, ref_grads) = pad_reference
  mesh = sharding.make_mesh(spec)
  c = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, pad=True))
  _, abstract, names = sharding.logical_names(lambda: models.Transformer(c, rngs=nnx.Rngs(0)))
  p_sh = sharding.param_shardings(abstract, names, mesh)
  with jax.set_mesh(mesh):
    placed = jax.device_put(nnx.to_pure_dict(params), p_sh)
    assert placed["blocks"]["moe"]["w_gate_EDF"].sharding.spec == MESHES[spec]
    x = sharding.shard_batch(TOKENS, mesh)

    def f(p, x):
      return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), x))(p)

    loss, grads = jax.jit(f)(placed, x)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               grads, nnx.to_pure_dict(ref_grads))


@pytest.mark.parametrize("call, message", [
    (lambda: padnet.check(0.0), "dynamic ratio must lie in (0, 1]"),
    (lambda: padnet.check(0.3, rounds=0), "at least one round"),
    (lambda: padnet.check(0.3, schedule="cubic"), "schedule must be one of"),
    (lambda: padnet.dynamic_share(models.Transformer(CFG, rngs=nnx.Rngs(0))), "has no PAD-Net layer"),
    (lambda: surgery.to_padnet(models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0))), "a dense one"),
    (lambda: surgery.to_moe(models.Transformer(CFG, rngs=nnx.Rngs(0))), "takes a PAD-Net transformer"),
])
def test_bad_arguments_are_refused_in_one_line(call, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")) as e:
    call()
  assert "\n" not in str(e.value)
